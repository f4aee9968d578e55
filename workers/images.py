"""Built task and stand-in images (``forkyard/env``): prune the ones no sandbox uses, by hand or under a cap.

They are content-addressed and rebuilt on demand, so removing one costs only its next
build. The cap keeps their total under a byte budget by removing the oldest unused
images first; an image still in use, or named in ``keep``, is never removed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from sandboxes.base import ImageInfo, SandboxBackend
from workers.dockerfile import ENV_IMAGE_NAME

logger = logging.getLogger(__name__)


@dataclass
class PruneReport:
    """What a prune removed (or would remove) and what it left."""

    removed: list[ImageInfo] = field(default_factory=list)
    in_use: int = 0
    """Images kept because a sandbox starts from them (or the caller is about to)."""
    total_bytes: int = 0
    """Bytes the built images hold after the prune."""

    @property
    def freed_bytes(self) -> int:
        """Bytes the removed images held."""
        return sum(i.size_bytes for i in self.removed)


async def prune_images(
    backend: SandboxBackend, *, max_bytes: int | None = None, keep: Collection[str] = (), dry_run: bool = False
) -> PruneReport:
    """Remove built images no sandbox uses, oldest first: all of them, or (``max_bytes``) until the rest fit.

    Args:
        max_bytes: stop as soon as the built images hold at most this many bytes; None removes every unused one.
        keep: refs never removed (images handed out for sandboxes about to start).
        dry_run: remove nothing; report what would go.
    """
    images = await backend.list_images(ENV_IMAGE_NAME)
    held = [i for i in images if i.in_use or i.ref in keep]
    report = PruneReport(in_use=len(held), total_bytes=sum(i.size_bytes for i in images))
    for image in sorted(images, key=lambda i: i.created_at):
        if max_bytes is not None and report.total_bytes <= max_bytes:
            break
        if image.in_use or image.ref in keep:
            continue
        if not dry_run:
            await backend.remove_image(image.ref)
        report.removed.append(image)
        report.total_bytes -= image.size_bytes
    return report


__all__ = ["PruneReport", "prune_images"]

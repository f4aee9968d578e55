"""Storing the files steps made and reading them back.

An artifact's id is ``art_`` and the first 40 hex digits of its bytes' sha256, so a step
that shows the same page twice stores one file, and its link never changes. A step's
``info["artifacts"]`` (a session step) or its record's ``artifacts`` (an episode step)
lists ``{"name", "id", "url", "media_type", "bytes"}`` per file.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.artifacts.models import Artifact
from gateway.errors import NotFoundError

logger = logging.getLogger(__name__)

#: Bytes one artifact may have; a bigger one is left out of the step (with a warning) rather than stored.
MAX_ARTIFACT_BYTES = 16 * 1024 * 1024
_MEDIA_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".txt": "text/plain",
                ".json": "application/json", ".html": "text/html"}


def artifact_id(data: bytes) -> str:
    """Return the id the artifact of ``data`` has."""
    return "art_" + hashlib.sha256(data).hexdigest()[:40]


def media_type(name: str) -> str:
    """Return the media type a file named ``name`` is served with."""
    suffix = name[name.rfind("."):].lower() if "." in name else ""
    return _MEDIA_TYPES.get(suffix, "application/octet-stream")


async def store_artifacts(*, db_session: AsyncSession, files: Mapping[str, bytes]) -> list[dict[str, Any]]:
    """Store each file (once per content) and return their links, committed."""
    links: list[dict[str, Any]] = []
    for name, data in files.items():
        if len(data) > MAX_ARTIFACT_BYTES:
            logger.warning("artifact %s is %d bytes, over the %d-byte cap; not stored", name, len(data),
                           MAX_ARTIFACT_BYTES)
            continue
        ident = artifact_id(data)
        kind = media_type(name)
        if await db_session.get(Artifact, ident) is None:
            db_session.add(Artifact(id=ident, media_type=kind, size=len(data), data=data))
            try:
                await db_session.commit()
            except IntegrityError:  # stored meanwhile by another step: the same bytes
                await db_session.rollback()
        links.append({"name": name, "id": ident, "url": f"/v1/artifacts/{ident}", "media_type": kind,
                      "bytes": len(data)})
    await db_session.commit()
    return links


async def read_artifact(*, db_session: AsyncSession, ident: str) -> tuple[bytes, str]:
    """Return an artifact's bytes and media type.

    Raises:
        NotFoundError: no artifact has that id.
    """
    row = (await db_session.execute(select(Artifact.data, Artifact.media_type).where(Artifact.id == ident))).first()
    if row is None:
        raise NotFoundError(f"Artifact {ident!r} does not exist.")
    return bytes(row.data), row.media_type

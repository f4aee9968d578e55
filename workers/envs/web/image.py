"""The image web sandboxes start from: the base image plus Debian's headless Chromium and Playwright for Python.

Playwright's own browser download needs the internet at run time, so the driver launches
the system's instead (``executable_path``): Debian's ``chromium-headless-shell``, the
old headless mode that Playwright's own headless build is too (no display compositor
pacing input and frames, so an action waits fewer frames: a click and its observation
took about 70 ms against 190 ms with the full ``chromium`` in new headless mode, one CPU). It
comes from ``bookworm-security``, which carries the current release (the main suite's
lags by several versions and has known holes). The image is built once per backend, like a
stand-in, with the build's network (the Debian mirror and PyPI).
"""

from __future__ import annotations

from collections.abc import Callable

from sandboxes.base import SandboxBackend

#: Playwright for Python, pinned: its protocol must speak to the Chromium below.
PLAYWRIGHT_VERSION = "1.65.2"
#: Where Debian's Chromium lives in the image.
CHROMIUM_PATH = "/usr/lib/chromium/chromium-headless-shell"

WEB_DOCKERFILE = f"""# forkyard web image: Debian's headless Chromium, Playwright for Python
FROM base
RUN echo 'deb http://deb.debian.org/debian-security bookworm-security main' \\
      > /etc/apt/sources.list.d/forkyard-security.list \\
 && apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends chromium-headless-shell python3-pip libatomic1 fonts-dejavu-core \\
      ca-certificates procps >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
RUN pip install --break-system-packages --no-cache-dir -q playwright=={PLAYWRIGHT_VERSION}
ENV PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
"""


async def web_image(backend: SandboxBackend, *, base_image: str, ca_bundle: bytes | None = None,
                    progress: Callable[[str], None] | None = None) -> str:
    """Return the web image on ``backend``, building it from the base image on first use.

    Raises:
        ImageBuildError: the build failed (no route to the Debian mirror or PyPI, say).
    """
    from workers.dockerfile import build_task_image

    return await build_task_image(backend, dockerfile=WEB_DOCKERFILE, context={}, base_image=base_image,
                                  aliases={}, ca_bundle=ca_bundle, progress=progress)


__all__ = ["CHROMIUM_PATH", "PLAYWRIGHT_VERSION", "WEB_DOCKERFILE", "web_image"]

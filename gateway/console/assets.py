"""The console's front-end library, fetched from the npm registry at install time (never committed).

htmx is one file; it comes from its npm package, checked against the integrity hash the
registry published for that version. ``python -m gateway.console.assets`` fetches it
(``.ci/bootstrap`` does); the console works without it, only without live refresh.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import sys
import tarfile
from pathlib import Path

import httpx

HTMX_VERSION = "2.0.11"
#: The npm registry's ``dist.integrity`` of htmx.org@2.0.11.
HTMX_INTEGRITY = "sha512-Thx/WtpeOQqSrqBCw/A1cwGJGg4UrVa3+sW0GmrM3p4gJgO89ecH4qtbnyzDDWFvBTqjnIMCgELTNt636dtamA=="
VENDOR = Path(__file__).parent / "static" / "vendor"


def fetch_htmx(*, registry: str | None = None, target: Path = VENDOR) -> Path:
    """Download htmx's npm tarball, check its integrity, and write ``dist/htmx.min.js`` into ``target``.

    Raises:
        RuntimeError: the download failed or its hash is not the published one.
    """
    out = target / "htmx.min.js"
    stamp = target / ".htmx-version"
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == HTMX_VERSION:
        return out
    registry = (registry or os.environ.get("NPM_CONFIG_REGISTRY") or "https://registry.npmjs.org").rstrip("/")
    url = f"{registry}/htmx.org/-/htmx.org-{HTMX_VERSION}.tgz"
    try:
        response = httpx.get(url, timeout=60, follow_redirects=True)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot download {url}: {exc}") from exc
    algo, _, expected = HTMX_INTEGRITY.partition("-")
    digest = base64.b64encode(hashlib.new(algo, response.content).digest()).decode()
    if digest != expected:
        raise RuntimeError(f"{url}: integrity mismatch ({algo} {digest}, the registry published {expected})")
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        member = tar.extractfile("package/dist/htmx.min.js")
        if member is None:
            raise RuntimeError(f"{url}: no dist/htmx.min.js in the package")
        data = member.read()
    target.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    stamp.write_text(HTMX_VERSION + "\n")
    return out


if __name__ == "__main__":
    try:
        print(f"htmx {HTMX_VERSION}: {fetch_htmx()}")
    except RuntimeError as exc:
        print(f"console assets: {exc} (the console works without live refresh)", file=sys.stderr)
        sys.exit(1)

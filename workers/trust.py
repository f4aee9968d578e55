"""The host's CA bundle, trusted inside image builds and networked sandboxes.

Package registries are often reached through a TLS-intercepting proxy (here, and behind
corporate ones) whose CA only the host trusts. A build or a networked sandbox gets the
host's bundle as one file and the variables the common clients read it from (pip,
requests, curl, OpenSSL and Python's ssl, git, Node, cargo, uv); the image's own bundle
is left as it is. Builds drop the file before they commit, so images never carry it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

#: Where the bundle is written inside a sandbox.
CA_BUNDLE_PATH = "/usr/local/share/forkyard/ca-bundle.crt"
#: The variables that point the usual clients at it.
CA_ENV_VARS = (
    "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "NODE_EXTRA_CA_CERTS",
    "CARGO_HTTP_CAINFO", "UV_NATIVE_TLS",
)  # fmt: skip
#: Debian's system bundle, the default.
SYSTEM_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
#: A bundle larger than this is not a CA bundle.
MAX_CA_BUNDLE_BYTES = 8 << 20


def ca_env() -> Mapping[str, str]:
    """Return the environment that makes the usual clients trust :data:`CA_BUNDLE_PATH`."""
    return {name: ("true" if name == "UV_NATIVE_TLS" else CA_BUNDLE_PATH) for name in CA_ENV_VARS}


def read_ca_bundle(path: str | os.PathLike[str] | None) -> bytes | None:
    """Return the PEM bundle at ``path`` (None: no bundle), warning once if it cannot be used."""
    if path is None or str(path) == "":
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CA_BUNDLE_BYTES + 1)
    except OSError as exc:
        logger.warning("CA bundle %s cannot be read (%s); builds and networked sandboxes keep their own", path, exc)
        return None
    if len(data) > MAX_CA_BUNDLE_BYTES or b"-----BEGIN CERTIFICATE-----" not in data:
        logger.warning("CA bundle %s is not a PEM certificate bundle; builds and networked sandboxes keep their own",
                       path)
        return None
    return data


__all__ = ["CA_BUNDLE_PATH", "SYSTEM_CA_BUNDLE", "ca_env", "read_ca_bundle"]

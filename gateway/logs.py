"""Logging filters for the gateway process: API keys redacted, request ids attached.

Only the CLI (the application entry point) installs handlers; see :func:`configure_logging`.
"""

from __future__ import annotations

import logging
import re
import sys

from gateway.middleware import current_request_id
from gateway.settings import API_KEY_PREFIX

_KEY_RE = re.compile(re.escape(API_KEY_PREFIX) + r"[A-Za-z0-9_\-]{6,}")


def redact_api_keys(text: str) -> str:
    """Return ``text`` with every API key replaced by ``fy_***``."""
    return _KEY_RE.sub(API_KEY_PREFIX + "***", text)


class RedactingFormatter(logging.Formatter):
    """Format records, then replace API keys anywhere in the text (tracebacks included)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_api_keys(super().format(record))


class RequestIdFilter(logging.Filter):
    """Attach ``record.request_id`` (the request being served, or ``-``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id() or "-"
        return True


def configure_logging(level: str | int = "INFO") -> None:
    """Send logs to stderr with request ids and redacted keys (for the ``forkyard`` CLI)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "httpx", "httpcore", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

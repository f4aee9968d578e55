"""Logging filters for the gateway process: API keys redacted, request ids attached.

Only the CLI (the application entry point) installs handlers; see :func:`configure_logging`.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys

from gateway.settings import API_KEY_PREFIX

#: The id of the request being served in this context (set by the request-id middleware).
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("forkyard_request_id", default=None)


def current_request_id() -> str | None:
    """Return the id of the request being served in this context, if any."""
    return request_id_var.get()

_KEY_RE = re.compile(re.escape(API_KEY_PREFIX) + r"[A-Za-z0-9_\-]{6,}")


#: Other secrets this process holds (inference servers' API keys), newest last; redacted like keys.
_SECRETS: dict[str, None] = {}
_MAX_SECRETS = 4096
#: Shorter values are not secrets worth hiding (and would redact common words).
_MIN_SECRET_LEN = 8


def register_secret(value: str | None) -> None:
    """Have every later log line show ``value`` as ``***`` (a policy's API key, when it is loaded)."""
    if not value or len(value) < _MIN_SECRET_LEN:
        return
    _SECRETS.pop(value, None)
    _SECRETS[value] = None
    while len(_SECRETS) > _MAX_SECRETS:
        del _SECRETS[next(iter(_SECRETS))]


def redact_api_keys(text: str) -> str:
    """Return ``text`` with every API key replaced by ``fy_***`` and every registered secret by ``***``."""
    text = _KEY_RE.sub(API_KEY_PREFIX + "***", text)
    for secret in list(_SECRETS):
        if secret in text:
            text = text.replace(secret, "***")
    return text


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

"""Console sign-in: an admin-scoped API key buys a session cookie; every action carries its CSRF token.

The cookie (``forkyard_admin``) is HttpOnly and SameSite=Strict (Secure over https); the
database holds only the SHA-256 of its secret, with the session's CSRF token and expiry. A
key revoked or no longer admin ends its sessions at their next request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fastapi import Request
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import service as keys
from gateway.auth.models import ApiKey
from gateway.console.models import AdminSession, AuditEntry
from gateway.db import utcnow

COOKIE = "forkyard_admin"
#: How long a console session lasts from sign-in.
SESSION_TTL = timedelta(hours=12)
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"


@dataclass(frozen=True)
class Admin:
    """The operator behind a request: their key and the session's CSRF token."""

    key_id: str
    key_prefix: str
    key_name: str
    csrf_token: str


class NotSignedIn(Exception):
    """The request has no live console session (the router answers with the login page)."""


class CsrfRefused(Exception):
    """A state-changing request without the session's CSRF token."""


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def sign_in(*, db_session: AsyncSession, api_key: str) -> tuple[str, Admin] | None:
    """Start a session for an admin key: return its cookie secret and operator, or None (unknown,
    revoked or trainer key)."""
    row = await keys.authenticate(db_session=db_session, key=api_key.strip())
    if row is None or row.scope != "admin":
        return None
    secret, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    now = utcnow()
    await db_session.execute(delete(AdminSession).where(AdminSession.expires_at < now))
    db_session.add(AdminSession(id_hash=_digest(secret), key_id=row.id, csrf_token=csrf, created_at=now,
                                expires_at=now + SESSION_TTL))
    await db_session.commit()
    return secret, Admin(key_id=row.id, key_prefix=row.prefix, key_name=row.name, csrf_token=csrf)


async def sign_out(*, db_session: AsyncSession, secret: str | None) -> None:
    """End the session of ``secret`` (nothing if there is none)."""
    if secret:
        await db_session.execute(delete(AdminSession).where(AdminSession.id_hash == _digest(secret)))
        await db_session.commit()


async def current_admin(request: Request, db_session: AsyncSession) -> Admin:
    """Return the signed-in operator of ``request``; raise :class:`NotSignedIn` if there is none."""
    secret = request.cookies.get(COOKIE)
    if not secret:
        raise NotSignedIn
    found = (await db_session.execute(
        select(AdminSession, ApiKey).join(ApiKey, ApiKey.id == AdminSession.key_id)
        .where(AdminSession.id_hash == _digest(secret))
    )).first()
    if found is None:
        raise NotSignedIn
    session, key = found
    expires = session.expires_at
    if expires <= utcnow() or key.revoked_at is not None or key.scope != "admin":
        raise NotSignedIn
    return Admin(key_id=key.id, key_prefix=key.prefix, key_name=key.name, csrf_token=session.csrf_token)


async def check_csrf(request: Request, admin: Admin) -> None:
    """Raise :class:`CsrfRefused` unless the request carries the session's token (form field or header)."""
    sent = request.headers.get(CSRF_HEADER)
    if sent is None:
        form = await request.form()
        value = form.get(CSRF_FIELD)
        sent = value if isinstance(value, str) else None
    if not sent or not hmac.compare_digest(sent, admin.csrf_token):
        raise CsrfRefused


async def audit(db_session: AsyncSession, admin: Admin, action: str, target: str, **detail: Any) -> None:
    """Record an operator's action (committed with the caller's transaction)."""
    db_session.add(AuditEntry(at=utcnow(), key_id=admin.key_id, key_prefix=admin.key_prefix, action=action,
                              target=target[:300], detail=detail))
    await db_session.commit()

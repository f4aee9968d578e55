"""Create, look up and revoke API keys; keys are random, shown once, and stored hashed."""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth.models import ApiKey
from gateway.db import new_id, utcnow
from gateway.settings import API_KEY_PREFIX, KEY_SCOPES

logger = logging.getLogger(__name__)

#: Characters of a key kept in clear (``fy_`` + 6) so operators can tell keys apart.
DISPLAY_PREFIX_LEN = len(API_KEY_PREFIX) + 6


@dataclass(frozen=True)
class CreatedApiKey:
    """A key just created: the secret exists only here and is never stored."""

    id: str
    name: str
    key: str


def generate_api_key() -> str:
    """Return a new random API key ``fy_<43 urlsafe chars>`` (256 bits)."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """Return the hex SHA-256 of ``key``; enough for high-entropy random keys."""
    return hashlib.sha256(key.encode()).hexdigest()


async def create_api_key(*, db_session: AsyncSession, name: str = "", key: str | None = None,
                         scope: str = "trainer") -> CreatedApiKey:
    """Store a new key (or ``key`` if given and not yet known) and return it with its secret.

    ``scope``: ``trainer`` (the ``/v1`` API) or ``admin`` (that and the console).
    """
    if scope not in KEY_SCOPES:
        raise ValueError(f"unknown key scope {scope!r}: one of {', '.join(KEY_SCOPES)}")
    key = key or generate_api_key()
    digest = hash_api_key(key)
    existing = await db_session.scalar(select(ApiKey).where(ApiKey.hash == digest))
    if existing is not None:
        return CreatedApiKey(id=existing.id, name=existing.name, key=key)
    row = ApiKey(id=new_id("key"), name=name, prefix=key[:DISPLAY_PREFIX_LEN], hash=digest, created_at=utcnow(),
                 scope=scope)
    db_session.add(row)
    await db_session.commit()
    logger.info("created %s API key %s (%s...)", scope, row.id, row.prefix)
    return CreatedApiKey(id=row.id, name=row.name, key=key)


#: Seconds a key checked against the database is trusted without asking it again. A key
#: revoked here stops at once; one revoked by another process (``forkyard keys revoke``)
#: within this long. Without it the lookup was a third of a session step's cost.
AUTH_CACHE_TTL_S = 1.0
_AUTH_CACHE_MAX = 10_000
_verified: dict[str, tuple[str, float]] = {}  # key hash -> (key id, trusted until, monotonic)


async def authenticate(*, db_session: AsyncSession, key: str) -> ApiKey | None:
    """Return the live (not revoked) key matching ``key``, or None."""
    if not key.startswith(API_KEY_PREFIX):
        return None
    row = await db_session.scalar(select(ApiKey).where(ApiKey.hash == hash_api_key(key)))
    if row is None or row.revoked_at is not None:
        return None
    return row


async def authenticated_key_id(*, db_session: AsyncSession, key: str) -> str | None:
    """Return the id of the live key matching ``key``, or None; the database is asked at most once a second."""
    digest = hash_api_key(key)
    now = time.monotonic()
    cached = _verified.get(digest)
    if cached is not None and cached[1] > now:
        return cached[0]
    row = await authenticate(db_session=db_session, key=key)
    if row is None:
        _verified.pop(digest, None)
        return None
    if len(_verified) >= _AUTH_CACHE_MAX:
        _verified.clear()
    _verified[digest] = (row.id, now + AUTH_CACHE_TTL_S)
    return row.id


async def list_api_keys(*, db_session: AsyncSession) -> list[ApiKey]:
    """Return every key (revoked ones included), oldest first."""
    return list((await db_session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))).all())


async def revoke_api_key(*, db_session: AsyncSession, key_id: str) -> bool:
    """Revoke the key with id ``key_id``; return False if there is no such key."""
    row = await db_session.get(ApiKey, key_id)
    if row is None:
        return False
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        await db_session.commit()
    for digest in [d for d, (kid, _) in _verified.items() if kid == key_id]:
        _verified.pop(digest, None)
    return True

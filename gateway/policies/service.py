"""Read and change a policy's weight version and pause switch.

A policy row springs into existence the first time a rollout names it or a trainer
announces a version; until then its version is 0 and it is not paused.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import utcnow
from gateway.errors import ConflictError, InvalidRequestError, NotFoundError
from gateway.policies.models import Policy

logger = logging.getLogger(__name__)


def _host_allowed(host: str, allowed: Sequence[str]) -> bool:
    host = host.strip("[]").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in allowed:
        entry = entry.strip().lower()
        if entry == "*":
            return True
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
        if host == entry.rstrip("."):
            return True
    return False


def check_inference_servers(base_urls: Sequence[str], *, allowed: Sequence[str]) -> None:
    """Refuse a policy whose servers are not on the operator's list (``FORKYARD_POLICY_HOSTS``).

    A rollout makes the gateway POST to its ``base_urls``; unchecked, any key holder could
    aim those requests at anything the gateway can reach. Names match exactly (or
    ``*.domain``), IP addresses by network, ``*`` allows any.

    Raises:
        InvalidRequestError: 422, code ``policy_host_not_allowed``, naming the host.
    """
    for url in base_urls:
        host = urlsplit(str(url)).hostname or ""
        if not _host_allowed(host, allowed):
            raise InvalidRequestError(
                f"Inference server host {host!r} is not one this gateway may call; an operator allows it "
                "with FORKYARD_POLICY_HOSTS (host names, *.domain, networks such as 10.0.0.0/8, or *).",
                code="policy_host_not_allowed",
            )


async def get_policy(*, db_session: AsyncSession, name: str) -> Policy:
    """Return the policy named ``name``; raise NotFoundError if no rollout or trainer ever named it."""
    row = await db_session.get(Policy, name, populate_existing=True)
    if row is None:
        raise NotFoundError(
            f"Policy {name!r} is unknown; announce a version with POST /v1/policies/{name}/version "
            "or name it in a rollout."
        )
    return row


async def ensure_policy(*, db_session: AsyncSession, name: str) -> None:
    """Create the policy row for ``name`` (version 0, not paused) if it is missing, and commit."""
    if await db_session.scalar(select(Policy.name).where(Policy.name == name)) is not None:
        return
    now = utcnow()
    db_session.add(Policy(name=name, version=0, paused=False, created_at=now, updated_at=now))
    try:
        await db_session.commit()
    except IntegrityError:
        await db_session.rollback()  # created concurrently


async def current_version(*, db_session: AsyncSession, name: str) -> int:
    """Return the latest weight version announced for ``name`` (0 if never announced)."""
    version = await db_session.scalar(select(Policy.version).where(Policy.name == name))
    return int(version or 0)


async def is_paused(*, db_session: AsyncSession, name: str) -> bool:
    """Return whether dispatch of ``name`` is paused (False for an unknown policy)."""
    return bool(await db_session.scalar(select(Policy.paused).where(Policy.name == name)))


async def set_policy_version(*, db_session: AsyncSession, name: str, version: int) -> Policy:
    """Announce ``version`` as the current weight version of ``name``.

    Raises:
        ConflictError: ``version`` is lower than the version already announced (code
            ``version_regression``); staleness is measured against a version that only grows.
    """
    await ensure_policy(db_session=db_session, name=name)
    result = await db_session.execute(
        update(Policy).where(Policy.name == name, Policy.version <= version)
        .values(version=version, updated_at=utcnow())
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        current = await current_version(db_session=db_session, name=name)
        await db_session.rollback()
        raise ConflictError(
            f"Policy {name!r} is already at version {current}; a version never goes back (got {version}).",
            code="version_regression",
        )
    await db_session.commit()
    logger.info("policy %s: weight version %d announced", name, version)
    return await get_policy(db_session=db_session, name=name)


async def set_paused(*, db_session: AsyncSession, name: str, paused: bool) -> Policy:
    """Pause or resume dispatch of ``name`` (idempotent)."""
    await ensure_policy(db_session=db_session, name=name)
    await db_session.execute(update(Policy).where(Policy.name == name).values(paused=paused, updated_at=utcnow()))
    await db_session.commit()
    logger.info("policy %s %s", name, "paused" if paused else "resumed")
    return await get_policy(db_session=db_session, name=name)


async def pause_policy(*, db_session: AsyncSession, name: str) -> Policy:
    """Pause dispatch of ``name``: running LLM calls finish, no new one starts."""
    return await set_paused(db_session=db_session, name=name, paused=True)


async def resume_policy(*, db_session: AsyncSession, name: str) -> Policy:
    """Resume dispatch of ``name``."""
    return await set_paused(db_session=db_session, name=name, paused=False)

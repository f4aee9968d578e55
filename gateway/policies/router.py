"""``/v1/policies`` routes: read a policy, announce a weight version, pause and resume."""

from __future__ import annotations

import re

from fastapi import APIRouter

from gateway.dependencies import DbSession
from gateway.errors import InvalidRequestError
from gateway.policies import service
from gateway.policies.schemas import PolicyRead, PolicyVersionSet
from workers.protocol import POLICY_NAME_PATTERN

router = APIRouter(prefix="/policies", tags=["policies"])


def _checked(name: str) -> str:
    if not re.match(POLICY_NAME_PATTERN, name):
        raise InvalidRequestError(f"Policy name {name[:80]!r} is not valid; use letters, digits and ._:/@+-.")
    return name


# Policy names may hold "/" (e.g. Qwen/Qwen3-8B), hence the path converters.
@router.post("/{name:path}/version", response_model=PolicyRead)
async def set_policy_version(name: str, body: PolicyVersionSet, db_session: DbSession):
    """Announce the weight version the trainer now serves."""
    return await service.set_policy_version(db_session=db_session, name=_checked(name), version=body.version)


@router.post("/{name:path}/pause", response_model=PolicyRead)
async def pause_policy(name: str, db_session: DbSession):
    """Pause dispatch: running LLM calls finish, no new one starts."""
    return await service.pause_policy(db_session=db_session, name=_checked(name))


@router.post("/{name:path}/resume", response_model=PolicyRead)
async def resume_policy(name: str, db_session: DbSession):
    """Resume dispatch."""
    return await service.resume_policy(db_session=db_session, name=_checked(name))


@router.get("/{name:path}", response_model=PolicyRead)
async def get_policy(name: str, db_session: DbSession):
    """Return a policy's current weight version and pause switch."""
    return await service.get_policy(db_session=db_session, name=_checked(name))

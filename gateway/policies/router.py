"""``/v1/policies`` routes: read a policy, announce a weight version, pause and resume."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request

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


def _changed(request: Request, name: str) -> None:
    """Push the change to this gateway's running episodes (others see it within a refresh)."""
    states = getattr(request.app.state, "policy_states", None)
    if states is not None:
        states.changed(name)


# Policy names may hold "/" (e.g. Qwen/Qwen3-8B), hence the path converters.
@router.post("/{name:path}/version", response_model=PolicyRead)
async def set_policy_version(name: str, body: PolicyVersionSet, db_session: DbSession, request: Request):
    """Announce the weight version the trainer now serves."""
    policy = await service.set_policy_version(db_session=db_session, name=_checked(name), version=body.version)
    _changed(request, name)
    return policy


@router.post("/{name:path}/pause", response_model=PolicyRead)
async def pause_policy(name: str, db_session: DbSession, request: Request):
    """Pause dispatch: running LLM calls finish, no new one starts."""
    policy = await service.pause_policy(db_session=db_session, name=_checked(name))
    _changed(request, name)
    return policy


@router.post("/{name:path}/resume", response_model=PolicyRead)
async def resume_policy(name: str, db_session: DbSession, request: Request):
    """Resume dispatch."""
    policy = await service.resume_policy(db_session=db_session, name=_checked(name))
    _changed(request, name)
    return policy


@router.get("/{name:path}", response_model=PolicyRead)
async def get_policy(name: str, db_session: DbSession):
    """Return a policy's current weight version and pause switch."""
    return await service.get_policy(db_session=db_session, name=_checked(name))

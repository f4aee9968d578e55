"""``/v1/sandboxes`` routes."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.dependencies import DbSession, Runtime
from gateway.sandboxes import service
from gateway.sandboxes.schemas import SandboxPage

router = APIRouter(prefix="/sandboxes", tags=["sandboxes"])


@router.get("", response_model=SandboxPage)
async def list_sandboxes(db_session: DbSession, runtime: Runtime):
    """List the live sandboxes of this node with the session and task each serves."""
    return SandboxPage(items=await service.list_sandboxes(db_session=db_session, runtime=runtime))

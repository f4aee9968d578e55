"""``/v1/nodes`` routes: the hosts that own sandboxes, and their drain switch."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.dependencies import DbSession, Drain
from gateway.nodes import service
from gateway.nodes.schemas import NodePage, NodeRead

router = APIRouter(prefix="/nodes", tags=["nodes"])


@router.get("", response_model=NodePage)
async def list_nodes(db_session: DbSession):
    """List every node with its state (up, down, draining), backend, capacity, load and last heartbeat."""
    return NodePage(items=await service.list_nodes(db_session=db_session))


@router.post("/{name}/drain", response_model=NodeRead)
async def drain_node(name: str, db_session: DbSession, drain: Drain):
    """Have a node take no new work: no new session or episode starts there; what runs finishes."""
    return await service.set_draining(db_session=db_session, name=name, draining=True, flag=drain)


@router.post("/{name}/undrain", response_model=NodeRead)
async def undrain_node(name: str, db_session: DbSession, drain: Drain):
    """Have a drained node take new work again."""
    return await service.set_draining(db_session=db_session, name=name, draining=False, flag=drain)

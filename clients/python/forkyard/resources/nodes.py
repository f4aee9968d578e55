"""client.nodes: the hosts that own sandboxes, their state and load, and their drain switch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base_client import RequestOptions
from .._models import Node, NodeList
from ._resource import Resource, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Nodes", "AsyncNodes"]


def _list_request() -> RequestOptions[NodeList]:
    return RequestOptions("GET", "/v1/nodes", cast_to=NodeList)


def _drain_request(name: str, action: str) -> RequestOptions[Node]:
    return RequestOptions("POST", f"/v1/nodes/{path_id(name, 'name')}/{action}", cast_to=Node, idempotent=True)


class Nodes(Resource):
    """See the fleet's nodes; drain one before maintenance (what runs finishes, nothing new starts)."""
    _client: SyncRequester

    def list(self) -> list[Node]:
        """Every node with its state (``up``, ``down``, ``draining``), backend, capacity and load."""
        return self._client._request(_list_request()).items

    def drain(self, name: str) -> Node:
        """Have the node take no new sessions or episodes."""
        return self._client._request(_drain_request(name, "drain"))

    def undrain(self, name: str) -> Node:
        """Have a drained node take new work again."""
        return self._client._request(_drain_request(name, "undrain"))


class AsyncNodes(Resource):
    """See the fleet's nodes; drain one before maintenance (what runs finishes, nothing new starts)."""
    _client: AsyncRequester

    async def list(self) -> list[Node]:
        """Every node with its state (``up``, ``down``, ``draining``), backend, capacity and load."""
        return (await self._client._request(_list_request())).items

    async def drain(self, name: str) -> Node:
        """Have the node take no new sessions or episodes."""
        return await self._client._request(_drain_request(name, "drain"))

    async def undrain(self, name: str) -> Node:
        """Have a drained node take new work again."""
        return await self._client._request(_drain_request(name, "undrain"))

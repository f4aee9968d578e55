"""client.sandboxes: the live sandbox fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base_client import RequestOptions
from .._models import Page, Sandbox
from .._pagination import AsyncPager, Pager
from ._resource import Resource

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Sandboxes", "AsyncSandboxes"]


def _page_request(cursor: str | None) -> RequestOptions[Page[Sandbox]]:
    return RequestOptions("GET", "/v1/sandboxes", params={"cursor": cursor}, cast_to=Page[Sandbox])


class Sandboxes(Resource):
    """List live sandboxes."""
    _client: SyncRequester

    def list(self) -> Pager[Sandbox]:
        """Iterate over every live sandbox on every node."""
        return Pager(self._client, _page_request)


class AsyncSandboxes(Resource):
    """List live sandboxes."""
    _client: AsyncRequester

    def list(self) -> AsyncPager[Sandbox]:
        """Iterate (`async for`) over every live sandbox on every node."""
        return AsyncPager(self._client, _page_request)

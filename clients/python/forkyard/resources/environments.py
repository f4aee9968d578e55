"""client.environments: environment families and versions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._base_client import RequestOptions
from .._models import Environment, Page
from .._pagination import AsyncPager, Pager
from ._resource import Resource

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Environments", "AsyncEnvironments"]


def _create_request(name: str, family: str, version: str, description: str | None) -> RequestOptions[Environment]:
    body: dict[str, Any] = {"name": name, "family": family, "version": version}
    if description is not None:
        body["description"] = description
    return RequestOptions("POST", "/v1/environments", json=body, cast_to=Environment)


def _page_request(cursor: str | None) -> RequestOptions[Page[Environment]]:
    return RequestOptions("GET", "/v1/environments", params={"cursor": cursor}, cast_to=Page[Environment])


class Environments(Resource):
    """Create and list environments."""
    _client: SyncRequester

    def create(
        self, name: str, *, family: str = "terminal", version: str = "1", description: str | None = None
    ) -> Environment:
        """Create an environment."""
        return self._client._request(_create_request(name, family, version, description))

    def list(self) -> Pager[Environment]:
        """Iterate over every environment."""
        return Pager(self._client, _page_request)


class AsyncEnvironments(Resource):
    """Create and list environments."""
    _client: AsyncRequester

    async def create(
        self, name: str, *, family: str = "terminal", version: str = "1", description: str | None = None
    ) -> Environment:
        """Create an environment."""
        return await self._client._request(_create_request(name, family, version, description))

    def list(self) -> AsyncPager[Environment]:
        """Iterate (`async for`) over every environment."""
        return AsyncPager(self._client, _page_request)

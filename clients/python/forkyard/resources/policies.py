"""client.policies: announce a policy's new weight version, pause and resume dispatch to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base_client import RequestOptions
from .._models import Policy
from ._resource import Resource, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Policies", "AsyncPolicies"]


def _set_version_request(name: str, version: int) -> RequestOptions[Policy]:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}.")
    return RequestOptions(
        "POST",
        f"/v1/policies/{path_id(name, 'name')}/version",
        json={"version": version},
        cast_to=Policy,
        idempotent=True,  # setting the same version again changes nothing
    )


def _action_request(name: str, action: str) -> RequestOptions[Policy]:
    return RequestOptions("POST", f"/v1/policies/{path_id(name, 'name')}/{action}", cast_to=Policy, idempotent=True)


def _get_request(name: str) -> RequestOptions[Policy]:
    return RequestOptions("GET", f"/v1/policies/{path_id(name, 'name')}", cast_to=Policy)


class Policies(Resource):
    """Tell the gateway about a policy's weights: its version, and whether to dispatch to it."""
    _client: SyncRequester

    def set_version(self, name: str, version: int) -> Policy:
        """Announce that the policy's servers now hold weight version `version` (staleness counts from it)."""
        return self._client._request(_set_version_request(name, version))

    def pause(self, name: str) -> Policy:
        """Stop starting new LLM calls to the policy (e.g. while its weights are being updated)."""
        return self._client._request(_action_request(name, "pause"))

    def resume(self, name: str) -> Policy:
        """Let LLM calls to the policy start again."""
        return self._client._request(_action_request(name, "resume"))

    def get(self, name: str) -> Policy:
        """Fetch the policy's current version and paused state."""
        return self._client._request(_get_request(name))


class AsyncPolicies(Resource):
    """Tell the gateway about a policy's weights: its version, and whether to dispatch to it."""
    _client: AsyncRequester

    async def set_version(self, name: str, version: int) -> Policy:
        """Announce that the policy's servers now hold weight version `version` (staleness counts from it)."""
        return await self._client._request(_set_version_request(name, version))

    async def pause(self, name: str) -> Policy:
        """Stop starting new LLM calls to the policy (e.g. while its weights are being updated)."""
        return await self._client._request(_action_request(name, "pause"))

    async def resume(self, name: str) -> Policy:
        """Let LLM calls to the policy start again."""
        return await self._client._request(_action_request(name, "resume"))

    async def get(self, name: str) -> Policy:
        """Fetch the policy's current version and paused state."""
        return await self._client._request(_get_request(name))

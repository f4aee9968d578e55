"""client.artifacts: files steps made (a web page's screenshot), by the id their step links."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base_client import RequestOptions
from ._resource import Resource, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Artifacts", "AsyncArtifacts"]


def _get_request(artifact_id: str) -> RequestOptions[bytes]:
    return RequestOptions("GET", f"/v1/artifacts/{path_id(artifact_id, 'artifact_id')}", raw=True)


class Artifacts(Resource):
    """Download the files steps made; a step lists its own in ``info["artifacts"]`` (or ``step.artifacts``)."""
    _client: SyncRequester

    def get(self, artifact_id: str) -> bytes:
        """Return an artifact's bytes (a PNG for a screenshot)."""
        return self._client._request(_get_request(artifact_id))


class AsyncArtifacts(Resource):
    """Download the files steps made; a step lists its own in ``info["artifacts"]`` (or ``step.artifacts``)."""
    _client: AsyncRequester

    async def get(self, artifact_id: str) -> bytes:
        """Return an artifact's bytes (a PNG for a screenshot)."""
        return await self._client._request(_get_request(artifact_id))

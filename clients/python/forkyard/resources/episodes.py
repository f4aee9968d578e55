"""client.episodes: look up episodes, their steps, and their training view."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base_client import RequestOptions
from .._models import Episode, EpisodeDetail, EpisodeInfo, EpisodeTree, Page
from .._pagination import DEFAULT_PAGE_SIZE, AsyncPager, Pager, PageRequest
from ._resource import Resource, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester
    from .._models import EpisodeStatus

__all__ = ["Episodes", "AsyncEpisodes"]



def _list_request(rollout_id: str | None, status: EpisodeStatus | str | None, limit: int) -> PageRequest[EpisodeInfo]:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}.")
    status_value = getattr(status, "value", status)

    def page(cursor: str | None) -> RequestOptions[Page[EpisodeInfo]]:
        params = {"rollout_id": rollout_id, "status": status_value, "limit": limit, "cursor": cursor}
        return RequestOptions("GET", "/v1/episodes", params=params, cast_to=Page[EpisodeInfo])

    return page


def _get_request(episode_id: str, tokens: bool) -> RequestOptions[EpisodeDetail]:
    return RequestOptions(
        "GET", f"/v1/episodes/{path_id(episode_id, 'episode_id')}", params={"tokens": "true"} if tokens else None,
        cast_to=EpisodeDetail,
    )


def _training_request(episode_id: str) -> RequestOptions[Episode]:
    return RequestOptions("GET", f"/v1/episodes/{path_id(episode_id, 'episode_id')}/training", cast_to=Episode)


def _tree_request(episode_id: str) -> RequestOptions[EpisodeTree]:
    return RequestOptions("GET", f"/v1/episodes/{path_id(episode_id, 'episode_id')}/tree", cast_to=EpisodeTree)


class Episodes(Resource):
    """List and fetch episodes."""
    _client: SyncRequester

    def list(
        self,
        *,
        rollout_id: str | None = None,
        status: EpisodeStatus | str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> Pager[EpisodeInfo]:
        """Iterate over the episodes matching the filters; `limit` is the page size."""
        return Pager(self._client, _list_request(rollout_id, status, limit), cursor)

    def get(self, episode_id: str, *, tokens: bool = False) -> EpisodeDetail:
        """Fetch one episode in full: messages, steps, timings, weight versions (and step tokens if ``tokens``)."""
        return self._client._request(_get_request(episode_id, tokens))

    def training(self, episode_id: str) -> Episode:
        """Fetch one episode's training view: input_ids, loss_mask, logprobs, reward, group_id."""
        return self._client._request(_training_request(episode_id))

    def tree(self, episode_id: str) -> EpisodeTree:
        """Fetch the trajectory tree the episode belongs to (a one-leaf tree outside branching rollouts)."""
        return self._client._request(_tree_request(episode_id))


class AsyncEpisodes(Resource):
    """List and fetch episodes."""
    _client: AsyncRequester

    def list(
        self,
        *,
        rollout_id: str | None = None,
        status: EpisodeStatus | str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> AsyncPager[EpisodeInfo]:
        """Iterate (`async for`) over the episodes matching the filters; `limit` is the page size."""
        return AsyncPager(self._client, _list_request(rollout_id, status, limit), cursor)

    async def get(self, episode_id: str, *, tokens: bool = False) -> EpisodeDetail:
        """Fetch one episode in full: messages, steps, timings, weight versions (and step tokens if ``tokens``)."""
        return await self._client._request(_get_request(episode_id, tokens))

    async def training(self, episode_id: str) -> Episode:
        """Fetch one episode's training view: input_ids, loss_mask, logprobs, reward, group_id."""
        return await self._client._request(_training_request(episode_id))

    async def tree(self, episode_id: str) -> EpisodeTree:
        """Fetch the trajectory tree the episode belongs to (a one-leaf tree outside branching rollouts)."""
        return await self._client._request(_tree_request(episode_id))

"""The synchronous and asynchronous Forkyard clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TypeVar, cast

import httpx

from ._base_client import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    BaseClient,
    RequestOptions,
    TimeoutTypes,
    _Sleep,
)
from .resources.artifacts import Artifacts, AsyncArtifacts
from .resources.environments import AsyncEnvironments, Environments
from .resources.episodes import AsyncEpisodes, Episodes
from .resources.nodes import AsyncNodes, Nodes
from .resources.policies import AsyncPolicies, Policies
from .resources.rollouts import AsyncRollouts, Rollouts
from .resources.sandboxes import AsyncSandboxes, Sandboxes
from .resources.sessions import AsyncSessions, Sessions
from .resources.snapshots import AsyncSnapshots, Snapshots
from .resources.tasks import AsyncTasks, Tasks

__all__ = ["Client", "AsyncClient"]

R = TypeVar("R")


class Client(BaseClient[httpx.Client]):
    """Talk to a Forkyard gateway synchronously.

    Args:
        base_url: the gateway's root URL; defaults to $FORKYARD_URL, else http://127.0.0.1:8000.
        api_key: defaults to $FORKYARD_API_KEY; one of the two is required.
        timeout: seconds (or an httpx.Timeout) per HTTP request, retries not included.
        max_retries: how many times a failed call is resent (see the README for which).
        default_headers: extra headers sent with every request.
        http_client: an httpx.Client to use; the caller keeps ownership and closes it.
    """

    environments: Environments
    tasks: Tasks
    sessions: Sessions
    snapshots: Snapshots
    artifacts: Artifacts
    sandboxes: Sandboxes
    rollouts: Rollouts
    policies: Policies
    nodes: Nodes
    episodes: Episodes

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
            http_client=http_client,
        )
        self.environments = Environments(self)
        self.tasks = Tasks(self)
        self.sessions = Sessions(self)
        self.snapshots = Snapshots(self)
        self.artifacts = Artifacts(self)
        self.sandboxes = Sandboxes(self)
        self.rollouts = Rollouts(self)
        self.policies = Policies(self)
        self.nodes = Nodes(self)
        self.episodes = Episodes(self)

    def _make_http_client(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout)

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _request(self, options: RequestOptions[R]) -> R:
        flow = self._request_flow(options)
        try:
            action = next(flow)
            while True:
                if isinstance(action, _Sleep):
                    self._sleep(action.seconds)
                    action = flow.send(None)
                    continue
                try:
                    response = self._http.send(action)
                except httpx.TransportError as exc:
                    action = flow.throw(exc)
                else:
                    action = flow.send(response)
        except StopIteration as stop:
            return cast(R, stop.value)
        finally:
            flow.close()

    def close(self) -> None:
        """Close the connections, unless the httpx client was passed in by the caller."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(BaseClient[httpx.AsyncClient]):
    """Talk to a Forkyard gateway from asyncio code; the twin of Client.

    Args:
        base_url: the gateway's root URL; defaults to $FORKYARD_URL, else http://127.0.0.1:8000.
        api_key: defaults to $FORKYARD_API_KEY; one of the two is required.
        timeout: seconds (or an httpx.Timeout) per HTTP request, retries not included.
        max_retries: how many times a failed call is resent (see the README for which).
        default_headers: extra headers sent with every request.
        http_client: an httpx.AsyncClient to use; the caller keeps ownership and closes it.
    """

    environments: AsyncEnvironments
    tasks: AsyncTasks
    sessions: AsyncSessions
    snapshots: AsyncSnapshots
    artifacts: AsyncArtifacts
    sandboxes: AsyncSandboxes
    rollouts: AsyncRollouts
    policies: AsyncPolicies
    nodes: AsyncNodes
    episodes: AsyncEpisodes

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            default_headers=default_headers,
            http_client=http_client,
        )
        self.environments = AsyncEnvironments(self)
        self.tasks = AsyncTasks(self)
        self.sessions = AsyncSessions(self)
        self.snapshots = AsyncSnapshots(self)
        self.artifacts = AsyncArtifacts(self)
        self.sandboxes = AsyncSandboxes(self)
        self.rollouts = AsyncRollouts(self)
        self.policies = AsyncPolicies(self)
        self.nodes = AsyncNodes(self)
        self.episodes = AsyncEpisodes(self)

    def _make_http_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.timeout)

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _request(self, options: RequestOptions[R]) -> R:
        flow = self._request_flow(options)
        try:
            action = next(flow)
            while True:
                if isinstance(action, _Sleep):
                    await self._sleep(action.seconds)
                    action = flow.send(None)
                    continue
                try:
                    response = await self._http.send(action)
                except httpx.TransportError as exc:
                    action = flow.throw(exc)
                else:
                    action = flow.send(response)
        except StopIteration as stop:
            return cast(R, stop.value)
        finally:
            flow.close()

    async def aclose(self) -> None:
        """Close the connections, unless the httpx client was passed in by the caller."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

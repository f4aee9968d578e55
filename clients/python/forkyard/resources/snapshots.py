"""client.snapshots: fork a session's snapshot into new sessions; list, pin, unpin and delete snapshots."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from .._base_client import RequestOptions
from .._models import ForkyardModel, Page, SessionInfo, Snapshot
from .._pagination import AsyncPager, Pager
from ._resource import Resource, path_id
from .sessions import snapshot_request

if TYPE_CHECKING:
    from typing import Protocol

    from .._base_client import AsyncRequester, SyncRequester
    from .sessions import AsyncSession, AsyncSessions, Session, Sessions

    class _ForkingRequester(SyncRequester, Protocol):
        sessions: Sessions  # forks come back as sessions of the same client

    class _AsyncForkingRequester(AsyncRequester, Protocol):
        sessions: AsyncSessions

__all__ = ["Snapshots", "AsyncSnapshots", "SessionList", "AsyncSessionList", "MAX_FORK"]

#: Most sessions one fork may start.
MAX_FORK = 64

S = TypeVar("S")


class _Forked(ForkyardModel):
    items: list[SessionInfo]


def _fork_request(snapshot_id: str, n: int) -> RequestOptions[_Forked]:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORK:
        raise ValueError(f"n must be an integer from 1 to {MAX_FORK}, got {n!r}.")
    return RequestOptions("POST", f"/v1/snapshots/{path_id(snapshot_id, 'snapshot_id')}/fork", json={"n": n},
                          cast_to=_Forked)


def _get_request(snapshot_id: str) -> RequestOptions[Snapshot]:
    return RequestOptions("GET", f"/v1/snapshots/{path_id(snapshot_id, 'snapshot_id')}", cast_to=Snapshot)


def _delete_request(snapshot_id: str) -> RequestOptions[None]:
    return RequestOptions("DELETE", f"/v1/snapshots/{path_id(snapshot_id, 'snapshot_id')}")


def _pin_request(snapshot_id: str, pinned: bool) -> RequestOptions[Snapshot]:
    verb = "pin" if pinned else "unpin"
    return RequestOptions("POST", f"/v1/snapshots/{path_id(snapshot_id, 'snapshot_id')}/{verb}", cast_to=Snapshot)


def _page_requests(session_id: str | None):  # -> Callable[[str | None], RequestOptions[Page[Snapshot]]]
    def page(cursor: str | None) -> RequestOptions[Page[Snapshot]]:
        params = {"cursor": cursor}
        if session_id is not None:
            params["session_id"] = session_id
        return RequestOptions("GET", "/v1/snapshots", params=params, cast_to=Page[Snapshot])

    return page


class SessionList(list["Session"]):
    """The sessions of a fork; use it as a context manager so every one is closed."""

    def close(self) -> None:
        """Close every session (each close is idempotent); the first failure is raised after trying all."""
        errors = []
        for session in self:
            try:
                session.close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> SessionList:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for session in self:
            session.__exit__(exc_type, exc, tb)


class AsyncSessionList(list["AsyncSession"]):
    """The sessions of a fork for asyncio code; use it with `async with` so every one is closed."""

    async def aclose(self) -> None:
        """Close every session; the first failure is raised after trying all."""
        errors = []
        for session in self:
            try:
                await session.aclose()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> AsyncSessionList:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for session in self:
            await session.__aexit__(exc_type, exc, tb)


class Snapshots(Resource):
    """Fork, list, pin, unpin and delete session snapshots."""
    _client: _ForkingRequester

    def create(self, session_id: str) -> Snapshot:
        """Snapshot an open session (filesystem, shell cwd and exports, history; not background processes)."""
        return self._client._request(snapshot_request(session_id))

    def fork(self, snapshot_id: str, n: int = 1) -> SessionList:
        """Start ``n`` sessions continuing from a snapshot; close them, or use the list in a `with` block."""
        from .sessions import Session

        forked = self._client._request(_fork_request(snapshot_id, n))
        return SessionList(Session(self._client.sessions, info) for info in forked.items)

    def get(self, snapshot_id: str) -> Snapshot:
        """Fetch one snapshot."""
        return self._client._request(_get_request(snapshot_id))

    def list(self, *, session_id: str | None = None) -> Pager[Snapshot]:
        """Iterate over the live snapshots, optionally of one source session."""
        return Pager(self._client, _page_requests(session_id))

    def delete(self, snapshot_id: str) -> None:
        """Delete a snapshot (ConflictError if pinned); its storage goes once no open fork holds it."""
        self._client._request(_delete_request(snapshot_id))

    def pin(self, snapshot_id: str) -> Snapshot:
        """Pin a snapshot: it cannot be deleted, and it outlives its session and forks until unpinned."""
        return self._client._request(_pin_request(snapshot_id, True))

    def unpin(self, snapshot_id: str) -> Snapshot:
        """Unpin a snapshot; with no open source session or fork left holding it, it is deleted."""
        return self._client._request(_pin_request(snapshot_id, False))


class AsyncSnapshots(Resource):
    """Fork, list, pin, unpin and delete session snapshots."""
    _client: _AsyncForkingRequester

    async def create(self, session_id: str) -> Snapshot:
        """Snapshot an open session (filesystem, shell cwd and exports, history; not background processes)."""
        return await self._client._request(snapshot_request(session_id))

    async def fork(self, snapshot_id: str, n: int = 1) -> AsyncSessionList:
        """Start ``n`` sessions continuing from a snapshot; close them, or use the list with `async with`."""
        from .sessions import AsyncSession

        forked = await self._client._request(_fork_request(snapshot_id, n))
        return AsyncSessionList(AsyncSession(self._client.sessions, info) for info in forked.items)

    async def get(self, snapshot_id: str) -> Snapshot:
        """Fetch one snapshot."""
        return await self._client._request(_get_request(snapshot_id))

    def list(self, *, session_id: str | None = None) -> AsyncPager[Snapshot]:
        """Iterate (`async for`) over the live snapshots, optionally of one source session."""
        return AsyncPager(self._client, _page_requests(session_id))

    async def delete(self, snapshot_id: str) -> None:
        """Delete a snapshot (ConflictError if pinned); its storage goes once no open fork holds it."""
        await self._client._request(_delete_request(snapshot_id))

    async def pin(self, snapshot_id: str) -> Snapshot:
        """Pin a snapshot: it cannot be deleted, and it outlives its session and forks until unpinned."""
        return await self._client._request(_pin_request(snapshot_id, True))

    async def unpin(self, snapshot_id: str) -> Snapshot:
        """Unpin a snapshot; with no open source session or fork left holding it, it is deleted."""
        return await self._client._request(_pin_request(snapshot_id, False))

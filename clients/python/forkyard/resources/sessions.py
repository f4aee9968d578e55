"""client.sessions: gym-like sessions on a task, and the Session helper."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Generator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._base_client import RequestOptions
from .._exceptions import NotFoundError
from .._models import Page, SessionInfo, SessionStepRecord, Snapshot, StepResult
from .._pagination import DEFAULT_PAGE_SIZE, AsyncPager, Pager, PageRequest
from ._resource import Resource, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Sessions", "AsyncSessions", "Session", "AsyncSession", "AsyncSessionOpener"]

logger = logging.getLogger(__name__)

SUBMIT_TOOL = "submit"


def _create_request(task_id: str) -> RequestOptions[SessionInfo]:
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"task_id must be a non-empty string, got {task_id!r}.")
    return RequestOptions("POST", "/v1/sessions", json={"task_id": task_id}, cast_to=SessionInfo)


def _get_request(session_id: str) -> RequestOptions[SessionInfo]:
    return RequestOptions("GET", f"/v1/sessions/{path_id(session_id, 'session_id')}", cast_to=SessionInfo)


def _close_request(session_id: str) -> RequestOptions[None]:
    return RequestOptions("DELETE", f"/v1/sessions/{path_id(session_id, 'session_id')}")


def _step_request(
    session_id: str, tool: str, arguments: Mapping[str, Any] | None, extra: Mapping[str, Any]
) -> RequestOptions[StepResult]:
    if not isinstance(tool, str) or not tool:
        raise ValueError(f"tool must be a non-empty string, got {tool!r}.")
    merged = {**(arguments or {}), **extra}
    return RequestOptions(
        "POST",
        f"/v1/sessions/{path_id(session_id, 'session_id')}/step",
        json={"action": {"tool": tool, "arguments": merged}},
        cast_to=StepResult,
    )


def _steps_request(session_id: str, limit: int) -> PageRequest[SessionStepRecord]:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}.")
    path = f"/v1/sessions/{path_id(session_id, 'session_id')}/steps"

    def page(cursor: str | None) -> RequestOptions[Page[SessionStepRecord]]:
        return RequestOptions("GET", path, params={"limit": limit, "cursor": cursor}, cast_to=Page[SessionStepRecord])

    return page


def snapshot_request(session_id: str) -> RequestOptions[Snapshot]:
    """Return the request snapshotting an open session."""
    return RequestOptions("POST", f"/v1/sessions/{path_id(session_id, 'session_id')}/snapshot", cast_to=Snapshot)


class _SessionBase:
    """Bookkeeping shared by Session and AsyncSession."""

    info: SessionInfo
    """The gateway's latest known record of this session."""
    observation: str
    """The latest observation: the task's opening one, then each step's."""
    tools: list[dict[str, Any]]
    """The tools the agent may call, in OpenAI function-tool format."""
    last_result: StepResult | None

    def __init__(self, info: SessionInfo) -> None:
        self.info = info
        self.observation = info.observation or ""
        self.tools = list(info.tools or [])
        self.last_result = None
        self._closed = False

    @property
    def id(self) -> str:
        """The session's id."""
        return self.info.id

    @property
    def task_id(self) -> str:
        """The id of the task this session runs."""
        return self.info.task_id

    @property
    def sandbox_id(self) -> str | None:
        """The id of the sandbox behind this session."""
        return self.info.sandbox_id

    @property
    def reward(self) -> float | None:
        """The reward of the last step, if any."""
        return self.last_result.reward if self.last_result else None

    @property
    def done(self) -> bool:
        """Whether the last step ended the episode."""
        return self.last_result.done if self.last_result else False

    @property
    def closed(self) -> bool:
        """Whether close() has succeeded."""
        return self._closed

    def _record(self, result: StepResult) -> StepResult:
        self.last_result = result
        self.observation = result.observation
        return result

    def _log_close_failure(self) -> None:
        logger.warning(
            "Could not close session %s after an error in its block; the gateway's reaper will collect it.",
            self.id,
            exc_info=True,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("done" if self.done else "open")
        return f"{type(self).__name__}(id={self.id!r}, task_id={self.task_id!r}, {state})"


class Session(_SessionBase):
    """A live session; use it as a context manager so the sandbox is always released."""

    def __init__(self, sessions: Sessions, info: SessionInfo) -> None:
        super().__init__(info)
        self._sessions = sessions

    def step(self, tool: str, arguments: Mapping[str, Any] | None = None, /, **kwargs: Any) -> StepResult:
        """Call one tool, e.g. step("bash", command="ls"), and return its result."""
        return self._record(self._sessions.step(self.id, tool, arguments, **kwargs))

    def submit(self) -> StepResult:
        """Finish the episode: run the verifier and return the reward."""
        return self.step(SUBMIT_TOOL)

    def snapshot(self) -> Snapshot:
        """Snapshot this session now; fork it with client.snapshots.fork(snapshot.id, n)."""
        return self._sessions.snapshot(self.id)

    def history(self, *, limit: int = DEFAULT_PAGE_SIZE) -> Pager[SessionStepRecord]:
        """Iterate over every step so far, oldest first (a fork's inherited steps first)."""
        return self._sessions.steps(self.id, limit=limit)

    def refresh(self) -> SessionInfo:
        """Fetch the gateway's current record of this session (state, steps, reward)."""
        self.info = self._sessions.get(self.id)
        return self.info

    def close(self) -> None:
        """Close the session and free its sandbox (idempotent)."""
        if self._closed:
            return
        try:
            self._sessions.close(self.id)
        except NotFoundError:
            logger.debug("Session %s was already gone when closing it", self.id)
        self._closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            self._log_close_failure()


class AsyncSession(_SessionBase):
    """A live session for asyncio code; use it with `async with` so the sandbox is always released."""

    def __init__(self, sessions: AsyncSessions, info: SessionInfo) -> None:
        super().__init__(info)
        self._sessions = sessions

    async def step(self, tool: str, arguments: Mapping[str, Any] | None = None, /, **kwargs: Any) -> StepResult:
        """Call one tool, e.g. await step("bash", command="ls"), and return its result."""
        return self._record(await self._sessions.step(self.id, tool, arguments, **kwargs))

    async def submit(self) -> StepResult:
        """Finish the episode: run the verifier and return the reward."""
        return await self.step(SUBMIT_TOOL)

    async def snapshot(self) -> Snapshot:
        """Snapshot this session now; fork it with aclient.snapshots.fork(snapshot.id, n)."""
        return await self._sessions.snapshot(self.id)

    def history(self, *, limit: int = DEFAULT_PAGE_SIZE) -> AsyncPager[SessionStepRecord]:
        """Iterate (`async for`) over every step so far, oldest first (a fork's inherited steps first)."""
        return self._sessions.steps(self.id, limit=limit)

    async def refresh(self) -> SessionInfo:
        """Fetch the gateway's current record of this session (state, steps, reward)."""
        self.info = await self._sessions.get(self.id)
        return self.info

    async def aclose(self) -> None:
        """Close the session and free its sandbox (idempotent)."""
        if self._closed:
            return
        try:
            await self._sessions.close(self.id)
        except NotFoundError:
            logger.debug("Session %s was already gone when closing it", self.id)
        self._closed = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.aclose()
            return
        try:
            await self.aclose()
        except Exception:
            self._log_close_failure()


class AsyncSessionOpener(Awaitable[AsyncSession]):
    """What AsyncSessions.create returns: await it for an AsyncSession, or use it with `async with`."""

    def __init__(self, open_session: Callable[[], Awaitable[AsyncSession]]) -> None:
        self._open_session = open_session
        self._session: AsyncSession | None = None
        self._used = False

    def _start(self) -> Awaitable[AsyncSession]:
        if self._used:
            raise RuntimeError("This sessions.create(...) result was already awaited or entered; call create again.")
        self._used = True
        return self._open_session()

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._start().__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._start()
        return self._session

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._session is not None
        await self._session.__aexit__(exc_type, exc, tb)


class Sessions(Resource):
    """Open, drive and close sessions."""
    _client: SyncRequester

    def create(self, task_id: str) -> Session:
        """Open a session on a task (starts its sandbox); close it, or use it in a `with` block."""
        return Session(self, self._client._request(_create_request(task_id)))

    def get(self, session_id: str) -> SessionInfo:
        """Fetch the gateway's record of a session."""
        return self._client._request(_get_request(session_id))

    def step(
        self, session_id: str, tool: str, arguments: Mapping[str, Any] | None = None, /, **kwargs: Any
    ) -> StepResult:
        """Call one tool in a session; arguments come as a mapping, keywords, or both."""
        return self._client._request(_step_request(session_id, tool, arguments, kwargs))

    def snapshot(self, session_id: str) -> Snapshot:
        """Snapshot an open session (filesystem, shell cwd and exports, history; not background processes)."""
        return self._client._request(snapshot_request(session_id))

    def steps(
        self, session_id: str, *, limit: int = DEFAULT_PAGE_SIZE, cursor: str | None = None
    ) -> Pager[SessionStepRecord]:
        """Iterate over a session's steps, oldest first (a fork's inherited steps first); `limit` is the page size."""
        return Pager(self._client, _steps_request(session_id, limit), cursor)

    def close(self, session_id: str) -> None:
        """Close a session and free its sandbox (closing a closed session is fine)."""
        self._client._request(_close_request(session_id))


class AsyncSessions(Resource):
    """Open, drive and close sessions."""
    _client: AsyncRequester

    def create(self, task_id: str) -> AsyncSessionOpener:
        """Open a session on a task: `async with aclient.sessions.create(id) as s`, or `s = await ...`."""
        request = _create_request(task_id)

        async def open_session() -> AsyncSession:
            return AsyncSession(self, await self._client._request(request))

        return AsyncSessionOpener(open_session)

    async def get(self, session_id: str) -> SessionInfo:
        """Fetch the gateway's record of a session."""
        return await self._client._request(_get_request(session_id))

    async def step(
        self, session_id: str, tool: str, arguments: Mapping[str, Any] | None = None, /, **kwargs: Any
    ) -> StepResult:
        """Call one tool in a session; arguments come as a mapping, keywords, or both."""
        return await self._client._request(_step_request(session_id, tool, arguments, kwargs))

    async def snapshot(self, session_id: str) -> Snapshot:
        """Snapshot an open session (filesystem, shell cwd and exports, history; not background processes)."""
        return await self._client._request(snapshot_request(session_id))

    def steps(
        self, session_id: str, *, limit: int = DEFAULT_PAGE_SIZE, cursor: str | None = None
    ) -> AsyncPager[SessionStepRecord]:
        """Iterate (`async for`) over a session's steps, oldest first; `limit` is the page size."""
        return AsyncPager(self._client, _steps_request(session_id, limit), cursor)

    async def close(self, session_id: str) -> None:
        """Close a session and free its sandbox (closing a closed session is fine)."""
        await self._client._request(_close_request(session_id))

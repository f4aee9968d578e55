"""client.rollouts: submit rollouts and receive their episodes (pull/ack, or a resuming stream)."""

from __future__ import annotations

import json
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, overload

import pydantic

from .._base_client import RequestOptions
from .._exceptions import APIError
from .._models import DeadLetter, Episode, ForkyardModel, Page, Rollout
from .._pagination import DEFAULT_PAGE_SIZE, AsyncPager, Pager, PageRequest
from .._streaming import (
    DEFAULT_MAX_RECONNECTS,
    STOP,
    AsyncStream,
    Reconnect,
    ServerSentEvent,
    Stream,
    sse_flow,
)
from .._training import DEFAULT_EPS, group_advantages
from ._resource import Resource, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester
    from .._models import Task

__all__ = ["Rollouts", "AsyncRollouts", "EpisodeBatch", "AsyncEpisodeBatch"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_EPISODES = 16


# -- episode batches --------------------------------------------------------------------


class _EpisodeBatchBase(Sequence[Episode]):
    """What EpisodeBatch and AsyncEpisodeBatch share: a read-only list of episodes plus delivery info."""

    episodes: list[Episode]
    rollout_id: str
    consumer: str
    cursor: int | None
    """The delivery position this batch reached (the highest seq); resume a stream after it."""
    done: bool
    """From pull: the rollout is finished and nothing is left for this consumer."""
    acked: bool

    def __init__(
        self,
        episodes: Iterable[Episode],
        *,
        rollout_id: str,
        consumer: str,
        cursor: int | None = None,
        done: bool = False,
    ) -> None:
        self.episodes = list(episodes)
        self.rollout_id = rollout_id
        self.consumer = consumer
        self.cursor = cursor
        self.done = done
        self.acked = False

    @overload
    def __getitem__(self, index: int) -> Episode: ...
    @overload
    def __getitem__(self, index: slice) -> list[Episode]: ...
    def __getitem__(self, index: int | slice) -> Episode | list[Episode]:
        return self.episodes[index]

    def __len__(self) -> int:
        return len(self.episodes)

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes)

    @property
    def episode_ids(self) -> list[str]:
        """The ids of the episodes, in order."""
        return [e.episode_id for e in self.episodes]

    @property
    def rewards(self) -> list[float | None]:
        """The rewards of the episodes, in order."""
        return [e.reward for e in self.episodes]

    def groups(self) -> dict[Hashable, list[Episode]]:
        """Return the episodes by group_id, in order of first appearance."""
        groups: dict[Hashable, list[Episode]] = {}
        for episode in self.episodes:
            key = episode.group_id if episode.group_id is not None else episode.episode_id
            groups.setdefault(key, []).append(episode)
        return groups

    def advantages(self, *, eps: float = DEFAULT_EPS) -> list[float]:
        """Return group-normalized advantages, (r - mean) / (std + eps) within each group_id of this batch.

        Raises:
            ValueError: an episode has no reward.
        """
        rewards = []
        for episode in self.episodes:
            if episode.reward is None:
                raise ValueError(f"Episode {episode.episode_id!r} has no reward; it cannot be trained on.")
            rewards.append(episode.reward)
        groups = [e.group_id if e.group_id is not None else ("episode", e.episode_id) for e in self.episodes]
        return group_advantages(rewards, groups, eps=eps)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rollout_id={self.rollout_id!r}, consumer={self.consumer!r}, "
            f"episodes={len(self.episodes)}, cursor={self.cursor}, done={self.done})"
        )


class EpisodeBatch(_EpisodeBatchBase):
    """Episodes delivered to one consumer, as a list; `ack()` confirms them so they are never redelivered."""

    def __init__(
        self,
        episodes: Iterable[Episode],
        *,
        rollout_id: str,
        consumer: str,
        acker: Callable[[list[str]], int],
        cursor: int | None = None,
        done: bool = False,
    ) -> None:
        super().__init__(episodes, rollout_id=rollout_id, consumer=consumer, cursor=cursor, done=done)
        self._acker = acker

    def ack(self) -> int:
        """Acknowledge exactly this batch's episodes for its consumer; return how many the gateway acked."""
        if not self.episodes:
            return 0
        acked = self._acker(self.episode_ids)
        self.acked = True
        return acked


class AsyncEpisodeBatch(_EpisodeBatchBase):
    """Episodes delivered to one consumer, as a list; `await ack()` confirms them so they are never redelivered."""

    def __init__(
        self,
        episodes: Iterable[Episode],
        *,
        rollout_id: str,
        consumer: str,
        acker: Callable[[list[str]], Awaitable[int]],
        cursor: int | None = None,
        done: bool = False,
    ) -> None:
        super().__init__(episodes, rollout_id=rollout_id, consumer=consumer, cursor=cursor, done=done)
        self._acker = acker

    async def ack(self) -> int:
        """Acknowledge exactly this batch's episodes for its consumer; return how many the gateway acked."""
        if not self.episodes:
            return 0
        acked = await self._acker(self.episode_ids)
        self.acked = True
        return acked


# -- requests -----------------------------------------------------------------------------


class _PullAnswer(ForkyardModel):
    episodes: list[Episode]
    cursor: int | None = None
    done: bool = False


class _AckAnswer(ForkyardModel):
    acked: int


_EPISODE_LIST: pydantic.TypeAdapter[list[Episode]] = pydantic.TypeAdapter(list[Episode])


def _check_consumer(consumer: Any) -> str:
    if not isinstance(consumer, str) or not consumer:
        raise ValueError(f"consumer must be a non-empty string naming the consumer group, got {consumer!r}.")
    return consumer


def _task_spec(tasks: Any) -> dict[str, Any]:
    if isinstance(tasks, Mapping):
        if not tasks:
            raise ValueError('tasks must not be empty: pass task ids, or {"environment": ..., "names": [...]}.')
        return dict(tasks)
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Iterable):
        raise TypeError(
            f'tasks must be a list of task ids (or Task objects) or a mapping such as {{"ids": [...]}}, got {tasks!r}.'
        )
    ids = []
    for task in tasks:
        task_id = task if isinstance(task, str) else getattr(task, "id", None)
        if not isinstance(task_id, str) or not task_id:
            raise TypeError(f"tasks must hold task ids or Task objects, got {task!r}.")
        ids.append(task_id)
    if not ids:
        raise ValueError("tasks must name at least one task.")
    return {"ids": ids}


def _create_request(
    *,
    tasks: Iterable[str | Task] | Mapping[str, Any],
    group_size: int,
    policy: Mapping[str, Any],
    agent: Mapping[str, Any] | None,
    limits: Mapping[str, Any] | None,
    max_staleness: int | None,
    staleness_action: str | None,
    max_attempts: int | None,
    group_mode: str | Mapping[str, Any] | None,
    group_spare: int | None,
    priority: int | None,
    concurrency: int | None,
    branching: Mapping[str, Any] | None,
    lazy_fork: bool | None,
    extra_body: Mapping[str, Any] | None,
) -> RequestOptions[Rollout]:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer of at least 1, got {group_size!r}.")
    if not isinstance(policy, Mapping) or not policy:
        raise ValueError('policy must be a mapping such as {"name": ..., "api": "tokens", "base_urls": [...]}.')
    body: dict[str, Any] = {"tasks": _task_spec(tasks), "group_size": group_size, "policy": dict(policy)}
    if isinstance(group_mode, str):
        group_mode = {"mode": group_mode}
    optional = {
        "agent": agent,
        "limits": limits,
        "max_staleness": max_staleness,
        "staleness_action": staleness_action,
        "max_attempts": max_attempts,
        "group_mode": group_mode,
        "group_spare": group_spare,
        "priority": priority,
        "concurrency": concurrency,
        "branching": branching,
        "lazy_fork": lazy_fork,
    }
    body.update({key: (dict(value) if isinstance(value, Mapping) else value)
                 for key, value in optional.items() if value is not None})
    body.update(extra_body or {})
    return RequestOptions("POST", "/v1/rollouts", json=body, cast_to=Rollout)


def _get_request(rollout_id: str) -> RequestOptions[Rollout]:
    return RequestOptions("GET", f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}", cast_to=Rollout)


def _cancel_request(rollout_id: str) -> RequestOptions[Rollout]:
    return RequestOptions("POST", f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}/cancel", cast_to=Rollout)


def _delete_request(rollout_id: str) -> RequestOptions[None]:
    return RequestOptions("DELETE", f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}")


def _list_request(status: str | None, limit: int) -> PageRequest[Rollout]:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}.")
    status = getattr(status, "value", status)

    def page(cursor: str | None) -> RequestOptions[Page[Rollout]]:
        params = {"status": status, "limit": limit, "cursor": cursor}
        return RequestOptions("GET", "/v1/rollouts", params=params, cast_to=Page[Rollout])

    return page


def _dead_letters_request(rollout_id: str, limit: int) -> PageRequest[DeadLetter]:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}.")
    path = f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}/dead_letters"

    def page(cursor: str | None) -> RequestOptions[Page[DeadLetter]]:
        return RequestOptions("GET", path, params={"limit": limit, "cursor": cursor}, cast_to=Page[DeadLetter])

    return page


def _pull_request(
    rollout_id: str,
    consumer: str,
    max_episodes: int,
    wait_s: float,
    visibility_timeout_s: float | None,
    cursor: int | None,
    redeliver: bool,
    include_failed: bool,
    make_batch: Callable[[list[Episode], int | None, bool], Any],
) -> RequestOptions[Any]:
    if isinstance(max_episodes, bool) or not isinstance(max_episodes, int) or max_episodes < 1:
        raise ValueError(f"max_episodes must be an integer of at least 1, got {max_episodes!r}.")
    if wait_s < 0:
        raise ValueError(f"wait_s must not be negative, got {wait_s!r}.")
    body: dict[str, Any] = {"consumer": _check_consumer(consumer), "max_episodes": max_episodes, "wait_s": wait_s}
    if visibility_timeout_s is not None:
        body["visibility_timeout_s"] = visibility_timeout_s
    if cursor is not None:
        body["cursor"] = cursor
    if redeliver:
        body["redeliver"] = True
    if include_failed:
        body["include"] = ["failed"]
    return RequestOptions(
        "POST",
        f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}/pull",
        json=body,
        cast_to=_PullAnswer,
        transform=lambda answer: make_batch(answer.episodes, answer.cursor, answer.done),
        # A lost answer only leaves its episodes leased until their visibility timeout,
        # after which they are delivered again: pulling again is safe.
        idempotent=True,
    )


def _ack_request(rollout_id: str, consumer: str, episode_ids: Iterable[str]) -> RequestOptions[int]:
    ids = [episode_ids] if isinstance(episode_ids, str) else list(episode_ids)
    if not all(isinstance(i, str) and i for i in ids):
        raise ValueError(f"episode_ids must be non-empty strings, got {ids!r}.")
    return RequestOptions(
        "POST",
        f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}/ack",
        json={"consumer": _check_consumer(consumer), "episode_ids": ids},
        cast_to=_AckAnswer,
        transform=lambda answer: answer.acked,
        idempotent=True,  # acking twice acks nothing more
    )


def _stream_options(
    rollout_id: str,
    consumer: str,
    batch_size: int | None,
    visibility_timeout_s: float | None,
    redeliver: bool,
    include_failed: bool,
    max_reconnects: int,
) -> RequestOptions[None]:
    if isinstance(max_reconnects, bool) or not isinstance(max_reconnects, int) or max_reconnects < 0:
        raise ValueError(f"max_reconnects must be a non-negative integer, got {max_reconnects!r}.")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer of at least 1, got {batch_size!r}.")
    return RequestOptions(
        "GET",
        f"/v1/rollouts/{path_id(rollout_id, 'rollout_id')}/stream",
        params={
            "consumer": _check_consumer(consumer),
            "batch_size": batch_size,
            "visibility_timeout_s": visibility_timeout_s,
            "redeliver": "true" if redeliver else None,
            "include": "failed" if include_failed else None,
        },
    )


class _BatchAssembler:
    """Turn a rollout stream's events into batches; end at `end`; drop episodes it already gave out."""

    def __init__(self, rollout_id: str, make_batch: Callable[[list[Episode], int | None], Any]) -> None:
        self.rollout_id = rollout_id
        self.make_batch = make_batch
        # Episodes handed out and not acked yet. After a reconnect, or when a lease
        # expires while the trainer is still busy with them, the gateway sends them
        # again; one iterator yields each episode once.
        self.unacked: set[str] = set()

    def forget(self, episode_ids: Iterable[str]) -> None:
        self.unacked.difference_update(episode_ids)

    def __call__(self, event: ServerSentEvent) -> Any:
        if event.event == "end":
            return STOP
        if event.event == "error":
            # The gateway reports a failure on its side this way, then closes; the
            # episodes of a lost batch come back on a reconnect with the last event id.
            return Reconnect(f"the gateway reported: {_error_message(event.data)}")
        if event.event != "episodes":
            logger.debug("Ignoring a %r event on the stream of rollout %s", event.event, self.rollout_id)
            return None
        try:
            data = json.loads(event.data)
            if isinstance(data, Mapping):
                data = data.get("episodes")
            episodes = _EPISODE_LIST.validate_python(data)
        except (ValueError, pydantic.ValidationError) as exc:
            raise APIError(
                f"The gateway sent a malformed 'episodes' event (id {event.id}) on the stream of rollout "
                f"{self.rollout_id}: {str(exc).splitlines()[0]}"
            ) from exc
        fresh = [e for e in episodes if e.episode_id not in self.unacked]
        if len(fresh) < len(episodes):
            logger.debug(
                "Skipping %d episodes of rollout %s already handed out by this stream",
                len(episodes) - len(fresh), self.rollout_id,
            )
        if not fresh:
            return None
        self.unacked.update(e.episode_id for e in fresh)
        seqs = [e.seq for e in fresh if e.seq is not None]
        cursor = int(event.id) if event.id is not None and event.id.isdigit() else (max(seqs) if seqs else None)
        return self.make_batch(fresh, cursor)


def _error_message(data: str) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return data or "no reason given"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str):
        return error
    return data


# -- namespaces ---------------------------------------------------------------------------


class Rollouts(Resource):
    """Submit, inspect and cancel rollouts; receive their episodes."""
    _client: SyncRequester

    def create(
        self,
        *,
        tasks: Iterable[str | Task] | Mapping[str, Any],
        group_size: int,
        policy: Mapping[str, Any],
        agent: Mapping[str, Any] | None = None,
        limits: Mapping[str, Any] | None = None,
        max_staleness: int | None = None,
        staleness_action: str | None = None,
        max_attempts: int | None = None,
        group_mode: str | Mapping[str, Any] | None = None,
        group_spare: int | None = None,
        priority: int | None = None,
        concurrency: int | None = None,
        branching: Mapping[str, Any] | None = None,
        lazy_fork: bool | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """Submit a rollout: group_size episodes per task under a policy; options left None take the gateway's defaults.

        Args:
            tasks: task ids or Task objects, or a mapping such as {"environment": "terminal", "names": [...]}.
            policy: {"name", "api": "tokens"|"chat"|"scripted", "base_urls", "model", "sampling", ...}.
            group_mode: "complete", "early", or {"mode": "early", "min_group_size": n}.
            group_spare: extra samples per group; the first group_size usable ones are delivered,
                the rest cancelled or kept unstreamed.
            branching: run each sample as a trajectory tree: {"at_turns": [k, ...], "fanout": m,
                "max_episodes": n} or {"adaptive": {"budget": b, "min_entropy": h, "fanout": m}}.
            lazy_fork: False to give every sample its own sandbox even when the task declares
                deterministic tools.
            extra_body: more fields to send as they are (for gateway options newer than this SDK).
        """
        return self._client._request(_create_request(
            tasks=tasks, group_size=group_size, policy=policy, agent=agent, limits=limits,
            max_staleness=max_staleness, staleness_action=staleness_action, max_attempts=max_attempts,
            group_mode=group_mode, group_spare=group_spare, priority=priority, concurrency=concurrency, branching=branching,
            lazy_fork=lazy_fork, extra_body=extra_body,
        ))

    def get(self, rollout_id: str) -> Rollout:
        """Fetch a rollout: status, per-status episode counts, progress."""
        return self._client._request(_get_request(rollout_id))

    def list(
        self, *, status: str | None = None, limit: int = DEFAULT_PAGE_SIZE, cursor: str | None = None
    ) -> Pager[Rollout]:
        """Iterate over rollouts, oldest first; `limit` is the page size."""
        return Pager(self._client, _list_request(status, limit), cursor)

    def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout: queued episodes never start, running ones stop."""
        return self._client._request(_cancel_request(rollout_id))

    def delete(self, rollout_id: str) -> None:
        """Delete a finished rollout and everything it stored (a ConflictError while it still runs)."""
        self._client._request(_delete_request(rollout_id))

    def dead_letters(
        self, rollout_id: str, *, limit: int = DEFAULT_PAGE_SIZE, cursor: str | None = None
    ) -> Pager[DeadLetter]:
        """Iterate over a rollout's failed and stale episodes that will not be delivered, with reasons."""
        return Pager(self._client, _dead_letters_request(rollout_id, limit), cursor)

    def pull(
        self,
        rollout_id: str,
        *,
        consumer: str,
        max_episodes: int = DEFAULT_MAX_EPISODES,
        wait_s: float = 0.0,
        visibility_timeout_s: float | None = None,
        cursor: int | None = None,
        redeliver: bool = False,
        include_failed: bool = False,
    ) -> EpisodeBatch:
        """Lease up to max_episodes delivered episodes for a consumer group, waiting up to wait_s for some.

        Leased episodes that are not acked within the visibility timeout are delivered
        again. `batch.done` tells that the rollout is finished and nothing is left.
        After a crash, pass the last `cursor` you processed (or redeliver=True) to get
        every unacked episode delivered after it at once instead of after its lease.
        include_failed=True also delivers the failed episodes (infra, verifier_error,
        policy_error), masked: `episode.masked`, reward None, loss_mask all zeros; ack them
        like the others. Use the same include_failed on every call of a consumer.
        """
        def make_batch(episodes: list[Episode], cursor: int | None, done: bool) -> EpisodeBatch:
            return EpisodeBatch(
                episodes, rollout_id=rollout_id, consumer=consumer, cursor=cursor, done=done,
                acker=lambda ids: self.ack(rollout_id, consumer=consumer, episode_ids=ids),
            )

        return self._client._request(
            _pull_request(
                rollout_id, consumer, max_episodes, wait_s, visibility_timeout_s, cursor, redeliver, include_failed,
                make_batch,
            )
        )

    def ack(self, rollout_id: str, *, consumer: str, episode_ids: Iterable[str]) -> int:
        """Acknowledge episodes for a consumer group so they are never delivered to it again; return the count."""
        return self._client._request(_ack_request(rollout_id, consumer, episode_ids))

    def stream(
        self,
        rollout_id: str,
        *,
        consumer: str,
        batch_size: int | None = None,
        cursor: int | None = None,
        visibility_timeout_s: float | None = None,
        redeliver: bool = False,
        include_failed: bool = False,
        max_reconnects: int = DEFAULT_MAX_RECONNECTS,
    ) -> Stream[EpisodeBatch]:
        """Iterate over a rollout's episodes as batches until the rollout is done.

        The connection is resumed after the last received event (Last-Event-ID) when it
        drops, up to max_reconnects times in a row. Ack each batch (`batch.ack()`) once
        trained on; one that is not acked within visibility_timeout_s is delivered again,
        but this iterator yields each episode once. `cursor` resumes after a position
        (a batch's `cursor`) with every unacked episode after it redelivered at once;
        `redeliver` redelivers all unacked ones. `include_failed` also delivers failed
        episodes, masked (`episode.masked`). Leaving the loop early: close the stream, or
        use it with `with`.
        """
        options = _stream_options(rollout_id, consumer, batch_size, visibility_timeout_s, redeliver, include_failed,
                                  max_reconnects)
        assembler: _BatchAssembler

        def acker(ids: list[str]) -> int:
            acked = self.ack(rollout_id, consumer=consumer, episode_ids=ids)
            assembler.forget(ids)
            return acked

        def make_batch(episodes: list[Episode], at: int | None) -> EpisodeBatch:
            return EpisodeBatch(episodes, rollout_id=rollout_id, consumer=consumer, cursor=at, acker=acker)

        assembler = _BatchAssembler(rollout_id, make_batch)
        flow = sse_flow(
            self._client, options, assembler, what=f"the stream of rollout {rollout_id}",
            last_event_id=None if cursor is None else str(cursor), max_reconnects=max_reconnects,
        )
        return Stream(self._client, flow)


class AsyncRollouts(Resource):
    """Submit, inspect and cancel rollouts; receive their episodes."""
    _client: AsyncRequester

    async def create(
        self,
        *,
        tasks: Iterable[str | Task] | Mapping[str, Any],
        group_size: int,
        policy: Mapping[str, Any],
        agent: Mapping[str, Any] | None = None,
        limits: Mapping[str, Any] | None = None,
        max_staleness: int | None = None,
        staleness_action: str | None = None,
        max_attempts: int | None = None,
        group_mode: str | Mapping[str, Any] | None = None,
        group_spare: int | None = None,
        priority: int | None = None,
        concurrency: int | None = None,
        branching: Mapping[str, Any] | None = None,
        lazy_fork: bool | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """Submit a rollout: group_size episodes per task under a policy; options left None take the gateway's defaults.

        Args:
            tasks: task ids or Task objects, or a mapping such as {"environment": "terminal", "names": [...]}.
            policy: {"name", "api": "tokens"|"chat"|"scripted", "base_urls", "model", "sampling", ...}.
            group_mode: "complete", "early", or {"mode": "early", "min_group_size": n}.
            group_spare: extra samples per group; the first group_size usable ones are delivered,
                the rest cancelled or kept unstreamed.
            branching: run each sample as a trajectory tree: {"at_turns": [k, ...], "fanout": m,
                "max_episodes": n} or {"adaptive": {"budget": b, "min_entropy": h, "fanout": m}}.
            lazy_fork: False to give every sample its own sandbox even when the task declares
                deterministic tools.
            extra_body: more fields to send as they are (for gateway options newer than this SDK).
        """
        return await self._client._request(_create_request(
            tasks=tasks, group_size=group_size, policy=policy, agent=agent, limits=limits,
            max_staleness=max_staleness, staleness_action=staleness_action, max_attempts=max_attempts,
            group_mode=group_mode, group_spare=group_spare, priority=priority, concurrency=concurrency, branching=branching,
            lazy_fork=lazy_fork, extra_body=extra_body,
        ))

    async def get(self, rollout_id: str) -> Rollout:
        """Fetch a rollout: status, per-status episode counts, progress."""
        return await self._client._request(_get_request(rollout_id))

    def list(
        self, *, status: str | None = None, limit: int = DEFAULT_PAGE_SIZE, cursor: str | None = None
    ) -> AsyncPager[Rollout]:
        """Iterate (`async for`) over rollouts, oldest first; `limit` is the page size."""
        return AsyncPager(self._client, _list_request(status, limit), cursor)

    async def cancel(self, rollout_id: str) -> Rollout:
        """Cancel a rollout: queued episodes never start, running ones stop."""
        return await self._client._request(_cancel_request(rollout_id))

    async def delete(self, rollout_id: str) -> None:
        """Delete a finished rollout and everything it stored (a ConflictError while it still runs)."""
        await self._client._request(_delete_request(rollout_id))

    def dead_letters(
        self, rollout_id: str, *, limit: int = DEFAULT_PAGE_SIZE, cursor: str | None = None
    ) -> AsyncPager[DeadLetter]:
        """Iterate (`async for`) over a rollout's failed and stale episodes that will not be delivered."""
        return AsyncPager(self._client, _dead_letters_request(rollout_id, limit), cursor)

    async def pull(
        self,
        rollout_id: str,
        *,
        consumer: str,
        max_episodes: int = DEFAULT_MAX_EPISODES,
        wait_s: float = 0.0,
        visibility_timeout_s: float | None = None,
        cursor: int | None = None,
        redeliver: bool = False,
        include_failed: bool = False,
    ) -> AsyncEpisodeBatch:
        """Lease up to max_episodes delivered episodes for a consumer group, waiting up to wait_s for some.

        Leased episodes that are not acked within the visibility timeout are delivered
        again. `batch.done` tells that the rollout is finished and nothing is left.
        After a crash, pass the last `cursor` you processed (or redeliver=True) to get
        every unacked episode delivered after it at once instead of after its lease.
        include_failed=True also delivers the failed episodes (infra, verifier_error,
        policy_error), masked: `episode.masked`, reward None, loss_mask all zeros; ack them
        like the others. Use the same include_failed on every call of a consumer.
        """
        def make_batch(episodes: list[Episode], cursor: int | None, done: bool) -> AsyncEpisodeBatch:
            return AsyncEpisodeBatch(
                episodes, rollout_id=rollout_id, consumer=consumer, cursor=cursor, done=done,
                acker=lambda ids: self.ack(rollout_id, consumer=consumer, episode_ids=ids),
            )

        return await self._client._request(
            _pull_request(
                rollout_id, consumer, max_episodes, wait_s, visibility_timeout_s, cursor, redeliver, include_failed,
                make_batch,
            )
        )

    async def ack(self, rollout_id: str, *, consumer: str, episode_ids: Iterable[str]) -> int:
        """Acknowledge episodes for a consumer group so they are never delivered to it again; return the count."""
        return await self._client._request(_ack_request(rollout_id, consumer, episode_ids))

    def stream(
        self,
        rollout_id: str,
        *,
        consumer: str,
        batch_size: int | None = None,
        cursor: int | None = None,
        visibility_timeout_s: float | None = None,
        redeliver: bool = False,
        include_failed: bool = False,
        max_reconnects: int = DEFAULT_MAX_RECONNECTS,
    ) -> AsyncStream[AsyncEpisodeBatch]:
        """Iterate (`async for`) over a rollout's episodes as batches until the rollout is done.

        The connection is resumed after the last received event (Last-Event-ID) when it
        drops, up to max_reconnects times in a row. Ack each batch (`await batch.ack()`)
        once trained on; one that is not acked within visibility_timeout_s is delivered
        again, but this iterator yields each episode once. `cursor` resumes after a
        position (a batch's `cursor`) with every unacked episode after it redelivered at
        once; `redeliver` redelivers all unacked ones. `include_failed` also delivers failed
        episodes, masked (`episode.masked`). Leaving the loop early: aclose the stream, or
        use `async with`.
        """
        options = _stream_options(rollout_id, consumer, batch_size, visibility_timeout_s, redeliver, include_failed,
                                  max_reconnects)
        assembler: _BatchAssembler

        async def acker(ids: list[str]) -> int:
            acked = await self.ack(rollout_id, consumer=consumer, episode_ids=ids)
            assembler.forget(ids)
            return acked

        def make_batch(episodes: list[Episode], at: int | None) -> AsyncEpisodeBatch:
            return AsyncEpisodeBatch(episodes, rollout_id=rollout_id, consumer=consumer, cursor=at, acker=acker)

        assembler = _BatchAssembler(rollout_id, make_batch)
        flow = sse_flow(
            self._client, options, assembler, what=f"the stream of rollout {rollout_id}",
            last_event_id=None if cursor is None else str(cursor), max_reconnects=max_reconnects,
        )
        return AsyncStream(self._client, flow)

"""Episode lifecycle (queued -> running -> final), group release, reads and the training view.

The dispatcher (``gateway/rollouts/dispatch.py``) drives episodes through
:func:`list_queued_episodes`, :func:`mark_episode_running`, :func:`record_step` and
:func:`finish_episode`; :func:`requeue_interrupted` repairs what a crash left running.

Locking: every write that can change a rollout's episodes, groups or status first locks
the rollout row with an UPDATE (on SQLite that takes the database write lock, on
PostgreSQL the row lock), so finishes, cancels, restarts and staleness drops of one
rollout apply one at a time and each sees what the previous one committed. Lock order
everywhere: delivery consumer -> rollout -> episodes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import new_id, utcnow
from gateway.episodes.models import Episode, EpisodeStep
from gateway.errors import ConflictError, NotFoundError
from gateway.pagination import page_of, paginate
from gateway.policies import service as policies_service
from gateway.rollouts.events import rollout_events
from gateway.rollouts.models import (
    ACTIVE_EPISODE_STATUSES,
    FAILURE_OUTCOMES,
    FINAL_EPISODE_STATUSES,
    FINAL_ROLLOUT_STATUSES,
    USABLE_EPISODE_STATUSES,
    EpisodeGroup,
    GroupMode,
    Rollout,
    RolloutStatus,
    StalenessAction,
)
from workers.protocol import EpisodeOutcome, EpisodeStatus, Termination

logger = logging.getLogger(__name__)

#: Longest error text kept on an episode row.
MAX_ERROR_CHARS = 4000
#: Longest error of one failed sample quoted in a partial group's reason.
MAX_REASON_ERROR_CHARS = 300
#: The error of an episode a gateway restart cut short.
INTERRUPTED_ERROR = "interrupted by a gateway restart"
#: The StepRecord fields :func:`record_step` stores.
STEP_FIELDS = ("index", "parent_index", "prompt_ids", "completion_ids", "logprobs", "weight_version",
               "finish_reason", "text", "action", "parse_error", "observation", "reward", "timings", "server",
               "artifacts")


def _error_text(error: BaseException | str | None) -> str | None:
    if error is None:
        return None
    text = error if isinstance(error, str) else (str(error) or type(error).__name__)
    return text[:MAX_ERROR_CHARS]


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def outcome_of(status: EpisodeStatus, info: Mapping[str, Any]) -> EpisodeOutcome | None:
    """Return the outcome of an episode that ended as ``status`` with ``info``.

    A usable episode is the agent's reward. A failed one has the runner's ``info.outcome``
    (a failure outcome), else ``infra`` when ``info.infra`` says so (paths that predate
    typed outcomes), else none (cancelled, refused before it ran). A stale one keeps the
    verdict its runner reported, if any.
    """
    if status in USABLE_EPISODE_STATUSES:
        return EpisodeOutcome.REWARD
    declared = info.get("outcome")
    known = declared if declared in {o.value for o in EpisodeOutcome} else None
    if status == EpisodeStatus.FAILED:
        if known is not None and EpisodeOutcome(known) in FAILURE_OUTCOMES:
            return EpisodeOutcome(known)
        return EpisodeOutcome.INFRA if info.get("infra") is True else None
    return EpisodeOutcome(known) if known is not None else None


# --------------------------------------------------------------------------- reads


async def get_episode(*, db_session: AsyncSession, episode_id: str) -> Episode:
    """Return the episode with this id; raise NotFoundError if there is none."""
    row = await db_session.get(Episode, episode_id, populate_existing=True)
    if row is None:
        raise NotFoundError(f"Episode {episode_id!r} does not exist.")
    return row


async def get_steps(*, db_session: AsyncSession, episode_id: str) -> list[EpisodeStep]:
    """Return the steps of an episode in index order."""
    stmt = select(EpisodeStep).where(EpisodeStep.episode_id == episode_id).order_by(EpisodeStep.index)
    return list((await db_session.scalars(stmt)).all())


async def get_steps_of(*, db_session: AsyncSession, episode_ids: Sequence[str]) -> dict[str, list[EpisodeStep]]:
    """Return the steps of several episodes, each list in index order."""
    steps: dict[str, list[EpisodeStep]] = {eid: [] for eid in episode_ids}
    if not episode_ids:
        return steps
    stmt = (select(EpisodeStep).where(EpisodeStep.episode_id.in_(list(episode_ids)))
            .order_by(EpisodeStep.episode_id, EpisodeStep.index))
    for step in (await db_session.scalars(stmt)).all():
        steps[step.episode_id].append(step)
    return steps


async def list_episodes(
    *, db_session: AsyncSession, rollout_id: str | None = None, status: EpisodeStatus | None = None,
    group_id: str | None = None, task_id: str | None = None, limit: int, cursor: str | None = None,
) -> tuple[list[Episode], str | None]:
    """Return one page of episodes (oldest first), optionally of one rollout, status, group or task."""
    stmt = select(Episode)
    if rollout_id is not None:
        stmt = stmt.where(Episode.rollout_id == rollout_id)
    if status is not None:
        stmt = stmt.where(Episode.status == status)
    if group_id is not None:
        stmt = stmt.where(Episode.group_id == group_id)
    if task_id is not None:
        stmt = stmt.where(Episode.task_id == task_id)
    stmt = paginate(stmt, created_at=Episode.created_at, id_=Episode.id, cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).all())
    return page_of(rows, limit=limit)


def training_view(episode: Episode, steps: Iterable[EpisodeStep], *,
                  tree: _TreeIndex | None = None) -> dict[str, Any]:
    """Return the token-exact training view of an episode from the steps of its root-to-leaf path.

    ``input_ids`` concatenates, step by step in index order, the tokens appended before the
    generation (``prompt_ids``, loss 0) and the sampled tokens (``completion_ids``, loss 1);
    ``logprobs`` holds one value per sampled token (None where the server returned none).

    In a trajectory tree (``tree``) the path includes the prefix steps the episode inherits
    from its ancestors. ``segments`` cut ``input_ids`` into runs of steps, each naming the
    episode that ran them and how many leaves share them; ``shared_prefix_len`` counts the
    leading tokens this leaf shares with at least one other leaf (the shared steps plus the
    prompt of the turn where it diverged), so a trainer can count them once.

    A failed episode is never training data: its view is masked (``loss_mask`` all zeros, no
    ``logprobs``, ``reward`` None) and says its ``outcome`` and ``error``.
    """
    masked = episode.status == EpisodeStatus.FAILED
    input_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float | None] = []
    segments: list[dict[str, Any]] = []
    shared_prefix_len = 0
    # Leaves that never train (failed, stale) share nothing with the others; the viewed one always counts.
    uncounted = 0 if tree is None or tree.counts(episode) else 1
    for step in sorted(steps, key=lambda s: s.index):
        start = len(input_ids)
        prompt = list(step.prompt_ids or [])
        completion = list(step.completion_ids or [])
        input_ids.extend(prompt)
        loss_mask.extend([0] * len(prompt))
        input_ids.extend(completion)
        loss_mask.extend([0 if masked else 1] * len(completion))
        if not masked:
            step_logprobs = list(step.logprobs) if step.logprobs is not None else []
            step_logprobs = step_logprobs[: len(completion)]
            logprobs.extend(step_logprobs + [None] * (len(completion) - len(step_logprobs)))
        if tree is None:
            continue
        shared_by = tree.leaves_sharing(step.episode_id, step.index) + uncounted
        if shared_by > 1:
            shared_prefix_len = len(input_ids)
        elif shared_prefix_len == start and tree.size + uncounted > 1:
            shared_prefix_len = start + len(prompt)  # the branches diverged at this turn's sampled tokens
        last = segments[-1] if segments else None
        if last is not None and last["episode_id"] == step.episode_id and last["shared_by"] == shared_by:
            last.update(last_turn=step.index, end=len(input_ids))
        else:
            segments.append({"episode_id": step.episode_id, "first_turn": step.index, "last_turn": step.index,
                             "start": start, "end": len(input_ids), "shared_by": shared_by})
    return {
        "episode_id": episode.id,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "reward": None if masked else episode.reward,
        "outcome": episode.outcome.value if episode.outcome else None,
        "error": episode.error,
        "group_id": episode.group_id,
        "weight_versions": list(episode.weight_versions or []),
        "termination": episode.termination.value if episode.termination else None,
        "status": episode.status.value,
        "parent_episode_id": episode.parent_episode_id,
        "branch_turn": episode.branch_turn,
        "shared_prefix_len": shared_prefix_len,
        "segments": segments,
    }


class _TreeIndex:
    """The shape of one trajectory tree: each episode's parent, branch turn and steps."""

    def __init__(self, episodes: Sequence[Episode], steps: dict[str, list[EpisodeStep]]) -> None:
        self.episodes = {e.id: e for e in episodes}
        self.steps = steps
        self.children: dict[str, list[Episode]] = {}
        for episode in episodes:
            if episode.parent_episode_id is not None:
                self.children.setdefault(episode.parent_episode_id, []).append(episode)
        self._sizes: dict[str, int] = {}

    @staticmethod
    def counts(episode: Episode) -> bool:
        """Tell whether a leaf counts in sharing: not one that failed or went stale (it never trains)."""
        return episode.status not in (EpisodeStatus.FAILED, EpisodeStatus.STALE)

    @property
    def size(self) -> int:
        """How many leaves of the tree count (see :meth:`counts`)."""
        return sum(self.counts(e) for e in self.episodes.values())

    def subtree_size(self, episode_id: str) -> int:
        if episode_id not in self._sizes:
            self._sizes[episode_id] = int(self.counts(self.episodes[episode_id])) + sum(
                self.subtree_size(c.id) for c in self.children.get(episode_id, []))
        return self._sizes[episode_id]

    def leaves_sharing(self, episode_id: str, index: int) -> int:
        """Return how many counting leaves' paths contain step ``index`` of ``episode_id``."""
        own = int(self.counts(self.episodes[episode_id])) if episode_id in self.episodes else 1
        return own + sum(self.subtree_size(c.id) for c in self.children.get(episode_id, [])
                         if (c.branch_turn or 0) > index)

    def path(self, episode_id: str) -> list[EpisodeStep]:
        """Return the steps of an episode's root-to-leaf path in index order."""
        episode = self.episodes[episode_id]
        own = self.steps.get(episode_id, [])
        if episode.parent_episode_id is None or episode.parent_episode_id not in self.episodes:
            return list(own)
        turn = episode.branch_turn or 0
        return [s for s in self.path(episode.parent_episode_id) if s.index < turn] + list(own)


async def list_tree_episodes(
    *, db_session: AsyncSession, root_episode_id: str, status: EpisodeStatus | None = None
) -> list[Episode]:
    """Return the episodes of one trajectory tree (optionally of one status), oldest first."""
    stmt = select(Episode).where(Episode.root_episode_id == root_episode_id)
    if status is not None:
        stmt = stmt.where(Episode.status == status)
    return list((await db_session.scalars(stmt.order_by(Episode.created_at, Episode.id))).all())


async def _tree_index(db_session: AsyncSession, root_episode_id: str) -> _TreeIndex:
    episodes = await list_tree_episodes(db_session=db_session, root_episode_id=root_episode_id)
    steps = await get_steps_of(db_session=db_session, episode_ids=[e.id for e in episodes])
    return _TreeIndex(episodes, steps)


async def training_views(*, db_session: AsyncSession, episodes: Sequence[Episode]) -> dict[str, dict[str, Any]]:
    """Return the training view of each episode (root-to-leaf paths for the leaves of trees)."""
    plain = [e for e in episodes if e.root_episode_id is None]
    steps = await get_steps_of(db_session=db_session, episode_ids=[e.id for e in plain])
    views = {e.id: training_view(e, steps[e.id]) for e in plain}
    trees: dict[str, _TreeIndex] = {}
    for episode in episodes:
        if episode.root_episode_id is None:
            continue
        if episode.root_episode_id not in trees:
            trees[episode.root_episode_id] = await _tree_index(db_session, episode.root_episode_id)
        tree = trees[episode.root_episode_id]
        views[episode.id] = training_view(episode, tree.path(episode.id), tree=tree)
    return views


async def get_training(*, db_session: AsyncSession, episode_id: str) -> dict[str, Any]:
    """Return the training view of one episode."""
    episode = await get_episode(db_session=db_session, episode_id=episode_id)
    return (await training_views(db_session=db_session, episodes=[episode]))[episode.id]


async def get_path_steps(*, db_session: AsyncSession, episode: Episode) -> list[EpisodeStep]:
    """Return the steps of an episode's root-to-leaf path (its own steps outside trees)."""
    if episode.root_episode_id is None:
        return await get_steps(db_session=db_session, episode_id=episode.id)
    return (await _tree_index(db_session, episode.root_episode_id)).path(episode.id)


def _summary(step: EpisodeStep) -> tuple[str | None, str]:
    action = step.action or {}
    tool = action.get("tool") if isinstance(action, dict) else None
    if tool is None:
        return None, "unparseable output" if step.parse_error else ""
    arguments = action.get("arguments")
    if tool == "bash" and isinstance(arguments, dict) and isinstance(arguments.get("command"), str):
        lines = arguments["command"].strip().splitlines() or [""]
        text = lines[0] + (" ..." if len(lines) > 1 else "")
    else:
        text = tool
    return tool, text[:120]


async def get_tree(*, db_session: AsyncSession, episode_id: str) -> dict[str, Any]:
    """Return the trajectory tree an episode belongs to: step nodes, edges, leaves and branch points.

    An episode outside a branching rollout is a tree of one leaf.
    """
    episode = await get_episode(db_session=db_session, episode_id=episode_id)
    if episode.root_episode_id is None:
        tree = _TreeIndex([episode], {episode.id: await get_steps(db_session=db_session, episode_id=episode.id)})
        root_id = episode.id
    else:
        root_id = episode.root_episode_id
        tree = await _tree_index(db_session, root_id)

    def node_of(eid: str, index: int) -> str:
        """The node of step ``index`` on ``eid``'s path ("root" before the first step)."""
        while index >= 0:
            e = tree.episodes[eid]
            if e.parent_episode_id is None or index >= (e.branch_turn or 0):
                return f"{eid}:{index}"
            eid = e.parent_episode_id
        return "root"

    nodes: list[dict[str, Any]] = [{"id": "root"}]
    edges: list[dict[str, str]] = []
    leaves: list[dict[str, Any]] = []
    for eid in sorted(tree.episodes, key=lambda i: (tree.episodes[i].created_at, i)):
        e = tree.episodes[eid]
        own = tree.steps.get(eid, [])
        for step in own:
            tool, summary = _summary(step)
            node = f"{eid}:{step.index}"
            nodes.append({"id": node, "episode_id": eid, "turn": step.index, "tool": tool, "summary": summary,
                          "observation": (step.observation or "")[:200], "reward": step.reward,
                          "parse_error": step.parse_error is not None})
            edges.append({"parent": node_of(eid, step.index - 1), "child": node})
        last = node_of(eid, own[-1].index if own else (e.branch_turn or 0) - 1)
        leaves.append({"episode_id": eid, "node": last, "reward": e.reward, "status": e.status.value,
                       "termination": e.termination.value if e.termination else None,
                       "parent_episode_id": e.parent_episode_id, "branch_turn": e.branch_turn})
    fanout: dict[str, int] = {}
    for edge in edges:
        fanout[edge["parent"]] = fanout.get(edge["parent"], 0) + 1
    return {
        "root_episode_id": root_id, "rollout_id": episode.rollout_id, "task_id": episode.task_id,
        "group_id": episode.group_id, "nodes": nodes, "edges": edges, "leaves": leaves,
        "branch_points": [{"node": n, "children": c} for n, c in fanout.items() if c > 1],
    }


async def spawn_branches(
    *, db_session: AsyncSession, parent_episode_id: str, turn: int, n: int, node: str | None = None,
    lease: str | None = None,
) -> list[str]:
    """Create ``n`` running branch episodes of a tree episode forked at ``turn``; return their ids.

    The branches carry ``lease`` (the tree's attempt runs them all).

    Raises:
        LeaseLostError: ``lease`` is given and is not the parent's.
        NotFoundError: no such parent episode.
        ValueError: the parent is not part of a trajectory tree.
    """
    parent = await get_episode(db_session=db_session, episode_id=parent_episode_id)
    _check_lease(parent, lease)
    if parent.root_episode_id is None:
        raise ValueError(f"episode {parent_episode_id} is not part of a trajectory tree")
    now = utcnow()
    ids = []
    for _ in range(n):
        branch = Episode(
            id=new_id("ep"), rollout_id=parent.rollout_id, group_id=parent.group_id, task_id=parent.task_id,
            task_index=parent.task_index, sample_index=parent.sample_index, attempt=parent.attempt,
            status=EpisodeStatus.RUNNING, messages=[], timings={}, weight_versions=[], info={}, num_turns=0,
            parent_episode_id=parent.id, branch_turn=turn, root_episode_id=parent.root_episode_id, node=node,
            created_at=now, started_at=now, lease=lease,
        )
        db_session.add(branch)
        ids.append(branch.id)
    await db_session.commit()
    return ids


# --------------------------------------------------------------------------- dispatch side


async def lock_rollout(db_session: AsyncSession, rollout_id: str) -> Rollout:
    """Lock a rollout row for this transaction and return it freshly read; raise NotFoundError if missing."""
    result = await db_session.execute(update(Rollout).where(Rollout.id == rollout_id).values(updated_at=utcnow()))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise NotFoundError(f"Rollout {rollout_id!r} does not exist.")
    rollout = await db_session.get(Rollout, rollout_id, populate_existing=True)
    assert rollout is not None
    return rollout


async def list_queued_episodes(*, db_session: AsyncSession, rollout_id: str, limit: int) -> list[Episode]:
    """Return up to ``limit`` queued episodes of a rollout in dispatch order.

    Reruns come first (their groups wait on them), then task order, then sample order, so
    whole groups finish early.
    """
    stmt = (
        select(Episode)
        .where(Episode.rollout_id == rollout_id, Episode.status == EpisodeStatus.QUEUED)
        .order_by(Episode.attempt.desc(), Episode.task_index, Episode.sample_index)
        .limit(limit)
    )
    return list((await db_session.scalars(stmt)).all())


def _in_flight(sent_after: datetime, down: Sequence[str]) -> Any:
    """Episodes that hold a node slot: running, or sent to a live node recently enough to be taken soon."""
    sent = (Episode.status == EpisodeStatus.QUEUED) & (Episode.dispatched_at >= sent_after)
    if down:
        sent = sent & Episode.node.not_in(list(down))
    return (Episode.status == EpisodeStatus.RUNNING) | sent


async def in_flight_by_node(
    *, db_session: AsyncSession, sent_after: datetime, down: Sequence[str] = ()
) -> dict[str, int]:
    """Return, per node, how many episodes it runs or has been sent (distributed mode's admission)."""
    stmt = select(Episode.node, func.count()).where(_in_flight(sent_after, down), Episode.node.is_not(None)) \
        .group_by(Episode.node)
    counts = {node: int(n) for node, n in (await db_session.execute(stmt)).all()}
    await db_session.commit()
    return counts


async def dispatch_queued(
    *, db_session: AsyncSession, rollout_id: str, free: dict[str, int], sent_after: datetime,
    down: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """Place a rollout's queued episodes on nodes with free slots; return ``(episode_id, node)`` to send.

    Least-loaded admission: each episode goes to the node with the most free slots
    (``free`` is updated), and no more run or wait at once than the rollout's concurrency.
    An episode sent before ``sent_after`` (its job lost, e.g. with a Redis restart) or to a
    node in ``down`` is placed again. The rollout row is locked meanwhile, so the schedulers
    of several gateways never place the same episode twice.
    """
    rollout = await lock_rollout(db_session, rollout_id)
    if rollout.status not in (RolloutStatus.QUEUED, RolloutStatus.RUNNING):
        await db_session.commit()
        return []
    busy = int(await db_session.scalar(select(func.count()).select_from(Episode).where(
        Episode.rollout_id == rollout_id, _in_flight(sent_after, down))) or 0)
    room = max(0, rollout.concurrency - busy)
    if room == 0 or max(free.values(), default=0) <= 0:
        await db_session.commit()
        return []
    unsent = Episode.dispatched_at.is_(None) | (Episode.dispatched_at < sent_after)
    if down:
        unsent = unsent | Episode.node.in_(list(down))
    stmt = (
        select(Episode)
        .where(Episode.rollout_id == rollout_id, Episode.status == EpisodeStatus.QUEUED, unsent)
        .order_by(Episode.attempt.desc(), Episode.task_index, Episode.sample_index)
        .limit(room)
    )
    now = utcnow()
    placed = []
    for episode in (await db_session.scalars(stmt)).all():
        node = max(free, key=lambda n: free[n])
        if free[node] <= 0:
            break
        free[node] -= 1
        episode.dispatched_at = now
        episode.node = node
        placed.append((episode.id, node))
    await db_session.commit()
    return placed


async def undispatch(*, db_session: AsyncSession, episode_id: str) -> None:
    """Return a queued episode a node will not run (it drains) to the schedulers."""
    await db_session.execute(update(Episode).where(Episode.id == episode_id, Episode.status == EpisodeStatus.QUEUED)
                             .values(dispatched_at=None, node=None))
    await db_session.commit()


async def count_running_episodes(*, db_session: AsyncSession, rollout_id: str) -> int:
    """Return how many episodes of a rollout are running."""
    stmt = select(func.count()).select_from(Episode).where(
        Episode.rollout_id == rollout_id, Episode.status == EpisodeStatus.RUNNING
    )
    return int(await db_session.scalar(stmt) or 0)


class LeaseLostError(ConflictError):
    """A runner wrote to an episode whose lease it no longer holds (another attempt owns it, or it ended)."""


async def mark_episode_running(
    *, db_session: AsyncSession, episode_id: str, node: str | None = None, lease: str | None = None
) -> bool:
    """Move a queued episode to running (and its rollout to running); return False if it must not run.

    False means the rollout was cancelled or failed, or the episode is no longer queued
    (another dispatcher took it, or a duplicate delivery of its job came first); nothing
    changes then. ``lease``: the claiming attempt's fencing token, which its writes
    (:func:`record_step`, :func:`finish_episode`, :func:`spawn_branches`) must then carry.
    """
    episode = await get_episode(db_session=db_session, episode_id=episode_id)
    now = utcnow()
    result = await db_session.execute(
        update(Rollout)
        .where(Rollout.id == episode.rollout_id,
               Rollout.status.in_([RolloutStatus.QUEUED, RolloutStatus.RUNNING]))
        .values(status=RolloutStatus.RUNNING, started_at=func.coalesce(Rollout.started_at, now), updated_at=now)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        await db_session.rollback()
        return False
    result = await db_session.execute(
        update(Episode).where(Episode.id == episode_id, Episode.status == EpisodeStatus.QUEUED)
        .values(status=EpisodeStatus.RUNNING, started_at=now, node=node, lease=lease)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        await db_session.rollback()
        return False
    await db_session.commit()
    return True


def _step_values(step: Any) -> dict[str, Any]:
    data = dataclasses.asdict(step) if dataclasses.is_dataclass(step) and not isinstance(step, type) else dict(step)
    if "index" not in data:
        raise ValueError("a step needs an index")
    values = {name: data.get(name) for name in STEP_FIELDS}
    completion = list(values["completion_ids"] or [])
    logprobs = values["logprobs"]
    if logprobs is not None:
        if len(logprobs) != len(completion):
            raise ValueError(f"step {values['index']}: {len(logprobs)} logprobs for {len(completion)} "
                             "completion tokens")
        # JSON has no infinities; a non-finite logprob is kept as null.
        logprobs = [None if lp is None or not math.isfinite(lp) else float(lp) for lp in logprobs]
    values.update(
        prompt_ids=[int(t) for t in values["prompt_ids"] or []],
        completion_ids=[int(t) for t in completion],
        logprobs=logprobs,
        text=values["text"] or "",
        observation=values["observation"] or "",
        timings=dict(values["timings"] or {}),
        reward=_finite(values["reward"]),
        parse_error=_error_text(values["parse_error"]),
        artifacts=list(values["artifacts"]) if values["artifacts"] else None,
    )
    return values


async def record_step(
    *, db_session: AsyncSession, episode_id: str, step: Any, lease: str | None = None
) -> EpisodeStep | None:
    """Append one step (a StepRecord or a dict of its fields) to a queued or running episode.

    Returns the stored step, or None (with a warning) if the episode has already ended.

    Raises:
        LeaseLostError: ``lease`` is given and is not the episode's (another attempt runs it).
        NotFoundError: no such episode.
        ValueError: the step has no index, repeats an index, or its logprobs do not match its
            completion tokens.
    """
    values = _step_values(step)
    stmt = update(Episode).where(Episode.id == episode_id, Episode.status.in_(list(ACTIVE_EPISODE_STATUSES)))
    if lease is not None:
        stmt = stmt.where(Episode.lease == lease)
    result = await db_session.execute(stmt.values(num_turns=Episode.num_turns + 1))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        await db_session.rollback()
        episode = await get_episode(db_session=db_session, episode_id=episode_id)  # NotFoundError if missing
        _check_lease(episode, lease)
        logger.warning("episode %s: step %s arrived after the episode ended; not recorded", episode_id,
                       values["index"])
        return None
    row = EpisodeStep(episode_id=episode_id, created_at=utcnow(), **values)
    db_session.add(row)
    try:
        await db_session.commit()
    except IntegrityError as exc:
        await db_session.rollback()
        raise ValueError(f"episode {episode_id} already has a step {values['index']}") from exc
    return row


def _check_lease(episode: Episode, lease: str | None) -> None:
    """Raise LeaseLostError if ``lease`` is given and ``episode`` is not held under it."""
    if lease is not None and episode.lease != lease:
        raise _lease_lost(episode)


def _lease_lost(episode: Episode) -> LeaseLostError:
    return LeaseLostError(f"episode {episode.id} is no longer held by this attempt (it is {episode.status.value} "
                          f"on node {episode.node}); its writes are refused")


def staleness_lag(weight_versions: Sequence[int], version: int) -> int | None:
    """Return how many versions the oldest turn lags ``version`` (None when no turn carries a version)."""
    versions = [v for v in weight_versions if v is not None]
    return version - min(versions) if versions else None


def _is_stale(rollout: Rollout, weight_versions: Sequence[int], version: int) -> bool:
    if rollout.max_staleness is None:
        return False
    lag = staleness_lag(weight_versions, version)
    return lag is not None and lag > rollout.max_staleness


async def finish_episode(
    *, db_session: AsyncSession, episode_id: str, status: EpisodeStatus | str, termination: Termination | str | None,
    reward: float | None, error: BaseException | str | None = None, messages: list[dict[str, Any]] | None = None,
    timings: dict[str, Any] | None = None, weight_versions: Sequence[int] | None = None,
    info: dict[str, Any] | None = None, current_version: int | None = None, lease: str | None = None,
) -> Episode:
    """Record how an episode ended and settle what follows, in one transaction.

    - Its outcome is recorded (see :func:`outcome_of`).
    - Staleness: a completed/truncated episode whose oldest turn lags the policy's version
      (``current_version``, or the announced version when None) by more than the rollout's
      ``max_staleness`` becomes ``stale``; with ``staleness_action`` rerun and attempts
      left a new queued attempt (same group and sample) is created, else it is dead-lettered.
    - A failed episode whose outcome is ``infra``, ``verifier_error`` or ``policy_error`` gets
      a new queued attempt (a fresh sandbox) while attempts remain; otherwise it is dead-lettered
      with its error.
    - Its group enters the delivery stream when ready (see :func:`release_group_if_ready`).
    - The rollout becomes ``completed`` when no episode is queued or running.

    Finishing an episode that has already ended changes nothing and returns it.

    Raises:
        LeaseLostError: ``lease`` is given and is not the episode's (another attempt runs it).
        NotFoundError: no such episode.
        ValueError: ``status`` is not a final state.
    """
    status = EpisodeStatus(status)
    if status not in FINAL_EPISODE_STATUSES:
        raise ValueError(f"cannot finish an episode as {status.value}; use a final state")
    term = Termination(termination) if termination is not None else None
    episode = await get_episode(db_session=db_session, episode_id=episode_id)
    rollout = await lock_rollout(db_session, episode.rollout_id)
    episode = await db_session.get(Episode, episode_id, populate_existing=True) or episode
    if lease is not None and episode.lease != lease:
        lost = _lease_lost(episode)  # read before the rollback expires the row
        await db_session.rollback()
        raise lost
    if episode.status not in ACTIVE_EPISODE_STATUSES:
        ended = episode.status.value
        await db_session.rollback()
        logger.warning("episode %s already ended as %s; finish ignored", episode_id, ended)
        return await get_episode(db_session=db_session, episode_id=episode_id)
    now = utcnow()
    versions = [int(v) for v in (weight_versions or []) if v is not None]
    extra = dict(info or {})
    episode.outcome = outcome_of(status, extra)
    if status in USABLE_EPISODE_STATUSES and rollout.max_staleness is not None and versions:
        version = current_version if current_version is not None else await policies_service.current_version(
            db_session=db_session, name=rollout.policy_name)
        if _is_stale(rollout, versions, version):
            extra["stale"] = {"detected": "finish", "policy_version": version, "oldest_version": min(versions),
                              "max_staleness": rollout.max_staleness,
                              "termination": term.value if term else None}
            status, term = EpisodeStatus.STALE, Termination.STALE
    episode.status = status
    episode.termination = term
    episode.reward = _finite(reward)
    episode.error = _error_text(error)
    episode.messages = list(messages or [])
    episode.timings = dict(timings or {})
    episode.weight_versions = versions
    episode.info = extra
    episode.finished_at = now
    episode.num_turns = int(await db_session.scalar(
        select(func.count()).select_from(EpisodeStep).where(EpisodeStep.episode_id == episode_id)) or 0)
    await _settle(db_session, rollout, episode, now)
    await db_session.commit()
    rollout_events.notify(rollout.id)
    logger.info("episode %s of rollout %s ended %s (%s), reward %s", episode_id, rollout.id, status.value,
                term.value if term else None, episode.reward)
    return episode


async def requeue_interrupted(
    *, db_session: AsyncSession, node: str | None = None, error: str = INTERRUPTED_ERROR
) -> int:
    """Fail the episodes a crash left ``running`` and queue a new attempt where attempts remain.

    Call it at gateway start, before the dispatcher resumes the rollouts still running, and
    for a node found down (``error`` then says so). With ``node``, only episodes started on
    that node are touched. Returns how many episodes were interrupted.
    """
    stmt = select(Episode.id, Episode.rollout_id).where(Episode.status == EpisodeStatus.RUNNING)
    if node is not None:
        stmt = stmt.where(Episode.node == node)
    by_rollout: dict[str, list[str]] = {}
    for episode_id, rollout_id in (await db_session.execute(stmt)).all():
        by_rollout.setdefault(rollout_id, []).append(episode_id)
    await db_session.commit()
    interrupted = 0
    for rollout_id, episode_ids in by_rollout.items():
        rollout = await lock_rollout(db_session, rollout_id)
        now = utcnow()
        for episode_id in episode_ids:
            episode = await get_episode(db_session=db_session, episode_id=episode_id)
            if episode.status != EpisodeStatus.RUNNING:
                continue
            episode.status = EpisodeStatus.FAILED
            episode.termination = Termination.ERROR
            episode.error = error
            episode.info = {**(episode.info or {}), "infra": True}  # the node's fault, never the policy's
            episode.outcome = EpisodeOutcome.INFRA
            episode.finished_at = now
            await _settle(db_session, rollout, episode, now)
            interrupted += 1
        await db_session.commit()
        rollout_events.notify(rollout_id)
    if interrupted:
        logger.warning("%d episode(s) were interrupted (%s) and failed; reruns queued where attempts remain",
                       interrupted, error)
    return interrupted


async def withdraw_stale(
    *, db_session: AsyncSession, rollout: Rollout, episode: Episode, version: int, now: datetime
) -> bool:
    """Turn a streamed episode found stale at delivery into ``stale`` and rerun or dead-letter it.

    The caller holds the rollout lock and commits. A rerun reopens a completed rollout
    (the dispatcher must pick it up again); its result is streamed on its own, replacing
    this one. Returns whether a rerun was queued.
    """
    extra = dict(episode.info or {})
    extra["stale"] = {"detected": "delivery", "policy_version": version,
                      "oldest_version": min(episode.weight_versions), "max_staleness": rollout.max_staleness,
                      "termination": episode.termination.value if episode.termination else None}
    episode.info = extra
    episode.status = EpisodeStatus.STALE
    episode.termination = Termination.STALE
    rerun = await _retire_stale(db_session, rollout, episode, now)
    await db_session.flush()
    await _complete_if_done(db_session, rollout, now)
    logger.info("episode %s of rollout %s was stale at delivery (policy at version %d)", episode.id, rollout.id,
                version)
    return rerun is not None


def is_stale_now(rollout: Rollout, episode: Episode, version: int) -> bool:
    """Return whether a streamed episode is too far behind ``version`` to be delivered as fresh."""
    return _is_stale(rollout, list(episode.weight_versions or []), version)


async def _settle(db_session: AsyncSession, rollout: Rollout, episode: Episode, now: datetime) -> None:
    """After ``episode`` reached a final state: rerun or dead-letter it, release its group, complete the rollout."""
    group = await db_session.get(EpisodeGroup, episode.group_id, populate_existing=True)
    assert group is not None
    # A surplus sample of a group already streamed (early mode, spares): no point running it again.
    surplus = group.released_at is not None and not await _sample_was_streamed(db_session, episode)
    if episode.status == EpisodeStatus.STALE:
        if surplus:
            episode.dead_letter_reason = _stale_reason(episode) + "; its group was already delivered"
        else:
            await _retire_stale(db_session, rollout, episode, now)
    elif episode.status == EpisodeStatus.FAILED:
        reason = episode.error or "the episode failed"
        why_not = "its group was already delivered" if surplus else _no_rerun(rollout, episode)
        if episode.outcome not in FAILURE_OUTCOMES:  # cancelled or refused: running it again changes nothing
            episode.dead_letter_reason = reason
        elif why_not is None:
            _queue_attempt(db_session, rollout, episode, now)
        else:
            episode.dead_letter_reason = f"{reason}; {why_not}"
    await db_session.flush()
    await release_group_if_ready(db_session=db_session, rollout=rollout, group=group, episode=episode, now=now)
    await _complete_if_done(db_session, rollout, now)


def _stale_reason(episode: Episode) -> str:
    stale = (episode.info or {}).get("stale")
    if not isinstance(stale, dict):  # marked stale by the caller (e.g. at dispatch)
        return f"stale: {episode.error or 'the policy moved too far ahead of its weight versions'}"
    return (f"stale: oldest turn at version {stale.get('oldest_version')}, policy at version "
            f"{stale.get('policy_version')} (max_staleness {stale.get('max_staleness')})")


async def _retire_stale(
    db_session: AsyncSession, rollout: Rollout, episode: Episode, now: datetime
) -> Episode | None:
    """Rerun a stale episode if the rollout allows it (returning the rerun), else dead-letter it."""
    reason = _stale_reason(episode)
    why_not = _no_rerun(rollout, episode)
    if rollout.staleness_action != StalenessAction.RERUN:
        episode.dead_letter_reason = reason
    elif why_not is not None:
        episode.dead_letter_reason = f"{reason}; {why_not}"
    else:
        return _queue_attempt(db_session, rollout, episode, now)
    return None


def _no_rerun(rollout: Rollout, episode: Episode) -> str | None:
    """Return why ``episode``'s sample gets no new attempt, or None if it may have one."""
    if rollout.branching is not None:
        return "episodes of trajectory trees are not rerun"
    if rollout.status in (RolloutStatus.CANCELLED, RolloutStatus.FAILED):
        return f"not rerun because the rollout is {rollout.status.value}"
    if episode.attempt >= rollout.max_attempts:
        return f"no attempts left (max_attempts {rollout.max_attempts})"
    return None


def _queue_attempt(db_session: AsyncSession, rollout: Rollout, episode: Episode, now: datetime) -> Episode:
    """Queue the next attempt of ``episode``'s sample (reopening a completed rollout)."""
    rerun = Episode(
        id=new_id("ep"), rollout_id=episode.rollout_id, group_id=episode.group_id, task_id=episode.task_id,
        task_index=episode.task_index, sample_index=episode.sample_index, attempt=episode.attempt + 1,
        status=EpisodeStatus.QUEUED, messages=[], timings={}, weight_versions=[], info={"previous": episode.id},
        num_turns=0, created_at=now,
    )
    db_session.add(rerun)
    if rollout.status == RolloutStatus.COMPLETED:
        rollout.status = RolloutStatus.RUNNING
        rollout.finished_at = None
    logger.info("episode %s: queued attempt %d as %s", episode.id, rerun.attempt, rerun.id)
    return rerun


async def _sample_was_streamed(db_session: AsyncSession, episode: Episode) -> bool:
    """Return whether an earlier attempt of this episode's sample entered the stream as training data."""
    stmt = select(func.count()).select_from(Episode).where(
        Episode.group_id == episode.group_id, Episode.sample_index == episode.sample_index,
        Episode.id != episode.id, Episode.seq.is_not(None), Episode.status != EpisodeStatus.FAILED,
    )
    return bool(await db_session.scalar(stmt))


async def release_group_if_ready(
    *, db_session: AsyncSession, rollout: Rollout, group: EpisodeGroup, episode: Episode | None, now: datetime
) -> bool:
    """Give the group's episodes stream positions once the group is ready; return whether it was released.

    Ready means no sample of the group is queued or running any more, or (outside trees) that
    it has as many usable (completed or truncated) episodes as it asks for: ``group_size``,
    ``min_group_size`` in ``early`` mode. The first ``group_size`` usable episodes to finish
    are streamed (in sample order), then the group's failed attempts with a failure outcome,
    which only consumers asking for failed episodes receive (masked). A group released with
    fewer usable episodes than it asks for is flagged ``partial`` with the reason.

    Once a group has ``group_size`` usable episodes its queued samples (spares, reruns; not the
    rerun of a streamed sample) are cancelled. Episodes that end after the release are kept but not streamed, except a rerun
    replacing a streamed episode found stale at delivery, which is streamed on its own. The
    caller holds the rollout lock and commits.
    """
    rows = list((await db_session.scalars(select(Episode).where(Episode.group_id == group.id))).all())
    usable = [e for e in rows if e.status in USABLE_EPISODE_STATUSES]
    tree = rollout.branching is not None
    if not tree and len(usable) >= rollout.group_size:
        streamed = {e.sample_index for e in rows if e.seq is not None and e.status != EpisodeStatus.FAILED}
        _cancel_queued([e for e in rows if e.status == EpisodeStatus.QUEUED and e.sample_index not in streamed],
                       Termination.CANCELLED, f"not run: its group already has {len(usable)} usable samples", now)
    if group.released_at is not None:
        if (episode is not None and episode.status in USABLE_EPISODE_STATUSES and episode.seq is None
                and await _sample_was_streamed(db_session, episode)):
            _assign_seq(rollout, [episode])
        return False
    wanted = rollout.min_group_size if rollout.group_mode == GroupMode.EARLY and rollout.min_group_size else \
        rollout.group_size
    if any(e.status in ACTIVE_EPISODE_STATUSES for e in rows) and (tree or len(usable) < wanted):
        return False
    first = sorted(usable, key=lambda e: (e.finished_at or now, e.sample_index))
    winners = first if tree else first[:rollout.group_size]
    failed = [e for e in rows if e.status == EpisodeStatus.FAILED and e.outcome in FAILURE_OUTCOMES]
    group.released_at = now
    group.updated_at = now
    _assign_seq(rollout, sorted(winners, key=lambda e: (e.sample_index, e.created_at)))
    _assign_seq(rollout, sorted(failed, key=lambda e: (e.sample_index, e.attempt, e.created_at)))
    if len(winners) < (len(rows) if tree else wanted):
        group.partial = True
        group.partial_reason = _partial_reason(rows, tree=tree)
    logger.info("group %s of rollout %s released: %d usable episode(s) streamed%s", group.id, rollout.id,
                len(winners), f" (partial: {group.partial_reason})" if group.partial else "")
    return True


def _partial_reason(rows: Sequence[Episode], *, tree: bool) -> str:
    """Say how many samples (a tree's episodes) of a group failed for good, with each one's outcome and error."""
    last: dict[Any, Episode] = {}
    for e in rows:  # a sample's last attempt is its verdict (a tree's episodes are each their own)
        key = e.id if tree else e.sample_index
        if key not in last or e.attempt > last[key].attempt:
            last[key] = e
    lost = [e for e in last.values() if e.status not in USABLE_EPISODE_STATUSES]
    labels: Counter[str] = Counter()
    for e in sorted(lost, key=lambda e: (e.sample_index, e.created_at)):
        kind = e.outcome.value if e.outcome else e.status.value if e.status == EpisodeStatus.STALE else \
            e.termination.value if e.termination else e.status.value
        why = (e.error or e.dead_letter_reason or "no reason given")[:MAX_REASON_ERROR_CHARS]
        labels[why if why.startswith(f"{kind}:") else f"{kind}: {why}"] += 1
    causes = "; ".join(text + (f" (x{n})" if n > 1 else "") for text, n in labels.items())
    noun = "episodes" if tree else "samples"
    return f"{len(lost)} of {len(last)} {noun} failed for good: {causes}"[:MAX_ERROR_CHARS]


def _cancel_queued(episodes: Iterable[Episode], termination: Termination, reason: str, now: datetime) -> None:
    """End queued episodes that will not run as failed (dead-lettered with ``reason``)."""
    for episode in episodes:
        episode.status = EpisodeStatus.FAILED
        episode.termination = termination
        episode.error = reason
        episode.dead_letter_reason = reason
        episode.finished_at = now


def _assign_seq(rollout: Rollout, episodes: Sequence[Episode]) -> None:
    for episode in episodes:
        rollout.last_seq += 1
        episode.seq = rollout.last_seq


async def _complete_if_done(db_session: AsyncSession, rollout: Rollout, now: datetime) -> None:
    if rollout.status in FINAL_ROLLOUT_STATUSES:
        return
    stmt = select(func.count()).select_from(Episode).where(
        Episode.rollout_id == rollout.id, Episode.status.in_(list(ACTIVE_EPISODE_STATUSES)))
    if int(await db_session.scalar(stmt) or 0) == 0:
        rollout.status = RolloutStatus.COMPLETED
        rollout.finished_at = now
        logger.info("rollout %s completed", rollout.id)


async def settle_cancelled(
    *, db_session: AsyncSession, rollout: Rollout, status: RolloutStatus, reason: str, now: datetime
) -> int:
    """Fail every queued episode of a rollout being cancelled or failed, and release groups that are now over.

    The caller holds the rollout lock, sets the rollout's status and commits. Returns how
    many queued episodes were failed.
    """
    queued = list((await db_session.scalars(
        select(Episode).where(Episode.rollout_id == rollout.id, Episode.status == EpisodeStatus.QUEUED))).all())
    termination = Termination.CANCELLED if status == RolloutStatus.CANCELLED else Termination.ERROR
    _cancel_queued(queued, termination, reason, now)
    await db_session.flush()
    for group_id in sorted({e.group_id for e in queued}):
        group = await db_session.get(EpisodeGroup, group_id, populate_existing=True)
        assert group is not None
        await release_group_if_ready(db_session=db_session, rollout=rollout, group=group, episode=None, now=now)
    return len(queued)

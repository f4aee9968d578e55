"""Shared-prefix execution of one group of samples: one sandbox while actions agree, a fork where they diverge.

The samples of a GRPO-style group start from the same task state and often issue
the same first actions (``ls``, ``cat README``). :class:`SharedEnvGroup` runs them as
a tree of *nodes*: all members start in one node (one sandbox). Each turn a node
waits until every member still in it has submitted its next call (``step`` or
``truncate``) or left (``close``), then groups the calls by their canonical key
(tool plus the canonical JSON of the arguments; a truncate is keyed by its reason):

- one key: the call runs once and every member gets an equal copy of its result;
- ``d`` keys: the node's sandbox is snapshotted once, restored ``d - 1`` times (the
  snapshot is deleted when the group closes, after its sandboxes), each distinct call runs on its own sandbox
  concurrently, and the members split into ``d`` child nodes (lazy fork).

A node's sandbox is destroyed when its last member leaves; a member whose call
ended the episode (terminated or truncated) leaves its node. An
:class:`~workers.errors.ActionError` (or any other exception) raised by the one
execution reaches every member of that key as an exception of the same type and
message.

Why this is correct only for deterministic tools
    A member of a shared node receives the observation of an action that ran once,
    in one sandbox. That equals what it would have seen alone only if the
    observation is a function of the sandbox state and the action, and the state
    after the action a function of the state before it and the action. Then members
    with equal action histories have equal states, by induction from the one reset,
    and one execution stands for all of them. Tools that read the clock, draw
    randomness (``$RANDOM``, ``mktemp``), use the network, race background processes
    or hit a timeout break this: the members would all see the one sampled outcome
    instead of independent ones (correlated samples), and background processes do
    not survive a fork (snapshots do not capture them, see :mod:`sandboxes.snapshots`).
    Use a group only for environments that declare their tools deterministic. The
    agent time budget is the shared sandbox's: forks inherit the time left.

The barrier and the deadlock caveat
    A node cannot run a turn until all its members have submitted, so the caller
    must run every member of the group concurrently, and must not put members behind
    a semaphore (or a pool) smaller than the group: members held outside it would
    never submit while those inside wait for them. The barrier is never unbounded:
    after ``barrier_timeout_s`` the members that submitted proceed, and the members
    that stalled are split off together into a node of their own (a fork of the
    state before the turn), where they go on whenever they submit. Such a split
    costs a fork and the wait, not correctness.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import json
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandboxes.base import SandboxSpec
from workers.envs.base import Action, Forkable, StepResult, ToolSpec
from workers.envs.registry import family_of
from workers.errors import SessionClosedError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sandboxes.base import SandboxBackend
    from workers.envs.base import EnvContext, Environment, EnvTask

logger = logging.getLogger(__name__)

#: Seconds a node waits for its slowest member's next call before splitting it off.
DEFAULT_BARRIER_TIMEOUT_S = 120.0


def action_key(tool: str, arguments: Any, budget_s: float | None = None) -> Hashable:
    """Return the canonical key of a step: equal keys mean the same action with the same budget.

    The budget counts in whole seconds (what an env bounds its tools by). Arguments that
    are not plain JSON (NaN, non-string keys, objects) get a key equal to nothing else,
    so such a call is never shared.
    """
    budget = None if budget_s is None else max(1, math.floor(budget_s))
    try:
        return json.dumps(
            ["step", tool, {} if arguments is None else arguments, budget],
            sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
        )
    except (TypeError, ValueError):
        return object()


def truncate_key(reason: str) -> Hashable:
    """Return the canonical key of a truncate (the reason is part of its observation)."""
    return json.dumps(["truncate", reason], ensure_ascii=False)


@dataclass(eq=False)
class _Call:
    """One member's submitted call, waiting for its node's turn."""

    key: Hashable
    action: Action | None
    """None for a truncate."""
    budget_s: float | None
    reason: str
    future: asyncio.Future[StepResult]


@dataclass(eq=False)
class _Node:
    """Members with equal histories and the one sandbox (env) they share."""

    id: int
    members: set[int]
    env: Environment | None = None
    """None only while the fork that makes it is being restored."""
    pending: dict[int, _Call] = field(default_factory=dict)
    busy: bool = False
    """A turn runs on this node (or on its env, for a child still being made)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class SharedMemberEnv:
    """One member of a :class:`SharedEnvGroup`, with the env surface the episode runner uses."""

    def __init__(self, group: SharedEnvGroup, index: int) -> None:
        self._group = group
        self.index = index
        self._reset = False
        self._busy = False
        self._done = False
        self._closed = False

    @property
    def done(self) -> bool:
        """Tell whether this member's episode has ended (its call ended it, or it closed)."""
        return self._done

    @property
    def tools(self) -> Sequence[ToolSpec]:
        """The task's family's tools."""
        return family_of(self._group.task).tools

    @property
    def sandbox(self) -> None:
        """None: a member has no sandbox of its own (its node's may change at any fork)."""
        return None

    async def reset(self) -> str:
        """Return the task instruction; the group's one sandbox is made by the first caller.

        Raises:
            SessionClosedError: this member was reset or closed already, or the group is closed.
        """
        return await self._group._reset(self)

    async def step(self, action: Action, *, budget_s: float | None = None) -> StepResult:
        """Apply one tool call, shared with the members of this node that make the same call (and budget).

        The budget is part of the call's key in whole seconds (what the env bounds a tool
        by), so members whose deadlines differ by milliseconds still share.

        Raises:
            ActionError: unknown tool or invalid arguments (the episode goes on).
            SessionClosedError: the episode has ended, or the member or group is closed.
        """
        return await self._group._submit(self, action, budget_s, "")

    async def truncate(self, reason: str) -> StepResult:
        """End the episode early and verify (truncated=True).

        Raises:
            SessionClosedError: the episode has ended, or the member or group is closed.
        """
        return await self._group._submit(self, None, None, reason)

    async def close(self) -> None:
        """Leave the group; the node's sandbox goes once its last member has left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._done = True
        await self._group._leave(self.index)


class SharedEnvGroup:
    """Run the ``size`` samples of one task on shared sandboxes, forking only where their actions diverge.

    Args:
        new_env: makes a fresh, not yet reset env (called once, by the first reset); it must be
            :class:`~workers.envs.base.Forkable` for the group to split.
        size: the number of members.
        ctx: the context ``new_env``'s envs live in (forks are restored on its backend).
        task: the task (forked envs continue it through its family's ``restore``).
        labels: labels of the forked sandboxes; defaults to those of the first env.
        barrier_timeout_s: how long a node waits for its slowest member's call before
            splitting the stalled members off into a node of their own.
    """

    @property
    def backend(self) -> SandboxBackend:
        """The backend the group's sandboxes live on."""
        return self.ctx.backend

    def __init__(
        self,
        new_env: Callable[[], Awaitable[Environment]],
        *,
        size: int,
        ctx: EnvContext,
        task: EnvTask,
        labels: Mapping[str, str] | None = None,
        barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
    ) -> None:
        if size < 1:
            raise ValueError(f"a shared group needs at least one member, got size={size}")
        if not barrier_timeout_s > 0:
            raise ValueError(f"barrier_timeout_s must be a positive number of seconds, got {barrier_timeout_s!r}")
        self._new_env = new_env
        self.size = size
        self.ctx = ctx
        self.task = task
        self.labels = dict(labels) if labels is not None else None
        self.barrier_timeout_s = barrier_timeout_s
        self._members = [SharedMemberEnv(self, i) for i in range(size)]
        self._node_of: dict[int, _Node] = {}
        self._nodes: set[_Node] = set()
        self._node_ids = itertools.count()
        self._left: set[int] = set()
        self._opening: asyncio.Task[str] | None = None
        self._first_env: Environment | None = None
        self._turns: set[asyncio.Task[None]] = set()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._fork_snapshots: list[str] = []
        self._closing: asyncio.Task[None] | None = None
        self._executed_steps = 0
        self._shared_steps = 0
        self._forks = 0
        self._sandboxes_created = 0

    def member(self, index: int) -> SharedMemberEnv:
        """Return member ``index`` (0 <= index < size)."""
        if not 0 <= index < self.size:
            raise ValueError(f"member index must be in [0, {self.size}), got {index}")
        return self._members[index]

    @property
    def stats(self) -> dict[str, int]:
        """Return the counters: executed_steps, shared_steps, forks and sandboxes_created.

        ``executed_steps`` counts calls run on a sandbox (one per distinct call and
        node); ``shared_steps`` the member-steps served by another member's execution.
        """
        return {
            "executed_steps": self._executed_steps,
            "shared_steps": self._shared_steps,
            "forks": self._forks,
            "sandboxes_created": self._sandboxes_created,
        }

    async def aclose(self) -> None:
        """Stop every turn and destroy every sandbox and fork snapshot left; idempotent."""
        if self._closing is None:
            self._closing = asyncio.create_task(self._shutdown())
        await asyncio.shield(self._closing)

    # ------------------------------------------------------------------ members' calls

    async def _reset(self, member: SharedMemberEnv) -> str:
        if member._closed or self._closing is not None:
            raise SessionClosedError("the environment is closed")
        if member._reset:
            raise SessionClosedError("a shared environment resets once; start a new group for another episode")
        if self._opening is None:
            self._opening = asyncio.create_task(self._open())
        try:
            instruction = await asyncio.shield(self._opening)
        except asyncio.CancelledError:
            if self._opening.cancelled() and self._closing is not None:
                raise SessionClosedError("the shared environment group was closed during reset") from None
            raise
        except Exception as exc:
            raise _clone_error(exc) from exc
        member._reset = True
        return instruction

    async def _open(self) -> str:
        env = await self._new_env()
        self._first_env = env
        try:
            instruction = await env.reset()
        except BaseException:
            await asyncio.shield(env.close())
            raise
        self._sandboxes_created += 1
        if self.labels is None:
            self.labels = dict(getattr(env, "labels", {}))
        root = self._add_node(set(range(self.size)) - self._left, env)
        await self._settle(root)
        return instruction

    async def _submit(
        self, member: SharedMemberEnv, action: Action | None, budget_s: float | None, reason: str
    ) -> StepResult:
        if self._closing is not None or member._closed:
            raise SessionClosedError("the environment is closed")
        if not member._reset:
            raise SessionClosedError("the environment has not been reset")
        if member._done:
            raise SessionClosedError("the episode has ended; reset to start another")
        if member._busy:
            raise RuntimeError(f"member {member.index} already has a call in flight; await it before the next one")
        node = self._node_of.get(member.index)
        if node is None:
            raise SessionClosedError("the environment is closed")
        key = truncate_key(reason) if action is None else action_key(action.tool, action.arguments, budget_s)
        call = _Call(key, action, budget_s, reason, asyncio.get_running_loop().create_future())
        node.pending[member.index] = call
        node.changed.set()
        member._busy = True
        try:
            self._kick(node)
            return await call.future
        except asyncio.CancelledError:
            # Withdraw the call unless a turn has taken it already.
            current = self._node_of.get(member.index)
            if current is not None and current.pending.get(member.index) is call:
                del current.pending[member.index]
            raise
        finally:
            member._busy = False

    async def _leave(self, index: int) -> None:
        self._left.add(index)
        node = self._node_of.pop(index, None)
        if node is None:
            return
        node.members.discard(index)
        call = node.pending.pop(index, None)
        if call is not None and not call.future.done():
            call.future.set_exception(SessionClosedError("the environment was closed while its call waited"))
        node.changed.set()
        await self._settle(node)

    # ------------------------------------------------------------------ nodes and turns

    def _add_node(self, members: set[int], env: Environment | None) -> _Node:
        node = _Node(next(self._node_ids), set(members), env)
        for m in node.members:
            self._node_of[m] = node
        self._nodes.add(node)
        return node

    def _kick(self, node: _Node) -> None:
        """Start the node's next turn if it has a call waiting and no turn running."""
        if node.busy or node.env is None or self._closing is not None:
            return
        if not any(not c.future.done() for c in node.pending.values()):
            return
        node.busy = True
        turn = asyncio.create_task(self._turn(node))
        self._turns.add(turn)
        turn.add_done_callback(self._turns.discard)

    async def _settle(self, node: _Node) -> None:
        """Destroy the node's sandbox once it has no member left, else start its next turn."""
        if node.busy:
            return
        if node.members:
            self._kick(node)
            return
        await self._retire(node)

    async def _retire(self, node: _Node) -> None:
        """Drop a node without members and destroy its sandbox."""
        env, node.env = node.env, None
        self._nodes.discard(node)
        if env is not None:
            await asyncio.shield(self._track(self._close_env(env)))

    async def _close_env(self, env: Environment) -> None:
        try:
            await env.close()
        except Exception:  # the backend's reaper gets it; the members are done with it
            logger.exception("task %s: destroying a shared sandbox failed", self.task.name)

    def _track(self, work: Awaitable[None]) -> asyncio.Task[None]:
        """Run cleanup work (sandbox and snapshot removal, forks) as a task aclose waits for, never cancels."""
        task = asyncio.ensure_future(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _barrier(self, node: _Node) -> None:
        """Wait until every member of the node has a call waiting, or the barrier timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.barrier_timeout_s
        while not all(m in node.pending and not node.pending[m].future.done() for m in node.members):
            left = deadline - loop.time()
            if left <= 0:
                return
            node.changed.clear()
            try:
                await asyncio.wait_for(node.changed.wait(), left)
            except TimeoutError:
                return

    async def _turn(self, node: _Node) -> None:
        calls: dict[int, _Call] = {}
        held = [node]  # nodes this turn keeps busy
        touched = [node]  # nodes to settle afterwards
        try:
            await self._barrier(node)
            calls = {m: c for m, c in node.pending.items() if not c.future.done()}
            node.pending.clear()
            if not calls:
                return
            branches: dict[Hashable, list[int]] = {}
            for m in sorted(calls):
                branches.setdefault(calls[m].key, []).append(m)
            groups = list(branches.values())
            stalled = node.members - calls.keys()
            if stalled:
                logger.info(
                    "task %s: node %d: member(s) %s sent no call within %gs; splitting them off",
                    self.task.name, node.id, sorted(stalled), self.barrier_timeout_s,
                )
            if len(groups) == 1 and not stalled:
                assert node.env is not None
                children = [node]
                outcomes = [await self._execute(node.env, calls[groups[0][0]])]
            else:
                forked = await self._fork(node, groups, stalled, calls, held, touched)
                if forked is None:
                    return
                children = forked
                outcomes = await asyncio.gather(
                    *(self._execute(child.env, calls[g[0]]) for child, g in zip(children, groups, strict=True))  # type: ignore[arg-type]
                )
            for child, g, outcome in zip(children, groups, outcomes, strict=True):
                self._depart(child, g, outcome)
            # A sandbox nobody needs any more is gone before its members see their last result.
            for child in children:
                if not child.members:
                    await self._retire(child)
            for g, outcome in zip(groups, outcomes, strict=True):
                self._deliver(g, calls, outcome)
        except Exception as exc:
            logger.exception("task %s: node %d: shared turn failed", self.task.name, node.id)
            for call in calls.values():
                if not call.future.done():
                    call.future.set_exception(_clone_error(exc))
        finally:
            for call in calls.values():
                if not call.future.done():  # cancelled: the group is closing
                    call.future.set_exception(SessionClosedError("the shared environment group was closed"))
            for n in held:
                n.busy = False
            if self._closing is None:
                for n in touched:
                    await self._settle(n)

    async def _fork(
        self,
        node: _Node,
        groups: list[list[int]],
        stalled: set[int],
        calls: dict[int, _Call],
        held: list[_Node],
        touched: list[_Node],
    ) -> list[_Node] | None:
        """Split the node: one child per call group (the first keeps the node) plus one for the stalled.

        Returns the nodes the groups run on, or None when the fork failed (every
        caller got the error and the node is as it was).
        """
        branches = [self._add_node(set(g), None) for g in groups[1:]]
        extra = branches + ([self._add_node(stalled, None)] if stalled else [])
        for child in extra:
            node.members -= child.members
            # Busy until its sandbox arrives: a member leaving meanwhile must not retire a node
            # whose restore is still on its way (the sandbox would outlive the group).
            child.busy = True
        held.extend(extra)
        touched.extend(extra)
        assert node.env is not None
        try:
            # Not cancellable halfway (a snapshot or sandbox would be lost); aclose waits for it.
            await asyncio.shield(self._track(self._restore_into(node.env, extra)))
        except Exception as exc:
            logger.warning("task %s: node %d: fork failed: %s", self.task.name, node.id, exc)
            for child in extra:
                node.members |= child.members
                for m in child.members:
                    self._node_of[m] = node
                node.pending.update(child.pending)
                child.members.clear()
                child.pending.clear()
                child.busy = False
                await self._settle(child)  # no member: destroys a sandbox it may have got
            for call in calls.values():
                if not call.future.done():
                    call.future.set_exception(_clone_error(exc))
            return None
        if stalled:  # the stalled members go on as soon as they call, not after this turn's steps
            held.remove(extra[-1])
            extra[-1].busy = False
            await self._settle(extra[-1])
        self._forks += 1
        self._sandboxes_created += len(extra)
        logger.info(
            "task %s: node %d forked into %s",
            self.task.name, node.id, ", ".join(f"node {n.id} {sorted(n.members)}" for n in [node, *extra]),
        )
        return [node, *branches]

    async def _restore_into(self, env: Environment, children: list[_Node]) -> None:
        """Snapshot the env's sandbox, give each child an env restored from it, delete the snapshot."""
        if not isinstance(env, Forkable):
            raise SessionClosedError(f"task {self.task.name}: its environment cannot fork, so a group cannot split")
        taken = await env.snapshot(metadata={"forkyard.shared": self.task.name})
        snap = taken.sandbox
        try:
            spec = SandboxSpec(image=snap.image, resources=snap.resources, network=snap.network,
                               labels=self.labels or {})
            infos = await self.backend.restore(snap, len(children), spec=spec)
            family = family_of(self.task)
            for child, info in zip(children, infos, strict=True):
                child.env = family.restore(self.task, self.ctx, info, taken.state, labels=self.labels or {})
        finally:
            # Deleted at close, once no sandbox of the group uses its layers: deleting it now
            # would leave the layers behind after the restored sandboxes are gone.
            self._fork_snapshots.append(snap.id)

    async def _delete_snapshot(self, snapshot_id: str) -> None:
        try:
            await self.backend.delete_snapshot(snapshot_id)
        except Exception:  # a stray snapshot costs disk, not the episode
            logger.exception("task %s: deleting fork snapshot %s failed", self.task.name, snapshot_id)

    async def _execute(self, env: Environment, call: _Call) -> StepResult | Exception:
        self._executed_steps += 1
        try:
            if call.action is None:
                return await env.truncate(call.reason)
            return await env.step(call.action, budget_s=call.budget_s)
        except Exception as exc:
            return exc

    def _depart(self, node: _Node, group: list[int], outcome: StepResult | Exception) -> None:
        """Take the members whose call ended their episode out of the node."""
        if isinstance(outcome, StepResult) and (outcome.terminated or outcome.truncated):
            for m in group:
                self._members[m]._done = True
                if self._node_of.get(m) is node:
                    node.members.discard(m)
                    del self._node_of[m]

    def _deliver(self, group: list[int], calls: dict[int, _Call], outcome: StepResult | Exception) -> None:
        """Hand each member of a call group its own copy of the outcome."""
        self._shared_steps += len(group) - 1
        for m in group:
            future = calls[m].future
            if future.done():
                continue
            if isinstance(outcome, StepResult):
                future.set_result(dataclasses.replace(outcome, info=copy.deepcopy(outcome.info)))
            else:
                future.set_exception(_clone_error(outcome))

    async def _shutdown(self) -> None:
        running = [t for t in [self._opening, *self._turns] if t is not None and not t.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        # Forks and removals in flight finish first: a fork may still hand a node its sandbox.
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        envs = [n.env for n in self._nodes if n.env is not None]
        if self._first_env is not None:
            envs.append(self._first_env)
        for node in self._nodes:
            node.env = None
            for call in node.pending.values():
                if not call.future.done():
                    call.future.set_exception(SessionClosedError("the shared environment group was closed"))
            node.pending.clear()
        self._nodes.clear()
        self._node_of.clear()
        for env in envs:
            await self._close_env(env)
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        snapshots, self._fork_snapshots = self._fork_snapshots, []
        for snapshot_id in snapshots:
            await self._delete_snapshot(snapshot_id)


def _clone_error(exc: BaseException) -> BaseException:
    """Return an exception of the same type and message for one more member (the original as its cause)."""
    try:
        clone = copy.copy(exc)
    except Exception:
        return exc
    clone.__cause__ = exc
    return clone


__all__ = ["DEFAULT_BARRIER_TIMEOUT_S", "SharedEnvGroup", "SharedMemberEnv", "action_key", "truncate_key"]

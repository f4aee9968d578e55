"""Trajectory trees: where an episode forks, how many branches it may spend, and their bookkeeping.

A branching rollout runs one *trunk* episode per task sample. At a branch point the
trunk snapshots its sandbox (:meth:`Forkable.snapshot <workers.envs.base.Forkable.snapshot>`), restores ``fanout - 1``
copies and continues as one of the branches itself; every branch samples the rest of
the episode independently. Each branch is an episode of its own that stores only the
steps it ran: the steps before its branch turn live once, on the episode that ran them,
and every leaf's training view is its root-to-leaf path.

Two ways to pick the branch points (:class:`BranchingSpec`):

- ``at_turns``: fork at the start of each listed turn (0-based: ``[2]`` shares turns 0
  and 1 and re-samples from turn 2 on), nested when several turns are listed, with at
  most ``max_episodes`` episodes per tree (granted in the order branch points are reached).
- ``adaptive``: fork at the turns where the policy was least certain. The uncertainty of
  a turn is the mean negative logprob of its sampled tokens, an unbiased estimate of the
  mean token entropy of the policy along the sampled action. When it reaches
  ``min_entropy`` the turn is re-sampled by ``fanout - 1`` new branches (the sandbox is
  snapshotted before the sampled action runs), spending at most ``budget`` extra
  episodes per tree. Needs logprobs (the ``tokens`` and ``chat`` APIs).

The snapshots a tree takes are held by the tree and deleted when its last branch ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from workers import protocol
from workers.errors import WorkerError
from workers.protocol import MAX_TREE_EPISODES

if TYPE_CHECKING:
    from workers.protocol import EpisodeReporter

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class BranchingSpec:
    """A rollout's ``branching`` section, validated."""

    at_turns: tuple[int, ...] = ()
    fanout: int = 2
    max_episodes: int = 1
    """at_turns: most episodes (leaves) per tree."""
    adaptive: bool = False
    budget: int = 0
    """adaptive: most extra episodes per tree."""
    min_entropy: float = 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | protocol.BranchingSpec) -> BranchingSpec:
        """Build a spec from a rollout's ``branching`` (its stored dict, or the wire spec itself).

        Raises:
            WorkerError: the dict is not a valid :class:`~workers.protocol.BranchingSpec`.
        """
        try:
            spec = data if isinstance(data, protocol.BranchingSpec) else protocol.BranchingSpec.from_stored(data)
        except ValidationError as exc:
            raise WorkerError(protocol.describe(exc, "branching")) from exc
        if spec.adaptive is not None:  # its fanout lives inside it; a top-level one would be the at_turns default
            return cls(fanout=spec.adaptive.fanout, adaptive=True, budget=spec.adaptive.budget,
                       min_entropy=spec.adaptive.min_entropy)
        assert spec.at_turns is not None
        return cls(at_turns=tuple(spec.at_turns), fanout=spec.fanout, max_episodes=spec.tree_episodes)

    @property
    def max_tree_episodes(self) -> int:
        """Most episodes one tree can hold under this spec."""
        return 1 + self.budget if self.adaptive else self.max_episodes


def turn_uncertainty(logprobs: Sequence[float | None] | None) -> float | None:
    """Return the mean negative logprob of a turn's sampled tokens (None without logprobs)."""
    values = [-lp for lp in logprobs or () if lp is not None and math.isfinite(lp)]
    return sum(values) / len(values) if values else None


class Tree:
    """One trajectory tree being run: its budget, its branch tasks and the snapshots it holds."""

    def __init__(
        self,
        spec: BranchingSpec,
        *,
        root_episode_id: str,
        reporter: EpisodeReporter,
        delete_snapshot: Callable[[str], Awaitable[None]],
    ) -> None:
        self.spec = spec
        self.root_episode_id = root_episode_id
        self.reporter = reporter
        """Where the branches are made (spawn_branches) and report (record_step, finish)."""
        self._delete_snapshot = delete_snapshot
        self.episodes = 1
        self.branch_points: list[dict[str, Any]] = []
        self.snapshots: list[str] = []
        self.unopened: dict[str, Any] = {}
        """Branch id -> its restored env, until the branch's task takes it (closed by :meth:`join` if never)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def wants_fork(self, turn: int, *, forked_at: int | None) -> bool:
        """Tell whether an episode at the start of ``turn`` reaches an ``at_turns`` branch point.

        ``forked_at`` is the turn the episode itself was forked at (None for the trunk): a
        branch does not fork again at the branch point that made it.
        """
        return not self.spec.adaptive and turn in self.spec.at_turns and turn != forked_at

    def wants_resample(self, turn: int, logprobs: Sequence[float | None] | None, *,
                       forked_at: int | None) -> float | None:
        """Return the turn's uncertainty when an adaptive tree should re-sample it, else None."""
        if not self.spec.adaptive or turn == forked_at:
            return None
        value = turn_uncertainty(logprobs)
        if value is None or value < self.spec.min_entropy:
            return None
        return value

    def grant(self) -> int:
        """Reserve the new branches of one branch point (0 when the budget is spent)."""
        room = self.spec.max_tree_episodes - self.episodes
        n = max(0, min(self.spec.fanout - 1, room))
        self.episodes += n
        return n

    def refund(self, n: int) -> None:
        """Give back branches a failed fork did not create."""
        self.episodes -= n

    def start(self, coro: Awaitable[None], name: str) -> None:
        """Run a branch in the background; :meth:`join` waits for it."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def join(self) -> None:
        """Wait for every branch (branches may start more while this waits), then free the snapshots."""
        try:
            while self._tasks:
                tasks = list(self._tasks)
                for task, outcome in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
                    if isinstance(outcome, Exception):
                        logger.error("tree %s: %s failed", self.root_episode_id, task.get_name(),
                                     exc_info=outcome)
        finally:
            await self._close_unopened()
            await self.free_snapshots()

    async def _close_unopened(self) -> None:
        """Close the envs of branches cancelled before their task ever ran."""
        envs, self.unopened = self.unopened, {}
        for branch_id, env in envs.items():
            try:
                await env.close()
            except Exception:
                logger.exception("tree %s: closing the sandbox of branch %s failed", self.root_episode_id, branch_id)

    async def cancel(self) -> None:
        """Stop every branch still running and free the snapshots."""
        for task in list(self._tasks):
            task.cancel()
        await self.join()

    async def free_snapshots(self) -> None:
        """Delete the snapshots this tree took (idempotent)."""
        snapshots, self.snapshots = self.snapshots, []
        for snapshot_id in snapshots:
            try:
                await self._delete_snapshot(snapshot_id)
            except Exception:
                logger.exception("tree %s: deleting snapshot %s failed", self.root_episode_id, snapshot_id)


__all__ = ["MAX_TREE_EPISODES", "BranchingSpec", "Tree", "turn_uncertainty"]

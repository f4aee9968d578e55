"""How the gateway has a rollout's episodes run: the :class:`Executor` protocol.

The embedded mode's executor is the in-process :class:`~gateway.rollouts.dispatch.Dispatcher`
(episodes run in this process, on this node's runtime); the distributed mode's hands
episode jobs to worker hosts. The API knows only this protocol: it says which rollout has
work and which was cancelled, and every decision after that is read from the database.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Executor(Protocol):
    """Runs the queued episodes of active rollouts."""

    async def start(self) -> None:
        """Requeue what a crash interrupted and resume the rollouts still active."""

    def submit(self, rollout_id: str) -> None:
        """Start running a rollout's queued episodes (no-op if they already run); never blocks."""

    async def cancel(self, rollout_id: str) -> None:
        """Stop a rollout's running episodes (the database already says it is cancelled)."""

    async def aclose(self) -> None:
        """Stop everything; interrupted episodes are requeued at the next start."""

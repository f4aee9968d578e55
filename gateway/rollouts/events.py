"""In-process wake-ups: a finished episode wakes the long-polls and streams of its rollout at once.

The database stays the source of truth; waiters also re-read it every poll interval, which
covers writes made by other processes (distributed mode) and lease expiry.
"""

from __future__ import annotations

import asyncio
import weakref


class RolloutEvents:
    """One asyncio.Event per rollout someone waits on; ``notify`` sets it and starts a fresh one."""

    def __init__(self) -> None:
        self._events: weakref.WeakValueDictionary[str, asyncio.Event] = weakref.WeakValueDictionary()

    def event(self, rollout_id: str) -> asyncio.Event:
        """Return the event the next change of ``rollout_id`` sets; take it BEFORE reading the database."""
        event = self._events.get(rollout_id)
        if event is None:
            event = asyncio.Event()
            self._events[rollout_id] = event
        return event

    def notify(self, rollout_id: str) -> None:
        """Wake everyone waiting on ``rollout_id`` (call after the change is committed)."""
        event = self._events.pop(rollout_id, None)
        if event is not None:
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> bool:
        """Wait until ``event`` is set or ``timeout_s`` passes; return whether it was set."""
        if timeout_s <= 0:
            return event.is_set()
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


#: The process-wide wake-ups (the gateway is one process in embedded mode).
rollout_events = RolloutEvents()

"""Wake-ups: a finished episode wakes the long-polls and streams of its rollout at once.

The database stays the source of truth; waiters also re-read it every poll interval, which
covers lease expiry and any wake-up that was lost. Within one gateway the wake-up is an
``asyncio.Event``. Gateways of one fleet share a :class:`RedisBridge` (Redis pub/sub,
``FORKYARD_REDIS_URL``): every notify is published, and each gateway wakes its own waiters
for what the others publish, so a stream on gateway A sees an episode finished through
gateway B without waiting for its next poll.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import weakref
from typing import Any

logger = logging.getLogger(__name__)

#: The pub/sub channel gateways announce changed rollouts on.
CHANNEL = "forkyard:rollouts"


class RolloutEvents:
    """One asyncio.Event per rollout someone waits on; ``notify`` sets it and starts a fresh one."""

    def __init__(self) -> None:
        self._events: weakref.WeakValueDictionary[str, asyncio.Event] = weakref.WeakValueDictionary()
        self.bridge: RedisBridge | None = None
        """Set while this gateway shares its wake-ups with others (see :class:`RedisBridge`)."""

    def event(self, rollout_id: str) -> asyncio.Event:
        """Return the event the next change of ``rollout_id`` sets; take it BEFORE reading the database."""
        event = self._events.get(rollout_id)
        if event is None:
            event = asyncio.Event()
            self._events[rollout_id] = event
        return event

    def notify(self, rollout_id: str) -> None:
        """Wake everyone waiting on ``rollout_id``, here and on every bridged gateway (call after the commit)."""
        self.wake(rollout_id)
        if self.bridge is not None:
            self.bridge.publish(rollout_id)

    def wake(self, rollout_id: str) -> None:
        """Wake this gateway's waiters on ``rollout_id`` only."""
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


class RedisBridge:
    """Share one gateway's :class:`RolloutEvents` with the other gateways through Redis pub/sub.

    Publishing never blocks a notify (it is queued and sent by a background task) and never
    fails one: with Redis away, waiters fall back to their poll interval and the bridge
    reconnects with a bounded backoff.
    """

    def __init__(self, events: RolloutEvents, url: str) -> None:
        self._events = events
        self._url = url
        self._origin = secrets.token_hex(8)
        self._outbox: asyncio.Queue[str] = asyncio.Queue(maxsize=10_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._subscribed = asyncio.Event()
        self._client: Any = None
        self.received = 0
        """Wake-ups received from other gateways."""

    async def start(self, *, timeout_s: float = 10.0) -> None:
        """Connect, subscribe and attach to the events; raise if Redis does not answer within ``timeout_s``."""
        import redis.asyncio as redis

        self._client = redis.from_url(self._url)
        try:
            await asyncio.wait_for(self._client.ping(), timeout_s)
        except Exception as exc:
            raise ConnectionError(f"Redis at {_redacted(self._url)} does not answer (FORKYARD_REDIS_URL): "
                                  f"{exc or type(exc).__name__}") from exc
        self._tasks = [asyncio.create_task(self._listen(), name="rollout events: listen"),
                       asyncio.create_task(self._send(), name="rollout events: send")]
        await asyncio.wait_for(self._subscribed.wait(), timeout_s)
        self._events.bridge = self
        logger.info("rollout wake-ups shared through %s", _redacted(self._url))

    def publish(self, rollout_id: str) -> None:
        try:
            self._outbox.put_nowait(rollout_id)
        except asyncio.QueueFull:  # the poll interval covers what is dropped
            logger.warning("rollout events: outbox full, a wake-up for %s is dropped", rollout_id)

    async def _send(self) -> None:
        while True:
            rollout_id = await self._outbox.get()
            try:
                await self._client.publish(CHANNEL, f"{self._origin} {rollout_id}")
            except Exception as exc:  # Redis away: the others fall back to polling
                logger.warning("rollout events: cannot publish to Redis: %s", exc)
                await asyncio.sleep(1.0)

    async def _listen(self) -> None:
        delay = 0.5
        while True:
            try:
                async with self._client.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    self._subscribed.set()
                    delay = 0.5
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        origin, _, rollout_id = bytes(message["data"]).decode().partition(" ")
                        if origin != self._origin and rollout_id:
                            self.received += 1
                            self._events.wake(rollout_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("rollout events: lost the Redis subscription (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def aclose(self) -> None:
        """Detach from the events and disconnect."""
        if self._events.bridge is self:
            self._events.bridge = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._client is not None:
            await self._client.aclose()


def _redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


#: The process-wide wake-ups (one gateway process; bridged to the others by the lifespan).
rollout_events = RolloutEvents()

"""Spread generations over several inference servers: least loaded, sticky per episode.

An episode's turns share a growing prefix, so they go to the server that served
its first turn (its prefix cache is warm there). A new episode goes to the server
with the fewest requests in flight, ties broken by the fewest episodes pinned,
then round robin. A server that refused a connection is avoided for new choices
for a short cooldown, and an episode pinned to it moves to a live one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

#: Seconds a server that refused a connection is passed over (unless every server is down).
DOWN_COOLDOWN_S = 10.0


def normalize_base_url(url: str) -> str:
    """Return ``url`` without trailing slashes or a trailing ``/v1`` (the clients add the api paths).

    Raises:
        ValueError: ``url`` is not an absolute http(s) URL.
        TypeError: ``url`` is not a string.
    """
    if not isinstance(url, str):
        raise TypeError(f"policy base_url must be a string, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"policy base_url {url!r} is not an absolute http(s) URL")
    if parts.query or parts.fragment:
        raise ValueError(f"policy base_url {url!r} must not carry a query or fragment")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


class ServerPool:
    """Choose a server per request: episode affinity first, else least loaded."""

    def __init__(self, base_urls: Sequence[str], *, down_cooldown_s: float = DOWN_COOLDOWN_S) -> None:
        if isinstance(base_urls, str) or not base_urls:
            raise ValueError("a policy needs at least one base_url")
        servers = [normalize_base_url(u) for u in base_urls]
        if len(set(servers)) != len(servers):
            raise ValueError(f"policy base_urls are not distinct: {list(base_urls)!r}")
        self.servers: tuple[str, ...] = tuple(servers)
        self.down_cooldown_s = down_cooldown_s
        self._in_flight = dict.fromkeys(self.servers, 0)
        self._pinned = dict.fromkeys(self.servers, 0)
        self._affinity: dict[str, str] = {}
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()

    def in_flight(self, server: str) -> int:
        """Return how many requests ``server`` is serving now."""
        return self._in_flight[server]

    def pinned(self, server: str) -> int:
        """Return how many live episodes are pinned to ``server``."""
        return self._pinned[server]

    def affinity(self, episode_id: str) -> str | None:
        """Return the server ``episode_id`` is pinned to, if any."""
        return self._affinity.get(episode_id)

    def is_down(self, server: str) -> bool:
        """Tell whether ``server`` refused a connection within the cooldown."""
        until = self._down_until.get(server)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._down_until[server]
            return False
        return True

    def choose(self, episode_id: str) -> str:
        """Return the server for ``episode_id``'s next request (and pin the episode to it)."""
        current = self._affinity.get(episode_id)
        up = [s for s in self.servers if not self.is_down(s)]
        if current is not None and (current in up or not up):
            return current
        candidates = up or list(self.servers)
        turn = next(self._turn)
        n = len(self.servers)
        best = min(
            candidates,
            key=lambda s: (self._in_flight[s], self._pinned[s], (self.servers.index(s) - turn) % n),
        )
        if current is not None:
            logger.warning("episode %s: server %s is down, moving to %s", episode_id, current, best)
            self._pinned[current] -= 1
        self._affinity[episode_id] = best
        self._pinned[best] += 1
        return best

    def acquire(self, episode_id: str) -> str:
        """Choose the server for a request and count it in flight; pair with :meth:`done`."""
        server = self.choose(episode_id)
        self._in_flight[server] += 1
        return server

    def done(self, server: str) -> None:
        """Count one request on ``server`` as finished."""
        if self._in_flight.get(server, 0) > 0:
            self._in_flight[server] -= 1

    def release(self, episode_id: str) -> None:
        """Unpin ``episode_id`` (its episode ended); idempotent."""
        server = self._affinity.pop(episode_id, None)
        if server is not None:
            self._pinned[server] -= 1

    def mark_down(self, server: str) -> None:
        """Pass ``server`` over for new choices during the cooldown (it refused a connection)."""
        if server in self._in_flight:
            self._down_until[server] = time.monotonic() + self.down_cooldown_s


__all__ = ["DOWN_COOLDOWN_S", "ServerPool", "normalize_base_url"]

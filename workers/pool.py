"""Warm pools: sandboxes started ahead of demand, so a reset claims one instead of waiting for a cold start.

A node keeps one pool per key. The key is everything a sandbox's start depends on:
- the backend;
- the source, either the image's digest (a fresh sandbox) or the setup cache's post-setup
  snapshot (a restored one, its key holding the environment's version, the task's
  content and the image);
- the spec less its labels (resources, network, environment variables, workdir).

A pooled sandbox is made exactly as a cold one would be, then its shell is started. It
is handed out once, to one episode or session, and destroyed by its owner like any other.
Nothing is ever returned to a pool, so no agent sees what another left behind.

Sizing follows demand unless an operator sets it. Every create or restore of a key counts
as a claim, hit or miss, and names its task. A key's demand is the larger of its claims in
the last ``window_s`` and the episodes queued for its tasks, this node's share
(:meth:`WarmPool.set_demand`, fed by the node's heartbeat from the database). The key's
target is ``ceil(headroom x demand)``, or the operator's size for it. Idle sandboxes of all keys together never
exceed ``max_idle`` on the node. A key nobody claimed for a window shrinks to nothing and
is forgotten.

Claims are atomic: each node claims only from its own pool, on its one event loop, and
taking an idle sandbox is a single pop with no await in between. Placement already sent
the episode to this node, so the claim needs no round trip to the database.

Refills run in the background: after every claim, and from a reconcile loop every
``reconcile_s``. At most ``fill_concurrency`` run at once, so refills never take the cores
from the episodes running. A key whose fills fail ``breaker_failures`` times in a row
opens its circuit breaker. Its claims then go cold, with no fills, for ``breaker_cooldown_s``,
and the cooldown doubles on each trip, up to ``MAX_COOLDOWN_S``.

Docker labels cannot change after create. A pooled sandbox therefore carries the pool's
owner label, and the pool remembers the labels of the claim that took it.
:meth:`WarmPool.view` shows a sandbox with those labels, which is how listings and the
reaper see the real owner.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandboxes.base import LABEL_OWNER, SandboxBackend, SandboxInfo, SandboxSpec
from sandboxes.errors import SandboxError
from sandboxes.snapshots import Snapshot
from workers.protocol import POOL_OWNER

logger = logging.getLogger(__name__)

#: Label naming the pool key a pooled sandbox was made for.
LABEL_POOL = "forkyard.pool"
#: Label naming the task a sandbox runs (the runtime and the runner set it): a key's demand counts its tasks.
LABEL_TASK = "forkyard.task"
#: Most task names one key remembers (a key shared by more tasks undercounts their demand, no worse).
MAX_TASKS_PER_KEY = 256
#: The longest a tripped circuit breaker keeps a key from filling.
MAX_COOLDOWN_S = 300.0
#: Seconds a fill may take to start the sandbox's shell.
SHELL_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PoolPolicy:
    """How a node's pools size and refill themselves."""

    max_idle: int = 0
    """Idle sandboxes of all keys together on this node; 0 turns pooling off."""
    window_s: float = 120.0
    """The claims of a key in this many seconds are its demand."""
    headroom: float = 1.2
    """A key's target is this times its demand (rounded up)."""
    sizes: Mapping[str, int] = field(default_factory=dict)
    """Operator-set targets by key id (or a prefix of one); they replace demand for that key."""
    fill_concurrency: int = 1
    reconcile_s: float = 2.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_idle < 0 or self.fill_concurrency < 1 or self.breaker_failures < 1:
            raise ValueError("max_idle must be >= 0, fill_concurrency and breaker_failures >= 1")
        if self.window_s <= 0 or self.reconcile_s <= 0 or self.headroom <= 0 or self.breaker_cooldown_s < 0:
            raise ValueError("window_s, reconcile_s and headroom must be > 0, breaker_cooldown_s >= 0")


@dataclass(frozen=True)
class Warmup:
    """Work a family does on a fresh pooled sandbox before a claim takes it (a web sandbox's browser started).

    A claim that misses gets a cold sandbox without it: the family checks, and warms it itself.
    """

    name: str
    """Part of the pool key: sandboxes warmed differently (or not) never stand in for each other."""
    run: Callable[[SandboxBackend, SandboxInfo], Awaitable[None]]


@dataclass(frozen=True)
class PoolKey:
    """What a pooled sandbox must match to stand in for a cold one."""

    backend: str
    source: str
    """``image:<digest>`` or ``snapshot:<id>``."""
    spec: str
    """The spec less its labels, as canonical JSON."""

    @property
    def id(self) -> str:
        """Return the sha256 hex of the key's parts."""
        return hashlib.sha256(json.dumps([self.backend, self.source, self.spec]).encode()).hexdigest()


def spec_shape(spec: SandboxSpec) -> str:
    """Return the parts of ``spec`` a pooled sandbox must match (all but labels and image) as canonical JSON."""
    return json.dumps({
        "resources": dataclasses.asdict(spec.resources),
        "network": spec.network,
        "env": dict(sorted(spec.env.items())),
        "workdir": spec.workdir,
    }, sort_keys=True, separators=(",", ":"))


@dataclass
class _Pool:
    key: PoolKey
    spec: SandboxSpec
    """The spec a fill creates or restores with (the pool's labels)."""
    snapshot: Snapshot | None
    warmup: Warmup | None = None
    idle: collections.deque[SandboxInfo] = field(default_factory=collections.deque)
    claims: collections.deque[float] = field(default_factory=collections.deque)
    filling: int = 0
    failures: int = 0
    trips: int = 0
    closed_until: float = 0.0
    """While now is before this, the breaker is open: no fills."""
    tasks: set[str] = field(default_factory=set)
    """The tasks (``forkyard.task`` labels) whose claims came to this key: what its demand counts."""
    demand: int = 0
    """Episodes queued for those tasks, this node's share (:meth:`WarmPool.set_demand`)."""


class WarmPool:
    """One node's warm pools: claim a started sandbox for a spec, keep each key filled to its target."""

    def __init__(self, backend: SandboxBackend, policy: PoolPolicy, *,
                 poolable: Callable[[Snapshot], bool] = lambda snapshot: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Pool ``backend``'s sandboxes as ``policy`` says.

        Args:
            poolable: whether restores of a snapshot may be pooled (the runtime passes the
                setup cache's ``holds``: its snapshots live long, a fork's do not).
            clock: monotonic seconds (tests step it).
        """
        self.backend = backend
        self.policy = policy
        self._poolable = poolable
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self._claimed: dict[str, dict[str, str]] = {}
        """Sandbox id to the labels of the claim that took it (docker cannot relabel)."""
        self._fills: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self.hits = 0
        self.misses = 0
        self.fills = 0
        self.fill_failures = 0
        self.breaker_trips = 0
        self.discarded = 0
        self.claim_seconds = 0.0
        self.fill_seconds = 0.0

    @property
    def enabled(self) -> bool:
        """Tell whether the pool keeps anything (``max_idle`` > 0)."""
        return self.policy.max_idle > 0 and not self._closed

    # ------------------------------------------------------------------ claiming

    async def create(self, spec: SandboxSpec, *, warmup: Warmup | None = None) -> SandboxInfo:
        """Return a started sandbox for ``spec``: a pooled one if the key has one idle, else a cold one.

        With ``warmup``, the key's fills run it on each sandbox before it waits idle; a cold
        sandbox (a miss) comes without it.
        """
        if not self.enabled or spec.network_of is not None:
            return await self.backend.create(spec)
        shape = spec_shape(spec) if warmup is None else f"{spec_shape(spec)}|warmup:{warmup.name}"
        key = PoolKey(self.backend.name, f"image:{await self.backend.image_digest(spec.image)}", shape)
        return await self._claim(key, spec, None, warmup)

    async def restore(self, snapshot: Snapshot, spec: SandboxSpec) -> SandboxInfo:
        """Return a sandbox restored from ``snapshot`` for ``spec``: pooled if the key has one idle, else cold."""
        if not self.enabled or spec.network_of is not None or not self._poolable(snapshot):
            (info,) = await self.backend.restore(snapshot, 1, spec=spec)
            return info
        key = PoolKey(self.backend.name, f"snapshot:{snapshot.id}", spec_shape(spec))
        return await self._claim(key, spec, snapshot)

    async def _claim(self, key: PoolKey, spec: SandboxSpec, snapshot: Snapshot | None,
                     warmup: Warmup | None = None) -> SandboxInfo:
        started = time.perf_counter()
        pool = self._pools.get(key.id)
        if pool is None:
            pool_spec = dataclasses.replace(spec, labels={LABEL_OWNER: POOL_OWNER, LABEL_POOL: key.id[:16]})
            pool = self._pools[key.id] = _Pool(key=key, spec=pool_spec, snapshot=snapshot, warmup=warmup)
        pool.claims.append(self._clock())
        task = spec.labels.get(LABEL_TASK)
        if task and len(pool.tasks) < MAX_TASKS_PER_KEY:
            pool.tasks.add(task)
        self._wake.set()
        if pool.idle:
            info = pool.idle.popleft()  # no await since the check: no other claim can take it
            labels = {**{k: v for k, v in info.labels.items() if k not in (LABEL_OWNER, LABEL_POOL)},
                      **spec.labels}
            self._claimed[info.id] = labels
            self.hits += 1
            self.claim_seconds += time.perf_counter() - started
            return dataclasses.replace(info, labels=labels)
        self.misses += 1
        if snapshot is None:
            return await self.backend.create(spec)
        (info,) = await self.backend.restore(snapshot, 1, spec=spec)
        return info

    # ------------------------------------------------------------------ what others see

    def holds(self, sandbox_id: str) -> bool:
        """Tell whether ``sandbox_id`` waits idle in a pool (nobody owns it yet)."""
        return any(info.id == sandbox_id for pool in self._pools.values() for info in pool.idle)

    def view(self, info: SandboxInfo) -> SandboxInfo:
        """Return ``info`` with the labels of the claim that took it, if a pool made it."""
        labels = self._claimed.get(info.id)
        return dataclasses.replace(info, labels=labels) if labels is not None else info

    def forget_gone(self, live_ids: set[str]) -> None:
        """Drop the claim labels of sandboxes no longer live (called with a fresh listing)."""
        for sandbox_id in set(self._claimed) - live_ids:
            del self._claimed[sandbox_id]

    def set_demand(self, queued_by_task: Mapping[str, int]) -> None:
        """Size each key for the episodes queued for its tasks (this node's share of them).

        A key's target is then headroom x the larger of its claims in the window and this
        demand, so a rollout queued after a lull (a trainer's update step) refills the keys
        of the tasks it will run before its claims arrive. Tasks absent from
        ``queued_by_task`` have no demand.
        """
        for pool in self._pools.values():
            pool.demand = sum(queued_by_task.get(task, 0) for task in pool.tasks)
        self._wake.set()

    def resize(self, key_id: str, size: int) -> None:
        """Set the target of the key ``key_id`` (or every key it prefixes) to ``size``: an operator's override.

        ``size`` < 0 removes the override (back to demand). Takes effect at the next reconcile.
        """
        if size < 0:
            sizes = {k: v for k, v in self.policy.sizes.items() if k != key_id}
        else:
            sizes = {**self.policy.sizes, key_id: size}
        self.policy = dataclasses.replace(self.policy, sizes=sizes)
        self._wake.set()

    def drop(self, sandbox_id: str) -> bool:
        """Forget ``sandbox_id`` if it waits idle (an operator destroys it); return whether it did."""
        for pool in self._pools.values():
            for info in pool.idle:
                if info.id == sandbox_id:
                    pool.idle.remove(info)
                    return True
        return False

    def target(self, pool: _Pool) -> int:
        """Return how many idle sandboxes ``pool``'s key should have now (before the node's cap)."""
        for prefix, size in self.policy.sizes.items():
            if prefix and pool.key.id.startswith(prefix):
                return size
        horizon = self._clock() - self.policy.window_s
        while pool.claims and pool.claims[0] < horizon:
            pool.claims.popleft()
        return math.ceil(self.policy.headroom * max(len(pool.claims), pool.demand) - 1e-9)

    def by_key(self) -> list[dict[str, Any]]:
        """Return each key's state now: its id (what ``sizes`` prefixes match), source, idle, filling,
        target and the seconds its breaker stays open (0: closed); the fullest first."""
        now = self._clock()
        keys = [{"id": pool.key.id, "backend": pool.key.backend, "source": pool.key.source,
                 "idle": len(pool.idle), "filling": pool.filling, "target": self.target(pool),
                 "demand": pool.demand,
                 "breaker_open_s": round(max(0.0, pool.closed_until - now), 3)}
                for pool in self._pools.values()]
        return sorted(keys, key=lambda k: (-k["idle"], k["id"]))

    def stats(self) -> dict[str, Any]:
        """Return hits, misses, fills, failures, breaker trips and seconds since start; idle and keys now
        (``by_key``: :meth:`by_key`)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "fills": self.fills,
            "fill_failures": self.fill_failures,
            "breaker_trips": self.breaker_trips,
            "discarded": self.discarded,
            "claim_seconds": round(self.claim_seconds, 6),
            "fill_seconds": round(self.fill_seconds, 6),
            "idle": sum(len(pool.idle) for pool in self._pools.values()),
            "filling": sum(pool.filling for pool in self._pools.values()),
            "keys": len(self._pools),
            "max_idle": self.policy.max_idle,
            "by_key": self.by_key(),
        }

    # ------------------------------------------------------------------ filling

    def start(self) -> None:
        """Start the reconcile loop (a no-op when pooling is off or the loop runs)."""
        if self.enabled and self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="warm-pool")

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self.reconcile()
            except Exception:  # the loop must outlive one bad pass
                logger.exception("warm pool: reconcile failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.policy.reconcile_s)
            except TimeoutError:
                pass

    async def reconcile(self) -> None:
        """Shrink pools above their target, forget keys nobody wants, start fills up to the targets."""
        now = self._clock()
        wanted: list[_Pool] = []
        for key_id, pool in list(self._pools.items()):
            target = self.target(pool)
            if pool.snapshot is not None and not self._poolable(pool.snapshot):
                target = 0  # the setup cache dropped it: its sandboxes would restore what is gone
            while len(pool.idle) > target:
                await self._discard(pool.idle.pop())
            if target == 0 and not pool.idle and not pool.filling and not pool.claims:
                del self._pools[key_id]
            elif len(pool.idle) + pool.filling < target and pool.closed_until <= now:
                wanted.append(pool)
        # Fill the emptiest first, so every key in demand gets some before any gets all.
        wanted.sort(key=lambda p: (len(p.idle) + p.filling) / max(1, self.target(p)))
        for pool in wanted:
            while (len(pool.idle) + pool.filling < self.target(pool)
                   and len(self._fills) < self.policy.fill_concurrency
                   and self._held() < self.policy.max_idle):
                pool.filling += 1
                task = asyncio.get_running_loop().create_task(self._fill(pool), name="warm-pool-fill")
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)

    def _held(self) -> int:
        return sum(len(pool.idle) + pool.filling for pool in self._pools.values())

    async def _fill(self, pool: _Pool) -> None:
        started = time.perf_counter()
        info: SandboxInfo | None = None
        try:
            if pool.snapshot is None:
                info = await self.backend.create(pool.spec)
            else:
                (info,) = await self.backend.restore(pool.snapshot, 1, spec=pool.spec)
            result = await self.backend.exec(info.id, "true", timeout_s=SHELL_START_TIMEOUT_S)
            if result.exit_code != 0:
                raise SandboxError(f"the shell of pooled sandbox {info.id} did not start: {result.stderr.strip()}")
            if pool.warmup is not None:
                await pool.warmup.run(self.backend, info)
        except asyncio.CancelledError:
            if info is not None:
                await asyncio.shield(self._discard(info))
            raise
        except Exception as exc:
            if info is not None:
                await self._discard(info)
            self._failed(pool, exc)
            return
        finally:
            pool.filling -= 1
            self._wake.set()
        self.fills += 1
        self.fill_seconds += time.perf_counter() - started
        pool.failures = 0
        if self._closed or self._pools.get(pool.key.id) is not pool:
            await self._discard(info)
        else:
            pool.idle.append(info)

    def _failed(self, pool: _Pool, exc: Exception) -> None:
        self.fill_failures += 1
        pool.failures += 1
        logger.warning("warm pool: fill of key %s failed (%d in a row): %s",
                       pool.key.id[:12], pool.failures, exc)
        if pool.failures >= self.policy.breaker_failures:
            cooldown = min(MAX_COOLDOWN_S, self.policy.breaker_cooldown_s * 2 ** pool.trips)
            pool.closed_until = self._clock() + cooldown
            pool.trips += 1
            pool.failures = 0
            self.breaker_trips += 1
            logger.warning("warm pool: key %s stops filling for %.0f s after %d failed fills; its claims go cold",
                           pool.key.id[:12], cooldown, self.policy.breaker_failures)

    async def _discard(self, info: SandboxInfo) -> None:
        self.discarded += 1
        try:
            await self.backend.destroy(info.id)
        except Exception:  # the reaper of the next start takes it
            logger.warning("warm pool: cannot destroy pooled sandbox %s", info.id, exc_info=True)

    async def aclose(self) -> None:
        """Stop filling and destroy every idle sandbox; claims after this go cold."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        fills = list(self._fills)
        for task in fills:
            task.cancel()
        await asyncio.gather(*fills, *([self._loop_task] if self._loop_task else []), return_exceptions=True)
        for pool in self._pools.values():
            while pool.idle:
                await self._discard(pool.idle.popleft())
        self._pools.clear()


def is_pooled(info: SandboxInfo) -> bool:
    """Tell whether ``info`` (as the backend lists it) is a sandbox a pool made."""
    return info.labels.get(LABEL_OWNER) == POOL_OWNER and LABEL_POOL in info.labels


__all__ = ["LABEL_POOL", "POOL_OWNER", "PoolKey", "PoolPolicy", "WarmPool", "Warmup", "is_pooled", "spec_shape"]

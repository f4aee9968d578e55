"""Warm pools: claims after demand are hits on real backends; sizing, caps and the breaker on a fake one.

The real-backend tests prove a claim hands out a sandbox the pool started before the
claim was made, with its shell already running and the claimer's labels. They also prove
two claims never share a sandbox, that restores of a setup snapshot pool while other
restores do not, and that closing the pool leaves nothing behind. The fake backend drives
the logic that needs a clock or failures: demand windows, the operator's sizes, the
node-wide cap and the circuit breaker.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from sandboxes.base import LABEL_OWNER, ExecResult, SandboxInfo, SandboxSpec, SandboxState
from sandboxes.errors import SandboxError
from sandboxes.snapshots import Snapshot
from workers.pool import POOL_OWNER, PoolPolicy, WarmPool, is_pooled
from workers.runtime import WorkerRuntime


async def settle(pool: WarmPool, *, idle: int, timeout_s: float = 60.0) -> None:
    """Reconcile until ``idle`` sandboxes wait in the pool and none is filling (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await pool.reconcile()
        stats = pool.stats()
        if stats["idle"] == idle and stats["filling"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the pool did not settle at {idle} idle: {pool.stats()}")


# ------------------------------------------------------------------ real backends


async def test_claims_after_demand_are_hits(build_backend, tmp_path: Path) -> None:
    backend = build_backend.backend
    pool = WarmPool(backend, PoolPolicy(max_idle=4, headroom=1.5))
    spec = SandboxSpec(image=build_backend.base, labels={LABEL_OWNER: "first"})
    try:
        cold = await pool.create(spec)
        assert pool.stats()["misses"] == 1 and pool.stats()["hits"] == 0
        assert cold.labels[LABEL_OWNER] == "first"
        await settle(pool, idle=2)  # ceil(1.5 x 1 claim)
        waiting = {info.id for info in await backend.list() if is_pooled(info)}
        assert len(waiting) == 2 and all(pool.holds(sid) for sid in waiting)

        claimed = []
        for owner in ("second", "third"):
            info = await pool.create(SandboxSpec(image=build_backend.base, labels={LABEL_OWNER: owner}))
            assert info.id in waiting and not pool.holds(info.id)  # started before the claim: no cold start
            assert info.labels[LABEL_OWNER] == owner
            claimed.append(info)
        assert claimed[0].id != claimed[1].id
        assert pool.stats()["hits"] == 2

        # Each claimed sandbox is its own: what one writes, the other never sees.
        first, second = claimed
        assert (await backend.exec(first.id, "echo mine > /tmp/mark && cat /tmp/mark")).stdout == "mine\n"
        assert (await backend.exec(second.id, "test -e /tmp/mark; echo $?")).stdout == "1\n"

        # Listings through a runtime show the claim's owner, not the pool's; the reaper spares idle ones.
        runtime = WorkerRuntime(backend, image_cache_dir=tmp_path, base_image=build_backend.base, pool=pool)
        owners = {info.id: info.labels.get(LABEL_OWNER) for info in await runtime.list_sandboxes()}
        assert owners[first.id] == "second" and owners[second.id] == "third"
        # One claimed and destroyed between two listings is recorded with its claim's owner too.
        await settle(pool, idle=4)  # 3 claims in the window: ceil(4.5), capped at max_idle
        hits = pool.stats()["hits"]
        brief = await pool.create(SandboxSpec(image=build_backend.base, labels={LABEL_OWNER: "brief"}))
        assert pool.stats()["hits"] == hits + 1  # the pool made it, under the pool's owner label
        await backend.destroy(brief.id)
        made = {info.id: info.labels.get(LABEL_OWNER) for info in runtime.sandboxes_made_after(0)[0]}
        assert made[brief.id] == "brief" and made[first.id] == "second"
        await settle(pool, idle=4)  # 3 claims in the window: ceil(4.5), capped at max_idle
        idle_now = {sid for sid, owner in (await _owners(runtime)).items() if owner == POOL_OWNER}
        assert len(idle_now) == 4
        reaped = await runtime.reap(keep_owner_ids={"second"})
        assert set(reaped) == {cold.id, second.id}
        assert idle_now <= {info.id for info in await backend.list()}
    finally:
        await pool.aclose()
    left = {info.id for info in await backend.list()}
    assert left == {first.id}, "closing the pool destroys what waits in it; the claimed one is its owner's"


async def _owners(runtime: WorkerRuntime) -> dict[str, str | None]:
    return {info.id: info.labels.get(LABEL_OWNER) for info in await runtime.list_sandboxes()}


async def test_setup_snapshots_pool_and_other_restores_do_not(build_backend) -> None:
    backend = build_backend.backend
    source = await backend.create(SandboxSpec(image=build_backend.base))
    await backend.exec(source.id, "echo set-up > /opt/state")
    setup = await backend.snapshot(source.id, metadata={"forkyard.kind": "setup"})
    fork = await backend.snapshot(source.id, metadata={"forkyard.tree": "t"})
    await backend.destroy(source.id)
    pool = WarmPool(backend, PoolPolicy(max_idle=2), poolable=lambda snap: snap.id == setup.id)
    spec = SandboxSpec(image=build_backend.base, labels={LABEL_OWNER: "episode"})
    try:
        await backend.destroy((await pool.restore(fork, spec)).id)
        await backend.destroy((await pool.restore(setup, spec)).id)
        await settle(pool, idle=2)
        assert pool.stats()["keys"] == 1, "only the setup snapshot's key is pooled"
        info = await pool.restore(setup, spec)
        assert pool.stats()["hits"] == 1
        assert (await backend.exec(info.id, "cat /opt/state")).stdout == "set-up\n"
        await backend.destroy(info.id)
    finally:
        await pool.aclose()
        for snap in (setup, fork):
            await backend.delete_snapshot(snap.id)
    assert await backend.list() == []


# ------------------------------------------------------------------ logic (a fake backend and clock)


class FakeBackend:
    """Creates and destroys records; ``fail`` makes creates raise."""

    name = "fake"
    node = "test"

    def __init__(self) -> None:
        self.live: dict[str, SandboxInfo] = {}
        self.fail = False
        self.creates = 0
        self._ids = itertools.count(1)

    async def image_digest(self, image: str) -> str:
        return f"sha256:{image}"

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        self.creates += 1
        await asyncio.sleep(0)
        if self.fail:
            raise SandboxError("the engine said no")
        info = SandboxInfo(id=f"sb{next(self._ids)}", backend=self.name, node=self.node, state=SandboxState.READY,
                           image=spec.image, created_at=time.time(), labels=dict(spec.labels))
        self.live[info.id] = info
        return info

    async def restore(self, snapshot: Snapshot, n: int = 1, *, spec: SandboxSpec | None = None) -> list[SandboxInfo]:
        assert spec is not None
        return [await self.create(spec) for _ in range(n)]

    async def exec(self, sandbox_id: str, command: str, **kwargs: object) -> ExecResult:
        return ExecResult(stdout="", stderr="", exit_code=0)

    async def destroy(self, sandbox_id: str) -> None:
        self.live.pop(sandbox_id, None)

    async def list(self) -> list[SandboxInfo]:
        return list(self.live.values())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_pool(**policy: object) -> tuple[WarmPool, FakeBackend, Clock]:
    backend, clock = FakeBackend(), Clock()
    return WarmPool(backend, PoolPolicy(**policy), clock=clock), backend, clock  # type: ignore[arg-type]


async def test_demand_sets_the_target_and_fades_with_the_window() -> None:
    pool, backend, clock = fake_pool(max_idle=20, window_s=60, headroom=1.2)
    spec = SandboxSpec(image="img")
    for _ in range(8):  # a group of 8 resets
        await pool.create(spec)
    await settle(pool, idle=10)  # ceil(1.2 x 8)
    clock.now += 30
    await pool.create(spec)
    await settle(pool, idle=11)  # 9 claims in the window: ceil(10.8); the hit took one
    clock.now += 61  # every claim is older than the window: no demand
    await settle(pool, idle=0)
    assert pool.stats()["keys"] == 0, "a key nobody wants is forgotten"
    assert pool.stats()["discarded"] == 11
    assert len(backend.live) == 9  # the claimed ones belong to their claimers


async def test_node_cap_spreads_over_keys_and_sizes_override_demand() -> None:
    pool, backend, clock = fake_pool(max_idle=4)
    for image in ("a", "b"):
        for _ in range(5):
            await pool.create(SandboxSpec(image=image))
    await settle(pool, idle=4)
    per_key = sorted(k["idle"] for k in pool.by_key())
    assert per_key == [2, 2], "the emptiest key fills first, so both get a share of the cap"
    assert pool.stats()["by_key"] == pool.by_key() and all(k["target"] == 6 for k in pool.by_key())

    key_a = next(k["id"] for k in pool.by_key() if k["source"] == "image:sha256:a")
    sized = WarmPool(backend, PoolPolicy(max_idle=12, sizes={key_a[:12]: 3}), clock=clock)
    await sized.create(SandboxSpec(image="a", labels={"x": "y"}))  # labels are not part of the key
    for _ in range(6):
        await sized.create(SandboxSpec(image="b"))
    await settle(sized, idle=3 + 8)  # a: the operator's 3; b: ceil(1.2 x 6)
    assert sorted(k["idle"] for k in sized.by_key()) == [3, 8]
    await pool.aclose()
    await sized.aclose()


async def test_breaker_stops_fills_after_failures_and_retries_after_cooldown() -> None:
    pool, backend, clock = fake_pool(max_idle=4, breaker_failures=3, breaker_cooldown_s=30, window_s=1000)
    spec = SandboxSpec(image="img")
    await pool.create(spec)
    await pool.create(spec)  # target 3
    backend.fail = True
    for _ in range(10):
        await pool.reconcile()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    stats = pool.stats()
    assert stats["breaker_trips"] == 1 and stats["fill_failures"] == 3
    assert stats["by_key"][0]["breaker_open_s"] == 30.0, "operators see how long the key's breaker stays open"
    attempts = backend.creates
    for _ in range(5):  # open: no fill is tried
        await pool.reconcile()
        await asyncio.sleep(0)
    assert backend.creates == attempts
    with pytest.raises(SandboxError):  # a claim meanwhile goes cold (and fails as a cold start would)
        await pool.create(spec)

    backend.fail = False
    clock.now += 31
    await settle(pool, idle=4)
    assert pool.stats()["breaker_trips"] == 1 and pool.stats()["fills"] == 4
    await pool.aclose()
    assert len(backend.live) == 2 and not any(is_pooled(info) for info in backend.live.values())


async def test_close_cancels_fills_and_later_claims_go_cold() -> None:
    pool, backend, _ = fake_pool(max_idle=3)
    await pool.create(SandboxSpec(image="img"))
    await pool.reconcile()  # starts a fill, not awaited
    await pool.aclose()
    assert not any(is_pooled(info) for info in backend.live.values())
    info = await pool.create(SandboxSpec(image="img", labels={LABEL_OWNER: "late"}))
    assert info.labels[LABEL_OWNER] == "late" and pool.stats()["keys"] == 0


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        PoolPolicy(max_idle=-1)
    with pytest.raises(ValueError):
        PoolPolicy(window_s=0)


async def test_queued_demand_for_a_keys_tasks_sizes_it_beyond_its_claims() -> None:
    pool, backend, clock = fake_pool(max_idle=20, window_s=60)
    await pool.create(SandboxSpec(image="a", labels={"forkyard.task": "t1"}))
    await pool.create(SandboxSpec(image="b", labels={"forkyard.task": "t2"}))
    await settle(pool, idle=4)  # one claim each: ceil(1.2 x 1) = 2 per key
    pool.set_demand({"t1": 10, "unknown": 50})  # a rollout queued 10 episodes of t1; no key runs "unknown"
    await settle(pool, idle=12 + 2)
    by_source = {k["source"]: k for k in pool.by_key()}
    assert by_source["image:sha256:a"]["target"] == 12 and by_source["image:sha256:a"]["demand"] == 10
    assert by_source["image:sha256:b"]["target"] == 2 and by_source["image:sha256:b"]["demand"] == 0

    clock.now += 61  # the claims age out of the window; the queued demand still holds t1's key
    pool.set_demand({"t1": 10})
    await settle(pool, idle=12)
    assert [k["source"] for k in pool.by_key()] == ["image:sha256:a"], "b's key, wanted by nobody, is gone"
    pool.set_demand({})  # the rollout ran (or was cancelled): nothing queued any more
    await settle(pool, idle=0)
    await pool.aclose()
    assert len(backend.live) == 2, "only the two claimed sandboxes are left, with their claimers"


async def test_a_warmup_runs_on_each_fill_and_keys_its_own_sandboxes() -> None:
    """A family's warm-up (a web sandbox's browser) runs before a sandbox waits idle; a miss comes cold."""
    from workers.pool import Warmup

    pool, backend, _ = fake_pool(max_idle=4, window_s=1000)
    warmed: list[str] = []

    async def warm(_backend, info: SandboxInfo) -> None:
        warmed.append(info.id)

    warmup = Warmup("browser", warm)
    spec = SandboxSpec(image="img")
    cold = await pool.create(spec, warmup=warmup)
    assert cold.id not in warmed  # a miss: the family warms it itself
    await settle(pool, idle=2)
    assert len(warmed) == 2
    hit = await pool.create(spec, warmup=warmup)
    assert hit.id in warmed
    plain = await pool.create(spec)  # the same spec without the warm-up is another key: never a warmed sandbox
    assert plain.id not in warmed and pool.stats()["keys"] == 2

    async def broken(_backend, info: SandboxInfo) -> None:
        raise SandboxError("the browser did not start")

    failing = Warmup("broken", broken)
    await pool.create(spec, warmup=failing)
    for _ in range(5):
        await pool.reconcile()
        await asyncio.sleep(0)
    stats = pool.stats()
    assert stats["fill_failures"] >= 1 and stats["discarded"] >= 1  # a failed warm-up is a failed fill, discarded
    await pool.aclose()

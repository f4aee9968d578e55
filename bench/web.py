"""Web family costs, in one run: browser start, step latency, tree extraction, forks, throughput.

Run with ``.venv/bin/python bench/web.py [--backend local|docker|all] [--steps 40]`` as root after
``bash .ci/bootstrap``. Uses the example tasks (examples/tasks/web/) and, per backend:

- ``start (cold)``: a reset with no warm pool: the sandbox, the site and the driver
  installed, Chromium launched, the start page opened and observed;
  ``start (pool)``: the same reset claiming its sandbox from a warm pool filled beforehand
  (ratio cold / pool);
- ``step``: one action to its next observation (the tree and the task's reward/done read
  back), over every example's oracle actions (the first right after its reset) and
  ``noop``s, together and apart: p50 and p95; the baseline is one bare
  ``backend.exec`` of ``true``, the transport a step rides on (ratio step / exec);
- ``tree``: the driver's own time to mark ids and extract and format the tree (an ``observe``);
- ``snapshot + fork x3``: snapshot a session mid-task, restore 3 sandboxes from it and run
  each branch's first step (the browser started again, the state loaded, the actions
  replayed, the tree compared);
- ``episodes/min``: every example solved by its oracle through the episode runner at
  concurrency 1, 4 and 8 (ratios against concurrency 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.backends import create_backend, docker_available  # noqa: E402
from sandboxes.base import LABEL_OWNER  # noqa: E402
from sandboxes.images import DEFAULT_IMAGE_CACHE, ensure_base_image  # noqa: E402
from workers.archives import read_dir  # noqa: E402
from workers.envs.base import Action  # noqa: E402
from workers.envs.web import FAMILY  # noqa: E402
from workers.envs.web.task import WebTask  # noqa: E402
from workers.pool import PoolPolicy, WarmPool  # noqa: E402
from workers.runtime import WorkerRuntime  # noqa: E402
from workers.trust import SYSTEM_CA_BUNDLE, read_ca_bundle  # noqa: E402

TASKS_DIR = ROOT / "examples" / "tasks" / "web"
OWNER = {LABEL_OWNER: "bench-web"}


def tasks() -> list[WebTask]:
    return [FAMILY.load_task(p.name, read_dir(p, max_bytes=1 << 24, max_files=1000))
            for p in sorted(TASKS_DIR.iterdir()) if (p / "task.toml").is_file()]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000


@contextlib.asynccontextmanager
async def runtime(kind: str, root: Path, pool: WarmPool | None = None) -> AsyncIterator[WorkerRuntime]:
    backend = pool.backend if pool is not None else create_backend(kind, node=f"bench-web-{uuid.uuid4().hex[:6]}",
                                                                   root_dir=root)
    try:
        base = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
        yield WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=base, pool=pool,
                            ca_bundle=read_ca_bundle(SYSTEM_CA_BUNDLE))
    finally:
        if pool is not None:
            await pool.aclose()
        for info in await backend.list():
            await backend.destroy(info.id)
        await backend.aclose()


async def starts(kind: str, root: Path, task: WebTask, runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"start (cold)": [], "start (pool)": []}
    async with runtime(kind, root / "cold") as rt:
        image = await rt.task_image(task)
        for _ in range(runs):
            env = rt.new_env(task, image=image, labels=OWNER)
            t0 = time.perf_counter()
            await env.reset()
            out["start (cold)"].append(time.perf_counter() - t0)
            await env.close()
    backend = create_backend(kind, node=f"bench-web-pool-{uuid.uuid4().hex[:6]}", root_dir=root / "pool")
    pool = WarmPool(backend, PoolPolicy(max_idle=2, window_s=3600, headroom=1.0))
    async with runtime(kind, root / "pool", pool) as rt:
        image = await rt.task_image(task)
        for i in range(runs + 1):
            env = rt.new_env(task, image=image, labels=OWNER)
            for _ in range(600):  # the pool refills in the background: wait for an idle sandbox (60 s at most)
                await pool.reconcile()
                if i == 0 or (pool.stats()["idle"] >= 1 and pool.stats()["filling"] == 0):
                    break
                await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            await env.reset()
            if i:  # the first claim only teaches the pool the key
                out["start (pool)"].append(time.perf_counter() - t0)
            await env.close()
    return out


async def steps(kind: str, root: Path, all_tasks: list[WebTask], noops: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"step": [], "step (actions)": [], "step (noop)": [], "exec": [], "tree": [],
                                   "snapshot + fork x3": []}
    async with runtime(kind, root / "steps") as rt:
        image = await rt.task_image(all_tasks[0])
        for task in all_tasks:
            env = rt.new_env(task, image=image, labels=OWNER)
            await env.reset()
            for action in FAMILY.oracle(task):  # the first one right after the reset, as an agent's
                if action.tool == "submit":
                    break
                t0 = time.perf_counter()
                result = await env.step(action)
                out["step (actions)"].append(time.perf_counter() - t0)
                if result.terminated or result.truncated:
                    break
            await env.close()
        task = next(t for t in all_tasks if t.name == "sort-table")
        env = rt.new_env(task, image=image, labels=OWNER)
        for i in range(noops):
            if i % 8 == 0:  # a new episode before the task's 10-step limit
                await env.reset()
            t0 = time.perf_counter()
            await env.step(Action("noop", {}))
            out["step (noop)"].append(time.perf_counter() - t0)
            reply = await env._call({"op": "observe"})  # the driver's own time for the tree
            out["tree"].append(reply["driver_ms"] / 1000)
            t0 = time.perf_counter()
            await rt.backend.exec(env.sandbox.id, "true", timeout_s=10)
            out["exec"].append(time.perf_counter() - t0)
        await env.reset()
        await env.step(Action("fill", {"bid": "search", "text": "lamp"}))
        for _ in range(3):
            t0 = time.perf_counter()
            snap = await env.snapshot()
            forks = await rt.restore_envs(snap, task, [OWNER] * 3)
            firsts = await asyncio.gather(*(f.step(Action("noop", {})) for f in forks))
            out["snapshot + fork x3"].append(time.perf_counter() - t0)
            assert all(f.info["restore"]["matches"] for f in firsts), [f.info["restore"] for f in firsts]
            for fork in forks:
                await fork.close()
            await rt.backend.delete_snapshot(snap.id)
        await env.close()
    out["step"] = out["step (actions)"] + out["step (noop)"]
    return out


async def throughput(kind: str, root: Path, all_tasks: list[WebTask]) -> dict[str, float]:
    from workers.policy.base import Sampling
    from workers.policy.scripted import ScriptedPolicy
    from workers.runner import AgentSettings, StageLimits, run_episode

    out: dict[str, float] = {}
    async with runtime(kind, root / "throughput") as rt:
        await rt.task_image(all_tasks[0])
        for concurrency in (1, 4, 8):
            stages = StageLimits.of(setup=concurrency, agent=concurrency, verify=concurrency)
            episodes = [all_tasks[i % len(all_tasks)] for i in range(max(len(all_tasks), 2 * concurrency))]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                run_episode(episode_id=f"bench-{concurrency}-{i}", task=t, runtime=rt,
                            policy=ScriptedPolicy.from_task(t), settings=AgentSettings(max_turns=12),
                            sampling=Sampling(), stages=stages, labels=OWNER)
                for i, t in enumerate(episodes)))
            elapsed = time.perf_counter() - t0
            assert all(r.reward == 1.0 for r in results), [(r.error, r.info) for r in results if r.reward != 1.0]
            out[f"episodes/min @{concurrency}"] = len(episodes) / elapsed * 60
    return out


async def bench(kind: str, runs: int, noops: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-web-{kind}-"))
    all_tasks = tasks()
    rows: dict[str, object] = {}
    rows.update(await starts(kind, root, all_tasks[0], runs))
    rows.update(await steps(kind, root, all_tasks, noops))
    rows.update(await throughput(kind, root, all_tasks))
    return rows


def report(kind: str, rows: dict[str, object]) -> None:
    def median(key: str) -> float:
        values = rows[key]
        assert isinstance(values, list)
        return statistics.median(values) * 1000

    print(f"\n{kind} backend ({platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')})")
    cold, warm = median("start (cold)"), median("start (pool)")
    print(f"  start (cold)           {cold:8.0f} ms")
    print(f"  start (pool)           {warm:8.0f} ms   cold/pool {cold / warm:.2f}x")
    step = rows["step"]
    assert isinstance(step, list)
    exec_ms = median("exec")
    print(f"  step p50 / p95         {pct(step, 0.5):8.1f} / {pct(step, 0.95):.1f} ms over {len(step)} steps   "
          f"step/exec {pct(step, 0.5) / exec_ms:.1f}x (target p50 <= 100 ms)")
    for kind_ in ("actions", "noop"):
        values = rows[f"step ({kind_})"]
        assert isinstance(values, list)
        print(f"    {kind_:<20} {pct(values, 0.5):8.1f} / {pct(values, 0.95):.1f} ms over {len(values)}")
    print(f"  exec 'true' (baseline) {exec_ms:8.1f} ms")
    print(f"  tree (driver)          {median('tree'):8.1f} ms")
    print(f"  snapshot + fork x3     {median('snapshot + fork x3'):8.0f} ms")
    one = rows["episodes/min @1"]
    assert isinstance(one, float)
    for c in (1, 4, 8):
        value = rows[f"episodes/min @{c}"]
        assert isinstance(value, float)
        print(f"  episodes/min @{c}        {value:8.1f}          x{value / one:.2f} of @1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["local", "docker", "all"], default="all")
    parser.add_argument("--runs", type=int, default=5, help="resets per start measure (default 5)")
    parser.add_argument("--noops", type=int, default=30, help="noop steps on one page (default 30)")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args()
    kinds = ["local", "docker"] if args.backend == "all" else [args.backend]
    if "docker" in kinds and not docker_available():
        print("docker is not available here: skipping it", file=sys.stderr)
        kinds.remove("docker")
    results = {}
    for kind in kinds:
        results[kind] = asyncio.run(bench(kind, args.runs, args.noops))
        report(kind, results[kind])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Warm pool claims against cold starts, on docker and local, in one run.

Run with ``.venv/bin/python bench/pool.py [--runs 10]`` as root after ``bash .ci/bootstrap``.
``bench/fleet.py`` runs it too and prints its rows. Each row is a median in milliseconds
over ``--runs`` starts:

- ``cold``: ``backend.create`` of the base image, then the shell's first command, which
  is when a cold sandbox is ready to use;
- ``claim``: :meth:`WarmPool.create` for the same spec while the pool holds one idle
  (the pool refills between claims, outside the timing);
- ``cold restore`` and ``claim restore``: the same two starts from a post-setup snapshot
  the pool may hold (what a task with a ``forkyard/reset.sh`` starts from);
- ``reset cold`` and ``reset pooled``: a whole ``TerminalEnv.reset`` of a task without
  setup, on the base image. This is what an episode waits for: the claim plus the env's own
  preparation (its directories, the workdir, the shell's environment).

The issue's target is a claim at least 20x faster than a cold sandbox on docker.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.backends import create_backend, docker_available  # noqa: E402
from sandboxes.base import LABEL_OWNER, SandboxSpec  # noqa: E402
from sandboxes.images import DEFAULT_IMAGE_CACHE, ensure_base_image  # noqa: E402
from workers.envs.terminal.env import TerminalEnv  # noqa: E402
from workers.envs.terminal.task import load_task_files  # noqa: E402
from workers.pool import PoolPolicy, WarmPool  # noqa: E402

#: The issue's target for a claim against a cold start on docker.
TARGET_RATIO = 20.0

TASK = load_task_files("bench-pool", {
    "instruction.md": b"Do nothing.\n",
    "task.toml": b"[agent]\ntimeout_sec = 600\n",
    "environment/Dockerfile": b"FROM ubuntu:24.04\n",
    "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
})


def med_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def refilled(pool: WarmPool, idle: int = 1, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await pool.reconcile()
        if pool.stats()["idle"] >= idle and pool.stats()["filling"] == 0:
            return
        await asyncio.sleep(0.02)
    raise RuntimeError(f"the pool did not refill: {pool.stats()}")


async def measure(kind: str, runs: int) -> dict[str, float]:
    """Return the medians (ms) of cold starts and pool claims on the ``kind`` backend."""
    root = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    backend = create_backend(kind, node=f"bench-pool-{uuid.uuid4().hex[:6]}", root_dir=root)
    pool = WarmPool(backend, PoolPolicy(max_idle=2, window_s=3600, headroom=1.0),
                    poolable=lambda snap: True)
    made: list[str] = []
    rows: dict[str, float] = {}
    try:
        base = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
        spec = SandboxSpec(image=base, labels={LABEL_OWNER: "bench"})

        async def ready_cold() -> float:
            started = time.perf_counter()
            info = await backend.create(spec)
            await backend.exec(info.id, "true")
            made.append(info.id)
            return time.perf_counter() - started

        async def claimed(start) -> float:
            await refilled(pool)
            started = time.perf_counter()
            info = await start()
            elapsed = time.perf_counter() - started
            made.append(info.id)
            return elapsed

        rows["cold"] = med_ms([await ready_cold() for _ in range(runs)])
        made.append((await pool.create(spec)).id)  # the first claim is a miss: it makes the key known
        rows["claim"] = med_ms([await claimed(lambda: pool.create(spec)) for _ in range(runs)])

        source = await backend.create(spec)
        await backend.exec(source.id, "head -c 1048576 /dev/urandom > /opt/setup.bin")
        snap = await backend.snapshot(source.id, metadata={"forkyard.kind": "setup"})
        await backend.destroy(source.id)

        async def restore_cold() -> float:
            started = time.perf_counter()
            (info,) = await backend.restore(snap, 1, spec=spec)
            await backend.exec(info.id, "true")
            made.append(info.id)
            return time.perf_counter() - started

        rows["cold restore"] = med_ms([await restore_cold() for _ in range(runs)])
        made.append((await pool.restore(snap, spec)).id)
        rows["claim restore"] = med_ms([await claimed(lambda: pool.restore(snap, spec)) for _ in range(runs)])

        async def reset(env_pool: WarmPool | None) -> float:
            if env_pool is not None:
                await refilled(env_pool)
            env = TerminalEnv(TASK, backend, image=base, labels={LABEL_OWNER: "bench"}, pool=env_pool)
            started = time.perf_counter()
            await env.reset()
            elapsed = time.perf_counter() - started
            await env.close()
            return elapsed

        rows["reset cold"] = med_ms([await reset(None) for _ in range(runs)])
        await pool.aclose()  # a pool of the env's own key only (its spec has the task's resources)
        pool = WarmPool(backend, PoolPolicy(max_idle=2, window_s=3600, headroom=1.0))
        env = TerminalEnv(TASK, backend, image=base, labels={LABEL_OWNER: "bench"}, pool=pool)
        await env.reset()  # a miss: makes the key known
        await env.close()
        rows["reset pooled"] = med_ms([await reset(pool) for _ in range(runs)])
        assert pool.stats()["hits"] == runs, pool.stats()
        await backend.delete_snapshot(snap.id)
    finally:
        await pool.aclose()
        for sandbox_id in made:
            await backend.destroy(sandbox_id)
        await backend.aclose()
        shutil.rmtree(root, ignore_errors=True)
    return rows


async def measure_all(runs: int) -> dict[str, dict[str, float]]:
    """Return :func:`measure` of docker (when its engine answers) and local."""
    kinds = (["docker"] if docker_available() else []) + ["local"]
    return {kind: await measure(kind, runs) for kind in kinds}


def report(results: dict[str, dict[str, float]]) -> list[str]:
    """Return the table's lines and the ratios against the cold starts."""
    lines = [f"{'backend':8s} {'cold':>8s} {'claim':>8s} {'ratio':>8s} {'cold restore':>13s} {'claim restore':>14s}"
             f" {'ratio':>8s} {'reset cold':>11s} {'reset pooled':>13s} {'ratio':>6s}"]
    for kind, r in results.items():
        lines.append(f"{kind:8s} {r['cold']:8.2f} {r['claim']:8.3f} {r['cold'] / r['claim']:7.0f}x"
                     f" {r['cold restore']:13.2f} {r['claim restore']:14.3f} {r['cold restore'] / r['claim restore']:7.0f}x"
                     f" {r['reset cold']:11.2f} {r['reset pooled']:13.2f} {r['reset cold'] / r['reset pooled']:5.1f}x")
    if "docker" in results:
        ratio = results["docker"]["cold"] / results["docker"]["claim"]
        verdict = "met" if ratio >= TARGET_RATIO else "missed"
        lines.append(f"docker: a claim is {ratio:.0f}x faster than a cold sandbox (target >= {TARGET_RATIO:.0f}x: "
                     f"{verdict})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    print("\n".join(report(asyncio.run(measure_all(args.runs)))))


if __name__ == "__main__":
    main()

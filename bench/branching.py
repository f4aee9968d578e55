"""Branching latency: snapshot and fork (restore into n sandboxes) on both backends vs. docker commit + run.

Run with ``.venv/bin/python bench/branching.py [--runs 20] [--reps 5]`` as root after
``bash .ci/bootstrap``. All measurements come from the same run:

- ``local`` and ``docker``: the Forkyard backends. A sandbox gets a fresh 1 MB change
  (``head -c 1M /dev/urandom`` over the same file, not timed) before each ``snapshot``;
  ``restore(snapshot, n)`` is timed for n = 1, 8, 32 (its branches are started
  concurrently, as ``restore`` does) and the branches are destroyed afterwards (not timed);
- ``docker CLI``: the baseline, ``docker commit <container>`` after the same 1 MB change,
  then ``n`` concurrent ``docker run -d --network none <committed image> sleep`` processes
  (concurrent because ``restore`` is), same base image.

Then, on the local backend (and docker when it is available), through the real runner
(:func:`workers.runner.run_episode`) with a scripted policy:

- tree vs linear: one trajectory tree (``--prefix`` shared turns, then ``--fanout`` branches
  of ``--suffix`` turns each) against ``--fanout`` independent episodes of the same
  actions, run concurrently: environment steps executed (counted by the runtime) and wall
  time, as ratios. Every turn runs a real command (``--step-work`` of CPU in Python).
- setup cache: ``reset()`` of ``examples/tasks/terminal/sensor-stats`` (its reset.sh builds a
  virtualenv and a data set) cold (no cache) vs served from the setup cache, as a ratio.

Before measuring it waits (at most ``--max-wait-s``) until the 1-minute load average is
below ``--max-load``. Prints p50 and p95 in milliseconds, the per-branch time (total / n)
and ratios against the baseline, and says which of the issue's targets are met.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.backends import create_backend, docker_available  # noqa: E402
from sandboxes.base import SandboxSpec  # noqa: E402
from sandboxes.images import DEFAULT_IMAGE_CACHE, base_image_ref, ensure_base_image  # noqa: E402

FANOUTS = (1, 8, 32)
CHANGE_PATH = "/root/branch-change.bin"
CHANGE_COMMAND = f"head -c 1M /dev/urandom > {CHANGE_PATH}"
BENCH_LABEL = "forkyard.bench=branching"
#: Targets from the "Branching" issue (2-core machine).
TARGET_SNAPSHOT_MS = 10.0
TARGET_FORK_PER_BRANCH_MS = 10.0
TARGET_SPEEDUP = 20.0
TARGET_CACHED_RESET = 10.0
SETUP_TASK = ROOT / "examples" / "tasks" / "terminal" / "sensor-stats"
TREE_TASK = ROOT / "examples" / "tasks" / "terminal" / "word-frequency"


def pct(values: list[float], q: float) -> float:
    """Return the q-quantile of ``values`` (seconds) in milliseconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx] * 1000


def med_ms(values: list[float]) -> float:
    """Return the median of ``values`` (seconds) in milliseconds."""
    return statistics.median(values) * 1000 if values else float("nan")


def load1() -> float:
    """Return the 1-minute load average."""
    with open("/proc/loadavg") as fh:
        return float(fh.read().split()[0])


def wait_for_quiet(max_load: float, max_wait_s: float, every_s: float = 30.0) -> tuple[float, float]:
    """Wait until the 1-minute load is below ``max_load`` (at most ``max_wait_s``); return (load at start, at end)."""
    start = load1()
    deadline = time.monotonic() + max_wait_s
    now = start
    while now >= max_load and time.monotonic() < deadline:
        print(f"load average {now:.2f} >= {max_load}, waiting {every_s:.0f} s ...", file=sys.stderr)
        time.sleep(every_s)
        now = load1()
    return start, now


def new_results() -> dict[str, list[float]]:
    """Return empty sample lists: ``snapshot`` and ``fork<n>`` (total seconds per restore)."""
    return {"snapshot": [], **{f"fork{n}": [] for n in FANOUTS}}


async def bench_backend(kind: str, runs: int, reps: int, root: Path) -> dict[str, list[float]]:
    """Time ``snapshot`` after a 1 MB change ``runs`` times and ``restore(snapshot, n)`` ``reps`` times per n."""
    backend = create_backend(kind, node=f"bench-branching-{secrets.token_hex(4)}", root_dir=root / kind)
    out = new_results()
    sandboxes: set[str] = set()
    snapshots: set[str] = set()
    try:
        image = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
        info = await backend.create(SandboxSpec(image=image))
        sandboxes.add(info.id)
        for i in range(runs + 1):  # the first one warms up
            r = await backend.exec(info.id, CHANGE_COMMAND)
            assert r.exit_code == 0, r
            t = time.perf_counter()
            snap = await backend.snapshot(info.id)
            dt = time.perf_counter() - t
            snapshots.add(snap.id)
            if i:
                out["snapshot"].append(dt)
            await backend.delete_snapshot(snap.id)
            snapshots.discard(snap.id)
        await backend.exec(info.id, CHANGE_COMMAND)
        snap = await backend.snapshot(info.id)
        snapshots.add(snap.id)
        for n in FANOUTS:
            for rep in range(reps):
                t = time.perf_counter()
                branches = await backend.restore(snap, n)
                dt = time.perf_counter() - t
                sandboxes.update(b.id for b in branches)
                out[f"fork{n}"].append(dt)
                if rep == 0:  # the branch sees the snapshot's change
                    r = await backend.exec(branches[-1].id, f"stat -c %s {CHANGE_PATH}")
                    assert r.stdout.strip() == str(1 << 20), r
                for b in branches:
                    await backend.destroy(b.id)
                    sandboxes.discard(b.id)
    finally:
        for sid in list(sandboxes):
            try:
                await backend.destroy(sid)
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                print(f"cleanup: cannot destroy {kind} sandbox {sid}: {exc}", file=sys.stderr)
        for snap_id in list(snapshots):
            try:
                await backend.delete_snapshot(snap_id)
            except Exception as exc:  # noqa: BLE001
                print(f"cleanup: cannot delete {kind} snapshot {snap_id}: {exc}", file=sys.stderr)
        await backend.aclose()
    return out


def _docker(*args: str, text: bool = True) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=text).stdout.strip()


async def _docker_run(image: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        "docker", "run", "-d", "--network", "none", "--label", BENCH_LABEL, image, "sleep", "3600",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"docker run failed: {stderr.decode(errors='replace').strip()}")
    return stdout.decode().strip()


async def bench_docker_cli(image: str, runs: int, reps: int) -> dict[str, list[float]]:
    """Time ``docker commit`` after a 1 MB change and ``n`` concurrent ``docker run`` of the committed image."""
    out = new_results()
    containers: set[str] = set()
    images: set[str] = set()
    try:
        cid = _docker("run", "-d", "--network", "none", "--label", BENCH_LABEL, image, "sleep", "3600")
        containers.add(cid)
        for i in range(runs + 1):
            _docker("exec", cid, "sh", "-c", CHANGE_COMMAND)
            t = time.perf_counter()
            img = _docker("commit", cid)
            dt = time.perf_counter() - t
            images.add(img)
            if i:
                out["snapshot"].append(dt)
            _docker("rmi", img)
            images.discard(img)
        _docker("exec", cid, "sh", "-c", CHANGE_COMMAND)
        img = _docker("commit", cid)
        images.add(img)
        for n in FANOUTS:
            for _ in range(reps):
                t = time.perf_counter()
                results = await asyncio.gather(*(_docker_run(img) for _ in range(n)), return_exceptions=True)
                dt = time.perf_counter() - t
                made = [r for r in results if isinstance(r, str)]
                containers.update(made)
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    raise failed[0]
                out[f"fork{n}"].append(dt)
                _docker("rm", "-f", *made)
                containers.difference_update(made)
    finally:
        if containers:
            try:
                _docker("rm", "-f", *containers)
            except subprocess.CalledProcessError as exc:
                print(f"cleanup: docker rm failed: {exc.stderr}", file=sys.stderr)
        for img in images:
            try:
                _docker("rmi", img)
            except subprocess.CalledProcessError as exc:
                print(f"cleanup: docker rmi {img} failed: {exc.stderr}", file=sys.stderr)
    return out


def _step(i: int, work: float) -> dict:
    """A bash action that does ``work`` seconds of CPU in Python and leaves a trace on disk."""
    code = f"import time; e = time.process_time() + {work}\nwhile time.process_time() < e: pass"
    return {"tool": "bash", "arguments": {"command": f"python3 -c '{code}' && echo {i} >> /root/trace.txt"}}


async def bench_tree(kind: str, root: Path, *, prefix: int, suffix: int, fanout: int, work: float,
                     reps: int) -> dict[str, list[float]]:
    """Time one tree (prefix shared, fanout branches) against fanout linear episodes; count env steps."""
    from workers.branching import BranchingSpec, Tree
    from workers.envs.terminal.task import load_task_dir
    from workers.policy.base import Sampling
    from workers.policy.scripted import ScriptedPolicy
    from workers.reporting import MemoryReporter
    from workers.runner import AgentSettings, StageLimits, run_episode
    from workers.runtime import WorkerRuntime

    backend = create_backend(kind, node=f"bench-tree-{secrets.token_hex(4)}", root_dir=root / f"tree-{kind}")
    runtime = WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE)
    task = load_task_dir(TREE_TASK)
    actions = [_step(i, work) for i in range(prefix + suffix)] + [{"tool": "submit", "arguments": {}}]
    settings = AgentSettings(max_turns=len(actions) + 1)
    stages = StageLimits.of(setup=fanout, agent=fanout, verify=fanout)
    out: dict[str, list[float]] = {"tree_s": [], "linear_s": [], "tree_steps": [], "linear_steps": []}
    try:
        await runtime.start()
        await runtime.task_image(task)

        async def episode(eid: str, tree: Tree | None = None):
            return await run_episode(episode_id=eid, task=task, runtime=runtime, policy=ScriptedPolicy(actions),
                                     settings=settings, sampling=Sampling(), stages=stages, tree=tree)

        for _ in range(reps + 1):  # the first one warms up
            reporter = MemoryReporter()
            spec = BranchingSpec.from_dict({"at_turns": [prefix], "fanout": fanout})
            tree = Tree(spec, root_episode_id="trunk", reporter=reporter, delete_snapshot=runtime.delete_snapshot)
            before = runtime.counters["env_steps"]
            t = time.perf_counter()
            trunk = await episode("trunk", tree)
            await tree.join()
            results = [trunk, *reporter.results.values()]
            tree_s = time.perf_counter() - t
            tree_steps = runtime.counters["env_steps"] - before
            assert len(results) == fanout and all(r.status == "completed" for r in results), results

            before = runtime.counters["env_steps"]
            t = time.perf_counter()
            linear = await asyncio.gather(*(episode(f"linear-{i}") for i in range(fanout)))
            linear_s = time.perf_counter() - t
            linear_steps = runtime.counters["env_steps"] - before
            assert all(r.status == "completed" for r in linear), linear
            if _:
                out["tree_s"].append(tree_s)
                out["linear_s"].append(linear_s)
                out["tree_steps"].append(tree_steps)
                out["linear_steps"].append(linear_steps)
    finally:
        await runtime.aclose()
    return out


async def bench_setup_cache(kind: str, root: Path, reps: int) -> dict[str, list[float]]:
    """Time reset() of the slow-setup task cold (no cache) and from the setup cache."""
    from workers.envs.terminal.task import load_task_dir
    from workers.runtime import WorkerRuntime
    from workers.setup_cache import SetupCache

    backend = create_backend(kind, node=f"bench-cache-{secrets.token_hex(4)}", root_dir=root / f"cache-{kind}")
    cache = SetupCache(backend, root / f"cache-index-{kind}")
    runtime = WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE, setup_cache=cache)
    cold_runtime = WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE)
    task = load_task_dir(SETUP_TASK)
    out: dict[str, list[float]] = {"cold": [], "cached": []}
    try:
        await runtime.start()
        image = await runtime.task_image(task)
        cold_runtime.base_image = runtime.base_image
        for which, rt in (("cold", cold_runtime), ("cached", runtime)):
            for i in range(reps + 1):  # cached: the first reset fills the cache (not timed)
                env = rt.new_env(task, image=image, labels={}, env_version="bench")
                t = time.perf_counter()
                await env.reset()
                dt = time.perf_counter() - t
                r = await backend.exec(env.sandbox.id, "test -x /opt/venv/bin/python && wc -l < /app/data/readings.csv")
                await env.close()
                assert r.exit_code == 0, r
                if i:
                    out[which].append(dt)
        assert runtime.counters["setup_runs"] == 1, runtime.counters
        await cache.clear()
    finally:
        await runtime.aclose()
    return out


def cell(values: list[float], n: int = 1) -> str:
    """Format p50 / p95, plus the per-branch p50 / p95 when ``n`` > 1."""
    if not values:
        return "—"
    text = f"{pct(values, 0.5):.1f} / {pct(values, 0.95):.1f}"
    if n > 1:
        text += f" ({pct(values, 0.5) / n:.1f} / {pct(values, 0.95) / n:.1f} per branch)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="snapshots per backend (default 20)")
    parser.add_argument("--reps", type=int, default=5, help="restores per fan-out n (default 5)")
    parser.add_argument("--prefix", type=int, default=6, help="tree: shared turns before the fork (default 6)")
    parser.add_argument("--suffix", type=int, default=2, help="tree: turns of each branch (default 2)")
    parser.add_argument("--fanout", type=int, default=4, help="tree: branches (default 4)")
    parser.add_argument("--step-work", type=float, default=0.2, help="tree: CPU seconds per turn (default 0.2)")
    parser.add_argument("--tree-reps", type=int, default=3, help="tree and linear runs (default 3)")
    parser.add_argument("--cache-reps", type=int, default=5, help="cold and cached resets (default 5)")
    parser.add_argument("--only", choices=["fork", "tree", "cache"], action="append",
                        help="run only these parts (repeatable; default all)")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--max-wait-s", type=float, default=600.0)
    args = parser.parse_args()

    parts = set(args.only or ["fork", "tree", "cache"])
    load_start, load_now = wait_for_quiet(args.max_load, args.max_wait_s)
    results: dict[str, dict[str, list[float]]] = {}
    trees: dict[str, dict[str, list[float]]] = {}
    caches: dict[str, dict[str, list[float]]] = {}
    kinds = ["local"] + (["docker"] if docker_available() and shutil.which("docker") else [])
    docker_image_created = False
    with tempfile.TemporaryDirectory(prefix="forkyard-bench-branching-") as tmp:
        if "fork" in parts:
            results["local"] = asyncio.run(bench_backend("local", args.runs, args.reps, Path(tmp)))
            if "docker" in kinds:
                ref = base_image_ref()
                docker_image_created = subprocess.run(
                    ["docker", "image", "inspect", ref], capture_output=True
                ).returncode != 0
                try:
                    results["docker"] = asyncio.run(bench_backend("docker", args.runs, args.reps, Path(tmp)))
                    results["docker CLI"] = asyncio.run(bench_docker_cli(ref, args.runs, args.reps))
                finally:
                    if docker_image_created:  # leave the engine as it was
                        subprocess.run(["docker", "rmi", ref], capture_output=True)
        for kind in kinds:
            if "tree" in parts:
                trees[kind] = asyncio.run(bench_tree(
                    kind, Path(tmp), prefix=args.prefix, suffix=args.suffix, fanout=args.fanout,
                    work=args.step_work, reps=args.tree_reps))
            if "cache" in parts:
                caches[kind] = asyncio.run(bench_setup_cache(kind, Path(tmp), args.cache_reps))
    load_end = load1()
    print(
        f"# bench/branching.py — {time.strftime('%Y-%m-%d')} — {platform.node()} "
        f"({os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}), "
        f"runs={args.runs}, reps={args.reps}, load average {load_start:.2f} at start, "
        f"{load_now:.2f} when measuring began, {load_end:.2f} at the end"
    )
    print()
    if results:
        print_fork_tables(results)
    if trees:
        print_tree_table(trees, args)
    if caches:
        print_cache_table(caches)


def print_tree_table(trees: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    leaves = args.fanout
    print(f"Tree vs linear: one tree forking after {args.prefix} turns into {leaves} branches of {args.suffix} "
          f"turns (+ submit) vs {leaves} independent episodes, {args.step_work:g} s of CPU per turn, "
          "run concurrently, same scripted actions (median of the runs):")
    print()
    print("| backend | env steps tree / linear | wall s tree / linear | steps ratio | wall ratio |")
    print("|---|---|---|---|---|")
    for kind, data in trees.items():
        ts, ls = statistics.median(data["tree_steps"]), statistics.median(data["linear_steps"])
        tw, lw = statistics.median(data["tree_s"]), statistics.median(data["linear_s"])
        print(f"| {kind} | {ts:.0f} / {ls:.0f} | {tw:.2f} / {lw:.2f} | {ls / ts:.2f}x fewer | {lw / tw:.2f}x faster |")
    print()


def print_cache_table(caches: dict[str, dict[str, list[float]]]) -> None:
    print("Setup cache: reset() of sensor-stats (reset.sh builds a virtualenv and a data set), "
          "cold vs from the cache (p50 / p95 ms):")
    print()
    print("| backend | cold reset | cached reset | ratio (cold p50 / cached p50) |")
    print("|---|---|---|---|")
    for kind, data in caches.items():
        ratio = med_ms(data["cold"]) / med_ms(data["cached"])
        met = "met" if ratio >= TARGET_CACHED_RESET else "not met"
        print(f"| {kind} | {cell(data['cold'])} | {cell(data['cached'])} | {ratio:.1f}x "
              f"(target >= {TARGET_CACHED_RESET:.0f}x: {met}) |")
    print()


def print_fork_tables(results: dict[str, dict[str, list[float]]]) -> None:
    print("Snapshot after a 1 MB change; fork = restore(snapshot, n), n branches started concurrently")
    print("(docker CLI: `docker commit`, then n concurrent `docker run -d`). Times in ms.")
    print()
    print("| backend | snapshot p50 / p95 | " + " | ".join(f"fork n={n} p50 / p95" for n in FANOUTS) + " |")
    print("|---|---|" + "---|" * len(FANOUTS))
    for name, data in results.items():
        cells = [cell(data["snapshot"])] + [cell(data[f"fork{n}"], n) for n in FANOUTS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    base = results.get("docker CLI")
    if base:
        print("Ratios (docker CLI p50 / Forkyard p50; >1 means Forkyard is faster):")
        for ours in ("local", "docker"):
            data = results.get(ours)
            if not data:
                continue
            parts = [f"snapshot {med_ms(base['snapshot']) / med_ms(data['snapshot']):.1f}x"]
            for n in FANOUTS:
                parts.append(f"fork n={n} {med_ms(base[f'fork{n}']) / med_ms(data[f'fork{n}']):.1f}x")
            for n in FANOUTS:
                theirs = med_ms(base["snapshot"]) + med_ms(base[f"fork{n}"])
                mine = med_ms(data["snapshot"]) + med_ms(data[f"fork{n}"])
                parts.append(f"snapshot + fork n={n} {theirs / mine:.1f}x")
            print(f"- {ours} vs docker CLI: " + ", ".join(parts))
        print()
    local = results["local"]
    snap_p50 = med_ms(local["snapshot"])
    print("Targets (issue \"Branching\", 2-core machine):")
    print(
        f"- local snapshot p50 <= {TARGET_SNAPSHOT_MS:.0f} ms for a 1 MB change: {snap_p50:.1f} ms — "
        + ("met" if snap_p50 <= TARGET_SNAPSHOT_MS else "not met")
    )
    for n in FANOUTS:
        per = med_ms(local[f"fork{n}"]) / n
        print(
            f"- local fork <= {TARGET_FORK_PER_BRANCH_MS:.0f} ms per branch, n={n}: {per:.1f} ms — "
            + ("met" if per <= TARGET_FORK_PER_BRANCH_MS else "not met")
        )
    if base:
        for n in FANOUTS:
            theirs = (med_ms(base["snapshot"]) + med_ms(base[f"fork{n}"])) / n
            mine = (snap_p50 + med_ms(local[f"fork{n}"])) / n
            ratio = theirs / mine
            print(
                f"- local snapshot + fork >= {TARGET_SPEEDUP:.0f}x faster than commit + run, n={n}: "
                f"{ratio:.1f}x ({mine:.1f} vs {theirs:.1f} ms per branch) — "
                + ("met" if ratio >= TARGET_SPEEDUP else "not met")
            )
    print()


if __name__ == "__main__":
    main()

"""SWE family costs, in one run: environment build, resets, grading, tool steps, long episodes, throughput.

Run with ``.venv/bin/python bench/swe.py [--backend local|docker|all] [--steps 200]`` as root after
``bash .ci/bootstrap``. Uses the example instances (examples/swe/) and, per backend:

- ``env build (cold)``: one environment image per example repository, made unique so
  nothing is cached (pip installs from the package registry included);
- ``reset (cold)``: an instance's first reset (the repository written into the workdir,
  git initialised) with an empty setup cache; ``reset (cached)``: the next reset of the
  same instance, restored from the setup cache's snapshot — the ratio is cold / cached;
- ``grading``: the submit of the gold patch (a fresh sandbox, the diff, test_patch, the tests);
- ``bash`` / ``editor``: one ``echo hi`` / one ``view`` of 10 lines through the env's step;
- ``step 1-20`` / ``step 101-120``: a 120-turn scripted episode (bash and editor turns
  alternating), the medians of its first and last 20 steps (a flat cost: ratio ~1);
- ``oracle rollout``: every instance solved by the scripted oracle through the episode
  runner, 4 at a time: episodes per minute.

``--scale 2000,6600`` adds resets of generated repositories of that many files (6 KB of
Python each; django's checkout has about 6,600 files): the cold reset grows with the
repository, the cached one does not, so the ratio is measured at SWE-bench's sizes.

``--synth`` adds the instances ``examples/swe/synth_pypi.sh`` synthesizes from real PyPI
projects (inflection, toolz; made once, then cached): the reset ratio is printed per
repository too, since a reset's cost grows with the repository written into the workdir.

SWE-ReX's per-command latency (its local deployment, ``echo hi``) is measured in the same
run as the baseline of the bash and editor steps (``bench/.venv-swerex``, made on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
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
from workers.envs.base import Action  # noqa: E402
from workers.envs.swe import FAMILY  # noqa: E402
from workers.envs.swe.repos import RepoStore  # noqa: E402
from workers.envs.swe.task import SWETask, parse_jsonl  # noqa: E402
from workers.runtime import WorkerRuntime  # noqa: E402
from workers.setup_cache import SetupCache  # noqa: E402

EXAMPLES = ROOT / "examples" / "swe"


def _load_sandboxes_bench():
    spec = importlib.util.spec_from_file_location("bench_sandboxes", ROOT / "bench" / "sandboxes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


@contextlib.asynccontextmanager
async def _runtime(kind: str, root: Path, name: str) -> AsyncIterator[tuple[WorkerRuntime, SetupCache]]:
    """A runtime with a setup cache on a fresh node of ``kind``; every sandbox and cache entry gone after."""
    backend = create_backend(kind, node=f"{name}-{uuid.uuid4().hex[:6]}", root_dir=root / name)
    try:
        base = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
        cache = SetupCache(backend, root / name / "setup-cache")
        yield WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=base, setup_cache=cache), cache
        await cache.clear()
    finally:
        for info in await backend.list():
            await backend.destroy(info.id)
        await backend.aclose()


async def bench_backend(kind: str, tasks: list[SWETask], root: Path, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in (
        "env build (cold)", "reset (cold)", "reset (cached)", "grading", "bash", "editor",
        "step 1-20", "step 101-120", "oracle rollout")}
    owner = {LABEL_OWNER: "bench-swe"}
    async with _runtime(kind, root, f"bench-swe-{kind}") as (runtime, cache):
        backend = runtime.backend
        # Cold environment builds: the install commands made unique, so no image of this run exists yet.
        nonce = uuid.uuid4().hex[:8]
        built: dict[str, str] = {}
        for repo in sorted({t.repo for t in tasks}):
            task = next(t for t in tasks if t.repo == repo)
            unique = SWETask(**{**_fields(task), "install": (*task.install, f"true build-{nonce}")})
            t0 = time.perf_counter()
            built[repo] = await runtime.task_image(unique)
            out["env build (cold)"].append(time.perf_counter() - t0)
        images = {t.instance_id: await runtime.task_image(t) for t in tasks}
        for task in tasks:
            for key in ("reset (cold)", "reset (cached)"):
                env = runtime.new_env(task, image=images[task.instance_id], labels=owner)
                t0 = time.perf_counter()
                await env.reset()
                out[key].append(time.perf_counter() - t0)
                out.setdefault(f"{key} {task.repo}", []).append(out[key][-1])
                if key == "reset (cached)":
                    await env.step(Action(*_oracle_call(task)))
                    t0 = time.perf_counter()
                    result = await env.step(Action("submit", {}))
                    out["grading"].append(time.perf_counter() - t0)
                    assert result.reward == 1.0, (task.instance_id, result.info)
                await env.close()
        # Tool steps, and a 120-turn episode.
        task = tasks[0]
        env = runtime.new_env(task, image=images[task.instance_id], labels=owner)
        await env.reset()
        path = f"{task.workdir}/calc/stats.py" if "calc" in task.repo else f"{task.workdir}/textkit/text.py"
        view = Action("str_replace_editor", {"command": "view", "path": path, "view_range": [1, 10]})
        echo = Action("bash", {"command": "echo hi"})
        for _ in range(5):
            await env.step(echo)
        for _ in range(steps):
            t0 = time.perf_counter()
            await env.step(echo)
            out["bash"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await env.step(view)
            out["editor"].append(time.perf_counter() - t0)
        await env.close()
        env = runtime.new_env(task, image=images[task.instance_id], labels=owner)
        await env.reset()
        per_step = []
        for turn in range(120):
            action = echo if turn % 2 == 0 else Action("str_replace_editor", {
                "command": "create", "path": f"{task.workdir}/notes/n{turn}.txt", "file_text": f"turn {turn}\n"})
            t0 = time.perf_counter()
            await env.step(action)
            per_step.append(time.perf_counter() - t0)
        out["step 1-20"], out["step 101-120"] = per_step[:20], per_step[100:]
        await env.close()
        # Oracle rollout through the episode runner, 4 episodes at a time.
        from workers.policy.base import Sampling
        from workers.policy.scripted import ScriptedPolicy
        from workers.runner import AgentSettings, StageLimits, run_episode

        stages = StageLimits.of(setup=4, agent=4, verify=4)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            run_episode(episode_id=f"bench-{i}", task=t, runtime=runtime, policy=ScriptedPolicy.from_task(t),
                        settings=AgentSettings(max_turns=4), sampling=Sampling(), stages=stages, labels=owner)
            for i, t in enumerate(tasks)))
        elapsed = time.perf_counter() - t0
        assert all(r.reward == 1.0 for r in results), [r.error for r in results]
        out["oracle rollout"] = [len(tasks) / elapsed * 60]
        for image in built.values():
            await backend.remove_image(image)
    return out


async def bench_scale(kind: str, store: RepoStore, sizes: list[int], root: Path, runs: int = 3) -> dict[int, dict]:
    """Cold and cached resets of generated repositories of ``sizes`` files each."""
    from workers.envs.swe.repos import commit_directory, head_commit

    out: dict[int, dict] = {}
    owner = {LABEL_OWNER: "bench-swe-scale"}
    async with _runtime(kind, root, f"bench-swe-scale-{kind}") as (runtime, cache):
        for n in sizes:
            repo = f"bench/scale{n}"
            if not store.has(repo):
                src = root / f"scale{n}-src" / f"scale{n}"
                for i in range(n):
                    path = src / "pkg" / f"m{i // 100:03d}" / f"mod{i:05d}.py"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # {'.' * 40}\n\n" for j in range(80))
                    path.write_text(body[:6144])
                commit_directory(src, root / f"scale{n}-repo")
                store.add(root / f"scale{n}-repo", name=repo)
            task = SWETask(instance_id=f"scale-{n}", repo=repo, base_commit=head_commit(store.path(repo)),
                           problem_statement="Nothing to fix: a reset benchmark.")
            image = await runtime.task_image(task)
            cold: list[float] = []
            cached: list[float] = []
            for _ in range(runs):
                await cache.clear()
                for times in (cold, cached):
                    env = runtime.new_env(task, image=image, labels=owner)
                    t0 = time.perf_counter()
                    await env.reset()
                    times.append(time.perf_counter() - t0)
                    await env.close()
            out[n] = {"reset (cold)": cold, "reset (cached)": cached}
    return out


def _synthesized(store: RepoStore) -> list[SWETask]:
    """The instances synth_pypi.sh makes (or finds cached), their repositories added to ``store``."""
    print("synthesizing (or reading the cache of) examples/swe/synth_pypi.sh ...", file=sys.stderr)
    done = subprocess.run(["bash", str(EXAMPLES / "synth_pypi.sh")], cwd=ROOT, check=True,
                          stdout=subprocess.PIPE, text=True)
    cache = Path(done.stdout.strip().splitlines()[-1])
    tasks: list[SWETask] = []
    for jsonl in sorted(cache.glob("*.jsonl")):
        store.add(cache / "repos" / f"pypi__{jsonl.stem}.git", name=f"pypi/{jsonl.stem}")
        tasks += parse_jsonl(jsonl.read_bytes())
    return tasks


def _file_count(store: RepoStore, task: SWETask) -> int:
    """Files in the workdir a reset of ``task`` writes (its repository at base_commit)."""
    listing = subprocess.run(["git", "-C", str(store.path(task.repo)), "ls-tree", "-r", "--name-only",
                              task.base_commit], check=True, stdout=subprocess.PIPE, text=True).stdout
    return len(listing.splitlines())


def _fields(task: SWETask) -> dict:
    from dataclasses import fields

    return {f.name: getattr(task, f.name) for f in fields(task)}


def _oracle_call(task: SWETask) -> tuple[str, dict]:
    action = FAMILY.oracle(task)[0]
    return action.tool, dict(action.arguments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["local", "docker", "all"], default="all")
    parser.add_argument("--steps", type=int, default=200, help="bash and editor steps timed (each)")
    parser.add_argument("--skip-swerex", action="store_true")
    parser.add_argument("--scale", default="", help="comma-separated repository sizes (files) to time resets at")
    parser.add_argument("--synth", action="store_true",
                        help="also the instances synthesized from PyPI projects (examples/swe/synth_pypi.sh)")
    args = parser.parse_args()
    kinds = ["local", "docker"] if args.backend == "all" else [args.backend]
    kinds = [k for k in kinds if k != "docker" or docker_available()]

    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="forkyard-bench-swe-") as tmp:
        store = RepoStore(Path(tmp) / "repos")
        for name in ("calc", "textkit"):
            store.add(EXAMPLES / "repos" / name, name=f"forkyard/{name}")
        FAMILY.configure(repo_store=store.root)
        tasks = parse_jsonl((EXAMPLES / "instances.jsonl").read_bytes())
        if args.synth:
            tasks += _synthesized(store)
        files = {t.repo: _file_count(store, t) for t in tasks}
        for kind in kinds:
            results[kind] = asyncio.run(bench_backend(kind, tasks, Path(tmp), args.steps))
        sizes = [int(s) for s in args.scale.split(",") if s.strip()]
        scale = {kind: asyncio.run(bench_scale(kind, store, sizes, Path(tmp))) for kind in kinds} if sizes else {}
    swerex: dict[str, list[float]] = {}
    if not args.skip_swerex:
        swerex = _load_sandboxes_bench().bench_swerex(args.steps)

    print(f"# bench/swe.py — {time.strftime('%Y-%m-%d')} — {platform.node()} ({os.cpu_count()} cores, "
          f"{platform.machine()}, Linux {platform.release()}); {len(tasks)} instances, {args.steps} steps per tool")
    print()
    rows = ["env build (cold)", "reset (cold)", "reset (cached)", "grading", "bash", "editor", "step 1-20",
            "step 101-120"]
    print("| backend | " + " | ".join(f"{r} p50 (ms)" for r in rows) + " | oracle rollout (episodes/min) |")
    print("|---|" + "---|" * (len(rows) + 1))
    for kind, data in results.items():
        print(f"| {kind} | " + " | ".join(f"{ms(data[r]):.1f}" for r in rows)
              + f" | {data['oracle rollout'][0]:.0f} |")
    if swerex.get("exec"):
        print("| SWE-ReX (local) | " + " | ".join("—" if r not in ("bash",) else f"{ms(swerex['exec']):.1f}"
                                                  for r in rows) + " | — |")
    print()
    print("| backend | repository | files | reset (cold) p50 (ms) | reset (cached) p50 (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for kind, data in results.items():
        for repo in sorted({t.repo for t in tasks}):
            cold, cached = ms(data[f"reset (cold) {repo}"]), ms(data[f"reset (cached) {repo}"])
            print(f"| {kind} | {repo} | {files[repo]} | {cold:.1f} | {cached:.1f} | {cold / cached:.1f}x |")
    for kind, by_size in scale.items():
        for n, data in by_size.items():
            cold, cached = ms(data["reset (cold)"]), ms(data["reset (cached)"])
            print(f"| {kind} | generated, 6 KB per file | {n} | {cold:.1f} | {cached:.1f} | {cold / cached:.1f}x |")
    print()
    print("Ratios:")
    for kind, data in results.items():
        parts = [f"cached reset {ms(data['reset (cold)']) / ms(data['reset (cached)']):.1f}x faster than cold",
                 f"steps 101-120 / steps 1-20 = {ms(data['step 101-120']) / ms(data['step 1-20']):.2f}"]
        if swerex.get("exec"):
            parts.append(f"bash {ms(swerex['exec']) / ms(data['bash']):.0f}x and editor "
                         f"{ms(swerex['exec']) / ms(data['editor']):.0f}x faster than a SWE-ReX command")
        print(f"- {kind}: " + "; ".join(parts))
    print()
    print(json.dumps({k: {r: round(ms(v), 3) for r, v in d.items()} for k, d in results.items()}))


if __name__ == "__main__":
    main()

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

SWE-ReX's per-command latency (its local deployment, ``echo hi``) is measured in the same
run as the baseline of the bash and editor steps (``bench/.venv-swerex``, made on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandboxes.backends import create_backend, docker_available  # noqa: E402
from sandboxes.base import LABEL_OWNER  # noqa: E402
from sandboxes.images import DEFAULT_IMAGE_CACHE, ensure_base_image  # noqa: E402
from workers.envs.base import Action, run_actions  # noqa: E402
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


async def bench_backend(kind: str, tasks: list[SWETask], root: Path, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in (
        "env build (cold)", "reset (cold)", "reset (cached)", "grading", "bash", "editor",
        "step 1-20", "step 101-120", "oracle rollout")}
    backend = create_backend(kind, node=f"bench-swe-{uuid.uuid4().hex[:6]}", root_dir=root / kind)
    owner = {LABEL_OWNER: "bench-swe"}
    try:
        base = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
        cache = SetupCache(backend, root / kind / "setup-cache")
        runtime = WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=base, setup_cache=cache)
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
        await cache.clear()
    finally:
        for info in await backend.list():
            await backend.destroy(info.id)
        await backend.aclose()
    return out


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
        for kind in kinds:
            results[kind] = asyncio.run(bench_backend(kind, tasks, Path(tmp), args.steps))
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
        print(f"| SWE-ReX (local) | " + " | ".join("—" if r not in ("bash",) else f"{ms(swerex['exec']):.1f}"
                                                  for r in rows) + " | — |")
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

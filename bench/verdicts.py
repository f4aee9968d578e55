"""What a verdict computed from the image's own tools costs, against the fork the verifier used to run in.

Run with ``.venv/bin/python bench/verdicts.py [--runs 10]`` as root after ``bash .ci/bootstrap``.
Each row is a median in milliseconds over ``--runs`` episodes, every one reset afresh and given
the same work before the timed part:

- ``fork baseline``: what verification cost before (a snapshot with the shell's state, a fork
  of it that joins the agent's network, ``bash /tests/test.sh`` there, the reward read);
- ``verdict``: ``TerminalEnv`` verification as it is now (the agent's exports read, a files-only
  snapshot, the host-side diff against the image, the tamper scan, a fork with the verifier's
  paths put back and no shell state, the same test);
- ``diff + scan``: the host-side part of it alone (:func:`sandboxes.layers.diff` and
  :func:`workers.envs.tamper.scan_filesystem`).

Workloads: ``small`` (one file in /app) and ``install`` (what a pip install leaves:
``--files`` new files under site-packages, plus the bytecode caches of the image's Python
put back silently). The ratio column is verdict / fork baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
from sandboxes.base import LABEL_OWNER  # noqa: E402
from sandboxes.images import DEFAULT_IMAGE_CACHE, ensure_base_image  # noqa: E402
from sandboxes.layers import diff  # noqa: E402
from workers.envs.tamper import scan_filesystem  # noqa: E402
from workers.envs.terminal.env import TerminalEnv  # noqa: E402
from workers.envs.terminal.task import load_task_files  # noqa: E402

TASK = load_task_files("bench-verdicts", {
    "instruction.md": b"Write /app/answer.txt.\n",
    "task.toml": b"[agent]\ntimeout_sec = 600\n",
    "environment/Dockerfile": b"FROM debian:bookworm\nWORKDIR /app\n",
    "tests/test.sh": b"#!/bin/bash\nmkdir -p /logs/verifier\n"
                     b"if grep -q 42 /app/answer.txt; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
})


def workload(kind: str, files: int) -> str:
    if kind == "small":
        return "echo 42 > /app/answer.txt"
    site = "/usr/local/lib/python3.11/dist-packages/benchpkg"
    return (f"echo 42 > /app/answer.txt && mkdir -p {site} && cd {site} && "
            f"for i in $(seq {files}); do echo \"x = $i\" > m$i.py; done && "
            "python3 -c 'import json, email.mime.text, http.client' && cd /app")


async def fork_baseline(env: TerminalEnv) -> float:
    """The verification of before: a fork of the agent's sandbox with its shell state, the tests run there."""
    backend, sid = env.backend, env._sandbox_id()
    t = time.perf_counter()
    snap = await backend.snapshot(sid, metadata={"forkyard.bench": "baseline"})
    spec = dataclasses.replace(env._spec(), network_of=sid)
    [fork] = await backend.restore(snap, 1, spec=spec)
    try:
        await backend.exec(fork.id, "rm -rf /tests /logs/verifier && mkdir -p /logs/verifier && id -u", timeout_s=30)
        for rel, data in TASK.test_files.items():
            await backend.write_file(fork.id, f"/tests/{rel}", data, mode=0o755)
        await backend.exec(fork.id, env._verifier_command("/tests/test.sh"), timeout_s=60)
        await backend.read_file(fork.id, "/logs/verifier/reward.txt")
        return time.perf_counter() - t
    finally:
        await backend.destroy(fork.id)
        await backend.delete_snapshot(snap.id)


async def host_part(env: TerminalEnv) -> float:
    """The host-side diff and scan alone (on a files-only snapshot taken outside the timing)."""
    backend = env.backend
    snap = await backend.snapshot(env._sandbox_id(), shell_state=False)
    try:
        top, base = await backend.filesystem(snap), await backend.filesystem(env.image)
        t = time.perf_counter()
        changes = await asyncio.to_thread(diff, base, top)
        scan_filesystem(changes, top=top, base=base, context=env._verifier_context())
        return time.perf_counter() - t
    finally:
        await backend.delete_snapshot(snap.id)


async def bench_backend(kind: str, runs: int, files: int) -> list[tuple[str, str, float, float, float]]:
    from workers.dockerfile import build_task_image

    root = Path(tempfile.mkdtemp(prefix="forkyard-bench-verdicts-"))
    backend = create_backend(kind, node=f"bench-verdicts-{uuid.uuid4().hex[:6]}", root_dir=root)
    rows = []
    try:
        base = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
        image = await build_task_image(backend, dockerfile=TASK.dockerfile or "", context={}, base_image=base,
                                       labels={LABEL_OWNER: "bench"})
        for load in ("small", "install"):
            timings: dict[str, list[float]] = {"baseline": [], "verdict": [], "host": []}
            for _ in range(runs):
                for what in ("baseline", "verdict", "host"):
                    env = TerminalEnv(TASK, backend, image=image, labels={LABEL_OWNER: "bench"})
                    try:
                        await env.reset()
                        await backend.exec(env._sandbox_id(), workload(load, files), timeout_s=600)
                        if what == "baseline":
                            timings[what].append(await fork_baseline(env))
                        elif what == "host":
                            timings[what].append(await host_part(env))
                        else:
                            t = time.perf_counter()
                            verdict = await env._verify()
                            timings[what].append(time.perf_counter() - t)
                            assert verdict.reward == 1.0 and not verdict.tamper, (verdict.reward, verdict.tamper)
                    finally:
                        await env.close()
            med = {k: statistics.median(v) * 1000 for k, v in timings.items()}
            rows.append((kind, load, med["baseline"], med["verdict"], med["host"]))
        await backend.remove_image(image)
    finally:
        for info in await backend.list():
            await backend.destroy(info.id)
        await backend.aclose()
        shutil.rmtree(root, ignore_errors=True)
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--files", type=int, default=3000, help="files the install workload adds")
    args = parser.parse_args()
    kinds = ["local"] + (["docker"] if docker_available() else [])
    print(f"verification, median ms over {args.runs} episodes (install: {args.files} files)")
    print(f"{'backend':8} {'workload':8} {'fork baseline':>14} {'verdict':>9} {'ratio':>6} {'diff + scan':>12}")
    for kind in kinds:
        for backend, load, baseline, verdict, host in await bench_backend(kind, args.runs, args.files):
            print(f"{backend:8} {load:8} {baseline:14.1f} {verdict:9.1f} {verdict / baseline:6.2f} {host:12.1f}")


if __name__ == "__main__":
    asyncio.run(main())

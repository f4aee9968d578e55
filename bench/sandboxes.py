"""Sandbox latency: create, exec, file write, snapshot, fork, destroy on every backend vs. baselines.

Run with ``.venv/bin/python bench/sandboxes.py [--runs 50]`` as root after
``bash .ci/bootstrap``. All measurements come from the same run:

- ``local (crun)``, ``local (runc)``, ``local (gvisor)``: the local backend under each OCI
  runtime installed here (the spec is the same; gVisor where ``runsc`` exists), and
  ``docker``: the Forkyard backends (one persistent shell per sandbox);
- ``docker CLI``: raw ``docker run --rm`` / ``docker exec`` (the engine's own floor);
- ``SWE-ReX``: its local deployment, a bash session, ``echo hi`` (the peer baseline),
  installed only in ``bench/.venv-swerex`` (created on first use).

Prints p50 and p95 in milliseconds and ratios against the baselines. ``fork`` is the
time per branch of one ``restore(snapshot, 8)``, ``fork n=1`` one ``restore(snapshot, 1)``
right after the previous sandbox operation, ``fork n=1 idle`` one after 50 ms in which no
sandbox started (how a lone fork arrives in a gateway: a start that follows others closely
is cheaper, see ``sandboxes.cgroups.favor_dynamic_moves``).
``local (crun), seccomp compiled per start`` is the local backend before it reused the
filter crun compiled for its first sandbox (the baseline of that change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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
from sandboxes.images import DEFAULT_IMAGE_CACHE, ensure_base_image  # noqa: E402

SWEREX_VENV = ROOT / "bench" / ".venv-swerex"


def pct(values: list[float], q: float) -> float:
    """Return the q-quantile of ``values`` in milliseconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx] * 1000


FORK_BRANCHES = 8
#: The pause before a ``fork n=1 idle``.
IDLE_S = 0.05


async def bench_backend(
    kind: str, runs: int, root: Path, *, isolation: str = "standard", runtime: str | None = None,
    compile_seccomp: bool = False,
) -> dict[str, list[float]]:
    """Time the backend contract operations ``runs`` times each.

    ``compile_seccomp``: the baseline of the compiled-filter reuse (local, crun): every
    start has crun compile the seccomp profile, as before the reuse.
    """
    backend = create_backend(kind, node="bench", root_dir=root / f"{kind}-{runtime or isolation}-{compile_seccomp}",
                             isolation=isolation, runtime=runtime)
    if compile_seccomp:
        backend._seccomp.enabled = False
    image = await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)
    spec = SandboxSpec(image=image)
    out: dict[str, list[float]] = {"create": [], "exec": [], "write": [], "snapshot": [], "fork": [], "fork n=1": [],
                                   "fork n=1 idle": [], "destroy": []}
    try:
        warm = await backend.create(spec)
        await backend.destroy(warm.id)
        for _ in range(runs):
            t = time.perf_counter()
            info = await backend.create(spec)
            out["create"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await backend.destroy(info.id)
            out["destroy"].append(time.perf_counter() - t)
        info = await backend.create(spec)
        try:
            for _ in range(5):
                await backend.exec(info.id, "echo hi")
            for _ in range(runs):
                t = time.perf_counter()
                r = await backend.exec(info.id, "echo hi")
                out["exec"].append(time.perf_counter() - t)
                assert r.stdout == "hi\n", r
            payload = b"x" * 1024
            for i in range(runs):
                t = time.perf_counter()
                await backend.write_file(info.id, f"/tmp/bench-{i}", payload)
                out["write"].append(time.perf_counter() - t)
            for i in range(max(runs // 5, 3)):
                # A 1 MB change since the last snapshot (the previous one removed).
                await backend.exec(info.id, f"rm -f /tmp/snap-*; head -c 1048576 /dev/urandom > /tmp/snap-{i}")
                t = time.perf_counter()
                snap = await backend.snapshot(info.id)
                out["snapshot"].append(time.perf_counter() - t)
                t = time.perf_counter()
                branches = await backend.restore(snap, FORK_BRANCHES)
                out["fork"].append((time.perf_counter() - t) / FORK_BRANCHES)
                for branch in branches:
                    await backend.destroy(branch.id)
                t = time.perf_counter()
                (branch,) = await backend.restore(snap, 1)
                out["fork n=1"].append(time.perf_counter() - t)
                await backend.destroy(branch.id)
                await asyncio.sleep(IDLE_S)
                t = time.perf_counter()
                (branch,) = await backend.restore(snap, 1)
                out["fork n=1 idle"].append(time.perf_counter() - t)
                await backend.destroy(branch.id)
                await backend.delete_snapshot(snap.id)
        finally:
            await backend.destroy(info.id)
    finally:
        await backend.aclose()
    return out


def bench_docker_cli(image: str, runs: int) -> dict[str, list[float]]:
    """Time raw ``docker run`` and ``docker exec`` through the CLI."""
    out: dict[str, list[float]] = {"create": [], "exec": [], "write": [], "destroy": []}
    docker = shutil.which("docker")
    if docker is None:
        return out
    for _ in range(max(runs // 2, 10)):
        t = time.perf_counter()
        subprocess.run([docker, "run", "--rm", "--network", "none", image, "true"], check=True, capture_output=True)
        out["create"].append(time.perf_counter() - t)
    cid = subprocess.run(
        [docker, "run", "-d", "--network", "none", image, "sleep", "3600"], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        for _ in range(runs):
            t = time.perf_counter()
            subprocess.run([docker, "exec", cid, "echo", "hi"], check=True, capture_output=True)
            out["exec"].append(time.perf_counter() - t)
        for i in range(max(runs // 2, 10)):
            t = time.perf_counter()
            subprocess.run(
                [docker, "exec", "-i", cid, "sh", "-c", f"cat > /tmp/f{i}"], input=b"x" * 1024, check=True
            )
            out["write"].append(time.perf_counter() - t)
    finally:
        t = time.perf_counter()
        subprocess.run([docker, "rm", "-f", cid], check=True, capture_output=True)
        out["destroy"].append(time.perf_counter() - t)
    return out


def bench_swerex(runs: int) -> dict[str, list[float]]:
    """Time SWE-ReX in its own virtualenv (created on first use)."""
    py = SWEREX_VENV / "bin" / "python"
    if not py.exists():
        print("installing swe-rex into bench/.venv-swerex ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(SWEREX_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "swe-rex==1.4.*"], check=True)
    proc = subprocess.run(
        [str(py), str(ROOT / "bench" / "_swerex_probe.py"), str(runs)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return {}
    # SWE-ReX logs to stdout too; the probe's result is the one JSON line.
    data = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
    return {"create": data["create"], "exec": data["exec"], "write": data["write"], "destroy": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--skip-swerex", action="store_true")
    args = parser.parse_args()

    from sandboxes.errors import BackendUnavailableError
    from sandboxes.oci import RUNTIMES

    results: dict[str, dict[str, list[float]]] = {}
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="forkyard-bench-") as tmp:
        for isolation, names in RUNTIMES.items():
            for name in names:
                label = f"local ({name})" if isolation == "standard" else f"local ({isolation})"
                try:
                    results[label] = asyncio.run(
                        bench_backend("local", args.runs, Path(tmp), isolation=isolation, runtime=name)
                    )
                except BackendUnavailableError as exc:
                    skipped.append(f"{label}: {exc}")
                if name == "crun" and label in results:  # the baseline of reusing crun's compiled filter
                    results["local (crun), seccomp compiled per start"] = asyncio.run(
                        bench_backend("local", args.runs, Path(tmp), runtime=name, compile_seccomp=True))
        if docker_available():
            results["docker"] = asyncio.run(bench_backend("docker", args.runs, Path(tmp)))
            from sandboxes.images import base_image_ref

            results["docker CLI"] = bench_docker_cli(base_image_ref(), args.runs)
    if not args.skip_swerex:
        results["SWE-ReX"] = bench_swerex(args.runs)

    ops = ["create", "exec", "write", "snapshot", "fork", "fork n=1", "fork n=1 idle", "destroy"]
    print(f"# bench/sandboxes.py — {time.strftime('%Y-%m-%d')} — {platform.node()} "
          f"({os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}), runs={args.runs}")
    print()
    print("| backend | " + " | ".join(f"{op} p50 / p95 (ms)" for op in ops) + " |")
    print("|---|" + "---|" * len(ops))
    for name, data in results.items():
        cells = []
        for op in ops:
            v = data.get(op, [])
            cells.append(f"{pct(v, 0.5):.2f} / {pct(v, 0.95):.2f}" if v else "—")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for line in skipped:
        print(f"\nnot measured: {line}")
    print()
    print("Ratios (baseline p50 / Forkyard p50; >1 means Forkyard is faster):")
    for ours in [k for k in results if k.startswith("local") or k == "docker"]:
        if ours not in results:
            continue
        for base in ("docker CLI", "SWE-ReX", "docker"):
            if base == ours:
                continue
            if not results.get(base):
                continue
            parts = []
            for op in ("create", "exec", "write", "snapshot", "fork"):
                a, b = results[ours].get(op), results[base].get(op)
                if a and b:
                    parts.append(f"{op} {statistics.median(b) / statistics.median(a):.1f}x")
            print(f"- {ours} vs {base}: " + ", ".join(parts))
    before, after = results.get("local (crun), seccomp compiled per start"), results.get("local (crun)")
    if before and after:
        parts = [f"{op} {statistics.median(before[op]) / statistics.median(after[op]):.2f}x"
                 for op in ("create", "fork", "fork n=1", "fork n=1 idle") if before.get(op) and after.get(op)]
        print("- local (crun) vs the same compiling its seccomp profile at every start: " + ", ".join(parts))


if __name__ == "__main__":
    main()

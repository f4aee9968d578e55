"""Rollouts: episodes/minute, stream delivery throughput, gateway overhead per policy turn.

Run with ``.venv/bin/python bench/rollouts.py`` as root after ``bash .ci/bootstrap``
(and ``bash .ci/vllm`` for the policy-turn part). Everything runs against one real
``forkyard up --backend local`` on 127.0.0.1 with a temporary data dir; every
comparison is against a baseline measured in the same run:

1. Episodes/minute with the ``scripted`` oracle policy at 1, 8 and 32 concurrent
   episodes (timed from ``rollouts.create`` until the SDK stream has delivered every
   episode; task images are built by a warm-up rollout first). Baseline: concurrency 1.
2. Stream delivery: finished episodes of ~4 KB and ~64 KB (training-view JSON), written
   straight into the gateway's database through the episode services, then received
   with ``client.rollouts.stream(..., batch_size=32)`` and acked. Baselines: the same
   episodes through ``client.rollouts.pull`` batches of 32 (acked), and through
   ``GET /v1/episodes/{id}/training`` one by one.
3. Gateway overhead per policy turn: a ``tokens``-policy rollout against a real vLLM
   CPU server on a tiny random model; then the same ``/inference/v1/generate`` requests
   (same token ids and sampling parameters, same order, prefix cache reset before each
   pass) sent straight to vLLM with httpx. Baseline: vLLM direct.

Prints medians (and p95 where there are enough samples) and ratios; asserts no timing.
Everything it starts (gateway, vLLM server, temp dirs, their sandboxes) is stopped and
removed at the end, on errors and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx

import forkyard
from tests.live import LiveGateway, run_gateway

TASKS_DIR = ROOT / "examples" / "tasks" / "terminal"
#: The example tasks the episodes/minute part runs (quick oracles, different images).
THROUGHPUT_TASKS = ("backup-archive", "count-log-errors", "edit-config", "word-frequency")
#: The task the policy-turn part runs (random tokens never form a tool call: the env step is an error string).
OVERHEAD_TASK = "edit-config"
ORACLE = {"name": "bench-oracle", "api": "scripted", "model": "oracle"}
#: Nominal training-view sizes of the stream part, in bytes.
STREAM_SIZES = {"4 KB": 4 * 1024, "64 KB": 64 * 1024}
STREAM_TURNS = 4
STREAM_BATCH = 32
OVERHEAD_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "seed": 0}


# -- helpers -------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Return the q-quantile of ``values`` (nearest rank), NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def med(values: Sequence[float]) -> float:
    """Return the median of ``values``, NaN when empty."""
    return statistics.median(values) if values else float("nan")


def log(message: str) -> None:
    """Print progress to stderr (stdout holds only the report)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def float32(value: float) -> float:
    """Return ``value`` rounded to float32, as a server's logprob would be."""
    return struct.unpack("f", struct.pack("f", value))[0]


def machine_line() -> str:
    """Return cores, architecture, memory and kernel of this machine."""
    mem = ""
    try:
        kb = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores, {platform.machine()}{mem}, Linux {platform.release()}"


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def unmount_under(root: Path) -> None:
    """Lazily unmount whatever is still mounted under ``root`` (a gateway that died mid-episode)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    prefix = str(root.resolve()) + "/"
    points = []
    for line in lines:
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(prefix):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        log(f"unmounting leftover {point}")
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@contextmanager
def temp_root() -> Iterator[Path]:
    """Make a temp dir for the whole run; unmount leftovers under it and remove it at the end."""
    root = Path(tempfile.mkdtemp(prefix="forkyard-bench-rollouts-"))
    try:
        yield root
    finally:
        unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


def drain_stream(client: forkyard.Client, rollout_id: str, *, consumer: str, expected: int,
                 batch_size: int = STREAM_BATCH) -> int:
    """Receive and ack episodes from the SDK stream until ``expected`` arrived or the stream ends; return the count."""
    received = 0
    with client.rollouts.stream(rollout_id, consumer=consumer, batch_size=batch_size) as stream:
        for batch in stream:
            received += len(batch)
            batch.ack()
            if received >= expected:
                break
    return received


def episode_ids_of(client: forkyard.Client, rollout_id: str) -> list[str]:
    """Return the ids of a rollout's episodes, in creation order."""
    return [e.id for e in client.episodes.list(rollout_id=rollout_id, limit=200)]


# -- 1. episodes/minute ----------------------------------------------------------------------


def bench_episodes_per_minute(client: forkyard.Client, task_ids: list[str],
                              concurrencies: Sequence[int]) -> list[dict[str, Any]]:
    """Run one oracle rollout per concurrency level; return throughput and episode times."""
    log(f"warm-up: one episode of each of {len(task_ids)} tasks (builds their images)")
    warm = client.rollouts.create(
        tasks={"ids": task_ids}, group_size=1, policy=ORACLE, concurrency=len(task_ids),
        agent={"max_turns": 4}, limits={"episode_timeout_s": 600, "step_timeout_s": 120},
    )
    drain_stream(client, warm.id, consumer="warm", expected=len(task_ids))
    rows = []
    for c in concurrencies:
        total = max(8, 3 * c)
        group_size = math.ceil(total / len(task_ids))
        total = group_size * len(task_ids)
        log(f"episodes/minute: concurrency {c}, {total} episodes")
        t0 = time.perf_counter()
        rollout = client.rollouts.create(
            tasks={"ids": task_ids}, group_size=group_size, policy=ORACLE, concurrency=c,
            agent={"max_turns": 4}, limits={"episode_timeout_s": 600, "step_timeout_s": 120},
        )
        received = drain_stream(client, rollout.id, consumer="trainer", expected=total)
        elapsed = time.perf_counter() - t0
        totals, rewards = [], []
        for eid in episode_ids_of(client, rollout.id):
            detail = client.episodes.get(eid)
            if "total_s" in detail.timings:
                totals.append(float(detail.timings["total_s"]))
            rewards.append(detail.reward)
        solved = sum(1 for r in rewards if r == 1.0)
        rows.append({"concurrency": c, "episodes": received, "solved": solved, "elapsed_s": elapsed,
                     "per_min": received / elapsed * 60, "total_p50": med(totals), "total_p95": pct(totals, 0.95)})
        log(f"  {received} episodes in {elapsed:.1f}s ({received / elapsed * 60:.0f}/min), {solved} solved")
    return rows


# -- 2. stream delivery ----------------------------------------------------------------------


def _steps_for(n_tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    """Return STREAM_TURNS StepRecord-shaped dicts holding ``n_tokens`` tokens, half of them sampled."""
    per_turn = max(2, n_tokens // STREAM_TURNS)
    steps = []
    for i in range(STREAM_TURNS):
        prompt = [rng.randrange(1, 150_000) for _ in range(per_turn // 2)]
        completion = [rng.randrange(1, 150_000) for _ in range(per_turn - per_turn // 2)]
        steps.append({
            "index": i, "parent_index": i - 1 if i else None, "prompt_ids": prompt, "completion_ids": completion,
            "logprobs": [float32(-rng.random() * 5) for _ in completion], "weight_version": 0,
            "finish_reason": "stop", "text": f"turn {i}", "action": {"tool": "bash", "arguments": {"command": "ls"}},
            "parse_error": None, "observation": "[exit code 0]", "reward": None,
            "timings": {"policy_s": 0.01, "env_s": 0.01}, "server": "bench",
        })
    return steps


def _view_bytes(steps: list[dict[str, Any]]) -> int:
    """Return the compact JSON size of the training view these steps make (as the gateway sends it)."""
    input_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for s in steps:
        input_ids += s["prompt_ids"] + s["completion_ids"]
        loss_mask += [0] * len(s["prompt_ids"]) + [1] * len(s["completion_ids"])
        logprobs += s["logprobs"]
    view = {"episode_id": "ep_" + "0" * 26, "input_ids": input_ids, "loss_mask": loss_mask, "logprobs": logprobs,
            "reward": 1.0, "group_id": "grp_" + "0" * 26, "weight_versions": [0], "termination": "submitted",
            "status": "completed"}
    return len(json.dumps(view, separators=(",", ":")))


def tokens_for_size(target: int) -> int:
    """Return how many tokens per episode give a training view of about ``target`` bytes."""
    rng = random.Random(0)
    a, b = 400, 4000
    sa, sb = _view_bytes(_steps_for(a, rng)), _view_bytes(_steps_for(b, rng))
    per_token = (sb - sa) / (b - a)
    return max(8, round(a + (target - sa) / per_token))


async def _populate(database_url: str, task_ids: list[str], per_size: int, tokens: dict[str, int]) -> dict[str, str]:
    """Create one finished rollout per size straight in the gateway's database; return {size: rollout id}."""
    from sqlalchemy import select

    from gateway.db import create_engine, create_sessionmaker
    from gateway.episodes import service as episodes_service
    from gateway.episodes.models import Episode
    from gateway.rollouts import service as rollouts_service
    from gateway.rollouts.schemas import RolloutCreate

    engine = create_engine(database_url)
    sessionmaker = create_sessionmaker(engine)
    out: dict[str, str] = {}
    try:
        for label, n_tokens in tokens.items():
            group_size = math.ceil(per_size / len(task_ids))
            spec = RolloutCreate.model_validate({
                "tasks": {"ids": task_ids}, "group_size": group_size,
                "policy": {"name": "bench-stream", "api": "scripted"},
            })
            async with sessionmaker() as db:
                rollout = await rollouts_service.create_rollout(db_session=db, spec=spec)
                rollout_id = rollout.id
            async with sessionmaker() as db:
                ids = list((await db.scalars(select(Episode.id).where(Episode.rollout_id == rollout_id)
                                             .order_by(Episode.task_index, Episode.sample_index))).all())
            rng = random.Random(label)
            for eid in ids:
                steps = _steps_for(n_tokens, rng)
                async with sessionmaker() as db:
                    await episodes_service.mark_episode_running(db_session=db, episode_id=eid, node="bench-writer")
                    for step in steps:
                        await episodes_service.record_step(db_session=db, episode_id=eid, step=step)
                    await episodes_service.finish_episode(
                        db_session=db, episode_id=eid, status="completed", termination="submitted", reward=1.0,
                        messages=[{"role": "user", "content": "bench"}], timings={"total_s": 0.1},
                        weight_versions=[0],
                    )
            out[label] = rollout_id
    finally:
        await engine.dispose()
    return out


def _by_stream(client: forkyard.Client, rollout_id: str, ids: list[str], rep: int) -> int:
    """Receive every episode through the SDK's SSE stream (acked per batch); return the count."""
    return drain_stream(client, rollout_id, consumer=f"stream-{rep}", expected=len(ids))


def _by_pull(client: forkyard.Client, rollout_id: str, ids: list[str], rep: int) -> int:
    """Receive every episode through pull batches (acked per batch); return the count."""
    got = 0
    for _ in range(len(ids) // STREAM_BATCH + 20):  # bounded: enough pulls for every episode, plus slack
        batch = client.rollouts.pull(rollout_id, consumer=f"pull-{rep}", max_episodes=STREAM_BATCH)
        got += len(batch)
        batch.ack()
        if got >= len(ids) or batch.done:
            break
    return got


def _by_get(client: forkyard.Client, rollout_id: str, ids: list[str], rep: int) -> int:
    """Fetch every episode's training view with one GET each; return the count."""
    return sum(1 for eid in ids if client.episodes.training(eid).episode_id == eid)


def bench_stream(client: forkyard.Client, gw: LiveGateway, task_ids: list[str], per_size: int,
                 repeats: int) -> list[dict[str, Any]]:
    """Time stream, pull and one-by-one GET delivery of finished episodes of each size."""
    tokens = {label: tokens_for_size(target) for label, target in STREAM_SIZES.items()}
    log(f"stream: writing {per_size} finished episodes per size ({tokens} tokens each) into the gateway DB")
    rollouts = asyncio.run(_populate(f"sqlite:///{gw.data_dir / 'forkyard.db'}", task_ids, per_size, tokens))
    rows = []
    headers = {"Authorization": f"Bearer {gw.api_key}"}
    with httpx.Client(base_url=gw.url, headers=headers, timeout=120) as raw:
        for label, rollout_id in rollouts.items():
            ids = episode_ids_of(client, rollout_id)
            n = len(ids)
            sizes = [len(raw.get(f"/v1/episodes/{eid}/training").content) for eid in ids[:20]]
            size = med(sizes)
            times: dict[str, list[float]] = {"stream": [], "pull": [], "get": []}
            ways = [("stream", _by_stream), ("pull", _by_pull), ("get", _by_get)]
            for rep in range(repeats):
                log(f"stream: {label} x {n}, pass {rep + 1}/{repeats}")
                # Rotate the order each pass so no way always runs first (or right after another).
                for how, way in ways[rep % 3:] + ways[:rep % 3]:
                    t = time.perf_counter()
                    got = way(client, rollout_id, ids, rep)
                    times[how].append(time.perf_counter() - t)
                    assert got == n, f"{how} delivered {got} of {n} episodes"
            row = {"label": label, "episodes": n, "tokens": tokens[label], "bytes": size}
            for how, values in times.items():
                row[how] = n / med(values)  # episodes/s, median pass
            rows.append(row)
    return rows


# -- 3. gateway overhead per policy turn -------------------------------------------------------


def bench_overhead(client: forkyard.Client, task_id: str, root: Path, episodes: int,
                   replays: int) -> dict[str, Any]:
    """Run a tokens-policy rollout against a real vLLM server, then replay its calls straight to vLLM."""
    from tests.policy.vllm_server import start_vllm_server, stop_vllm_server
    from workers.policy.base import Sampling
    from workers.policy.tiny_model import build_tiny_model
    from workers.policy.tokens import GENERATE_PATH, sampling_params

    log("overhead: building the tiny model and starting vLLM (CPU)")
    model_dir = build_tiny_model(root / "tiny-model", seed=0)
    server = start_vllm_server(model_dir, log_path=root / "vllm" / "server.log")
    try:
        log(f"overhead: vLLM up after {server.startup_s:.0f}s")
        policy = {"name": "bench-tiny", "api": "tokens", "base_urls": [server.base_url], "model": server.model,
                  "tokenizer": str(model_dir), "sampling": OVERHEAD_SAMPLING}
        settings = {"agent": {"max_turns": 4}, "limits": {"episode_timeout_s": 300, "step_timeout_s": 120}}
        vllm = httpx.Client(base_url=server.base_url, timeout=120)
        try:
            # Warm-up (first calls of a fresh server are slow), then an empty prefix cache for each pass.
            warm = client.rollouts.create(tasks={"ids": [task_id]}, group_size=1, policy=policy, concurrency=1,
                                          **settings)
            drain_stream(client, warm.id, consumer="warm", expected=1)
            vllm.post("/reset_prefix_cache").raise_for_status()
            log(f"overhead: {episodes} episodes x 4 turns through the gateway")
            rollout = client.rollouts.create(tasks={"ids": [task_id]}, group_size=episodes, policy=policy,
                                             concurrency=1, **settings)
            drain_stream(client, rollout.id, consumer="trainer", expected=episodes)
            infos = sorted(client.episodes.list(rollout_id=rollout.id), key=lambda e: e.started_at)
            details = [client.episodes.get(e.id, tokens=True) for e in infos]

            per_turn, policy_s, calls = [], [], []
            for d in details:
                turns = len(d.steps)
                env = sum(float(s.timings.get("env_s", 0.0)) for s in d.steps)
                if turns and "agent_s" in d.timings:
                    per_turn.append((float(d.timings["agent_s"]) - env) / turns)
                context: list[int] = []
                for s in d.steps:
                    policy_s.append(float(s.timings["policy_s"]))
                    prompt = context + list(s.prompt_ids or [])
                    calls.append((prompt, list(s.completion_ids or [])))
                    context = prompt + list(s.completion_ids or [])

            body_params = sampling_params(Sampling.from_dict(OVERHEAD_SAMPLING))
            direct: list[list[float]] = [[] for _ in calls]
            same = 0
            for rep in range(replays):
                log(f"overhead: replaying {len(calls)} calls straight to vLLM, pass {rep + 1}/{replays}")
                vllm.post("/reset_prefix_cache").raise_for_status()
                for i, (prompt, completion) in enumerate(calls):
                    body = {"request_id": f"bench-direct-{rep}-{i}", "token_ids": prompt,
                            "sampling_params": body_params, "output_mode": "tokens", "model": server.model}
                    t = time.perf_counter()
                    response = vllm.post(GENERATE_PATH, json=body)
                    direct[i].append(time.perf_counter() - t)
                    response.raise_for_status()
                    if rep == 0 and response.json()["choices"][0]["token_ids"] == completion:
                        same += 1
        finally:
            vllm.close()
    finally:
        stop_vllm_server(server)
    direct_calls = [med(v) for v in direct]  # per call: median over the replay passes
    return {"episodes": len(details), "calls": len(calls), "reproduced": same, "replays": replays,
            "direct": direct_calls, "policy_s": policy_s, "per_turn": per_turn}


# -- report ------------------------------------------------------------------------------------


def report(args: argparse.Namespace, epm: list[dict[str, Any]] | None, stream: list[dict[str, Any]] | None,
           overhead: dict[str, Any] | None) -> None:
    """Print the markdown report."""
    ms = 1000.0
    print(f"# bench/rollouts.py — {time.strftime('%Y-%m-%d')} — {platform.node()} ({machine_line()}), "
          f"backend local")
    if epm:
        print()
        print("Episodes/minute, `scripted` oracle policy (bash running solve.sh, then submit + verifier), "
              f"{len(THROUGHPUT_TASKS)} tasks, timed from `rollouts.create` to the last episode out of the SDK stream:")
        print()
        base = epm[0]["per_min"]
        print(f"| concurrency | episodes | wall (s) | episodes/min | vs c={epm[0]['concurrency']} | "
              "episode total p50 / p95 (s) |")
        print("|---|---|---|---|---|---|")
        for r in epm:
            print(f"| {r['concurrency']} | {r['episodes']} ({r['solved']} solved) | {r['elapsed_s']:.1f} | "
                  f"{r['per_min']:.0f} | {r['per_min'] / base:.2f}x | {r['total_p50']:.2f} / {r['total_p95']:.2f} |")
    if stream:
        print()
        print(f"Stream delivery (episodes/s into the SDK, acked, batches of {STREAM_BATCH}; median of "
              f"{args.stream_repeats} passes):")
        print()
        print("| episode (training JSON) | episodes | SSE stream (ep/s, MB/s) | pull batches (ep/s, MB/s) | "
              "GET one by one (ep/s) | stream vs pull | stream vs GET |")
        print("|---|---|---|---|---|---|---|")
        for r in stream:
            mb = r["bytes"] / 1e6
            print(f"| {r['label']} ({r['bytes'] / 1024:.1f} KB, {r['tokens']} tokens) | {r['episodes']} | "
                  f"{r['stream']:.0f}, {r['stream'] * mb:.1f} | {r['pull']:.0f}, {r['pull'] * mb:.1f} | "
                  f"{r['get']:.0f} | "
                  f"{r['stream'] / r['pull']:.2f}x | {r['stream'] / r['get']:.2f}x |")
    if overhead:
        o = overhead
        d, p, t = o["direct"], o["policy_s"], o["per_turn"]
        print()
        print(f"Gateway overhead per policy turn (tokens api, tiny model on vLLM CPU, max_tokens 16; "
              f"{o['episodes']} episodes x 4 turns = {o['calls']} calls, concurrency 1; the direct replay sends "
              f"the same token ids and sampling parameters, median of {o['replays']} passes per call, "
              f"{o['reproduced']}/{o['calls']} completions reproduced exactly):")
        print()
        print("| measure | p50 (ms) | p95 (ms) | n |")
        print("|---|---|---|---|")
        print(f"| vLLM direct (`POST /inference/v1/generate`, httpx) | {med(d) * ms:.1f} | {pct(d, 0.95) * ms:.1f} "
              f"| {len(d)} |")
        print(f"| gateway policy call (step `policy_s`) | {med(p) * ms:.1f} | {pct(p, 0.95) * ms:.1f} | {len(p)} |")
        print(f"| gateway turn, env step excluded ((agent_s - Σ env_s) / turns) | {med(t) * ms:.1f} | "
              f"{pct(t, 0.95) * ms:.1f} | {len(t)} |")
        print()
        print(f"Overhead (p50 vs vLLM direct): policy call +{(med(p) - med(d)) * ms:.1f} ms "
              f"({med(p) / med(d):.2f}x); whole turn +{(med(t) - med(d)) * ms:.1f} ms ({med(t) / med(d):.2f}x).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--stream-episodes", type=int, default=200, help="finished episodes per size")
    parser.add_argument("--stream-repeats", type=int, default=5)
    parser.add_argument("--overhead-episodes", type=int, default=16)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["episodes", "stream", "overhead"])
    args = parser.parse_args()

    if "overhead" not in args.skip:
        from tests.policy.vllm_server import VLLMServerError, vllm_python

        try:
            vllm_python()
        except VLLMServerError as exc:
            parser.exit(2, f"bench/rollouts.py: {exc}, or pass --skip overhead\n")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    epm = stream = overhead = None
    started = time.monotonic()
    with ExitStack() as stack:
        root = stack.enter_context(temp_root())
        log(f"starting forkyard up --backend local in {root}")
        gw = stack.enter_context(run_gateway("local", root / "gateway", node=f"bench-{uuid.uuid4().hex[:8]}"))
        client = stack.enter_context(forkyard.Client(base_url=gw.url, api_key=gw.api_key, timeout=300))
        tasks = {t.name: t.id for t in client.tasks.import_dir(TASKS_DIR)}
        task_ids = [tasks[name] for name in THROUGHPUT_TASKS]
        if "episodes" not in args.skip:
            epm = bench_episodes_per_minute(client, task_ids, args.concurrency)
        if "stream" not in args.skip:
            stream = bench_stream(client, gw, task_ids, args.stream_episodes, args.stream_repeats)
        if "overhead" not in args.skip:
            overhead = bench_overhead(client, tasks[OVERHEAD_TASK], root, args.overhead_episodes, args.replays)
        log("stopping the gateway")
    log(f"done in {time.monotonic() - started:.0f}s")
    report(args, epm, stream, overhead)


if __name__ == "__main__":
    main()

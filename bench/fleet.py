"""The distributed mode against the embedded one: step latency, dispatch latency, throughput by workers.

Run with ``.venv/bin/python bench/fleet.py [--steps 200] [--episodes 32] </dev/null`` as root
after ``bash .ci/bootstrap`` (PostgreSQL on 127.0.0.1:5432; a private redis-server is
started). Everything comes from the same run, on the local backend:

- ``step``: ``POST /v1/sessions/{id}/step`` of a command printing 1 KB, p50 over
  ``--steps`` steps: through an embedded ``forkyard up`` (the sandbox in the gateway's
  process; on SQLite, its default, and on PostgreSQL, the fleet's database) vs. through a
  ``forkyard gateway`` to the ``forkyard worker`` that owns the
  sandbox (one more hop, over the node channel); and the same step over the
  trainer's gRPC channel (``Sessions.Attach``) of each. The embedded gateway on PostgreSQL
  and the fleet run side by side and their sessions are stepped in turn; the hop is the
  median of the step-by-step differences;
- ``node call``: the bare round trip of the node channel (a call that touches no sandbox
  and no database) from a client on asyncio's loop and on uvloop's (the gateways' and the
  nodes' loop);
- ``dispatch``: a rollout's creation to its (only) episode starting, p50 over 10 rollouts
  of one episode that submits at once: the embedded dispatcher vs. the fleet scheduler,
  a Celery job over Redis and the node's claim;
- ``throughput``: oracle episodes per minute of one rollout of ``--episodes`` episodes
  (the terminal example tasks × groups of 8) with 1, 2 and 3 workers of capacity 4, and
  the embedded gateway at the same concurrency as the baseline.

- ``pool``: a warm pool claim against a cold sandbox on docker and local (``bench/pool.py``).

Workers pool by default (up to their capacity idle), so the throughput rows include the
pools: the fills compete with the episodes for this machine's cores. The step rows wait for
the pools to settle after the session's claim (no fill runs while steps are timed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pool import measure_all, report  # noqa: E402
from bench.sessions import Gateway, command, med_ms  # noqa: E402
from tests.e2e.test_terminal_tasks import TASK_NAMES, TASKS_DIR  # noqa: E402
from tests.fleet import fleet, postgres_database  # noqa: E402

ORACLE = {"name": "oracle", "api": "scripted", "model": "oracle"}
SUBMIT = {"name": "submit", "api": "scripted", "model": "x", "actions": [{"tool": "submit", "arguments": {}}]}
#: The issue's target: the hop to a node adds at most this at p50.
TARGET_ADDED_MS = 0.5
#: The nodes' heartbeat in this bench (their load, pools included, is as fresh as it).
HEARTBEAT_S = 1.0


def import_tasks(http: httpx.Client) -> dict[str, str]:
    tasks = []
    for name in TASK_NAMES:
        root = TASKS_DIR / name
        tasks.append({"name": name, "files": {str(p.relative_to(root)): p.read_text()
                                              for p in sorted(root.rglob("*")) if p.is_file()}})
    r = http.post("/v1/tasks", json={"tasks": tasks})
    r.raise_for_status()
    return {t["name"]: t["id"] for t in r.json()["items"]}


def settle_pools(http: httpx.Client, timeout_s: float = 30.0) -> None:
    """Wait until no node's warm pool is filling, so no fill competes with the steps measured next.

    Opening a session is a claim: the node's pool then starts sandboxes for the next one,
    which takes the cores for a second or so. The embedded gateway pools nothing.
    """
    time.sleep(HEARTBEAT_S * 1.5)  # the claim's fills show in the next heartbeat's load
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pools = [n["load"].get("pool") or {} for n in http.get("/v1/nodes").raise_for_status().json()["items"]]
        if all(not p.get("filling") and all(k["idle"] >= k["target"] for k in p.get("by_key", ()))
               for p in pools):
            return
        time.sleep(0.5)


def paired_rest_steps(sides: list[tuple[httpx.Client, str]], steps: int) -> list[list[float]]:
    """Step one session on each side in turn (a, b, a, b...), so a stall of this machine hits both alike."""
    sids = [http.post("/v1/sessions", json={"task_id": task_id}).raise_for_status().json()["id"]
            for http, task_id in sides]
    for http, _ in sides:
        settle_pools(http)
    body = {"action": {"tool": "bash", "arguments": {"command": command(1024)}}}
    times: list[list[float]] = [[] for _ in sides]
    for _ in range(steps + 10):
        for (http, _), sid, out in zip(sides, sids, times, strict=True):
            started = time.perf_counter()
            http.post(f"/v1/sessions/{sid}/step", json=body).raise_for_status()
            out.append(time.perf_counter() - started)
    for (http, _), sid in zip(sides, sids, strict=True):
        http.delete(f"/v1/sessions/{sid}")
    return [t[10:] for t in times]


async def paired_grpc_steps(sides: list[tuple[str, str, str]], steps: int) -> list[list[float]]:
    """As :func:`paired_rest_steps` over each side's ``Sessions.Attach`` (``sides``: address, key, session)."""
    import grpc

    from gateway.grpc.codegen import modules

    pb2, pb2_grpc = modules()
    args = json.dumps({"command": command(1024)})
    times: list[list[float]] = [[] for _ in sides]
    channels = [grpc.aio.insecure_channel(address) for address, _, _ in sides]
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in sides]

    async def requests(queue: asyncio.Queue):
        while (item := await queue.get()) is not None:
            yield item

    try:
        calls = [pb2_grpc.SessionsStub(channel).Attach(requests(queue), metadata=(
                    ("authorization", f"Bearer {key}"), ("x-forkyard-session", sid)))
                 for channel, queue, (_, key, sid) in zip(channels, queues, sides, strict=True)]
        for seq in range(steps + 10):
            for call, queue, out in zip(calls, queues, times, strict=True):
                started = time.perf_counter()
                await queue.put(pb2.StepRequest(seq=seq, tool="bash", arguments_json=args))
                reply = await call.read()
                assert not reply.HasField("error"), reply.error
                out.append(time.perf_counter() - started)
    finally:
        for queue in queues:
            await queue.put(None)
        for channel in channels:
            await channel.close()
    return [t[10:] for t in times]


def paired_grpc_session_steps(sides: list[tuple[httpx.Client, str, str, str]], steps: int) -> list[list[float]]:
    """``sides``: (http, grpc address, key, task id) of each gateway."""
    sids = [http.post("/v1/sessions", json={"task_id": task_id}).raise_for_status().json()["id"]
            for http, _, _, task_id in sides]
    for http, *_ in sides:
        settle_pools(http)
    try:
        return asyncio.run(paired_grpc_steps(
            [(address, key, sid) for (_, address, key, _), sid in zip(sides, sids, strict=True)], steps))
    finally:
        for (http, *_), sid in zip(sides, sids, strict=True):
            http.delete(f"/v1/sessions/{sid}")


def paired_added_ms(base: list[float], other: list[float]) -> float:
    """The median of the step-by-step differences (``other`` minus ``base``), in ms."""
    return med_ms([b - a for a, b in zip(base, other, strict=True)])


def rest_steps(http: httpx.Client, task_id: str, steps: int) -> list[float]:
    return paired_rest_steps([(http, task_id)], steps)[0]


def grpc_session_steps(http: httpx.Client, address: str, key: str, task_id: str, steps: int) -> list[float]:
    return paired_grpc_session_steps([(http, address, key, task_id)], steps)[0]


async def node_calls(database_url: str, node: str, calls: int) -> list[float]:
    """Time the bare node channel: ``session_count`` calls (no sandbox, no database) from this process.

    The node's address and channel token are read from the database, as a gateway reads them.
    """
    from sqlalchemy import select

    from gateway.db import create_engine
    from gateway.fleet.channel import NodeClient
    from gateway.nodes.models import Node

    engine = create_engine(database_url)
    try:
        async with engine.connect() as db:
            address, token = (await db.execute(select(Node.address, Node.channel_token).where(Node.name == node))).one()
    finally:
        await engine.dispose()
    client = NodeClient("bench", address, token=token)
    times = []
    try:
        for _ in range(calls + 50):
            started = time.perf_counter()
            await client.call("session_count")
            times.append(time.perf_counter() - started)
    finally:
        await client.aclose()
    return times[50:]


def node_address(http: httpx.Client, node: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for n in http.get("/v1/nodes").raise_for_status().json()["items"]:
            if n["name"] == node and n.get("address"):
                return n["address"]
        time.sleep(0.2)
    raise RuntimeError(f"node {node} shows no address")


def wait_rollout(http: httpx.Client, rollout_id: str, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.get(f"/v1/rollouts/{rollout_id}").raise_for_status().json()
        if r["status"] in ("completed", "failed", "cancelled"):
            return r
        time.sleep(0.05)
    raise RuntimeError(f"rollout {rollout_id} did not finish")


def dispatch_latencies(http: httpx.Client, task_id: str, runs: int = 10) -> list[float]:
    out = []
    for _ in range(runs):
        created = http.post("/v1/rollouts", json={"tasks": {"ids": [task_id]}, "group_size": 1, "policy": SUBMIT,
                                                  "agent": {"max_turns": 2}}).raise_for_status().json()
        wait_rollout(http, created["id"])
        [episode] = http.get("/v1/episodes", params={"rollout_id": created["id"]}).json()["items"]
        started = datetime.fromisoformat(episode["started_at"])
        out.append((started - datetime.fromisoformat(episode["created_at"])).total_seconds())
    return out


def throughput(http: httpx.Client, task_ids: dict[str, str], episodes: int, concurrency: int) -> float:
    """Run one oracle rollout of ``episodes`` episodes; return episodes per minute."""
    groups = max(1, episodes // 8)
    ids = [task_ids[TASK_NAMES[i % len(TASK_NAMES)]] for i in range(groups)]
    started = time.perf_counter()
    created = http.post("/v1/rollouts", json={"tasks": {"ids": ids}, "group_size": 8, "policy": ORACLE,
                                              "agent": {"max_turns": 4}, "concurrency": concurrency})
    rollout = wait_rollout(http, created.raise_for_status().json()["id"])
    elapsed = time.perf_counter() - started
    done = rollout["progress"]["finished"]
    return done / elapsed * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--only", choices=("all", "step"), default="all",
                        help="step: only the step latencies (and the hop), in a minute or two")
    args = parser.parse_args()
    full = args.only == "all"
    rows: dict[str, float] = {}
    pools = asyncio.run(measure_all(10)) if full else None
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        # ----------------------------------------------------------------- embedded baseline
        (work / "up").mkdir()
        with Gateway(work / "up") as gw, httpx.Client(base_url=gw.url, timeout=300,
                                                      headers={"Authorization": f"Bearer {gw.key}"}) as http:
            tasks = import_tasks(http)
            first = tasks[TASK_NAMES[0]]
            rows["embedded REST step"] = med_ms(rest_steps(http, first, args.steps))
            rows["embedded gRPC step"] = med_ms(grpc_session_steps(http, gw.grpc, gw.key, first, args.steps))
            if full:
                rows["embedded dispatch"] = med_ms(dispatch_latencies(http, first))
                rows["embedded episodes/min"] = throughput(http, tasks, args.episodes, concurrency=4)
        # ------------------------------------------------- embedded on PostgreSQL beside the fleet
        # The fleet's gateways run on PostgreSQL: the hop to a node is measured against an embedded
        # gateway on it, both up at once and stepped in turn, so the machine's noise hits both alike.
        env = {"FORKYARD_GRPC_PORT": "0", "FORKYARD_FLEET__SCHEDULE_S": "0.2",
               "FORKYARD_NODES__HEARTBEAT_S": str(HEARTBEAT_S)}
        (work / "up-pg").mkdir()
        with ExitStack() as stack:
            pg_stack = stack.enter_context(ExitStack())  # closed once the hop is measured
            os.environ["FORKYARD_DATABASE_URL"] = pg_stack.enter_context(postgres_database())
            try:
                pg = pg_stack.enter_context(Gateway(work / "up-pg"))
            finally:
                del os.environ["FORKYARD_DATABASE_URL"]
            pg_http = pg_stack.enter_context(httpx.Client(base_url=pg.url, timeout=300,
                                                       headers={"Authorization": f"Bearer {pg.key}"}))
            pg_first = import_tasks(pg_http)[TASK_NAMES[0]]
            f = stack.enter_context(fleet(work / "fleet", env=env))
            url = f.start_gateway("a")
            grpc_address = f.gateways["a"].wait_line("FORKYARD_GRPC", 10)
            f.start_worker("n1", capacity=4)
            with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {f.api_key}"}) as http:
                tasks = import_tasks(http)
                first = tasks[TASK_NAMES[0]]
                base, other = paired_rest_steps([(pg_http, pg_first), (http, first)], args.steps)
                rows["embedded on PostgreSQL REST step"], rows["fleet REST step"] = med_ms(base), med_ms(other)
                rows["hop, REST (paired)"] = paired_added_ms(base, other)
                base, other = paired_grpc_session_steps(
                    [(pg_http, pg.grpc, pg.key, pg_first), (http, grpc_address, f.api_key, first)], args.steps)
                rows["embedded on PostgreSQL gRPC step"], rows["fleet gRPC step"] = med_ms(base), med_ms(other)
                rows["hop, gRPC (paired)"] = paired_added_ms(base, other)
                pg_stack.close()  # nothing of it runs beside the fleet from here
                from gateway.fleet import event_loop

                node_address(http, "n1")  # its channel is up
                rows["node call, asyncio client"] = med_ms(asyncio.run(node_calls(f.database_url, "n1", 2000)))
                with asyncio.Runner(loop_factory=event_loop) as runner:
                    rows["node call, uvloop client"] = med_ms(runner.run(node_calls(f.database_url, "n1", 2000)))
                if not full:
                    print_rows(rows, args, None)
                    return
                rows["fleet dispatch"] = med_ms(dispatch_latencies(http, first))
                rows["fleet episodes/min, 1 worker"] = throughput(http, tasks, args.episodes, concurrency=64)
                f.start_worker("n2", capacity=4)
                rows["fleet episodes/min, 2 workers"] = throughput(http, tasks, args.episodes, concurrency=64)
                f.start_worker("n3", capacity=4)
                rows["fleet episodes/min, 3 workers"] = throughput(http, tasks, args.episodes, concurrency=64)
    print_rows(rows, args, pools)


def print_rows(rows: dict[str, float], args: argparse.Namespace, pools: Any) -> None:
    print(f"# bench/fleet.py — {datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} CPUs; {args.steps} steps, {args.episodes} episodes per rollout")
    for name, value in rows.items():
        unit = "" if "episodes/min" in name else " ms"
        print(f"{name:34s} {value:9.2f}{unit}")
    added, added_grpc = rows["hop, REST (paired)"], rows["hop, gRPC (paired)"]
    verdict = "met" if added <= TARGET_ADDED_MS else "missed"
    print(f"the hop to a node adds {added:.2f} ms to a REST step, {added_grpc:.2f} ms to a gRPC step (median of "
          f"the step-by-step differences; medians differ by "
          f"{rows['fleet REST step'] - rows['embedded on PostgreSQL REST step']:.2f} and "
          f"{rows['fleet gRPC step'] - rows['embedded on PostgreSQL gRPC step']:.2f} ms) over an embedded gateway on "
          f"PostgreSQL stepped in turn with it (target <= {TARGET_ADDED_MS} ms: {verdict})")
    if pools is None:
        return
    print(f"dispatch: fleet / embedded = {rows['fleet dispatch'] / rows['embedded dispatch']:.2f}x")
    one = rows["fleet episodes/min, 1 worker"]
    print("throughput vs 1 worker: " + ", ".join(
        f"{n} workers {rows[f'fleet episodes/min, {n} workers'] / one:.2f}x" for n in (2, 3))
        + f"; embedded (concurrency 4) / 1 worker (capacity 4) = {rows['embedded episodes/min'] / one:.2f}x")
    print("pool claim vs cold sandbox (ms, medians of 10):")
    print("\n".join(report(pools)))


if __name__ == "__main__":
    main()

"""Console page render times with 10,000 episodes and 1,000 sandboxes in the database.

Run with ``.venv/bin/python bench/console.py [--episodes 10000] [--sandboxes 1000] [--runs 30] </dev/null``
as root after ``bash .ci/bootstrap`` (PostgreSQL on 127.0.0.1:5432).

A fresh PostgreSQL database is seeded directly (SQLAlchemy bulk inserts): nodes with warm
pool and setup cache reports, 20 rollouts sharing the episodes (three turns each, with
token ids and logprobs), one branching tree, the sandboxes (60% live), snapshots and an
audit log. A real ``forkyard up`` serves it on 127.0.0.1; an httpx client signed in with
an admin key fetches each page ``--runs`` times, one request in flight.

Prints p50/p95 per page and the ratio of each p50 to ``GET /healthz`` and to the API's
``GET /v1/rollouts`` measured in the same run; the issue's goal is every page under 300 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
from sqlalchemy import select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.auth.service import create_api_key  # noqa: E402
from gateway.console.models import AuditEntry  # noqa: E402
from gateway.db import create_engine, create_sessionmaker, upgrade_database, utcnow  # noqa: E402
from gateway.environments.models import Environment  # noqa: E402
from gateway.episodes.models import Episode, EpisodeStep  # noqa: E402
from gateway.nodes.models import Node  # noqa: E402
from gateway.rollouts.models import (  # noqa: E402
    EpisodeGroup,
    GroupMode,
    Rollout,
    RolloutStatus,
    StalenessAction,
)
from gateway.sandboxes.models import Sandbox  # noqa: E402
from gateway.snapshots.models import SnapshotRecord  # noqa: E402
from gateway.tasks.models import Task  # noqa: E402
from workers.protocol import EpisodeStatus, SandboxStatus, Termination  # noqa: E402

FORKYARD = ROOT / ".venv" / "bin" / "forkyard"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TARGET_MS = 300.0
ROLLOUTS = 20
NODES = ("node-a", "node-b", "node-c", "node-d")


def ms(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def seed(url: str, episodes: int, sandboxes: int) -> dict[str, str]:
    """Fill the database; return the ids the page list needs and an admin key."""
    await asyncio.to_thread(upgrade_database, url)
    engine = create_engine(url)
    rng = random.Random(0)
    now = utcnow()
    ids: dict[str, str] = {}
    try:
        async with create_sessionmaker(engine)() as db:
            from gateway.environments.service import ensure_default_environments

            await ensure_default_environments(db_session=db)
            env_id = await db.scalar(select(Environment.id).where(Environment.name == "terminal"))
            tasks = [Task(id=f"task_{i:024x}", name=f"task-{i}", environment_id=env_id, family="terminal",
                          content_hash=f"{i:064x}", instruction=f"Do thing {i}.", meta={}, archive=b"",
                          created_at=now) for i in range(50)]
            db.add_all(tasks)
            for n, name in enumerate(NODES):
                keys = [{"id": f"{n}{k:063x}", "backend": "local", "source": "image:sha256:abc", "idle": 1,
                         "filling": 0, "target": 2, "demand": 1, "breaker_open_s": 0} for k in range(10)]
                items = [{"id": f"{n}{k:063x}", "environment": "terminal@1", "task_hash": "ab" * 8,
                          "snapshot": f"snap-{n}-{k}", "bytes": 2 ** 20 * k, "created_at": time.time(),
                          "last_used_at": time.time()} for k in range(50)]
                db.add(Node(name=name, backend="local", capacity=8, heartbeat_s=3600.0, heartbeat_at=now,
                            started_at=now, load={"sessions": 3, "episodes": 5,
                                                  "pool": {"hits": 10, "misses": 2, "idle": 10, "max_idle": 16,
                                                           "by_key": keys},
                                                  "setup_cache": {"hits": 5, "misses": 1, "evictions": 0,
                                                                  "entries": 50, "bytes": 2 ** 30,
                                                                  "max_bytes": 20 * 2 ** 30, "items": items}}))
            await db.commit()
            per = episodes // ROLLOUTS
            for r in range(ROLLOUTS):
                rid = f"ro_{r:024x}"
                db.add(Rollout(id=rid, status=RolloutStatus.COMPLETED if r else RolloutStatus.RUNNING,
                               policy_name="pol", group_size=8, task_ids=[t.id for t in tasks[:per // 8]],
                               policy={"name": "pol", "api": "scripted"}, agent={}, limits={}, max_attempts=1,
                               priority=0, concurrency=8, last_seq=per, group_mode=GroupMode.COMPLETE,
                               staleness_action=StalenessAction.RERUN, created_at=now, updated_at=now))
                groups = {}
                rows, steps = [], []
                for e in range(per):
                    gid = groups.setdefault(e // 8, f"grp_{r:04x}{e // 8:020x}")
                    eid = f"ep_{r:04x}{e:020x}"
                    failed = rng.random() < 0.05
                    rows.append(Episode(
                        id=eid, rollout_id=rid, group_id=gid, task_id=tasks[(e // 8) % 50].id, task_index=e // 8,
                        sample_index=e % 8, attempt=0, status=EpisodeStatus.FAILED if failed else EpisodeStatus.COMPLETED,
                        termination=Termination.ERROR if failed else Termination.SUBMITTED,
                        reward=None if failed else float(rng.random() < 0.6), error="infra: sandbox lost" if failed else None,
                        messages=[{"role": "user", "content": "Do it."}, {"role": "assistant", "content": "ok"}],
                        timings={"total_s": 1.0}, weight_versions=[0, 1, 1], info={}, num_turns=3, seq=e,
                        created_at=now - timedelta(minutes=60 - e * 60 // per),
                        finished_at=now - timedelta(minutes=59 - e * 59 // per)))
                    for i in range(3):
                        completion = [rng.randrange(1, 150_000) for _ in range(20)]
                        steps.append(EpisodeStep(
                            episode_id=eid, index=i, parent_index=i - 1 if i else None,
                            prompt_ids=[rng.randrange(1, 150_000) for _ in range(60 if i == 0 else 15)],
                            completion_ids=completion, logprobs=[-rng.random() * 3 for _ in completion],
                            weight_version=1, finish_reason="stop", text=f"turn {i}",
                            action={"tool": "bash", "arguments": {"command": f"echo {i}"}}, observation=f"{i}\n",
                            timings={"policy_s": 0.1, "env_s": 0.05}, created_at=now))
                await db.flush()  # the rollout, then its groups, episodes and steps: each row's keys exist first
                db.add_all([EpisodeGroup(id=gid, rollout_id=rid, task_id=tasks[0].id, created_at=now, updated_at=now)
                            for gid in groups.values()])
                await db.flush()
                db.add_all(rows)
                await db.flush()
                db.add_all(steps)
                await db.commit()
                if r == 1:
                    ids["rollout"], ids["episode"] = rid, rows[0].id
            # One branching tree: a root and three branches at turn 2.
            root = ids["episode"]
            for b in range(3):
                eid = f"ep_tree{b:018x}"
                db.add(Episode(id=eid, rollout_id=ids["rollout"], group_id=f"grp_{1:04x}{0:020x}",
                               task_id=tasks[0].id, task_index=0, sample_index=100 + b, attempt=0,
                               status=EpisodeStatus.COMPLETED, termination=Termination.SUBMITTED, reward=float(b % 2),
                               messages=[], timings={}, weight_versions=[1], info={}, num_turns=1,
                               parent_episode_id=root, branch_turn=2, root_episode_id=root, created_at=now,
                               finished_at=now))
                db.add(EpisodeStep(episode_id=eid, index=2, parent_index=1, prompt_ids=[1, 2], completion_ids=[3],
                                   logprobs=[-0.1], weight_version=1, text="branch", observation="b",
                                   action={"tool": "bash", "arguments": {"command": f"echo {b}"}}, timings={},
                                   created_at=now))
                await db.flush()
            await db.execute(Episode.__table__.update().where(Episode.id == root).values(root_episode_id=root))
            boxes = []
            for s in range(sandboxes):
                live = s < sandboxes * 0.6
                boxes.append(Sandbox(id=f"sbx{s:09x}", node=NODES[s % len(NODES)], backend="local",
                                     state=SandboxStatus.READY if live else SandboxStatus.GONE,
                                     task_id=tasks[s % 50].id, owner_kind="episode", owner_id=f"ep_{s:022x}",
                                     rollout_id=f"ro_{s % ROLLOUTS:024x}", created_at=now - timedelta(seconds=s),
                                     gone_at=None if live else now))
            db.add_all(boxes)
            ids["sandbox"] = boxes[0].id
            db.add_all([SnapshotRecord(id=f"snap_{s:020x}", node=NODES[0], backend="local", session_id=f"sess_{s}",
                                       task_id=tasks[0].id, kind="session", pinned=s % 5 == 0, state={},
                                       created_at=now) for s in range(200)])
            db.add_all([AuditEntry(at=now, key_id="key_x", key_prefix="fy_abcdef", action="node.drain",
                                   target=NODES[0], detail={}) for _ in range(500)])
            await db.commit()
            ids["key"] = (await create_api_key(db_session=db, name="bench", scope="admin")).key
    finally:
        await engine.dispose()
    return ids


def pages(ids: dict[str, str]) -> dict[str, str]:
    return {
        "overview": "/admin",
        "overview fragment": "/admin/fragments/overview",
        "nodes": "/admin/nodes",
        "sandboxes": "/admin/sandboxes",
        "sandboxes p4, node, any state": "/admin/sandboxes?state=&node=node-b&page=4",
        "sandbox detail": f"/admin/sandboxes/{ids['sandbox']}",
        "kill preview (all live)": "/admin/sandboxes/kill",
        "warm pools": "/admin/pools",
        "rollouts": "/admin/rollouts",
        "rollout (500 episodes)": f"/admin/rollouts/{ids['rollout']}",
        "episode": f"/admin/episodes/{ids['episode']}",
        "tree": f"/admin/episodes/{ids['episode']}/tree",
        "cache & snapshots": "/admin/cache",
        "tasks": "/admin/tasks",
        "environments": "/admin/environments",
        "audit log": "/admin/audit",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--sandboxes", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    import psycopg

    name = f"forkyard_console_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    proc = None
    try:
        started = time.perf_counter()
        ids = asyncio.run(seed(url, args.episodes, args.sandboxes))
        print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {os.cpu_count()} cpus; seeded "
              f"{args.episodes} episodes ({3 * args.episodes} steps), {args.sandboxes} sandboxes in "
              f"{time.perf_counter() - started:.0f} s (PostgreSQL)", flush=True)
        data_dir = Path(tempfile.mkdtemp(prefix="console-bench-"))
        log = data_dir / "up.log"
        proc = subprocess.Popen(
            [str(FORKYARD), "up", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir),
             "--backend", "local", "--log-level", "warning"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
            cwd=ROOT, start_new_session=True,
            env={**os.environ, "FORKYARD_DATABASE_URL": url, "FORKYARD_NODE": f"bench-{uuid.uuid4().hex[:6]}"})
        base = None
        deadline = time.monotonic() + 300
        while base is None and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"forkyard up exited:\n{log.read_text()[-3000:]}")
            found = re.search(r"^FORKYARD_URL=(\S+)", log.read_text(), re.M)
            base = found.group(1) if found else None
            time.sleep(0.2)
        if base is None:
            raise SystemExit("forkyard up did not get ready")
        with httpx.Client(base_url=base, timeout=60) as http:
            assert http.post("/admin/login", data={"api_key": ids["key"]}).status_code == 303
            api_headers = {"Authorization": f"Bearer {ids['key']}"}
            targets = {"baseline: GET /healthz": ("/healthz", {}),
                       "baseline: GET /v1/rollouts": ("/v1/rollouts", api_headers)}
            targets.update({label: (path, {}) for label, path in pages(ids).items()})
            times: dict[str, list[float]] = {}
            for label, (path, headers) in targets.items():
                response = http.get(path, headers=headers)  # warm
                assert response.status_code == 200, (path, response.status_code, response.text[-300:])
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    response = http.get(path, headers=headers)
                    times.setdefault(label, []).append(time.perf_counter() - t0)
                    assert response.status_code == 200
        floor = statistics.median(times["baseline: GET /healthz"])
        api = statistics.median(times["baseline: GET /v1/rollouts"])
        print(f"\n{'page':<30} {'p50 ms':>8} {'p95 ms':>8} {'x healthz':>10} {'x API list':>11}  goal < {TARGET_MS:g} ms")
        for label, values in times.items():
            p50 = statistics.median(values)
            verdict = "" if label.startswith("baseline") else ("ok" if ms(values, 0.95) < TARGET_MS else "OVER")
            print(f"{label:<30} {p50 * 1000:>8.1f} {ms(values, 0.95):>8.1f} {p50 / floor:>10.1f} "
                  f"{p50 / api:>11.2f}  {verdict}")
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()

"""Solve the example web tasks through the SDK with their oracle action lists.

Usage: FORKYARD_URL=... FORKYARD_API_KEY=... python examples/solve_web.py [TASK_DIR_PARENT]

For every imported web task whose directory is under TASK_DIR_PARENT (default
examples/tasks/web), opens a session, plays ``solution/actions.json`` one action per
step (in a real headless Chromium in the sandbox), submits if the page did not end the
episode itself, and prints the reward, the steps' median latency and the first
screenshot's link when the task stores them. Exits non-zero unless every reward is 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import forkyard


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks_dir", nargs="?", default=str(Path(__file__).parent / "tasks" / "web"))
    args = parser.parse_args()

    local = {p.name: p for p in sorted(Path(args.tasks_dir).iterdir()) if (p / "task.toml").is_file()}
    failures = 0
    with forkyard.Client(timeout=600) as client:
        newest = {}
        for t in client.tasks.list(environment="web"):
            if t.name in local and (t.name not in newest or t.created_at > newest[t.name].created_at):
                newest[t.name] = t
        if not newest:
            print(f"no web task from {args.tasks_dir} is imported; run "
                  f"`forkyard tasks import {args.tasks_dir} --environment web`")
            return 2
        print(f"solving {len(newest)} web tasks with their oracle actions (the first one builds the web image)")
        for i, task in enumerate(sorted(newest.values(), key=lambda t: t.name), 1):
            actions = json.loads((local[task.name] / "solution" / "actions.json").read_text())
            started = time.perf_counter()
            latencies, shot = [], None
            with client.sessions.create(task.id) as session:
                result = None
                for action in actions:
                    t0 = time.perf_counter()
                    result = session.step(action["tool"], **action.get("arguments", {}))
                    latencies.append(time.perf_counter() - t0)
                    shot = shot or next(iter(result.info.get("artifacts") or []), None)
                    if result.terminated or result.truncated:
                        break
                if result is None or not (result.terminated or result.truncated):
                    result = session.submit()
            ok = result.reward == 1.0
            failures += not ok
            extra = f"  screenshot {shot['url']}" if shot else ""
            print(f"[{i}/{len(newest)}] {'ok ' if ok else 'BAD'} {task.name:<16} reward={result.reward}  "
                  f"step p50 {statistics.median(latencies) * 1000:.0f} ms  ({time.perf_counter() - started:.1f}s){extra}")
    print(f"{len(newest) - failures}/{len(newest)} web tasks scored 1.0")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

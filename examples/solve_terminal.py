"""Solve the example terminal tasks through the SDK with their oracle solutions.

Usage: FORKYARD_URL=... FORKYARD_API_KEY=... python examples/solve_terminal.py [TASK_DIR_PARENT] [--wrong]

For every imported task whose directory is under TASK_DIR_PARENT (default
examples/tasks/terminal), opens a session, sends the task's solution/solve.sh as one
``bash`` action, then ``submit``, and prints the reward. ``--wrong`` submits without
solving (every reward should then be 0). Exits non-zero unless every reward is as expected.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import forkyard


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks_dir", nargs="?", default=str(Path(__file__).parent / "tasks" / "terminal"))
    parser.add_argument("--wrong", action="store_true", help="submit without solving")
    args = parser.parse_args()

    local = {p.name: p for p in sorted(Path(args.tasks_dir).iterdir()) if (p / "task.toml").is_file()}
    expected = 0.0 if args.wrong else 1.0
    failures = 0
    with forkyard.Client() as client:
        # A name imported again with other content is a new task: solve the newest of each name.
        newest = {}
        for t in client.tasks.list():
            if t.name in local and (t.name not in newest or t.created_at > newest[t.name].created_at):
                newest[t.name] = t
        tasks = list(newest.values())
        if not tasks:
            print(f"no task from {args.tasks_dir} is imported; run `forkyard tasks import {args.tasks_dir}`")
            return 2
        print(f"solving {len(tasks)} tasks ({'wrong actions' if args.wrong else 'oracle solutions'})")
        for i, task in enumerate(sorted(tasks, key=lambda t: t.name), 1):
            started = time.perf_counter()
            with client.sessions.create(task.id) as session:
                if not args.wrong:
                    script = (local[task.name] / "solution" / "solve.sh").read_text()
                    session.step("bash", command=f"bash <<'FORKYARD_ORACLE'\n{script}\nFORKYARD_ORACLE", timeout=120)
                result = session.submit()
            ok = result.reward == expected
            failures += not ok
            mark = "ok " if ok else "BAD"
            print(f"[{i}/{len(tasks)}] {mark} {task.name:<28} reward={result.reward}  ({time.perf_counter() - started:.1f}s)")
    print(f"{len(tasks) - failures}/{len(tasks)} tasks scored {expected}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

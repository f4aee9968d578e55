"""Solve the example SWE instances with their gold patches through a rollout, and show an unsolved one.

    FORKYARD_URL=... FORKYARD_API_KEY=... .venv/bin/python examples/solve_swe.py

Expects the instances imported (``forkyard tasks import examples/swe/instances.jsonl``) and
their repositories in the gateway's store (``forkyard repos add``), as examples/demo.sh does.
"""

from __future__ import annotations

import os
import sys

import forkyard


def main() -> int:
    with forkyard.Client(base_url=os.environ["FORKYARD_URL"], api_key=os.environ["FORKYARD_API_KEY"],
                         timeout=600) as client:
        tasks = list(client.tasks.list(environment="swe"))
        if not tasks:
            print("no swe tasks: import examples/swe/instances.jsonl first", file=sys.stderr)
            return 1
        names = {t.id: t.name for t in tasks}
        rollout = client.rollouts.create(
            tasks={"ids": list(names)}, group_size=1, policy={"name": "oracle", "api": "scripted", "model": "oracle"},
            agent={"max_turns": 4}, limits={"episode_timeout_s": 600, "step_timeout_s": 300},
        )
        rewards = {}
        for batch in client.rollouts.stream(rollout.id, consumer="demo", batch_size=8):
            for episode in batch:
                rewards[names[episode.task_id]] = episode.reward
            batch.ack()
        for name in sorted(rewards):
            print(f"{name:45s} gold patch  reward {rewards[name]:g}")
        # The same instance submitted untouched: its FAIL_TO_PASS tests still fail.
        with client.sessions.create(tasks[0].id) as session:
            result = session.step("submit")
            failing = result.info["grading"]["FAIL_TO_PASS"]["failure"]
            print(f"{tasks[0].name:45s} no change   reward {result.reward:g} ({len(failing)} FAIL_TO_PASS test(s) fail)")
        return 0 if set(rewards.values()) == {1.0} and result.reward == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""A branching rollout: one trajectory tree per sample, printed as text and saved as an SVG.

Usage: FORKYARD_URL=... FORKYARD_API_KEY=... python examples/branching.py [--svg PATH] [--group-size N]

Imports examples/tasks/terminal/count-log-errors and runs it with a scripted policy that
behaves like a sampled one: the same first look around, then (``one_of``) a choice
between reading the rotated logs and going straight at the count, then a choice between
the right pipeline (the task's oracle) and two plausible wrong ones. The rollout forks
every sample at turns 1 and 2 (``branching: {"at_turns": [1, 2], "fanout": 3,
"max_episodes": 6}``): the shared turns run once, each leaf is an episode with its own
reward, and all leaves of a tree share one ``group_id``. Exits non-zero unless every tree
came back whole (its leaves delivered, its shared turns run once).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import forkyard

TASK_DIR = Path(__file__).parent / "tasks" / "terminal" / "count-log-errors"


def bash(command: str) -> dict:
    return {"tool": "bash", "arguments": {"command": command}}


def actions() -> list[dict]:
    oracle = (TASK_DIR / "solution" / "solve.sh").read_text()
    return [
        bash("ls -la /var/log/webapp"),
        {"one_of": [bash("zcat -f /var/log/webapp/app.log* | head -n 3"),
                    bash("grep -c ERROR /var/log/webapp/app.log")]},
        {"one_of": [
            bash(f"bash <<'FORKYARD_ORACLE'\n{oracle}FORKYARD_ORACLE"),
            bash("grep -h ERROR /var/log/webapp/app.log* | awk '{print $3}' | tr -d '[]' | sort | uniq -c "
                 "| awk '{print $2, $1}' > /app/report.txt"),
            bash("grep ' ERROR ' /var/log/webapp/app.log | wc -l | sed 's/^/total /' > /app/report.txt"),
        ]},
        {"tool": "submit", "arguments": {}},
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--svg", default="trajectory-tree.svg", help="where to write the first tree's picture")
    parser.add_argument("--group-size", type=int, default=2, help="trees (samples) to run (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the scripted choices (default 1)")
    args = parser.parse_args()

    with forkyard.Client() as client:
        (task,) = client.tasks.import_dir(TASK_DIR)
        rollout = client.rollouts.create(
            tasks=[task.id], group_size=args.group_size, agent={"max_turns": 6},
            policy={"name": "branching-demo", "api": "scripted", "actions": actions(),
                    "sampling": {"seed": args.seed}},
            branching={"at_turns": [1, 2], "fanout": 3, "max_episodes": 6},
        )
        print(f"rollout {rollout.id}: {args.group_size} trees of up to 6 leaves, forked at turns 1 and 2")
        leaves = []
        for batch in client.rollouts.stream(rollout.id, consumer="branching-demo"):
            leaves.extend(batch)
            batch.ack()
        trees: dict[str, list] = {}
        for leaf in leaves:
            trees.setdefault(leaf.group_id, []).append(leaf)
        ok = len(trees) == args.group_size
        for i, (group_id, group) in enumerate(sorted(trees.items())):
            tree = client.episodes.tree(group[0].episode_id)
            steps = len(tree.nodes) - 1
            linear = sum(len(client.episodes.get(leaf.episode_id).steps) for leaf in group)
            print(f"\ntree {i + 1} (group {group_id}): {len(group)} leaves, {steps} steps run "
                  f"({linear} if each leaf had run alone)")
            print(tree.render_text())
            ok = ok and len(tree.leaves) == len(group) >= 1 and steps <= linear
            if i == 0:
                Path(args.svg).write_text(tree.render_svg(title="count-log-errors: a trajectory tree"))
                print(f"(picture: {args.svg})")
    solved = sum(leaf.reward == 1.0 for leaf in leaves)
    print(f"\n{solved} of {len(leaves)} leaves solved the task")
    print("ok" if ok else "FAILED: a tree is missing or incomplete")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

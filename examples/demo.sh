#!/usr/bin/env bash
# The main job on the embedded default: bring the gateway up (SQLite, in-process
# worker, docker backend if an engine answers, else local), import the example
# terminal tasks, SWE instances and web tasks, solve each through the SDK with its
# oracle solution, print rewards.
set -euo pipefail
cd "$(dirname "$0")/.."

bash .ci/bootstrap

data_dir=${FORKYARD_DATA_DIR:-.forkyard}
log=$(mktemp /tmp/forkyard-up.XXXXXX.log)
.venv/bin/forkyard up --data-dir "$data_dir" --port "${FORKYARD_PORT:-8000}" >"$log" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT

echo "waiting for the gateway (log: $log)"
for _ in $(seq 1 600); do
  grep -q '^FORKYARD_API_KEY=' "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "forkyard up exited" >&2; exit 1; }
  sleep 0.5
done
grep -q '^FORKYARD_API_KEY=' "$log" || { cat "$log"; echo "gateway did not come up" >&2; exit 1; }
export FORKYARD_URL FORKYARD_API_KEY
FORKYARD_URL=$(grep '^FORKYARD_URL=' "$log" | cut -d= -f2-)
FORKYARD_API_KEY=$(grep '^FORKYARD_API_KEY=' "$log" | cut -d= -f2-)
echo "gateway at $FORKYARD_URL"

.venv/bin/forkyard tasks import examples/tasks/terminal
.venv/bin/python examples/solve_terminal.py examples/tasks/terminal

# SWE: the example repositories into the gateway's repository store, the instances in,
# each solved by its gold patch in a rollout (and one left unsolved, which scores 0).
for repo in calc textkit; do
  .venv/bin/forkyard repos add "examples/swe/repos/$repo" --name "forkyard/$repo" --data-dir "$data_dir"
done
.venv/bin/forkyard tasks import examples/swe/instances.jsonl >/dev/null
.venv/bin/python examples/solve_swe.py

# Web: the example web tasks in headless Chromium inside the sandboxes, each solved by its
# oracle actions (the first session builds the web image: Debian's Chromium and Playwright).
.venv/bin/forkyard tasks import examples/tasks/web --environment web >/dev/null
.venv/bin/python examples/solve_web.py

# Branching: one scripted rollout forked at turns 1 and 2, its trajectory trees printed
# and the first one drawn.
.venv/bin/python examples/branching.py --svg "$data_dir/trajectory-tree.svg"

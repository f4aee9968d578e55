#!/usr/bin/env bash
# Synthesize SWE instances from two real projects of the package registry whose source
# distributions ship their test suites (inflection 0.5.1, toolz 1.0.0): each sdist is
# downloaded inside a sandbox, made a repository, and bugs its tests catch are injected
# by `forkyard swe synth`. The result is cached (nothing of it is committed):
#
#   $FORKYARD_SWE_SYNTH_CACHE/<version>/repos/        the repository store (pypi__inflection.git, ...)
#   $FORKYARD_SWE_SYNTH_CACHE/<version>/<name>.jsonl  the instances
#
# <version> changes with the synthesis code, so a stale cache is never read. Prints the
# cache directory. Import with: forkyard repos add <cache>/repos/pypi__inflection.git
# --name pypi/inflection; forkyard tasks import <cache>/inflection.jsonl
set -euo pipefail
cd "$(dirname "$0")/../.."

version=$(cat workers/envs/swe/synth.py workers/envs/swe/env.py workers/envs/swe/task.py examples/swe/synth_pypi.sh \
  | sha256sum | cut -c1-12)
cache="${FORKYARD_SWE_SYNTH_CACHE:-/var/cache/forkyard/swe-synth}/$version"
mkdir -p "$cache"
for spec in inflection==0.5.1 toolz==1.0.0; do
  name=${spec%%==*}
  if [ ! -s "$cache/$name.jsonl" ]; then
    .venv/bin/forkyard swe synth "$spec" --name "pypi/$name" --out "$cache/$name.jsonl.part" --data-dir "$cache" \
      --backend "${FORKYARD_SWE_SYNTH_BACKEND:-local}" --max-instances 12 --seed 0 >&2
    mv "$cache/$name.jsonl.part" "$cache/$name.jsonl"
  fi
done
# The synthesis's own sandboxes and images are not needed once the instances exist.
rm -rf "$cache/sandboxes" "$cache/forkyard.db" "$cache/node" "$cache/setup-cache"
echo "$cache"

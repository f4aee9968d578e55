#!/bin/bash
# Oracle for git-bugfix: branch, fix mean() with python, commit.
set -euo pipefail
cd /app/stats
git checkout -q -b fix-mean main
python3 - <<'PY'
from pathlib import Path
path = Path("stats.py")
source = path.read_text()
old = "    return sum(values) / (len(values) - 1)\n"
new = "    if not values:\n        return 0.0\n    return sum(values) / len(values)\n"
assert old in source
path.write_text(source.replace(old, new))
PY
git add stats.py
git commit -q -m "Fix mean: divide by the number of values, 0.0 when empty"
git status --short

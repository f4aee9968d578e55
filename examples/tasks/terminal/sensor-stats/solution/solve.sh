#!/bin/bash
# Oracle for sensor-stats: group the readings and take the median with statkit.
set -euo pipefail
/opt/venv/bin/python - <<'PY'
import collections
import csv
import json

import statkit

groups = collections.defaultdict(list)
with open("/app/data/readings.csv", newline="") as fh:
    for row in csv.DictReader(fh):
        groups[row["sensor"]].append(float(row["value"]))
report = {sensor: round(statkit.median(values), 3) for sensor, values in sorted(groups.items())}
with open("/app/report.json", "w") as fh:
    json.dump(report, fh, indent=2)
print(len(report), "sensors")
PY

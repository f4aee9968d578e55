"""Compare /app/report.json with the medians computed here from the (unmodified) data set."""

import collections
import csv
import hashlib
import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    data = Path("/app/data/readings.csv").read_bytes()
    if hashlib.sha256(data).hexdigest() != Path("/app/data/readings.sha256").read_text().strip():
        print("FAIL: the data set was modified")
        return 1
    report_file = Path("/app/report.json")
    if not report_file.is_file():
        print("FAIL: /app/report.json does not exist")
        return 1
    try:
        report = json.loads(report_file.read_text())
    except ValueError as exc:
        print(f"FAIL: /app/report.json is not JSON: {exc}")
        return 1
    groups = collections.defaultdict(list)
    with open("/app/data/readings.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            groups[row["sensor"]].append(float(row["value"]))
    want = {sensor: round(statistics.median(values), 3) for sensor, values in groups.items()}
    if not isinstance(report, dict) or set(report) != set(want):
        print(f"FAIL: the report must have exactly the sensors {sorted(want)}")
        return 1
    wrong = [s for s in want if not isinstance(report[s], (int, float)) or abs(report[s] - want[s]) > 0.0011]
    if wrong:
        print(f"FAIL: wrong medians for {wrong}: got {[report[s] for s in wrong]}, want {[want[s] for s in wrong]}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

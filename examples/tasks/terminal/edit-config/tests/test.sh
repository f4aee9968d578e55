#!/bin/bash
# Verifier for edit-config: /app/app.conf must equal the expected file line for line
# (trailing whitespace ignored). Always writes /logs/verifier/reward.txt.
mkdir -p /logs/verifier
if [ ! -f /app/app.conf ]; then
    echo "FAIL: /app/app.conf is missing"
    echo 0 > /logs/verifier/reward.txt
    exit 0
fi
if python3 - /app/app.conf /tests/expected.conf <<'PY'
import sys
got = [line.rstrip() for line in open(sys.argv[1], encoding="utf-8", errors="replace").read().rstrip("\n").split("\n")]
want = [line.rstrip() for line in open(sys.argv[2], encoding="utf-8").read().rstrip("\n").split("\n")]
if got != want:
    for number, (a, b) in enumerate(zip(got, want), 1):
        if a != b:
            print(f"FAIL: line {number}: got {a!r}, want {b!r}")
            break
    else:
        print(f"FAIL: got {len(got)} lines, want {len(want)}")
    sys.exit(1)
print("PASS")
PY
then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi

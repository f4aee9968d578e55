#!/bin/bash
# Verifier for git-bugfix: partial credit in reward.json (the reward is the mean of the parts).
mkdir -p /logs/verifier
python3 /tests/check.py || true
if [ ! -s /logs/verifier/reward.json ]; then
    echo '{"branch": 0, "fix": 0, "commit": 0}' > /logs/verifier/reward.json
fi

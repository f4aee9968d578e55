#!/bin/bash
# Verifier for word-frequency: run the agent's script on hidden fixtures. Always writes reward.txt.
mkdir -p /logs/verifier
if python3 /tests/check.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi

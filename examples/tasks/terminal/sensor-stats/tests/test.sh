#!/bin/bash
# Verifier for sensor-stats: recompute the medians from the data set. Always writes reward.txt.
mkdir -p /logs/verifier
if python3 /tests/check.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi

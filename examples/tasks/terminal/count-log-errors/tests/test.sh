#!/bin/bash
# Verifier for count-log-errors: /app/report.txt must match the expected report
# (trailing whitespace and a final newline ignored). Always writes reward.txt.
mkdir -p /logs/verifier
expected='billing 35
gateway 33
auth 25
search 25
total 118'
if [ -f /app/report.txt ] && [ "$(sed -e 's/[[:space:]]*$//' /app/report.txt | sed -e '/^$/d')" = "$expected" ]; then
    echo "PASS"
    echo 1 > /logs/verifier/reward.txt
else
    echo "FAIL: /app/report.txt does not hold the expected report"
    [ -f /app/report.txt ] && cat /app/report.txt
    echo 0 > /logs/verifier/reward.txt
fi

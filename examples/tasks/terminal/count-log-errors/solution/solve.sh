#!/bin/bash
# Oracle for count-log-errors: decompress on the fly, keep level ERROR, count per service.
set -euo pipefail
cd /var/log/webapp
{ cat app.log app.log.1; zcat app.log.2.gz app.log.3.gz; } \
    | awk '$2 == "ERROR" { gsub(/[][]/, "", $3); count[$3]++ } END { for (s in count) print s, count[s] }' \
    | sort -k2,2nr -k1,1 > /tmp/by_service.txt
total=$(awk '{ t += $2 } END { print t + 0 }' /tmp/by_service.txt)
{ cat /tmp/by_service.txt; echo "total $total"; } > /app/report.txt
rm -f /tmp/by_service.txt

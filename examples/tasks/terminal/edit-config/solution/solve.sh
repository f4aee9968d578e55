#!/bin/bash
# Oracle for edit-config: edit only the three keys, each within its own section.
set -euo pipefail
awk '
    /^\[/ { section = $0 }
    section == "[server]" && /^port[ \t]*=/ { print "port = 9090"; next }
    section == "[server]" && /^workers[ \t]*=/ { print "workers = 4"; next }
    section == "[logging]" && /^level[ \t]*=/ { print "level = warning"; next }
    { print }
' /app/app.conf > /tmp/app.conf.new
cat /tmp/app.conf.new > /app/app.conf
rm -f /tmp/app.conf.new

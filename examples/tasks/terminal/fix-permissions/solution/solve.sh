#!/bin/bash
# Oracle for fix-permissions.
set -euo pipefail
mkdir -p /srv/app/logs
chmod 755 /srv/app/logs
chown -R deploy:deploy /srv/app
chmod 750 /srv/app/bin/start.sh
chmod 700 /srv/app/secrets
chmod 600 /srv/app/secrets/*
chmod 640 /srv/app/config/*

#!/bin/bash
# Oracle for backup-archive.
set -euo pipefail
mkdir -p /backup
tar -C /srv -czf /backup/data.tar.gz --exclude='*.tmp' --exclude='data/cache' data
tar -tzf /backup/data.tar.gz

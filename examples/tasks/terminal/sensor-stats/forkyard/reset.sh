#!/bin/bash
# Setup for sensor-stats, run at every reset: "install the dependencies" (a virtualenv at
# /opt/venv with the statkit package, byte-compiled) and generate the readings data set.
set -euo pipefail

# One line per run, so a test can tell a restored setup from a second run.
echo "setup $(cat /proc/sys/kernel/random/uuid)" >> /var/log/sensor-stats-setup.log

python3 -m venv --without-pip /opt/venv
site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/statkit"
cat > "$site/statkit/__init__.py" <<'PY'
"""statkit: small, exact statistics over sequences of floats."""

from statkit.robust import median, trimmed_mean

__all__ = ["median", "trimmed_mean"]
__version__ = "1.4.2"
PY
cat > "$site/statkit/robust.py" <<'PY'
"""Robust location estimates."""


def median(values):
    """Return the median of a non-empty sequence (the mean of the two middle values when even)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of an empty sequence")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def trimmed_mean(values, fraction=0.1):
    """Return the mean after dropping ``fraction`` of the values at each end."""
    ordered = sorted(values)
    cut = int(len(ordered) * fraction)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)
PY
# Vendor and byte-compile a copy of some standard library packages, as a real install would.
stdlib=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mkdir -p "$site/_vendor"
for pkg in asyncio concurrent email encodings http importlib json logging multiprocessing unittest xml; do
    cp -r "$stdlib/$pkg" "$site/_vendor/$pkg"
done
find "$site/_vendor" -name __pycache__ -prune -exec rm -rf {} +
/opt/venv/bin/python -m compileall -q -f "$site" >/dev/null

# The data set: 400,000 readings of 12 sensors (each the mean of 6 noisy samples), fixed seed.
mkdir -p /app/data
/opt/venv/bin/python - <<'PY'
import hashlib
import random

rng = random.Random(20240601)
sensors = [f"sensor-{i:02d}" for i in range(12)]
lines = ["sensor,value\n"]
for _ in range(400_000):
    k = rng.randrange(len(sensors))
    value = sum(rng.gauss(20.0 + 1.5 * k, 10.0) for _ in range(6)) / 6
    lines.append(f"{sensors[k]},{value:.4f}\n")
data = "".join(lines).encode()
with open("/app/data/readings.csv", "wb") as fh:
    fh.write(data)
with open("/app/data/readings.sha256", "w") as fh:
    fh.write(hashlib.sha256(data).hexdigest() + "\n")
PY

#!/bin/bash
# Oracle for word-frequency: write the script with the standard library only.
set -euo pipefail
cat > /app/wordfreq.py <<'PY'
#!/usr/bin/env python3
"""Print the N most frequent words of a text file."""
import collections
import re
import sys


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print("usage: wordfreq.py FILE [N]", file=sys.stderr)
        return 2
    n = int(sys.argv[2]) if len(sys.argv) == 3 else 5
    try:
        with open(sys.argv[1], encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        print(f"wordfreq.py: {exc}", file=sys.stderr)
        return 2
    counts = collections.Counter(re.findall(r"[a-z]+", text.lower()))
    for word, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]:
        print(word, count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x /app/wordfreq.py

"""Run /app/wordfreq.py on fixture files and compare with a reference implementation."""

import collections
import re
import subprocess
import sys
from pathlib import Path


def reference(path: Path, n: int) -> str:
    words = re.findall(r"[a-z]+", path.read_text().lower())
    counts = collections.Counter(words)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]
    return "".join(f"{word} {count}\n" for word, count in ranked)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "/app/wordfreq.py", *args], capture_output=True, text=True, timeout=20
    )


def main() -> int:
    if not Path("/app/wordfreq.py").is_file():
        print("FAIL: /app/wordfreq.py does not exist")
        return 1
    fixtures = Path("/tests/fixtures")
    cases = [(fixtures / "prose.txt", None), (fixtures / "prose.txt", 12), (fixtures / "ties.txt", 4),
             (fixtures / "tiny.txt", 10), (Path("/app/sample.txt"), 3)]
    for path, n in cases:
        args = [str(path)] if n is None else [str(path), str(n)]
        proc = run(*args)
        want = reference(path, 5 if n is None else n)
        got = "".join(line.rstrip() + "\n" for line in proc.stdout.splitlines())
        if proc.returncode != 0 or got != want:
            print(f"FAIL: wordfreq.py {' '.join(args)} exited {proc.returncode}")
            print(f"got:\n{proc.stdout}{proc.stderr}want:\n{want}")
            return 1
    proc = run("/nonexistent/file.txt")
    if proc.returncode != 2 or not proc.stderr.strip():
        print(f"FAIL: a missing file must exit 2 with a message on stderr, got exit {proc.returncode}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())

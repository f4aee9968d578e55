"""Score git-bugfix: branch (1/3), fix in the working tree (1/3), clean commit on fix-mean (1/3)."""

import json
import subprocess

REPO = "/app/stats"
MAIN_STATS = "/tests/stats_main.py"


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=20)


def mean_is_fixed(source: str) -> bool:
    """Load source as a module and test mean(), median() and value_range()."""
    namespace: dict = {}
    try:
        exec(compile(source, "stats.py", "exec"), namespace)
        mean, median, value_range = namespace["mean"], namespace["median"], namespace["value_range"]
        checks = [
            mean([1, 2, 3, 4]) == 2.5,
            mean([5]) == 5,
            mean([]) == 0.0,
            abs(mean([0.1, 0.2, 0.3]) - 0.2) < 1e-9,
            median([3, 1, 2]) == 2,
            median([]) is None,
            value_range([4, 9, 1]) == 8,
        ]
    except Exception as exc:  # noqa: BLE001 - any failure of the agent's code scores zero
        print(f"stats.py fails: {exc!r}")
        return False
    return all(checks)


def main() -> None:
    scores = {"branch": 0.0, "fix": 0.0, "commit": 0.0}
    branch = git("rev-parse", "--abbrev-ref", "HEAD").stdout.strip()
    main_ok = git("show", "main:stats.py").stdout == open(MAIN_STATS).read()
    if git("rev-parse", "--verify", "--quiet", "refs/heads/fix-mean").returncode == 0 and branch == "fix-mean":
        scores["branch"] = 1.0
    try:
        working = open(f"{REPO}/stats.py").read()
    except OSError:
        working = ""
    if mean_is_fixed(working):
        scores["fix"] = 1.0
    committed = git("show", "fix-mean:stats.py")
    message = git("log", "-1", "--format=%B", "fix-mean").stdout.lower()
    clean = git("status", "--porcelain").stdout.strip() == ""
    if committed.returncode == 0 and mean_is_fixed(committed.stdout) and "fix mean" in message and clean and main_ok:
        scores["commit"] = 1.0
    print(json.dumps(scores))
    with open("/logs/verifier/reward.json", "w") as out:
        json.dump(scores, out)


if __name__ == "__main__":
    main()

"""Write examples/swe/instances.jsonl: SWE-smith-style instances of the two example repositories.

Each instance is a bug written by hand into a clean repository (``patch_kind = "bug"``:
its ``patch`` introduces the bug, the agent starts from the buggy tree, the gold
solution reverts it), sometimes with a ``test_patch`` adding the test that catches it.
FAIL_TO_PASS and PASS_TO_PASS are not written by hand: the tests are run here, on the
buggy and on the clean tree (each with the test patch), and read with the grader's own
parsers.

    .venv/bin/python examples/swe/make_instances.py     # rewrites instances.jsonl

The repositories enter a repository store with ``forkyard repos add examples/swe/repos/calc
--name forkyard/calc`` (a plain directory becomes one commit with a fixed author and date,
so ``base_commit`` below is the same everywhere).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from workers.envs.swe.grading import PARSERS  # noqa: E402
from workers.envs.swe.repos import RepoStore, head_commit  # noqa: E402

PYTEST = "pytest -rA -p no:cacheprovider"
UNITTEST = "python -m unittest -v tests.test_case"


@dataclass(frozen=True)
class Bug:
    repo: str
    slug: str
    file: str
    old: str
    new: str
    problem: str
    test_file: str = ""
    test_text: str = ""
    test_cmd: str = PYTEST
    log_parser: str = "pytest"


BUGS = [
    Bug("calc", "clamp-upper", "calc/numbers.py", "    if value > high:\n        return high",
        "    if value > high:\n        return low",
        "`clamp(42, 0, 10)` returns 0 instead of 10: values above the range come back as its lower bound."),
    Bug("calc", "fibonacci-off-by-one", "calc/numbers.py", "    for _ in range(n):", "    for _ in range(n - 1):",
        "`fibonacci(n)` is one step behind: `fibonacci(2)` is 0 but should be 1, and `fibonacci(7)` is 8, not 13."),
    Bug("calc", "lcm", "calc/numbers.py", "    return abs(a * b) // gcd(a, b)", "    return abs(a * b) // gcd(a, a)",
        "`lcm(4, 6)` returns 6; the least common multiple of 4 and 6 is 12."),
    Bug("calc", "is-prime-squares", "calc/numbers.py", "    while i * i <= n:", "    while i * i < n:",
        "`is_prime` says 4, 9, 25 and 49 are prime. Squares of primes are not prime."),
    Bug("calc", "median-even", "calc/stats.py", "    return (ordered[middle - 1] + ordered[middle]) / 2",
        "    return (ordered[middle] + ordered[middle + 1]) / 2",
        "`median([4, 1, 3, 2])` returns 3.5 instead of 2.5 (for an even count it must average the two middle values)."),
    Bug("calc", "mode-ties", "calc/stats.py", "    for value in values:\n        if counts[value] == best:",
        "    for value in sorted(values):\n        if counts[value] == best:",
        "`mode([3, 1, 1, 3, 2])` returns 1, but ties must go to the value seen first (3)."),
    Bug("calc", "variance-ddof", "calc/stats.py", "    return total / (n - 1 if sample else n)",
        "    return total / (n if sample else n - 1)",
        "`variance` mixes up the population and the sample variance: `variance([2, 4, 4, 4, 5, 5, 7, 9])` should be 4."),
    Bug("calc", "mean-generator", "calc/stats.py",
        "    values = list(values)\n    if not values:\n        raise ValueError(\"mean of an empty sequence\")",
        "    if not values:\n        raise ValueError(\"mean of an empty sequence\")",
        "`mean(x for x in [1, 2, 3])` raises TypeError; `mean` should accept any iterable, generators included.",
        test_file="tests/test_iterables.py",
        test_text="from calc import mean\n\n\ndef test_mean_of_a_generator():\n    assert mean(x for x in [1, 2, 3]) == 2\n"),
    Bug("textkit", "slugify-accents", "textkit/text.py", 'unicodedata.normalize("NFKD", text)',
        'unicodedata.normalize("NFC", text)',
        '`slugify("Crème Brûlée")` gives "crme-brle": accented letters are dropped instead of losing their accents.'),
    Bug("textkit", "truncate-exact", "textkit/text.py", "    if len(text) <= width:", "    if len(text) < width:",
        '`truncate("hello", 5)` returns "he..." although the text already fits in 5 characters.'),
    Bug("textkit", "wrap-exact", "textkit/text.py", "        elif len(current) + 1 + len(word) <= width:",
        "        elif len(current) + 1 + len(word) < width:",
        '`wrap("ab cd", 5)` splits into two lines although "ab cd" is exactly 5 characters wide.'),
    Bug("textkit", "palindrome-spaces", "textkit/text.py", "    letters = [c.lower() for c in text if c.isalnum()]",
        "    letters = [c.lower() for c in text if c.isalnum() or c == \" \"]",
        '`is_palindrome("A man, a plan, a canal: Panama")` is False: spaces must be ignored like punctuation.'),
    Bug("textkit", "camel-underscore", "textkit/case.py", 'r"\\1_\\2"', 'r"\\1\\2_"',
        '`camel_to_snake("parseHttpResponse")` gives "parseh_ttpr_esponse" instead of "parse_http_response".',
        test_cmd=UNITTEST, log_parser="unittest"),
    Bug("textkit", "title-small-first", "textkit/case.py", "        if i > 0 and word.lower() in _SMALL_WORDS:",
        "        if word.lower() in _SMALL_WORDS:",
        '`title_case("the lord of the rings")` starts with a lowercase "the": the first word is always capitalized.'),
    Bug("textkit", "count-apostrophes", "textkit/text.py", r"""re.findall(r"[a-z']+", text.lower())""",
        r"""re.findall(r"[a-z]+", text.lower())""",
        "`count_words(\"don't stop\")` counts \"don\" and \"t\": words with apostrophes must stay whole.",
        test_file="tests/test_apostrophes.py",
        test_text=("from textkit import count_words\n\n\ndef test_apostrophes_stay_in_words():\n"
                   "    assert count_words(\"don't stop, don't\") == {\"don't\": 2, \"stop\": 1}\n")),
]


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False, timeout=600)
    return done.stdout + done.stderr


def _checkout(store: RepoStore, repo: str, commit: str, where: Path) -> Path:
    where.mkdir(parents=True)
    subprocess.run(["tar", "-xf", "-"], input=store.archive(repo, commit), cwd=where, check=True)
    _run("git", "init", "-q", cwd=where)
    _run("git", "add", "-A", cwd=where)
    _run("git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-qm", "base", cwd=where)
    return where


def _diff(where: Path) -> str:
    _run("git", "add", "-A", cwd=where)
    return _run("git", "diff", "--cached", "--no-color", cwd=where)


def _statuses(where: Path, bug: Bug) -> dict[str, str]:
    log = _run("bash", "-c", bug.test_cmd.replace("python ", f"{sys.executable} ", 1)
               if bug.test_cmd.startswith("python ") else f"{sys.executable} -m {bug.test_cmd}", cwd=where)
    return PARSERS[bug.log_parser](log)


def make(store: RepoStore, commits: dict[str, str], bug: Bug, scratch: Path) -> dict:
    repo = f"forkyard/{bug.repo}"
    clean = _checkout(store, repo, commits[bug.repo], scratch / f"{bug.slug}-clean")
    test_patch = ""
    if bug.test_file:
        (clean / bug.test_file).write_text(bug.test_text)
        test_patch = _diff(clean)
        _run("git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-qm", "tests", cwd=clean)
    buggy = _checkout(store, repo, commits[bug.repo], scratch / f"{bug.slug}-buggy")
    source = (buggy / bug.file).read_text()
    assert source.count(bug.old) == 1, f"{bug.slug}: the text to change must occur once in {bug.file}"
    (buggy / bug.file).write_text(source.replace(bug.old, bug.new))
    patch = _diff(buggy)
    if bug.test_file:
        (buggy / bug.test_file).write_text(bug.test_text)
    good, bad = _statuses(clean, bug), _statuses(buggy, bug)
    passing = {"PASSED", "XFAIL"}
    f2p = sorted(t for t, s in good.items() if s in passing and bad.get(t) not in passing)
    p2p = sorted(t for t, s in good.items() if s in passing and bad.get(t) in passing)
    assert f2p, f"{bug.slug}: the bug breaks no test"
    assert p2p, f"{bug.slug}: the bug leaves no test passing"
    return {
        "instance_id": f"forkyard__{bug.repo}-{bug.slug}", "repo": repo, "base_commit": commits[bug.repo],
        "problem_statement": bug.problem, "patch": patch, "test_patch": test_patch, "patch_kind": "bug",
        "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "version": "0.1", "test_cmd": bug.test_cmd,
        "log_parser": bug.log_parser,
        "install": ["pip install --quiet pytest", "pip install --quiet --no-build-isolation -e ."],
        "created_at": "2026-12-02T00:00:00Z",
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = RepoStore(Path(tmp) / "store")
        commits = {}
        for name in ("calc", "textkit"):
            commits[name] = head_commit(store.add(HERE / "repos" / name, name=f"forkyard/{name}"))
        lines = [json.dumps(make(store, commits, bug, Path(tmp)), sort_keys=True) for bug in BUGS]
    (HERE / "instances.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} instances to {HERE / 'instances.jsonl'}")


if __name__ == "__main__":
    main()

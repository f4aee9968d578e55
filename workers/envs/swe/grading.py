"""Grading SWE instances with the reference harness's semantics (``swebench.harness.grading``).

The grader runs ``test_cmd`` between :data:`START_MARKER` and :data:`END_MARKER` and
records its exit code after them. The log between the markers is read by a parser
(test id -> status); the instance is resolved (reward 1) when every FAIL_TO_PASS test
passed and every PASS_TO_PASS test was maintained:

- passed: the test's status is PASSED or XFAIL;
- maintained (PASS_TO_PASS only): passed, or SKIPPED;
- a test the log does not mention has failed.

As the reference does, a log is invalid (nothing passes) when the markers are missing,
when no test result and no sign of a run is found, or when the command exited non-zero
while the log shows no failure (a patch printing its own ``PASSED`` lines).

A parser is a function ``log -> {test id: status}`` registered in :data:`PARSERS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

START_MARKER = ">>>>> Start Test Output"
END_MARKER = ">>>>> End Test Output"
EXIT_MARKER = ">>>>> Test Exit Code"

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (FAILED, PASSED, SKIPPED, ERROR, XFAIL)
_PASSING = frozenset({PASSED, XFAIL})
_SKIP_SUMMARY = re.compile(r"^\[\d+\]$")
_EXIT_RE = re.compile(rf"{re.escape(EXIT_MARKER)}:\s*(-?\d+)")
# Signs a runner ran although no test result was parsed (pytest's and unittest's summaries).
_SUITE_RAN = re.compile(r"^=+ .*\b(?:passed|failed|skipped|errors?|no tests ran)\b.* =+$|^Ran [1-9]\d* tests? in ",
                        re.M)


def parse_pytest(log: str) -> dict[str, str]:
    """Read ``pytest -rA`` output: lines ``STATUS test_id`` (``FAILED id - message`` too)."""
    statuses: dict[str, str] = {}
    for line in log.split("\n"):
        if not line.startswith(STATUSES):
            continue
        if line.startswith(FAILED):
            line = line.replace(" - ", " ")
        words = line.split()
        if len(words) <= 1 or words[0] not in STATUSES:
            continue
        if words[0] == SKIPPED and _SKIP_SUMMARY.match(words[1]):
            continue  # "SKIPPED [2] file:line: reason" counts skips, names no test
        statuses[words[1]] = words[0]
    return statuses


def parse_unittest(log: str) -> dict[str, str]:
    """Read ``unittest -v`` output (also Django's runner) as the reference harness's Django parser does.

    A test's id is what precedes `` ... `` on its line, e.g. ``test_x (pkg.tests.Case.test_x)``
    (``test_x (pkg.tests.Case)`` before Python 3.11): ``... ok`` passed, ``... skipped``
    skipped, ``... FAIL``/``... ERROR`` failed/errored, and an ``ok`` on a later line passes the
    last test named. ``FAIL: x``/``ERROR: x`` headers mark ``x``. Like the reference, an
    ``expected failure`` records nothing.
    """
    statuses: dict[str, str] = {}
    previous: str | None = None
    for raw in log.split("\n"):
        line = raw.strip()
        if " ... " in line:
            previous = line.split(" ... ")[0]
        for suffix in (" ... ok", " ... OK", " ...  OK"):
            if line.endswith(suffix):
                statuses[line.rsplit(suffix, 1)[0]] = PASSED
                break
        if " ... skipped" in line:
            statuses[line.split(" ... skipped")[0]] = SKIPPED
        if line.endswith(" ... FAIL"):
            statuses[line.split(" ... FAIL")[0]] = FAILED
        if line.startswith("FAIL:") and len(line.split()) > 1:
            statuses[line.split()[1].strip()] = FAILED
        if line.endswith(" ... ERROR"):
            statuses[line.split(" ... ERROR")[0]] = ERROR
        if line.startswith("ERROR:") and len(line.split()) > 1:
            statuses[line.split()[1].strip()] = ERROR
        if line.startswith("ok") and previous is not None:
            statuses[previous] = PASSED
    return statuses


#: Log parsers by the name an instance's ``log_parser`` gives.
PARSERS: dict[str, Callable[[str], dict[str, str]]] = {"pytest": parse_pytest, "unittest": parse_unittest}


@dataclass
class GradeReport:
    """What grading found: the verdict, per-test statuses and why."""

    resolved: bool
    valid: bool
    """False when the log cannot be trusted (no markers, no run, an exit code the log contradicts)."""
    statuses: dict[str, str]
    f2p_passed: list[str] = field(default_factory=list)
    f2p_failed: list[str] = field(default_factory=list)
    p2p_passed: list[str] = field(default_factory=list)
    p2p_failed: list[str] = field(default_factory=list)
    exit_code: int | None = None
    problem: str | None = None

    @property
    def f2p_fraction(self) -> float:
        """Share of FAIL_TO_PASS tests that pass (1 when there are none)."""
        total = len(self.f2p_passed) + len(self.f2p_failed)
        return len(self.f2p_passed) / total if total else 1.0

    @property
    def p2p_fraction(self) -> float:
        """Share of PASS_TO_PASS tests maintained (1 when there are none)."""
        total = len(self.p2p_passed) + len(self.p2p_failed)
        return len(self.p2p_passed) / total if total else 1.0

    def to_info(self) -> dict[str, Any]:
        """Return the report as an episode's info."""
        return {"resolved": self.resolved, "valid": self.valid, "problem": self.problem,
                "exit_code": self.exit_code, "fail_to_pass": self.f2p_fraction, "pass_to_pass": self.p2p_fraction,
                "FAIL_TO_PASS": {"success": self.f2p_passed, "failure": self.f2p_failed},
                "PASS_TO_PASS": {"success": self.p2p_passed, "failure": self.p2p_failed},
                "tests": dict(self.statuses)}


def read_log(log: str, parser: str) -> tuple[dict[str, str], int | None, str | None]:
    """Return (statuses, exit code, problem) of a grader log; ``problem`` is None for a valid log."""
    exit_match = _EXIT_RE.search(log)
    exit_code = int(exit_match.group(1)) if exit_match else None
    if START_MARKER not in log or END_MARKER not in log:
        return {}, exit_code, "the test output markers are missing (the test command did not run to its end)"
    parse = PARSERS[parser]
    statuses = parse(log.split(START_MARKER, 1)[1].split(END_MARKER, 1)[0])
    if not statuses:
        statuses = parse(log)
    if not statuses and not _SUITE_RAN.search(log):
        return {}, exit_code, "no test result in the log and no sign that the tests ran"
    if exit_code not in (None, 0) and statuses and not any(s in (FAILED, ERROR) for s in statuses.values()):
        return {}, exit_code, f"the test command exited {exit_code} while its log shows no failure"
    return statuses, exit_code, None


def grade(log: str, *, parser: str, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> GradeReport:
    """Grade a grader log against the instance's FAIL_TO_PASS and PASS_TO_PASS lists."""
    statuses, exit_code, problem = read_log(log, parser)
    report = GradeReport(resolved=False, valid=problem is None, statuses=statuses, exit_code=exit_code,
                         problem=problem)
    for test in fail_to_pass:
        (report.f2p_passed if statuses.get(test) in _PASSING else report.f2p_failed).append(test)
    for test in pass_to_pass:
        maintained = statuses.get(test) in _PASSING or statuses.get(test) == SKIPPED
        (report.p2p_passed if maintained else report.p2p_failed).append(test)
    report.resolved = report.valid and not report.f2p_failed and not report.p2p_failed
    return report


__all__ = ["END_MARKER", "EXIT_MARKER", "PARSERS", "START_MARKER", "GradeReport", "grade", "parse_pytest",
           "parse_unittest", "read_log"]

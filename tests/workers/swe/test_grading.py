"""SWE grading: log parsers and the verdict, checked against the reference ``swebench`` package."""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import pytest

from workers.envs.swe.grading import (
    END_MARKER,
    EXIT_MARKER,
    START_MARKER,
    grade,
    parse_pytest,
)

F2P = ["tests/test_a.py::test_fixed", "tests/test_a.py::test_param[1-x]"]
P2P = ["tests/test_a.py::test_kept", "tests/test_b.py::test_skipped", "tests/test_b.py::test_xfail"]


def _log(body: str, *, exit_code: int | None = 0, markers: bool = True) -> str:
    if not markers:
        return body
    tail = f"\n{EXIT_MARKER}: {exit_code}\n" if exit_code is not None else "\n"
    return f"+ pytest -rA\n{START_MARKER}\n{body}\n{END_MARKER}{tail}"


def _summary(statuses: dict[str, str]) -> str:
    lines = ["============================= test session starts ==============================", "collected 5 items",
             "", "=========================== short test summary info ============================"]
    for test, status in statuses.items():
        lines.append(f"{status} {test}" + (" - AssertionError: assert 1 == 2" if status == "FAILED" else ""))
    lines.append("SKIPPED [1] tests/test_b.py:12: not on this platform")
    lines.append("========================= 2 passed, 1 failed in 0.12s ==========================")
    return "\n".join(lines)


RESOLVED = {F2P[0]: "PASSED", F2P[1]: "PASSED", P2P[0]: "PASSED", P2P[1]: "SKIPPED", P2P[2]: "XFAIL"}
CASES = {
    "resolved": (_log(_summary(RESOLVED)), True),
    "one f2p still fails": (_log(_summary({**RESOLVED, F2P[1]: "FAILED"}), exit_code=1), False),
    "f2p errors": (_log(_summary({**RESOLVED, F2P[0]: "ERROR"}), exit_code=1), False),
    "f2p skipped is not a fix": (_log(_summary({**RESOLVED, F2P[0]: "SKIPPED"})), False),
    "f2p xfail passes": (_log(_summary({**RESOLVED, F2P[0]: "XFAIL"})), True),
    "p2p broken": (_log(_summary({**RESOLVED, P2P[0]: "FAILED"}), exit_code=1), False),
    "p2p missing": (_log(_summary({k: v for k, v in RESOLVED.items() if k != P2P[0]})), False),
    "no markers": (_log(_summary(RESOLVED), markers=False), False),
    "nothing ran": (_log("ModuleNotFoundError: No module named 'calc'", exit_code=4), False),
    "exit code contradicts the log": (_log(_summary(RESOLVED), exit_code=1), False),
    "no exit code recorded": (_log(_summary(RESOLVED), exit_code=None), True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_verdicts(name: str) -> None:
    log, resolved = CASES[name]
    report = grade(log, parser="pytest", fail_to_pass=F2P, pass_to_pass=P2P)
    assert report.resolved is resolved, report.to_info()


def test_partial_pass_fractions_and_info() -> None:
    report = grade(CASES["one f2p still fails"][0], parser="pytest", fail_to_pass=F2P, pass_to_pass=P2P)
    info = report.to_info()
    assert info["fail_to_pass"] == 0.5 and info["pass_to_pass"] == 1.0 and not info["resolved"]
    assert info["FAIL_TO_PASS"]["failure"] == [F2P[1]] and info["tests"][F2P[1]] == "FAILED"
    assert "[1]" not in info["tests"]  # a skip summary names no test


def test_unittest_output_old_and_new_python() -> None:
    log = _log("\n".join([
        "test_a (pkg.tests.Case) ... ok",
        "test_b (pkg.tests.Case.test_b) ... FAIL",
        "test_c (pkg.tests.Case.test_c) ... skipped 'slow'",
        "test_d (pkg.tests.Case.test_d) ... ERROR",
        "test_e (pkg.tests.Case.test_e) ... some output",
        "ok",
        "test_f (pkg.tests.Case.test_f) ... expected failure",
        "Ran 6 tests in 0.01s",
    ]), exit_code=1)
    report = grade(log, parser="unittest", fail_to_pass=["test_a (pkg.tests.Case)"],
                   pass_to_pass=["test_c (pkg.tests.Case.test_c)", "test_e (pkg.tests.Case.test_e)"])
    assert report.statuses == {"test_a (pkg.tests.Case)": "PASSED", "test_b (pkg.tests.Case.test_b)": "FAILED",
                               "test_c (pkg.tests.Case.test_c)": "SKIPPED", "test_d (pkg.tests.Case.test_d)": "ERROR",
                               "test_e (pkg.tests.Case.test_e)": "PASSED"}
    assert report.resolved


def test_pytest_lines_outside_the_summary_and_odd_ids() -> None:
    statuses = parse_pytest("PASSED tests/t.py::test_x[a - b]\nFAILED tests/t.py::test_y - boom\nPASSED\nXFAIL t::z\n")
    assert statuses == {"tests/t.py::test_x[a": "PASSED", "tests/t.py::test_y": "FAILED", "t::z": "XFAIL"}


# ------------------------------------------------------------------ the reference harness


def _reference():
    """Return swebench's grading and parser registry (its harness package's __init__ pulls in datasets and modal)."""
    import swebench

    if "swebench.harness" not in sys.modules:
        harness = types.ModuleType("swebench.harness")
        harness.__path__ = [str(Path(swebench.__file__).parent / "harness")]
        sys.modules["swebench.harness"] = harness
    from swebench.harness import grading
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS

    def reference(log: str, parser: str, f2p: list[str], p2p: list[str]) -> tuple[bool, dict[str, str]]:
        spec = types.SimpleNamespace(log_parser="parse_log_pytest" if parser == "pytest" else "parse_log_django")
        with tempfile.NamedTemporaryFile("w", suffix=".log") as file:
            file.write(log)
            file.flush()
            statuses, valid = grading.get_logs_eval(spec, file.name)
        if not valid:
            return False, {}
        report = grading.get_eval_tests_report(statuses, {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p})
        return grading.get_resolution_status(report) == "RESOLVED_FULL", statuses

    return reference


def test_the_reference_reads_its_logs_the_way_this_test_calls_it() -> None:
    """The reference is swebench's own get_logs_eval (a log file in, statuses out) and its report functions."""
    import swebench

    assert swebench.__version__ == "5.0.2"
    reference = _reference()
    assert reference(CASES["resolved"][0], "pytest", F2P, P2P)[0] is True


@pytest.mark.parametrize("name", sorted(CASES))
def test_grading_agrees_with_the_reference_on_every_case(name: str) -> None:
    log, _ = CASES[name]
    mine = grade(log, parser="pytest", fail_to_pass=F2P, pass_to_pass=P2P)
    resolved, statuses = _reference()(log, "pytest", F2P, P2P)
    assert mine.resolved is resolved
    if mine.valid:
        assert mine.statuses == statuses


def test_grading_agrees_with_the_reference_on_real_logs(swe_store, tmp_path: Path) -> None:
    """Real pytest and unittest runs of the shipped instances (buggy and fixed), graded by both."""
    import subprocess

    from tests.workers.conftest import SWE_EXAMPLES

    store, tasks = swe_store
    reference = _reference()
    checked = 0
    chosen = {t.instance_id: t for t in [*tasks[::3], *(t for t in tasks if t.log_parser == "unittest")]}
    for task in chosen.values():
        for fixed in (False, True):
            where = tmp_path / f"{task.instance_id}-{fixed}"
            where.mkdir()
            subprocess.run(["tar", "-xf", "-"], input=store.archive(task.repo, task.base_commit), cwd=where, check=True)
            for patch, reverse in ((task.patch, False), (task.test_patch, False), (task.patch if fixed else "", True)):
                if patch:
                    subprocess.run(["git", "apply", *(["-R"] if reverse else []), "-"], input=patch.encode(),
                                   cwd=where, check=True)
            command = task.test_cmd.replace("python ", f"{sys.executable} ", 1) if task.test_cmd.startswith(
                "python ") else f"{sys.executable} -m {task.test_cmd}"
            run = subprocess.run(["bash", "-c", command], cwd=where, capture_output=True, text=True, timeout=300)
            log = f"{START_MARKER}\n{run.stdout}{run.stderr}\n{END_MARKER}\n{EXIT_MARKER}: {run.returncode}\n"
            mine = grade(log, parser=task.log_parser, fail_to_pass=task.fail_to_pass, pass_to_pass=task.pass_to_pass)
            resolved, statuses = reference(log, task.log_parser, list(task.fail_to_pass), list(task.pass_to_pass))
            assert (mine.resolved, mine.statuses) == (resolved, statuses), task.instance_id
            assert mine.resolved is fixed, (task.instance_id, mine.to_info())
            checked += 1
    assert checked >= 10 and SWE_EXAMPLES.is_dir()

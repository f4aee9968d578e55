"""The agent's change taken host-side (workers.envs.swe.patch): real layer dirs, the host's real git.

Layers are made here as overlayfs keeps them (a whiteout is a 0/0 character device), a
base layer holding the reset point and an upper holding what the agent did. Every patch
is checked the way the grader uses it: ``git apply`` in a copy of the base workdir must
give the agent's files.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from sandboxes.layers import LayerStack
from workers.envs.swe import patch as patch_module
from workers.envs.swe.patch import (
    CAUSE_PATCH_TOO_LARGE,
    MAX_PATCH_BYTES,
    PatchError,
    is_test_file,
    take_patch,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts need root")

WORKDIR = "/testbed"
HOOK = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
PYPROJECT = '[project]\nname = "calc"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
SETUP_CFG = "[metadata]\nname = calc\n\n[tool:pytest]\naddopts = -q\n"


def _write(layer: Path, rel: str, data: str | bytes = "x\n", mode: int = 0o644) -> None:
    path = layer / WORKDIR.lstrip("/") / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)


def _delete(layer: Path, rel: str) -> None:
    path = layer / WORKDIR.lstrip("/") / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


class Repo:
    """A base layer (the reset point) and an upper layer (the agent's changes) of one workdir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lower = root / "lower"
        self.upper = root / "upper"
        for path in (self.lower / WORKDIR.lstrip("/"), self.upper):
            path.mkdir(parents=True)
        _write(self.lower, "calc/__init__.py", "from calc.numbers import clamp\n")
        _write(self.lower, "calc/numbers.py", "def clamp(value, low, high):\n    return max(low, min(value, high))\n")
        _write(self.lower, "tests/test_numbers.py", "from calc import clamp\n\ndef test_clamp():\n    assert clamp(5, 0, 3) == 3\n")
        _write(self.lower, "pyproject.toml", PYPROJECT)
        _write(self.lower, ".git/HEAD", "ref: refs/heads/main\n")

    def take(self, **kwargs):
        return take_patch(LayerStack([self.lower]), LayerStack([self.lower, self.upper]), WORKDIR, **kwargs)

    def applies(self, patch: bytes) -> Path:
        """Apply ``patch`` with git in a copy of the base workdir (as a grader does); return the copy."""
        out = self.root / "applied"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(self.lower / WORKDIR.lstrip("/"), out, symlinks=True)
        if patch:
            subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=patch, cwd=out, check=True,
                           capture_output=True)
        return out


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path)


def _paths(findings) -> dict[str, str]:
    return {f.path: f.why for f in findings}


@pytest.mark.parametrize(("path", "test"), [
    ("tests/test_calc.py", True), ("src/pkg/tests/helpers.py", True), ("conftest.py", True),
    ("pkg/conftest.py", True), ("calc/stats_test.py", True), ("testing/util.py", True), ("test_x.py", True),
    ("calc/stats.py", False), ("calc/testing_utils.py", False), ("README.md", False), ("src/contest.py", False),
    ("pytest.ini", False), ("pyproject.toml", False),
])
def test_which_paths_are_test_files(path: str, test: bool) -> None:
    assert is_test_file(path) is test


def test_a_fix_is_a_patch_that_applies_to_the_base_and_names_nothing(repo: Repo) -> None:
    fixed = "def clamp(value, low, high):\n    return low if value < low else high if value > high else value\n"
    _write(repo.upper, "calc/numbers.py", fixed)
    _write(repo.upper, "calc/tool.sh", "#!/bin/sh\necho hi\n", mode=0o755)
    _write(repo.upper, "calc/blob.bin", bytes(range(256)) * 4)
    (repo.upper / "testbed/calc/link").symlink_to("numbers.py")
    _write(repo.upper, "calc/__pycache__/numbers.cpython-311.pyc", b"\x00bytecode")
    _write(repo.upper, ".git/config", "[diff]\n\texternal = /tmp/x.sh\n")  # the repository's own: never read
    taken = repo.take()
    assert taken.findings == [] and taken.bytecode_skipped >= 1
    assert {f.path for f in taken.files} == {"calc/numbers.py", "calc/tool.sh", "calc/blob.bin", "calc/link"}
    assert b"GIT binary patch" in taken.patch and b"rename" not in taken.patch and b"copy" not in taken.patch
    out = repo.applies(taken.patch)
    assert (out / "calc/numbers.py").read_text() == fixed
    assert os.access(out / "calc/tool.sh", os.X_OK) and os.readlink(out / "calc/link") == "numbers.py"
    assert (out / "calc/blob.bin").read_bytes() == bytes(range(256)) * 4
    assert not (out / "calc/__pycache__").exists()


def test_deletions_and_the_repositorys_attributes_are_not_honoured(repo: Repo) -> None:
    """A .gitattributes of the agent's cannot make git hide, filter or convert the change."""
    _delete(repo.upper, "calc/__init__.py")
    _write(repo.upper, ".gitattributes", "*.py -diff filter=evil eol=crlf\n*.txt binary\n")
    _write(repo.upper, "calc/numbers.py", "def clamp(value, low, high):\n    return value\n")
    taken = repo.take()
    assert b"Binary files" not in taken.patch and b"+    return value\n" in taken.patch
    out = repo.applies(taken.patch)
    assert not (out / "calc/__init__.py").exists() and b"\r\n" not in (out / "calc/numbers.py").read_bytes()


def test_ignore_rules_apply_as_git_add_applies_them(repo: Repo) -> None:
    """A new ignored file is no part of the change (never even copied); a tracked one that is ignored stays tracked."""
    _write(repo.lower, ".gitignore", "*.log\nbuild/\n")
    _write(repo.lower, "calc/keep.log", "tracked before the rule? no: ignored at the base too\n")
    _write(repo.lower, "calc/sub/.gitignore", "secret.txt\n")
    _write(repo.upper, "calc/new.log", "ignored\n")
    _write(repo.upper, "build/lib/huge.o", b"\0" * 1024)
    _write(repo.upper, "calc/sub/secret.txt", "ignored by the nested rule\n")
    _write(repo.upper, "calc/sub/open.txt", "kept\n")
    _write(repo.upper, "calc/keep.log", "changed, but never tracked\n")
    _write(repo.upper, ".gitignore", "*.log\nbuild/\ncalc/numbers.py\n")  # ignoring a tracked file keeps it tracked
    _write(repo.upper, "calc/numbers.py", "changed = True\n")
    taken = repo.take()
    assert {f.path for f in taken.files} == {".gitignore", "calc/sub/open.txt", "calc/numbers.py"}


def test_a_nested_repository_and_the_workdirs_git_are_left_out(repo: Repo) -> None:
    _write(repo.upper, "vendor/lib/.git/HEAD", "ref: refs/heads/main\n")
    _write(repo.upper, "vendor/lib/mod.py", "x = 1\n")
    _write(repo.upper, ".git/hooks/pre-commit", "#!/bin/sh\n", mode=0o755)
    _write(repo.upper, "calc/x.py", "x = 1\n")
    assert {f.path for f in repo.take().files} == {"calc/x.py"}


def test_changes_that_steer_the_grade_are_findings(repo: Repo) -> None:
    _write(repo.upper, "tests/test_numbers.py", "def test_clamp():\n    pass\n")
    _write(repo.upper, "tests/conftest.py", HOOK)
    _write(repo.upper, ".pytest.ini", "[pytest]\naddopts = -p calc.forge\n")
    _write(repo.upper, "calc/sitecustomize.py", "import os\n")
    _write(repo.upper, "calc/zz.pth", "import os\n")
    _write(repo.upper, "calc.egg-info/entry_points.txt", "[pytest11]\nforge = calc.forge\n")
    _write(repo.upper, "calc/_speedups.so", b"\x7fELF\0")
    taken = repo.take()
    found = _paths(taken.findings)
    assert set(found) == {"tests/test_numbers.py", "tests/conftest.py", ".pytest.ini", "calc/sitecustomize.py",
                          "calc/zz.pth", "calc.egg-info/entry_points.txt", "calc/_speedups.so"}
    assert all(found.values()) and {f.change for f in taken.findings} == {"added", "modified"}


@pytest.mark.parametrize(("name", "before", "after", "steers"), [
    ("pyproject.toml", PYPROJECT, PYPROJECT.replace('version = "0.1.0"', 'version = "0.1.0"\ndependencies = ["attrs"]'),
     False),
    ("pyproject.toml", PYPROJECT, PYPROJECT + 'addopts = "-p calc.forge"\n', True),
    ("pyproject.toml", PYPROJECT, PYPROJECT + "[tool.pytest]\nminversion = '9'\n", True),
    ("pyproject.toml", PYPROJECT, "[tool.pytest.ini_options\n", True),  # unparsable
    ("pyproject.toml", None, '[tool.pytest.ini_options]\naddopts = "-x"\n', True),
    ("setup.cfg", SETUP_CFG, SETUP_CFG.replace("name = calc", "name = calc\nversion = 2"), False),
    ("setup.cfg", SETUP_CFG, SETUP_CFG + "  -p calc.forge\n", True),
    ("setup.cfg", SETUP_CFG, SETUP_CFG.replace("[tool:pytest]", "[tool:pytest] ; moved"), False),
    ("setup.cfg", "[metadata]\nname = calc\n", "[metadata]\nname = calc\n[tool:pytest]\naddopts = -p x\n", True),
    # An indented header is a continuation of addopts to pytest's reader: a change of its section.
    ("setup.cfg", SETUP_CFG + "  [extra]\n", SETUP_CFG + "  [extra]\n  -p calc.forge\n", True),
    ("tox.ini", "[tox]\nenvlist = py3\n", "[tox]\nenvlist = py3,py4\n", False),
    ("tox.ini", "[tox]\nenvlist = py3\n", "[tox]\nenvlist = py3\n[pytest]\naddopts = -p x\n", True),
    ("tox.ini", "[pytest]\naddopts = -q\n", None, True),
    ("setup.cfg", SETUP_CFG, b"\xff\xfe[tool:pytest]\n", True),
])
def test_only_pytest_sections_of_shared_config_files_count(repo: Repo, name: str, before: str | None,
                                                           after: str | bytes | None, steers: bool) -> None:
    if before is not None:
        _write(repo.lower, f"pkg/{name}", before)
    if after is None:
        _delete(repo.upper, f"pkg/{name}")
    else:
        _write(repo.upper, f"pkg/{name}", after)
    taken = repo.take()
    assert [f.path for f in taken.files] == [f"pkg/{name}"]
    assert bool(taken.findings) is steers, taken.findings


def test_a_config_file_turned_into_a_link_counts(repo: Repo) -> None:
    _write(repo.upper, "calc/opts.txt", "[tool:pytest]\naddopts = -p calc.forge\n")
    (repo.upper / "testbed/setup.cfg").symlink_to("calc/opts.txt")
    assert "setup.cfg" in _paths(repo.take().findings)


def test_source_newly_naming_the_runners_internals_is_a_finding(repo: Repo) -> None:
    _write(repo.upper, "calc/__init__.py", "from calc.numbers import clamp\nimport _pytest.reports as r\n"
                                           "r.TestReport.outcome = 'passed'\n")
    _write(repo.upper, "calc/numbers.py", "import os\n\ndef clamp(value, low, high):\n    os._exit(0)\n")
    found = _paths(repo.take().findings)
    assert set(found) == {"calc/__init__.py", "calc/numbers.py"}
    assert "_pytest" in found["calc/__init__.py"] and "TestReport" in found["calc/__init__.py"]


def test_names_the_repositorys_own_code_already_has_are_not_findings(repo: Repo) -> None:
    """pytest's own repository names _pytest everywhere: its fixes are no tamper."""
    _write(repo.lower, "src/_pytest/reports.py", "class TestReport:\n    pass\n")
    _write(repo.lower, "src/_pytest/runner.py", "from _pytest.reports import TestReport\n")
    _write(repo.upper, "src/_pytest/runner.py", "from _pytest.reports import TestReport\nimport _pytest.nodes\n")
    _write(repo.upper, "calc/hook.py", "from _pytest.reports import TestReport\n")
    # A test file naming it does not count as the repository's code.
    _write(repo.lower, "tests/test_hooks.py", "def pytest_runtest_makereport():\n    pass\n")
    _write(repo.upper, "calc/more.py", "def pytest_runtest_makereport(item, call):\n    pass\n")
    taken = repo.take()
    assert [f.path for f in taken.findings] == ["calc/more.py"], taken.findings


def test_report_leaves_the_findings_out_of_the_patch(repo: Repo) -> None:
    fixed = "def clamp(value, low, high):\n    return 0\n"
    _write(repo.upper, "calc/numbers.py", fixed)
    _write(repo.upper, "tests/conftest.py", HOOK)
    _write(repo.upper, "tests/test_numbers.py", "def test_clamp():\n    pass\n")
    _delete(repo.upper, "pyproject.toml")
    taken = repo.take(leave_out_findings=True)
    assert taken.left_out == ["pyproject.toml", "tests/conftest.py", "tests/test_numbers.py"]
    out = repo.applies(taken.patch)
    assert (out / "calc/numbers.py").read_text() == fixed and not (out / "tests/conftest.py").exists()
    assert (out / "pyproject.toml").read_text() == PYPROJECT and "clamp(5, 0, 3)" in (out / "tests/test_numbers.py").read_text()


def test_a_change_larger_than_the_bounds_is_the_agents(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(repo.upper, "calc/blob.bin", os.urandom(MAX_PATCH_BYTES))
    with pytest.raises(PatchError) as info:
        repo.take()
    assert info.value.cause == CAUSE_PATCH_TOO_LARGE
    monkeypatch.setattr(patch_module, "MAX_EXPORT_FILES", 3)
    for n in range(4):
        _write(repo.upper, f"calc/m{n}.py", "x = 1\n")
    with pytest.raises(PatchError, match="larger than 3 files"):
        repo.take()


def test_git_reads_no_configuration_of_this_process(repo: Repo, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose environment or global config asks for an external diff or prefixes still gets git's own patch."""
    config = tmp_path / "gitconfig"
    config.write_text("[diff]\n\texternal = /bin/false\n\tnoprefix = true\n[core]\n\tautocrlf = true\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", "/bin/false")
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))
    _write(repo.upper, "calc/numbers.py", "x = 1\n")
    taken = repo.take()
    assert taken.patch.startswith(b"diff --git a/calc/numbers.py b/calc/numbers.py\n")
    repo.applies(taken.patch)

"""The tamper rules (workers.envs.tamper) on real layer dirs: what is a finding, what is put back silently,
and what is the agent's work. The end-to-end attempts are in tests/security/test_verdicts.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandboxes.layers import LayerStack, diff
from workers.envs.tamper import (
    VerifierContext,
    runner_hooks_in,
    scan_filesystem,
    scan_variables,
    verifier_environment,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts need root")

CONTEXT = VerifierContext(path_dirs=("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"))
SITE = "/usr/local/lib/python3.11/dist-packages"


def _put(layer: Path, rel: str, data: bytes = b"x", mode: int = 0o644) -> None:
    path = layer / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    layer = tmp_path / "image"
    for program in ("/usr/bin/env", "/usr/bin/bash", "/usr/bin/python3", "/usr/bin/sqlite3", "/usr/sbin/ldconfig"):
        _put(layer, program, program.encode(), 0o755)
    _put(layer, "/usr/lib/x86_64-linux-gnu/libc.so.6", b"libc", 0o755)
    _put(layer, "/usr/lib/python3.11/json/__init__.py", b"json")
    _put(layer, "/usr/lib/x86_64-linux-gnu/gio/modules/giomodule.cache", b"cache")
    _put(layer, "/usr/lib/python3/dist-packages/pytest/__init__.py", b"pytest")
    _put(layer, "/var/lib/dpkg/info/coreutils.list", b"/usr/bin/env\n/usr/bin/ls\n")
    _put(layer, "/etc/apt/sources.list", b"deb http://deb.debian.org/debian bookworm main\n")
    return layer


def _scan(image: Path, agent: Path):
    base, top = LayerStack([image]), LayerStack([image, agent])
    return scan_filesystem(diff(base, top), top=top, base=base, context=CONTEXT)


def _sorted(scan) -> tuple[set[str], set[str]]:
    return {f.path for f in scan.findings}, set(scan.reset)


@pytest.mark.parametrize(("rel", "data", "mode"), [
    ("/usr/bin/env", b"forged", 0o755),                        # the image's program, rewritten
    ("/usr/lib/x86_64-linux-gnu/libc.so.6", b"forged", 0o755),  # the image's library
    ("/usr/lib/python3.11/json/__init__.py", b"forged", 0o644),  # the image's Python code
    ("/usr/local/bin/python3", b"#!/bin/sh", 0o755),            # in front of the image's python3 on the PATH
    ("/usr/local/bin/env", b"#!/bin/sh", 0o755),                # in front of the image's env (a coreutil)
    ("/usr/local/lib/libc.so.6", b"forged", 0o755),             # a library named as the image's
    (f"{SITE}/zz.pth", b"import os; os._exit(0)\n", 0o644),      # a .pth that runs code
    (f"{SITE}/sitecustomize.py", b"x", 0o644),
    ("/root/.local/lib/python3.11/site-packages/usercustomize.py", b"x", 0o644),
    ("/root/.local/lib/python3.11/site-packages/zz.pth", b"import os\n", 0o644),  # the user site: read too
    ("/etc/ld.so.preload", b"/tmp/x.so", 0o644),
    ("/pytest.ini", b"[pytest]\n", 0o644),
    ("/conftest.py", b"x", 0o644),
    ("/tests/test.sh", b"x", 0o755),
    ("/logs/verifier/reward.txt", b"1", 0o644),
])
def test_changes_to_what_the_verifier_relies_on_are_findings(tmp_path: Path, image: Path, rel: str, data: bytes,
                                                             mode: int) -> None:
    agent = tmp_path / "agent"
    _put(agent, rel, data, mode)
    found, reset = _sorted(_scan(image, agent))
    assert rel in found and rel not in reset


def test_a_deleted_program_and_a_replaced_log_dir_are_findings(tmp_path: Path, image: Path) -> None:
    agent = tmp_path / "agent"
    (agent / "usr/bin").mkdir(parents=True)
    os.mknod(agent / "usr/bin/bash", stat.S_IFCHR, os.makedev(0, 0))
    _put(agent, "/logs", b"not a dir")
    found, _ = _sorted(_scan(image, agent))
    assert found == {"/usr/bin/bash", "/logs"}


@pytest.mark.parametrize("rel", [
    f"{SITE}/pytest_forge/__init__.py",              # a plugin package
    f"{SITE}/pip/__init__.py",                       # an upgraded pip
    f"{SITE}/pytest/__init__.py",                    # a pytest (fake or not) in front of the image's
    f"{SITE}/setuptools/__init__.py",
    f"{SITE}/distutils-precedence.pth",              # setuptools' own shim
    f"{SITE}/forge-1.0.dist-info/entry_points.txt",   # a pytest11 entry point (below)
    "/usr/local/bin/pytest",
    "/usr/lib/python3.11/json/__pycache__/__init__.cpython-311.pyc",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf.d/fakeroot.conf",
    "/etc/apt/sources.list.d/deb-src.list",
    "/etc/apt/apt.conf.d/99hook",
    "/etc/pip.conf",
    "/root/.config/pip/pip.conf",
])
def test_routine_changes_are_put_back_without_a_finding(tmp_path: Path, image: Path, rel: str) -> None:
    agent = tmp_path / "agent"
    _put(agent, rel, b"[pytest11]\nforge = forge\n" if rel.endswith("entry_points.txt") else b"x", 0o755)
    scan = _scan(image, agent)
    found, reset = _sorted(scan)
    assert rel in reset and not found
    assert scan.rebuild_loader_cache == rel.startswith("/etc/ld.so")


@pytest.mark.parametrize("rel", [
    "/app/answer.txt",
    "/usr/local/bin/mytool",                            # a new program of the agent's own
    "/usr/local/bin/sqlite3",                          # built and installed by the task: not a verifier's program
    f"{SITE}/numpy/__init__.py",                        # a third-party package
    f"{SITE}/app-lib.pth",                              # a .pth of paths only (below)
    "/usr/lib/x86_64-linux-gnu/gio/modules/giomodule.cache",  # data an install's triggers rewrite
    "/usr/lib/x86_64-linux-gnu/libnew.so.1",
    "/root/.bashrc",                                    # the verifier's shell reads none
    "/etc/passwd",
    "/etc/nginx/conf.d/site.conf",
])
def test_the_agents_work_is_left_alone(tmp_path: Path, image: Path, rel: str) -> None:
    agent = tmp_path / "agent"
    _put(agent, rel, b"/app/lib\n" if rel.endswith(".pth") else b"x", 0o755)
    scan = _scan(image, agent)
    assert scan.findings == [] and scan.revert == []


def test_a_virtualenv_the_agent_made_is_its_own(tmp_path: Path, image: Path) -> None:
    """python3 -m venv puts pip, setuptools and setuptools' .pth in the venv: none of it is the verifier's."""
    agent = tmp_path / "agent"
    venv_site = "/app/.venv/lib/python3.11/site-packages"
    _put(agent, "/app/.venv/pyvenv.cfg", b"home = /usr/bin\n")
    for rel in ("pip/__init__.py", "setuptools/__init__.py", "_distutils_hack/__init__.py", "pytest/__init__.py"):
        _put(agent, f"{venv_site}/{rel}")
    _put(agent, f"{venv_site}/distutils-precedence.pth", b"import os; var = 'SETUPTOOLS_USE_DISTUTILS'\n")
    scan = _scan(image, agent)
    assert scan.findings == [] and scan.revert == []


def test_variables_that_run_a_file_at_start_are_findings_and_never_reach_the_verifier() -> None:
    initial = {"PATH": "/usr/bin", "ENV": "/etc/shrc"}
    exported = {**initial, "BASH_ENV": "/tmp/x.sh", "PYTHONPATH": "/app", "ENV": "/etc/shrc",
                "BASH_FUNC_ls%%": "() { true; }"}
    assert [f.variable for f in scan_variables(exported, initial)] == ["BASH_ENV", "BASH_FUNC_ls%%"]
    env = verifier_environment({**initial, "LD_PRELOAD": "/x.so"}, {"MARK": "1"})
    assert env == {"PATH": "/usr/bin", "MARK": "1"}


def test_runner_internals_are_named() -> None:
    assert runner_hooks_in("import _pytest.reports\ndef pytest_runtest_makereport(item): ...") == {
        "_pytest", "pytest_runtest_makereport"}
    assert runner_hooks_in("import pytest\nassert x == 1") == set()

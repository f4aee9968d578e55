"""What a verifier must not trust: the agent's changes to the tools and hooks a verdict runs through.

A reward is computed with the task image's own programs, reading the agent's work. This
module decides, from a host-side diff of the agent's files against the state it started
from (:func:`sandboxes.layers.diff`), which changes touch the verifier's side. Every such
change is put back as the image had it for the verifier (:func:`sandboxes.layers.seed_revert`);
some are also a :class:`Finding`, which a task's ``tamper`` policy turns into a refused
verdict (the default) or only reports.

Findings: changes honest work has no reason to make.

- the image's own code (a program, a library, a script, a symbolic link) under a program
  or library directory (``/usr/bin``, ``/usr/lib``, ``/usr/local/lib``, every directory on
  the verifier's ``PATH`` and the ``lib`` beside it), modified, replaced or deleted;
- a new program in front of one the verifier runs (a shell, ``env``, a coreutil, Python,
  pytest, pip, uv) on the ``PATH``; a new library named as one of the image's in a
  directory the loader searches first;
- start hooks: a ``.pth`` with an ``import`` line, ``sitecustomize``/``usercustomize``,
  ``/etc/ld.so.preload``;
- pytest configuration above the tests (``/pytest.ini``, ``/conftest.py``...);
- anything in the verifier's own directories (``/tests``, ``/logs/verifier``);
- variables exported in the agent's shell that make a shell or interpreter run a file at start.

Put back silently: changes honest work makes all the time (measured on real Terminal-Bench
tasks and honest installs: apt, pip, upgrading pip or setuptools or pytest) but that a
verifier must not run with: the test runner, its plugins and the installers as the agent
installed, upgraded or replaced them (a fake pytest in front of the image's included),
bytecode caches,
the loader's cache and configuration, ``/etc/alternatives``, package-manager configuration
(apt sources and hooks, pip, npm, uv, cargo).

Left alone, as the agent's work: everything else, new programs and libraries, third-party
Python packages, virtualenvs the agent made, data files (caches) under the program
directories, and shell rc files
(the verifier's shell reads none; a test that opens an interactive shell asks for them,
as Terminal-Bench's headless-terminal does).

What this cannot see: code the agent wrote that the tests themselves import runs inside
the test process and can rewrite its results. :func:`runner_hooks_in` flags source that
reaches into a test runner's internals, a heuristic and no proof.
"""

from __future__ import annotations

import enum
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandboxes.layers import ChangeKind, Entry, EntryKind, FileChange, LayerStack

#: Directories holding the image's programs and libraries (beside the PATH's own).
TOOL_DIRS = (
    "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32",
    "/usr/lib64", "/usr/libx32", "/usr/libexec", "/usr/local/bin", "/usr/local/sbin", "/usr/local/lib",
    "/usr/local/lib64", "/usr/local/libexec",
)  # fmt: skip
#: Directories the dynamic loader searches (libraries named as the image's must not appear in them).
LIBRARY_DIRS = (
    "/usr/local/lib", "/usr/local/lib64", "/usr/local/lib/x86_64-linux-gnu", "/usr/local/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
    "/lib64", "/usr/lib64", "/lib", "/usr/lib",
)  # fmt: skip
#: Files run by the loader at every program start.
HOOK_FILES = ("/etc/ld.so.preload",)
#: Configuration a verifier must see as the image has it (its own installs and loader read it), put back silently.
RESET_CONFIG = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/apt", "/etc/dpkg",
    "/etc/pip.conf", "/etc/xdg/pip", "/etc/npmrc", "/usr/etc/npmrc", "/usr/local/etc/npmrc", "/etc/uv",
)  # fmt: skip
HOME_RESET_CONFIG = (".pip", ".config/pip", ".pydistutils.cfg", ".npmrc", ".config/uv", ".cargo/config",
                     ".cargo/config.toml")
#: Top-level names under site-packages of what a verifier runs or installs with: the test runner, the
#: packages it imports at start, the installers. Put back silently when the agent adds or changes them
#: (honest work installs pytest and upgrades pip all the time): the verifier gets the image's.
VERIFIER_PACKAGES = frozenset({
    "pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "pygments", "exceptiongroup", "tomli",
    "colorama", "pip", "setuptools", "_distutils_hack", "pkg_resources", "wheel", "uv",
})  # fmt: skip
#: The .pth files of those packages (setuptools' shim): put back with them.
_VERIFIER_PTH = frozenset({"distutils-precedence.pth"})
#: Their commands on the PATH.
VERIFIER_SCRIPTS = re.compile(r"(pytest|py\.test|pip|pip3(\.\d+)?|uv|uvx)")
#: Programs a verifier runs whatever the task (besides the image's coreutils): a new one of these
#: names in front of the image's on the PATH is a finding.
VERIFIER_PROGRAMS = re.compile(r"(bash|sh|dash|env|python|python3(\.\d+)?|pytest|py\.test|pip|pip3(\.\d+)?|uvx?)")
#: Coreutils' programs, for an image without dpkg's list of them.
COREUTILS = frozenset((
    "cat chgrp chmod chown cp date dd df dir echo false ln ls mkdir mknod mktemp mv pwd readlink rm rmdir sleep "
    "stty sync touch true uname vdir [ arch b2sum base32 base64 basename basenc chcon cksum comm csplit cut "
    "dirname du env expand expr factor fmt fold groups head hostid id install join link logname md5sum mkfifo "
    "nice nl nohup nproc numfmt od paste pathchk pinky pr printenv printf ptx realpath runcon seq sha1sum "
    "sha224sum sha256sum sha384sum sha512sum shred shuf sort split stat stdbuf sum tac tail tee test timeout tr "
    "truncate tsort tty unexpand uniq unlink users wc who whoami yes chroot").split())
_COREUTILS_LIST = "/var/lib/dpkg/info/coreutils.list"
#: pytest's configuration files (and conftest.py), honoured in the tests' directory and above it.
RUNNER_CONFIG_FILES = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg",
                                 "pyproject.toml", "conftest.py"})
#: Variables that make a shell or an interpreter run a file at start; never passed to a verifier.
HOOK_VARIABLES = frozenset({
    "BASH_ENV", "ENV", "PROMPT_COMMAND", "SHELLOPTS", "BASHOPTS", "LD_PRELOAD", "LD_AUDIT", "PYTHONSTARTUP",
    "PYTHONINSPECT", "PERL5OPT", "NODE_OPTIONS", "RUBYOPT",
})  # fmt: skip
#: What marks a file as code rather than data (a cache, a table) when it has no execute bit.
_CODE_SUFFIX = re.compile(r"\.(so(\.[\d.]+)?|py|pyc|pth|pm|pl|rb|js|mjs|cjs|sh|jar|class)$")
_SITE_DIR = re.compile(r"/(site|dist)-packages(/|$)")
_PTH_CODE = re.compile(rb"^(import[ \t])", re.M)
_PYTEST_ENTRY_POINT = re.compile(rb"^\s*\[pytest11\]\s*$", re.M)
_STARTUP_MODULES = ("sitecustomize", "usercustomize")
#: Reading limits for the files whose content decides (a .pth, an entry_points.txt, dpkg's list).
_MAX_READ = 1 << 20


class TamperPolicy(str, enum.Enum):
    """What findings do to a verdict (``[verifier] tamper`` in task.toml, ``tamper`` of a SWE instance)."""

    FAIL = "fail"
    """Reward 0 with ``info.cause = "tamper"`` (the default)."""
    REPORT = "report"
    """The verifier runs on the agent's work with the tools put back; findings are listed."""


@dataclass(frozen=True)
class Finding:
    """One change the agent made to something a verdict relies on."""

    why: str
    path: str | None = None
    variable: str | None = None
    change: str | None = None
    """added, modified or deleted (paths only)."""

    def as_dict(self) -> dict[str, Any]:
        """Return the finding as ``info.tamper`` lists it."""
        out: dict[str, Any] = {"path": self.path} if self.path is not None else {"variable": self.variable}
        if self.change is not None:
            out["change"] = self.change
        out["why"] = self.why
        return out


@dataclass
class FilesystemScan:
    """What the agent's changes mean to a verifier: findings, and the paths to put back."""

    findings: list[Finding] = field(default_factory=list)
    revert: list[str] = field(default_factory=list)
    """Every path to show as the image had it: findings' and silently reset ones'."""
    reset: list[str] = field(default_factory=list)
    """Paths put back without a finding."""
    rebuild_loader_cache: bool = False
    """The loader's cache or configuration was put back: the verifier rebuilds the cache with the image's
    ``ldconfig`` (so libraries the agent installed are still found)."""


def _under(path: str, roots: Iterable[str]) -> str | None:
    for root in roots:
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return root
    return None


def _distribution_name(top: str) -> str:
    """Return the project a site-packages entry belongs to (``pytest`` of ``pytest-8.3.2.dist-info``)."""
    for suffix in (".dist-info", ".egg-info", ".egg-link"):
        if top.endswith(suffix):
            return top[: -len(suffix)].rsplit("-", 1)[0].replace("-", "_").lower()
    return top.split(".", 1)[0].lower()


def _is_code(entry: Entry) -> bool:
    """Tell whether an image entry is code (a program, library, script or link) rather than data."""
    if entry.kind is EntryKind.SYMLINK:
        return True
    return entry.kind is EntryKind.FILE and bool(entry.mode & 0o111 or _CODE_SUFFIX.search(entry.path))


@dataclass(frozen=True)
class VerifierContext:
    """Where the verifier runs: what it executes, where it looks and whose homes it uses."""

    path_dirs: Sequence[str]
    """The verifier's PATH, in order."""
    homes: Sequence[str] = ("/root",)
    tests_dir: str = "/tests"
    verifier_dirs: Sequence[str] = ("/logs/verifier",)

    def tool_dirs(self) -> tuple[str, ...]:
        """Return every directory whose image content the verifier's programs come from."""
        dirs = list(TOOL_DIRS)
        for d in self.path_dirs:
            d = posixpath.normpath(d) if d.startswith("/") else ""
            if not d or d == "/":
                continue
            dirs.append(d)
            parent = posixpath.dirname(d)
            if parent not in ("", "/"):
                dirs += [f"{parent}/lib", f"{parent}/lib64", f"{parent}/libexec"]
        return tuple(dict.fromkeys(dirs))

    def runner_config_dirs(self) -> tuple[str, ...]:
        """Return the directories above the tests, where pytest would look for its configuration."""
        parts = [p for p in self.tests_dir.split("/") if p]
        return tuple("/" + "/".join(parts[:i]) for i in range(len(parts)))


@dataclass(frozen=True)
class _Rules:
    """The context's paths, worked out once per scan."""

    context: VerifierContext
    base: LayerStack
    top: LayerStack
    tool_dirs: tuple[str, ...]
    reset_config: tuple[str, ...]
    verifier_dirs: tuple[str, ...]
    config_dirs: tuple[str, ...]
    path_dirs: tuple[str, ...]
    verifier_programs: frozenset[str]


def scan_filesystem(changes: Sequence[FileChange], *, top: LayerStack, base: LayerStack,
                    context: VerifierContext) -> FilesystemScan:
    """Sort the agent's changes into findings, silent resets and the rest (the agent's work)."""
    homes = [h.rstrip("/") for h in context.homes]
    rules = _Rules(
        context=context, base=base, top=top, tool_dirs=context.tool_dirs(),
        reset_config=(*RESET_CONFIG, *(f"{h}/{n}" for h in homes for n in HOME_RESET_CONFIG)),
        verifier_dirs=(context.tests_dir, *context.verifier_dirs), config_dirs=context.runner_config_dirs(),
        path_dirs=tuple(context.path_dirs), verifier_programs=_coreutils(base) | {"env"},
    )  # fmt: skip
    scan = FilesystemScan()
    for change in changes:
        why, silent = _judge(change, rules)
        if why is None:
            continue
        scan.revert.append(change.path)
        if silent:
            scan.reset.append(change.path)
            scan.rebuild_loader_cache |= _under(change.path, ("/etc/ld.so.cache", "/etc/ld.so.conf",
                                                              "/etc/ld.so.conf.d")) is not None
        else:
            scan.findings.append(Finding(why=why, path=change.path, change=change.kind.value))
    return scan


def _coreutils(base: LayerStack) -> frozenset[str]:
    """Return the names of the image's coreutils programs (dpkg's list of them, else a fixed list)."""
    try:
        listed = base.read(_COREUTILS_LIST, max_bytes=_MAX_READ).decode("utf-8", "replace").split()
    except Exception:  # noqa: BLE001 - not a Debian image, or no such list
        return COREUTILS
    names = {posixpath.basename(p) for p in listed if "/bin/" in p}
    return frozenset(names) or COREUTILS


def _judge(change: FileChange, rules: _Rules) -> tuple[str | None, bool]:
    """Return (why the verifier must not see this change, whether it is put back silently), or (None, False)."""
    path, kind, after = change.path, change.kind, change.after
    parent, name = posixpath.split(path)
    if (root := _under(path, rules.verifier_dirs)) is not None:
        return f"written where the verifier's own files go ({root})", False
    if after is not None and after.kind is not EntryKind.DIR and \
            any(d.startswith(path + "/") for d in rules.verifier_dirs):
        return "replaced a directory the verifier's files go in", False
    if "/__pycache__/" in path + "/" and (_under(path, rules.tool_dirs) or _SITE_DIR.search(path)):
        return "a bytecode cache (rebuilt from the sources)", True
    if (root := _under(path, HOOK_FILES)) is not None:
        return f"runs at every program start ({root})", False
    if (root := _under(path, rules.reset_config)) is not None:
        return f"configuration the verifier's own installs or loader read ({root})", True
    if name.split(".", 1)[0] in _STARTUP_MODULES and kind is not ChangeKind.DELETED:
        return f"{name.split('.', 1)[0]} runs at every Python start", False
    if parent in rules.config_dirs and name in RUNNER_CONFIG_FILES:
        return f"pytest reads {name} above the tests ({rules.context.tests_dir})", False
    site = _SITE_DIR.search(path)
    if site is not None and path[site.end():]:
        return _judge_site_packages(change, rules, site_dir=path[:site.end()].rstrip("/"),
                                    top_name=path[site.end():].split("/", 1)[0])
    if parent in rules.path_dirs and VERIFIER_SCRIPTS.fullmatch(name):
        return f"the command {name}, which a verifier runs", True
    tool_root = _under(path, rules.tool_dirs)
    if tool_root is None:
        return None, False
    before = change.before
    if kind is not ChangeKind.ADDED and before is not None:
        if before.kind is EntryKind.DIR:
            return "a directory of the image's programs", True
        if _is_code(before):
            return f"the image's own {'program' if 'bin' in tool_root else 'code'} under {tool_root} was {kind.value}", \
                False
        return None, False  # data (a cache, a table) the agent's installs rewrite
    if after is not None and after.kind is not EntryKind.DIR:
        shadowed = _shadowed(path, rules)
        if shadowed:
            return f"stands in front of the image's {shadowed}", False
    return None, False


def _judge_site_packages(change: FileChange, rules: _Rules, *, site_dir: str, top_name: str) -> tuple[str | None, bool]:
    """Judge a change inside a site-packages dir: start hooks, the test runner, or the agent's own packages.

    A virtualenv the agent made is its work whole: only its own interpreter reads it, and a
    verifier runs that only where the task says so. (A user site dir is not one: the image's
    Python reads it.)
    """
    venv = posixpath.dirname(posixpath.dirname(posixpath.dirname(site_dir)))  # <venv>/lib/pythonX.Y/site-packages
    if rules.top.lookup(f"{venv}/pyvenv.cfg") is not None and rules.base.lookup(f"{venv}/pyvenv.cfg") is None:
        return None, False
    path, kind, after = change.path, change.kind, change.after
    name = posixpath.basename(path)
    live = kind is not ChangeKind.DELETED and after is not None and after.kind is EntryKind.FILE
    project = _distribution_name(top_name)
    if project in VERIFIER_PACKAGES or project.startswith(("pytest_", "pytest-")) or name in _VERIFIER_PTH:
        return f"what the verifier tests or installs with ({top_name})", True
    if name.endswith(".pth") and top_name == name and live and _pth_runs_code(rules.top, path):
        return "a .pth file with an import line runs code at every Python start", False
    if name == "entry_points.txt" and live and _pytest_plugin(rules.top, path):
        return "registers a pytest plugin (a pytest11 entry point), which pytest would load at start", True
    return None, False  # third-party packages are the agent's to install and upgrade


def _shadowed(path: str, rules: _Rules) -> str | None:
    """Return the image program or library a new file at ``path`` stands in front of, if it matters."""
    parent, name = posixpath.split(path)
    if parent in rules.path_dirs and (VERIFIER_PROGRAMS.fullmatch(name) or name in rules.verifier_programs):
        for d in rules.path_dirs[rules.path_dirs.index(parent) + 1:]:
            if d != parent and rules.base.lookup(f"{d}/{name}") is not None:
                return f"{d}/{name}"
    if parent in LIBRARY_DIRS and ".so" in name:
        for d in LIBRARY_DIRS:
            if d != parent and rules.base.lookup(f"{d}/{name}") is not None:
                return f"{d}/{name}"
    return None


def _pth_runs_code(top: LayerStack, path: str) -> bool:
    try:
        return bool(_PTH_CODE.search(top.read(path, max_bytes=_MAX_READ)))
    except Exception:  # noqa: BLE001 - unreadable within bounds (too large, a special file): assume the worst
        return True


def _pytest_plugin(top: LayerStack, path: str) -> bool:
    try:
        return bool(_PYTEST_ENTRY_POINT.search(top.read(path, max_bytes=_MAX_READ)))
    except Exception:  # noqa: BLE001 - unreadable within bounds: assume the worst
        return True


def scan_variables(exported: Mapping[str, str], initial: Mapping[str, str]) -> list[Finding]:
    """Return the start-hook variables the agent exported that the image did not set (the verifier drops them)."""
    found = []
    for name in sorted(exported):
        if (name in HOOK_VARIABLES or name.startswith("BASH_FUNC_")) and exported[name] != initial.get(name):
            found.append(Finding(variable=name, why="makes a shell or an interpreter run a file at start"))
    return found


def verifier_environment(initial: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """Return the environment a verifier runs with: the image's (as the sandbox started), less start hooks, plus ``extra``."""
    env = {k: v for k, v in initial.items() if k not in HOOK_VARIABLES and not k.startswith("BASH_FUNC_")}
    env.update(extra)
    return env


#: Names that reach into a test runner's reporting machinery (in-process forgery).
_RUNNER_INTERNALS = re.compile(
    r"\b(_pytest\b|pytest_runtest_\w+|pytest_report_\w+|pytest_collection_\w+|TestReport\b|CallInfo\b|hookwrapper\b"
    r"|pluggy\b|pytest_configure\b|pytest_sessionfinish\b|unittest\.TestResult\b|addSuccess\b|addFailure\b"
    r"|os\._exit\b|sys\.settrace\b|sys\.setprofile\b)"
)


def runner_hooks_in(added: str) -> set[str]:
    """Return the test-runner internals ``added`` (source lines) names: code that could rewrite results."""
    return {m.group(1) for m in _RUNNER_INTERNALS.finditer(added)}


__all__ = [
    "HOOK_VARIABLES",
    "FilesystemScan",
    "Finding",
    "TamperPolicy",
    "VerifierContext",
    "runner_hooks_in",
    "scan_filesystem",
    "scan_variables",
    "verifier_environment",
]

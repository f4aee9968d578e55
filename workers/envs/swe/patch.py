"""The agent's change to a SWE repository, taken on the host, and what in it would steer its own grade.

The change is what ``git add -A && git diff --cached <base commit>`` in the workdir shows,
computed without running a program of the agent's sandbox and without reading a byte of
its repository's configuration (:func:`take_patch`):

1. :func:`sandboxes.layers.diff` lists what the agent's files changed against the state it
   started from, both read host-side from immutable snapshot layers;
2. the changed paths under the workdir (less ``.git``, nested repositories and Python's
   bytecode, which Python rebuilds from the sources) go into a private temp dir as two
   sparse trees, ``base/`` and ``agent/``, with the ``.gitignore`` files above them, so
   that ignore rules apply as they would in the workdir: a new ignored file is no part
   of the change, a tracked one stays tracked;
3. the host's git, with a private repository and an environment that reads no
   configuration (no system or global config; an attributes file that unsets every
   attribute, which beats any ``.gitattributes`` in the trees: no external diff,
   textconv, filter or eol conversion), indexes both trees and diffs them with
   ``--binary --full-index --no-renames``: the patch holds no copy or rename header, and
   every byte of it is git's own.

:func:`find_tamper` then names what in the change decides how the tests run or what they
report: test files and ``conftest.py``, pytest's configuration, interpreter startup
files, pytest plugin entry points, native modules, and source that newly names the test
runner's internals. The last is a heuristic and no proof: code the tests import runs
inside the test process, and no filter rules out that it rewrites their results.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandboxes.errors import FileTooLargeError, SandboxError
from sandboxes.layers import ChangeKind, Entry, EntryKind, FileChange, LayerStack, diff
from workers.envs.tamper import Finding, runner_hooks_in

logger = logging.getLogger(__name__)

#: The most of the agent's patch the grader takes; a bigger change is graded 0 with the reason.
MAX_PATCH_BYTES = 4 * 1024 * 1024
#: The most bytes and files of the agent's change (both sides) copied out of the layers to diff.
MAX_EXPORT_BYTES = 256 * 1024 * 1024
MAX_EXPORT_FILES = 20_000
#: The most changed paths under the workdir looked at (ignored ones included: a virtualenv, a build dir).
MAX_CHANGED_PATHS = 200_000
#: ``info.cause`` of a change too large to take or to grade.
CAUSE_PATCH_TOO_LARGE = "patch_too_large"
#: ``info.cause`` of a change git cannot store (a path it refuses).
CAUSE_PATCH_INVALID = "patch_invalid"
#: Where the sparse trees and the private repository are made.
TEMP_ROOT = "/tmp"

# Each git call is local work on bounded input.
_GIT_TIMEOUT_S = 300.0
# Unsets every attribute for every path: $GIT_DIR/info/attributes beats each .gitattributes.
_NO_ATTRIBUTES = b"* !diff !filter !text !eol !ident !working-tree-encoding !merge !binary !export-subst\n"
# Settings pinned on the command line, where no file can change them.
_GIT_SETTINGS = (
    "core.autocrlf=false", "core.safecrlf=false", "core.fileMode=true", "core.symlinks=true",
    "core.ignoreCase=false", "core.precomposeUnicode=false", "core.fsmonitor=false", "core.untrackedCache=false",
    "core.hooksPath=/dev/null", "core.excludesFile=/dev/null", "diff.noprefix=false", "diff.mnemonicPrefix=false",
    "diff.renames=false", "gc.auto=0", "maintenance.auto=false",
)  # fmt: skip
_STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_GIT_STATUS = {"A": ChangeKind.ADDED, "D": ChangeKind.DELETED, "M": ChangeKind.MODIFIED, "T": ChangeKind.MODIFIED}
_ZERO_ID = "0" * 40

#: Test files (the instance's tests decide the grade) and pytest's per-directory plugin file.
_TEST_FILE = re.compile(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_tests?\.py$")
_CONFTEST = re.compile(r"(^|/)conftest\.py$")
#: pytest's own configuration files: any change to them is one to how the tests run.
PYTEST_CONFIG_FILES = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"})
#: Files shared with other tools, where only pytest's sections count.
_INI_PYTEST_SECTIONS = ("pytest", "tool:pytest")
_STARTUP = re.compile(r"\.pth$|(^|/)(sitecustomize|usercustomize)[^/]*$")
_ENTRY_POINTS = re.compile(r"\.(egg|dist)-info/entry_points\.txt$")
_NATIVE = re.compile(r"\.(so(\.\d+)*|pyd|dylib|dll)$")
#: Source files searched for what the repository already names of the test runner.
_CODE_SUFFIXES = (".py", ".pyi", ".pyx")
_MAX_CODE_FILE_BYTES = 1024 * 1024
_MAX_CODE_BYTES = 512 * 1024 * 1024
# git's own test for binary content: a NUL in the first 8000 bytes.
_BINARY_PROBE = 8000


class PatchError(Exception):
    """The agent's change cannot be taken or graded (too large, a path git refuses): the agent's doing."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class ChangedFile:
    """One file of the agent's change, by its path relative to the workdir."""

    path: str
    kind: ChangeKind


@dataclass(frozen=True)
class Link:
    """A symbolic link where a file's bytes were looked for."""

    target: str


#: What one side of a change holds at a path: bytes, a link, or nothing.
Content = bytes | Link | None


@dataclass
class AgentPatch:
    """The agent's change as the grader applies it, and what in it steers the grade."""

    patch: bytes
    """A ``git diff --binary`` of the workdir, paths relative to it (what ``git apply`` there takes)."""
    files: list[ChangedFile] = field(default_factory=list)
    """Every file the change touches (findings' included)."""
    findings: list[Finding] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    """Paths of findings kept out of :attr:`patch` (``leave_out_findings``)."""
    bytecode_skipped: int = 0
    """Bytecode files (``__pycache__``, ``*.pyc``) of the change no grader takes."""


def is_test_file(path: str) -> bool:
    """Tell whether ``path`` (relative to the workdir) is a test file or a ``conftest.py``."""
    return bool(_TEST_FILE.search(path) or _CONFTEST.search(path))


def take_patch(base: LayerStack, top: LayerStack, workdir: str, *, leave_out_findings: bool = False) -> AgentPatch:
    """Return the agent's change to the repository at ``workdir``: ``top`` against ``base``, with its findings.

    Blocking (files and git): run it in a thread.

    Raises:
        PatchError: the change is too large, or holds a path git cannot store (the agent's doing).
        SandboxError: git is missing on the host or failed on the base side (not the agent's doing).
    """
    workdir = "/" + workdir.strip("/")
    try:
        changes = diff(base, top)
    except SandboxError as exc:
        raise PatchError(f"the agent changed too many files to take its change: {exc}",
                         cause=CAUSE_PATCH_TOO_LARGE) from exc
    selected, bytecode = _select(changes, base=base, top=top, workdir=workdir)
    with tempfile.TemporaryDirectory(prefix="forkyard-swe-patch-", dir=TEMP_ROOT) as tmp:
        taken = _Differ(tmp, base=base, top=top, workdir=workdir).take(selected, leave_out_findings=leave_out_findings)
    taken.bytecode_skipped = bytecode
    return taken


def _is_bytecode(parts: Sequence[str]) -> bool:
    return "__pycache__" in parts or parts[-1].endswith((".pyc", ".pyo"))


def _select(changes: Sequence[FileChange], *, base: LayerStack, top: LayerStack,
            workdir: str) -> tuple[list[tuple[str, FileChange]], int]:
    """Return the changes under ``workdir`` a ``git add -A`` there could see (relative path, change) and the bytecode count."""
    prefix = workdir.rstrip("/") + "/"
    nested: dict[str, bool] = {}

    def in_nested_repo(parts: list[str]) -> bool:
        for depth in range(1, len(parts)):
            rel = "/".join(parts[:depth])
            if rel not in nested:
                where = f"{prefix}{rel}/.git"
                nested[rel] = top.lookup(where) is not None or base.lookup(where) is not None
            if nested[rel]:
                return True
        return False

    selected: list[tuple[str, FileChange]] = []
    bytecode = 0
    for change in changes:
        if not change.path.startswith(prefix):
            continue
        rel = change.path[len(prefix):]
        parts = rel.split("/")
        if ".git" in parts or in_nested_repo(parts):
            continue  # the repository's own metadata, and repositories inside it (git adds them as links)
        if _is_bytecode(parts):
            entry = change.after or change.before
            bytecode += entry is not None and entry.kind is not EntryKind.DIR
            continue
        selected.append((rel, change))
        if len(selected) > MAX_CHANGED_PATHS:
            raise PatchError(f"the agent changed more than {MAX_CHANGED_PATHS} paths in the repository",
                             cause=CAUSE_PATCH_TOO_LARGE)
    return selected, bytecode


class _Budget:
    """What may still be copied out of the layers."""

    def __init__(self) -> None:
        self.files = MAX_EXPORT_FILES
        self.bytes = MAX_EXPORT_BYTES

    def take(self, size: int) -> None:
        self.files -= 1
        self.bytes -= size
        if self.files < 0 or self.bytes < 0:
            raise PatchError(f"the agent's change is larger than {MAX_EXPORT_FILES} files or "
                             f"{MAX_EXPORT_BYTES // (1024 * 1024)} MiB", cause=CAUSE_PATCH_TOO_LARGE)


class _SparseTree:
    """One side of the change as files under ``root``: only the changed paths and the .gitignore files above them."""

    def __init__(self, root: str, view: LayerStack, workdir: str, budget: _Budget) -> None:
        self.root = root
        self.view = view
        self.workdir = workdir
        self.budget = budget
        self.entries: dict[str, Entry] = {}
        """Relative path -> the view's entry, for every file and link placed."""
        self.filled: set[str] = set()
        os.mkdir(root, 0o755)

    def _host(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def _parents(self, rel: str) -> None:
        """Make the directories above ``rel``, never through a link."""
        parts = rel.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            host = self._host("/".join(parts[:depth]))
            try:
                os.mkdir(host, 0o755)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(host).st_mode):
                    raise SandboxError(f"{self.workdir}/{rel}: a parent is no directory in one view of the "
                                       "filesystem") from None

    def place(self, rel: str, entry: Entry) -> None:
        """Put ``entry`` at ``rel``: a directory, a link as it is, a file empty until :meth:`fill`."""
        self._parents(rel)
        host = self._host(rel)
        if entry.kind is EntryKind.DIR:
            try:
                os.mkdir(host, 0o755)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(host).st_mode):
                    raise SandboxError(f"{self.workdir}/{rel}: a file and a directory in one view") from None
        elif entry.kind is EntryKind.SYMLINK:
            os.symlink(entry.target, host)
            self.entries[rel] = entry
        elif entry.kind is EntryKind.FILE:
            os.close(os.open(host, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
            self.entries[rel] = entry
        # A device, FIFO or socket is nothing git stores.

    def fill(self, rel: str) -> None:
        """Copy the bytes (and the exec bit) of the file placed at ``rel`` from the view."""
        entry = self.entries.get(rel)
        if entry is None or entry.kind is not EntryKind.FILE or rel in self.filled:
            return
        self.budget.take(entry.size)
        try:
            data = self.view.read(entry.path, max_bytes=entry.size)
        except FileTooLargeError as exc:  # an immutable layer's file does not grow: nothing honest gets here
            raise PatchError(f"{rel}: {exc}", cause=CAUSE_PATCH_TOO_LARGE) from exc
        fd = os.open(self._host(rel), os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(self._host(rel), 0o755 if entry.mode & stat.S_IXUSR else 0o644)
        self.filled.add(rel)

    def place_ignore_files(self, dirs: set[str]) -> None:
        """Place and fill the ``.gitignore`` of each directory of ``dirs`` (relative; "" is the workdir)."""
        for rel_dir in sorted(dirs):
            rel = f"{rel_dir}/.gitignore" if rel_dir else ".gitignore"
            if rel in self.entries:
                self.fill(rel)
                continue
            entry = self.view.lookup(f"{self.workdir}/{rel}")
            if entry is None or entry.kind not in (EntryKind.FILE, EntryKind.SYMLINK):
                continue
            self.place(rel, entry)
            self.fill(rel)

    def content(self, rel: str) -> Content:
        """Return what ``rel`` holds as copied: a file's bytes, a link, or None."""
        entry = self.entries.get(rel)
        if entry is not None and entry.kind is EntryKind.SYMLINK:
            return Link(entry.target)
        if rel not in self.filled:
            return None
        with open(self._host(rel), "rb") as fh:
            return fh.read()


class _Differ:
    """The host's git on a private repository, over the two sparse trees of one change."""

    def __init__(self, tmp: str, *, base: LayerStack, top: LayerStack, workdir: str) -> None:
        git = shutil.which("git", path=os.environ.get("PATH") or _STANDARD_PATH)
        if git is None:
            raise SandboxError("the host has no git: SWE grading diffs the agent's change with the host's git")
        self.git_bin = git
        self.tmp = tmp
        self.base_view, self.top_view, self.workdir = base, top, workdir
        budget = _Budget()
        self.base = _SparseTree(os.path.join(tmp, "base"), base, workdir, budget)
        self.agent = _SparseTree(os.path.join(tmp, "agent"), top, workdir, budget)
        self.git_dir = os.path.join(tmp, "git")
        home = os.path.join(tmp, "home")
        os.mkdir(home, 0o700)
        # Built from nothing: no variable of this process (GIT_DIR, GIT_CONFIG_*) reaches git.
        self.env = {
            "PATH": os.environ.get("PATH") or _STANDARD_PATH, "HOME": home, "XDG_CONFIG_HOME": home,
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_SYSTEM": "/dev/null", "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "GIT_NO_REPLACE_OBJECTS": "1",
            "GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat", "LC_ALL": "C", "GIT_DIR": self.git_dir,
        }  # fmt: skip

    def git(self, *args: str, work_tree: str | None = None, index: str | None = None, stdin: bytes | None = None,
            stdout: Any = subprocess.PIPE) -> bytes:
        """Run git; raise _GitError with its stderr if it fails."""
        env = dict(self.env)
        if work_tree is not None:
            env["GIT_WORK_TREE"] = work_tree
        if index is not None:
            env["GIT_INDEX_FILE"] = index
        command = [self.git_bin, *(item for setting in _GIT_SETTINGS for item in ("-c", setting)), *args]
        try:
            run = subprocess.run(command, cwd=work_tree or self.tmp, env=env, input=stdin, stdout=stdout,
                                 stderr=subprocess.PIPE, timeout=_GIT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SandboxError(f"git {args[0]} ran past {_GIT_TIMEOUT_S:g}s") from exc
        if run.returncode != 0:
            raise _GitError(f"git {args[0]} failed: {run.stderr.decode(errors='replace').strip()[-500:]}")
        return run.stdout if run.stdout is not None else b""

    def untracked(self, tree: _SparseTree) -> set[str]:
        """Return the files of ``tree`` a ``git add -A`` with an empty index adds (the ones no rule ignores)."""
        out = self.git("ls-files", "-z", "--others", "--exclude-standard", work_tree=tree.root,
                       index=os.path.join(self.tmp, "empty.index"))
        return {os.fsdecode(p) for p in out.split(b"\0") if p}

    def take(self, selected: list[tuple[str, FileChange]], *, leave_out_findings: bool) -> AgentPatch:
        """Diff the two sides of ``selected``; return the patch and its findings."""
        ignore_dirs: set[str] = set()
        for rel, change in selected:
            if change.before is not None:
                self.base.place(rel, change.before)
            if change.after is not None:
                with _agents_path(rel):
                    self.agent.place(rel, change.after)
            parts = rel.split("/")
            ignore_dirs.update("/".join(parts[:depth]) for depth in range(len(parts)))
        self.base.place_ignore_files(ignore_dirs)
        self.agent.place_ignore_files(ignore_dirs)
        self.git("init", "-q", "--bare", "--template=")  # where GIT_DIR says
        os.makedirs(os.path.join(self.git_dir, "info"), exist_ok=True)
        with open(os.path.join(self.git_dir, "info", "attributes"), "wb") as fh:
            fh.write(_NO_ATTRIBUTES)

        # Only files the index will hold are copied: what git ignores (a virtualenv, a build dir) never is.
        tracked = self.untracked(self.base)
        try:
            added = self.untracked(self.agent)
        except _GitError as exc:
            raise PatchError(f"git cannot read the agent's change: {exc}", cause=CAUSE_PATCH_INVALID) from exc
        for rel in sorted(tracked):
            self.base.fill(rel)
        for rel in sorted(self.agent.entries):
            if rel in tracked or rel in added:
                self.agent.fill(rel)

        base_index, agent_index = os.path.join(self.tmp, "base.index"), os.path.join(self.tmp, "agent.index")
        self.git("add", "-A", work_tree=self.base.root, index=base_index)
        base_tree = self.git("write-tree", index=base_index).decode().strip()
        # The agent's index starts as the base's tree without stat data: every tracked file is hashed again.
        self.git("read-tree", base_tree, index=agent_index)
        try:
            self.git("add", "-A", work_tree=self.agent.root, index=agent_index)
        except _GitError as exc:
            raise PatchError(f"git cannot take the agent's change: {exc}", cause=CAUSE_PATCH_INVALID) from exc
        agent_tree = self.git("write-tree", index=agent_index).decode().strip()

        files = self.changed(base_tree, agent_tree)
        judged = _judge(files, before=self.base.content, after=self.agent.content,
                        known_hooks=_KnownHooks(self.base_view, self.workdir))
        left_out: list[str] = []
        if judged and leave_out_findings:
            left_out = sorted({file.path for file, _finding in judged})
            agent_tree = self.without(agent_tree, base_tree, left_out, index=agent_index)
        patch_file = os.path.join(self.tmp, "agent.patch")
        with open(patch_file, "wb") as out:
            self.git("diff", "--binary", "--full-index", "--no-renames", "--no-ext-diff", "--no-textconv",
                     "--no-color", "--src-prefix=a/", "--dst-prefix=b/", base_tree, agent_tree, stdout=out)
        size = os.path.getsize(patch_file)
        if size > MAX_PATCH_BYTES:
            raise PatchError(f"the change to the repository is {size // 1024} KiB, more than the "
                             f"{MAX_PATCH_BYTES // (1024 * 1024)} MiB a grader takes", cause=CAUSE_PATCH_TOO_LARGE)
        with open(patch_file, "rb") as fh:
            patch = fh.read()
        return AgentPatch(patch=patch, files=files, findings=[finding for _file, finding in judged], left_out=left_out)

    def changed(self, base_tree: str, agent_tree: str) -> list[ChangedFile]:
        """Return the files that differ between the two trees."""
        out = self.git("diff", "--name-status", "-z", "--no-renames", base_tree, agent_tree).split(b"\0")
        return [ChangedFile(os.fsdecode(path), _GIT_STATUS.get(status.decode(), ChangeKind.MODIFIED))
                for status, path in zip(out[0::2], out[1::2], strict=False) if path]

    def without(self, agent_tree: str, base_tree: str, paths: list[str], *, index: str) -> str:
        """Return ``agent_tree`` with ``paths`` as ``base_tree`` has them (gone where it has none)."""
        entries: dict[str, bytes] = {}
        for record in self.git("ls-tree", "-r", "-z", "--full-tree", base_tree).split(b"\0"):
            if record:
                meta, _, path = record.partition(b"\t")
                entries[os.fsdecode(path)] = meta
        lines = []
        for path in paths:
            meta = entries.get(path)
            if meta is None:
                lines.append(f"0 {_ZERO_ID}\t".encode() + os.fsencode(path) + b"\0")
            else:
                mode, _, obj = meta.split(b" ")
                lines.append(mode + b" " + obj + b"\t" + os.fsencode(path) + b"\0")
        self.git("update-index", "-z", "--index-info", index=index, stdin=b"".join(lines))
        return self.git("write-tree", index=index).decode().strip()


@contextlib.contextmanager
def _agents_path(rel: str) -> Iterator[None]:
    """Make a path too long for this host's temp dir the agent's doing (it made the path)."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        raise PatchError(f"a path of the change is too long to take: {rel[:200]}...",
                         cause=CAUSE_PATCH_INVALID) from exc


class _GitError(SandboxError):
    """A git command over the sparse trees failed."""


class _KnownHooks:
    """The test-runner internals the repository's non-test code names at the reset point (read once, when asked)."""

    def __init__(self, base: LayerStack, workdir: str) -> None:
        self.base = base
        self.workdir = workdir
        self._known: set[str] | None = None

    def __call__(self, tokens: set[str]) -> set[str]:
        if self._known is None:
            self._known = self._scan()
        return tokens & self._known

    def _code_files(self) -> Iterator[Entry]:
        stack = [self.workdir]
        while stack:
            current = stack.pop()
            for name, entry in sorted(self.base.children(current).items(), reverse=True):
                rel = entry.path[len(self.workdir) + 1:]
                if entry.kind is EntryKind.DIR and name != ".git":
                    stack.append(entry.path)
                elif (entry.kind is EntryKind.FILE and name.endswith(_CODE_SUFFIXES) and not is_test_file(rel)
                      and entry.size <= _MAX_CODE_FILE_BYTES):
                    yield entry

    def _scan(self) -> set[str]:
        known: set[str] = set()
        budget = _MAX_CODE_BYTES
        for entry in self._code_files():
            budget -= entry.size
            if budget < 0:
                logger.warning("%s: more than %d MiB of source; the rest is not searched for test-runner names",
                               self.workdir, _MAX_CODE_BYTES // (1024 * 1024))
                break
            try:
                known |= runner_hooks_in(self.base.read(entry.path).decode("utf-8", "replace"))
            except (OSError, SandboxError):
                continue
        return known


# ------------------------------------------------------------------ findings


def find_tamper(files: Sequence[ChangedFile], *, before: Callable[[str], Content], after: Callable[[str], Content],
                known_hooks: Callable[[set[str]], set[str]]) -> list[Finding]:
    """Return what in a change steers its own grade.

    Args:
        files: the change's files (paths relative to the workdir).
        before, after: what a path holds at the reset point and in the change.
        known_hooks: which of the given test-runner names the repository's non-test code
            already has at the reset point (asked only when an added line names one).
    """
    return [finding for _file, finding in _judge(files, before=before, after=after, known_hooks=known_hooks)]


def _judge(files: Sequence[ChangedFile], *, before: Callable[[str], Content], after: Callable[[str], Content],
           known_hooks: Callable[[set[str]], set[str]]) -> list[tuple[ChangedFile, Finding]]:
    found: list[tuple[ChangedFile, Finding]] = []
    hooks: list[tuple[ChangedFile, set[str]]] = []
    for file in files:
        why = _steers(file, before, after)
        if why is not None:
            found.append((file, _finding(file, why)))
        elif file.kind is not ChangeKind.DELETED:
            tokens = runner_hooks_in(_added_lines(before(file.path), after(file.path)))
            if tokens:
                hooks.append((file, tokens))
    if hooks:
        known = known_hooks(set().union(*(tokens for _file, tokens in hooks)))
        for file, tokens in hooks:
            new = sorted(tokens - known)
            if new:
                found.append((file, _finding(file, f"adds code naming the test runner's internals ({', '.join(new)}), "
                                                   "which the repository's own code does not: code the tests import "
                                                   "could rewrite their results")))
    return found


def _finding(file: ChangedFile, why: str) -> Finding:
    shown = file.path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return Finding(path=shown, change=file.kind.value, why=why)


def _steers(file: ChangedFile, before: Callable[[str], Content], after: Callable[[str], Content]) -> str | None:
    """Return why ``file`` decides how the tests run or what they report, or None."""
    path = file.path
    name = path.rsplit("/", 1)[-1]

    def differs(read: Callable[[Content], object]) -> bool:
        old, new = before(path), after(path)
        if isinstance(old, Link) or isinstance(new, Link):
            return True  # a link in either version: whatever it points to is read through it
        return read(old) != read(new)

    if _CONFTEST.search(path):
        return "conftest.py: pytest runs it as a plugin of the test process"
    if _TEST_FILE.search(path):
        return "a test file: the instance's own tests decide the grade"
    if name in PYTEST_CONFIG_FILES:
        return f"pytest's configuration ({name}): its options and plugins decide how the tests run"
    if name in ("tox.ini", "setup.cfg") and differs(_ini_pytest):
        return f"changes pytest's section of {name}: its options and plugins decide how the tests run"
    if name == "pyproject.toml" and differs(_toml_pytest):
        return "changes [tool.pytest] of pyproject.toml: its options and plugins decide how the tests run"
    if _STARTUP.search(path):
        return f"{name} runs code at every Python start"
    if _ENTRY_POINTS.search(path) and differs(_pytest11):
        return "registers a pytest plugin (a pytest11 entry point), which pytest loads at start"
    if _NATIVE.search(name) and file.kind is not ChangeKind.DELETED:
        return "native code the tests could load, which no check can read"
    return None


def _added_lines(before: Content, after: Content) -> str:
    """Return the lines ``after`` has more of than ``before`` (text files only)."""
    if not isinstance(after, bytes) or b"\0" in after[:_BINARY_PROBE]:
        return ""
    new = collections.Counter(after.decode("utf-8", "replace").splitlines())
    old = collections.Counter(before.decode("utf-8", "replace").splitlines() if isinstance(before, bytes) else [])
    return "\n".join((new - old).elements())


_UNREADABLE = ("unreadable",)


def _ini_pytest(data: Content) -> object:
    """Return the lines of pytest's sections of an ini file as two readers split it (iniconfig's, configparser's)."""
    if not isinstance(data, bytes):
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _UNREADABLE
    readings = []
    for header in (_iniconfig_header, _configparser_header):
        sections: dict[str, list[str]] = {}
        current: list[str] | None = None
        for line in text.splitlines():
            name = header(line)
            if name is not None:
                current = sections.setdefault(name, [])
                continue
            if current is not None:
                current.append(line.rstrip())
        readings.append(tuple(tuple(sections[n]) if n in sections else None for n in _INI_PYTEST_SECTIONS))
    return tuple(readings)


def _iniconfig_header(line: str) -> str | None:
    """Return the section a line opens as pytest's ini reader (iniconfig) reads it, or None."""
    line = line.rstrip()
    if not line.startswith("["):
        return None
    for comment in "#;":
        line = line.split(comment)[0].rstrip()
    return line[1:-1].strip() if line.endswith("]") else None


def _configparser_header(line: str) -> str | None:
    """Return the section a line opens as Python's configparser reads it (indented too), or None."""
    match = re.match(r"\s*\[(.+)\]", line)
    return match.group(1).strip() if match else None


def _toml_pytest(data: Content) -> object:
    """Return ``[tool.pytest]`` of a pyproject.toml (with ``ini_options``), None if it has none."""
    if not isinstance(data, bytes):
        return None
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return _UNREADABLE
    tool = parsed.get("tool")
    return tool.get("pytest") if isinstance(tool, dict) else None


def _pytest11(data: Content) -> object:
    """Return the lines of the ``[pytest11]`` section of an entry_points.txt."""
    if not isinstance(data, bytes):
        return None
    lines: list[str] = []
    inside = False
    for line in data.decode("utf-8", "replace").splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped.replace(" ", "") == "[pytest11]"
        elif inside and stripped:
            lines.append(stripped)
    return tuple(lines)


__all__ = ["CAUSE_PATCH_INVALID", "CAUSE_PATCH_TOO_LARGE", "MAX_EXPORT_BYTES", "MAX_EXPORT_FILES", "MAX_PATCH_BYTES",
           "PYTEST_CONFIG_FILES", "AgentPatch", "ChangedFile", "Content", "Link", "PatchError", "find_tamper",
           "is_test_file", "take_patch"]

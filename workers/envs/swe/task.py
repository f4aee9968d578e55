"""SWE-bench-style instances: validate, hash and store them.

One instance is one JSON object (a line of a JSONL file), a superset of the SWE-bench
instance::

    instance_id, repo, base_commit, problem_statement          required
    patch, test_patch                                            the gold patch, the tests it is graded with
    FAIL_TO_PASS, PASS_TO_PASS                                   test ids: a list or a JSON-encoded string
    version, environment_setup_commit, hints_text, created_at    kept as the reference gives them
    patch_kind      "fix" (default: ``patch`` fixes the bug) or "bug" (SWE-smith: ``patch``
                    introduces it, so the agent starts from base_commit + patch)
    test_cmd        the command the grader runs in the workdir (default ``pytest -rA``)
    log_parser      how its output is read: "pytest" (default) or "unittest"
    workdir         where the repository is checked out (default /testbed)
    install         commands that build the environment image (run in the workdir)
    image           an existing image to start from (default: the Python stand-in)
    tamper          what a change that steers its own grade (tests, pytest configuration, startup
                    files: :mod:`~workers.envs.swe.patch`) does: "fail" (default: reward 0 with
                    ``info.cause = "tamper"``) or "report" (those files are left out of the grade)

A file of instances is all or nothing: every line is checked first and every problem is
reported as ``line N: field: what`` in one :class:`~workers.errors.TaskFormatError`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from workers.envs.tamper import TamperPolicy
from workers.errors import TaskFormatError

#: The file a stored instance is kept in (the gateway's task archive is this JSON).
INSTANCE_FILE = "instance.json"
DEFAULT_WORKDIR = "/testbed"
DEFAULT_TEST_CMD = "pytest -rA -p no:cacheprovider"
LOG_PARSERS = ("pytest", "unittest")
PATCH_KINDS = ("fix", "bug")
#: Caps on one instance: its JSON, and the lines of a JSONL file.
MAX_INSTANCE_BYTES = 8 * 1024 * 1024
MAX_INSTANCES = 10_000

DEFAULT_AGENT_TIMEOUT_S = 1800.0
DEFAULT_VERIFIER_TIMEOUT_S = 1800.0
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 4096
DEFAULT_DISK_MB = 10240

_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement")
_STRINGS = ("patch", "test_patch", "version", "environment_setup_commit", "hints_text", "created_at",
            "test_cmd", "image")
_KNOWN = frozenset({*_REQUIRED, *_STRINGS, "FAIL_TO_PASS", "PASS_TO_PASS", "patch_kind", "log_parser",
                    "workdir", "install", "agent_timeout_sec", "verifier_timeout_sec", "cpus", "memory_mb",
                    "tamper"})
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{7,64}$")
_HASH_DOMAIN = b"forkyard.swe-instance.v1\x00"


@dataclass(frozen=True)
class SWETask:
    """One validated SWE instance."""

    family: ClassVar[str] = "swe"
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str = ""
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    version: str = ""
    environment_setup_commit: str = ""
    hints_text: str = ""
    created_at: str = ""
    patch_kind: str = "fix"
    test_cmd: str = DEFAULT_TEST_CMD
    log_parser: str = "pytest"
    workdir: str = DEFAULT_WORKDIR
    install: tuple[str, ...] = ()
    image: str = ""
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    cpus: float = DEFAULT_CPUS
    memory_mb: int = DEFAULT_MEMORY_MB
    disk_mb: int = DEFAULT_DISK_MB
    tamper: TamperPolicy = TamperPolicy.FAIL
    """Whether a change to what decides its own grade fails the episode (the default) or is left out and reported."""
    warnings: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the instance Forkyard does not use, kept as given."""

    def __hash__(self) -> int:
        return hash(self.content_hash)

    @property
    def name(self) -> str:
        """The instance id."""
        return self.instance_id

    @property
    def instruction(self) -> str:
        """The problem statement, with where the repository is."""
        return (f"{self.problem_statement.rstrip()}\n\nThe repository is checked out at {self.workdir}. "
                "Change its non-test source files so the issue is resolved, then call submit.\n")

    @property
    def metadata(self) -> dict[str, Any]:
        """What the API shows of the instance beside its name."""
        return {"repo": self.repo, "base_commit": self.base_commit, "version": self.version,
                "patch_kind": self.patch_kind, "FAIL_TO_PASS": list(self.fail_to_pass),
                "PASS_TO_PASS": list(self.pass_to_pass)}

    @property
    def setup_commit(self) -> str:
        """The commit the environment image installs from (``environment_setup_commit``, else ``base_commit``)."""
        return self.environment_setup_commit or self.base_commit

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 hex of the instance's canonical JSON."""
        return hashlib.sha256(_HASH_DOMAIN + encode_instance(self)).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """Return the instance in its input shape (SWE-bench field names)."""
        data = asdict(self)
        data.pop("warnings")
        extra = dict(data.pop("extra"))
        data["FAIL_TO_PASS"] = list(data.pop("fail_to_pass"))
        data["PASS_TO_PASS"] = list(data.pop("pass_to_pass"))
        data["install"] = list(data["install"])
        data["agent_timeout_sec"] = data.pop("agent_timeout_s")
        data["verifier_timeout_sec"] = data.pop("verifier_timeout_s")
        data.pop("disk_mb")
        # Written only when not the default: an instance that does not set it keeps the hash it had.
        tamper = data.pop("tamper")
        if tamper is not TamperPolicy.FAIL:
            data["tamper"] = tamper.value
        return {**extra, **data}


def encode_instance(task: SWETask) -> bytes:
    """Return the instance as canonical JSON bytes (sorted keys, no spaces)."""
    return json.dumps(task.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class _Problems:
    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[tuple[str, str]] = []

    def add(self, key: str, what: str) -> None:
        self.found.append((key, what))


def _test_list(value: object, key: str, problems: _Problems) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            problems.add(key, "a JSON-encoded string must hold a list of test ids")
            return ()
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        problems.add(key, "must be a list of test ids (or that list JSON-encoded)")
        return ()
    return tuple(value)


def instance_from_json(data: object, *, where: str = "instance") -> SWETask:
    """Validate one instance object.

    Raises:
        TaskFormatError: every problem found, each as ``field: what``.
    """
    problems = _Problems(where)
    if not isinstance(data, dict):
        raise TaskFormatError(f"{where}: an instance must be a JSON object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key in _REQUIRED:
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            problems.add(key, "is required (a non-empty string)")
        else:
            values[key] = value
    for key in _STRINGS:
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            problems.add(key, f"must be a string, got {type(value).__name__}")
        else:
            values[key] = value
    if "instance_id" in values and not _ID_RE.match(values["instance_id"]):
        problems.add("instance_id", "use letters, digits, '.', '_' and '-' (at most 128)")
    if "repo" in values and not _REPO_RE.match(values["repo"]):
        problems.add("repo", "must look like owner/name (letters, digits, '.', '_', '-')")
    for key in ("base_commit", "environment_setup_commit"):
        if key in values and values[key] and not _COMMIT_RE.match(values[key]):
            problems.add(key, "must be a hex commit id")
    f2p = _test_list(data.get("FAIL_TO_PASS"), "FAIL_TO_PASS", problems)
    p2p = _test_list(data.get("PASS_TO_PASS"), "PASS_TO_PASS", problems)
    if not f2p and "FAIL_TO_PASS" not in [k for k, _ in problems.found]:
        problems.add("FAIL_TO_PASS", "must name at least one test (what resolving the issue makes pass)")
    kind = data.get("patch_kind", "fix")
    if kind not in PATCH_KINDS:
        problems.add("patch_kind", f"must be one of {', '.join(PATCH_KINDS)}, got {kind!r}")
    if kind == "bug" and not values.get("patch"):
        problems.add("patch", "a patch_kind 'bug' instance needs the patch that introduces the bug")
    tamper = data.get("tamper", TamperPolicy.FAIL.value)
    if not isinstance(tamper, str) or tamper not in {p.value for p in TamperPolicy}:
        problems.add("tamper", f"must be \"fail\" or \"report\", got {tamper!r}")
        tamper = TamperPolicy.FAIL.value
    parser = data.get("log_parser", "pytest")
    if parser not in LOG_PARSERS:
        problems.add("log_parser", f"must be one of {', '.join(LOG_PARSERS)}, got {parser!r}")
    workdir = data.get("workdir", DEFAULT_WORKDIR)
    if not isinstance(workdir, str) or not workdir.startswith("/") or workdir.rstrip("/") == "" or ".." in workdir:
        problems.add("workdir", "must be an absolute path other than /")
        workdir = DEFAULT_WORKDIR
    install = data.get("install", [])
    if isinstance(install, str):
        install = [install]
    if not isinstance(install, list) or not all(isinstance(c, str) and c.strip() for c in install):
        problems.add("install", "must be a list of shell commands")
        install = []
    numbers: dict[str, float] = {}
    for key, default, low, high in (("agent_timeout_sec", DEFAULT_AGENT_TIMEOUT_S, 1, 86400),
                                    ("verifier_timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, 1, 86400),
                                    ("cpus", DEFAULT_CPUS, 0.1, 1024), ("memory_mb", DEFAULT_MEMORY_MB, 64, 1 << 22)):
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            problems.add(key, f"must be a number from {low:g} to {high:g}")
            value = default
        numbers[key] = float(value)
    if problems.found:
        lines = "; ".join(f"{key}: {what}" for key, what in problems.found)
        raise TaskFormatError(f"{where}: {lines}", field=problems.found[0][0])
    unused = sorted(set(data) - _KNOWN)
    return SWETask(
        **values, fail_to_pass=f2p, pass_to_pass=p2p, patch_kind=kind, log_parser=parser,
        workdir=workdir.rstrip("/"), install=tuple(install),
        agent_timeout_s=numbers["agent_timeout_sec"], verifier_timeout_s=numbers["verifier_timeout_sec"],
        cpus=numbers["cpus"], memory_mb=int(numbers["memory_mb"]), tamper=TamperPolicy(tamper),
        warnings=tuple(f"{where}: field {key!r} is not used by Forkyard (kept)" for key in unused),
        extra={key: data[key] for key in unused},
    )


def parse_jsonl(data: bytes) -> list[SWETask]:
    """Read a JSONL file of instances; all or nothing.

    Raises:
        TaskFormatError: names every bad line (``line N: field: what``), a duplicate
            instance id, or an empty file.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFormatError(f"the file is not UTF-8 text (byte {exc.start})") from None
    tasks: list[SWETask] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    first_field: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(tasks) + len(errors) >= MAX_INSTANCES:
            errors.append(f"line {number}: more than {MAX_INSTANCES} instances in one file")
            break
        if len(line.encode()) > MAX_INSTANCE_BYTES:
            errors.append(f"line {number}: longer than {MAX_INSTANCE_BYTES // (1024 * 1024)} MiB")
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            errors.append(f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        try:
            task = instance_from_json(obj, where=f"line {number}")
        except TaskFormatError as exc:
            errors.append(str(exc))
            first_field = first_field or exc.field
            continue
        if task.instance_id in seen:
            errors.append(f"line {number}: instance_id: {task.instance_id!r} is also on line {seen[task.instance_id]}")
            continue
        seen[task.instance_id] = number
        tasks.append(task)
    if errors:
        shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
        raise TaskFormatError(f"{len(errors)} bad line(s), nothing imported: " + " | ".join(shown), field=first_field)
    if not tasks:
        raise TaskFormatError("the file holds no instance (one JSON object per line)")
    return tasks


def decode_instance(data: bytes) -> SWETask:
    """Return the instance :func:`encode_instance` stored."""
    return instance_from_json(json.loads(data), where="stored instance")


__all__ = ["DEFAULT_TEST_CMD", "DEFAULT_WORKDIR", "INSTANCE_FILE", "LOG_PARSERS", "SWETask", "decode_instance",
           "encode_instance", "instance_from_json", "parse_jsonl"]

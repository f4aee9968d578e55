"""Harbor-style terminal tasks: load, validate, hash and archive task directories.

A task directory looks like::

    <name>/
        instruction.md          what the agent is asked to do (required, non-empty)
        task.toml               [metadata], [agent], [verifier], [environment] (required)
        environment/Dockerfile  the scene (required unless [environment] docker_image)
        forkyard/reset.sh       Forkyard's reset hook: run at every reset (optional)
        tests/test.sh           the verifier, copied in only at verification (required)
        solution/solve.sh       the oracle (optional)

``environment/setup.sh`` is Harbor's: only a file the Dockerfile may COPY and RUN at
build time; Forkyard never runs it (running it again at each reset broke tasks whose
prepared state it changes). ``forkyard/reset.sh`` does per-reset work the image cannot hold (install
dependencies, generate data, start from a known state): it runs with bash from the
task's working directory with the image's environment, bounded by ``[environment]
setup_timeout_sec`` (default 600), and a failure fails the reset. A worker with a
setup cache runs it once per (environment version, task, image) and restores later
resets from a snapshot taken right after it. ``[environment] deterministic_tools``
(default false) declares that the same actions from the same state always give the
same observations, which lets samples of one group share a sandbox until they diverge.

Keys of ``task.toml`` that Forkyard does not use are accepted (Harbor grows new ones)
and reported in :attr:`TerminalTask.warnings` (the import answer lists them); the keys it
uses must have the right type. Left out, a key takes Harbor's default (verifier 600 s,
2048 MB, internet allowed). Every problem is a :class:`~workers.errors.TaskFormatError`
naming the file and the field.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import math
import os
import re
import tarfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, TypeVar

from workers.archives import ArchiveLimits, iter_members, read_dir
from workers.envs.tamper import TamperPolicy
from workers.errors import TaskFormatError

logger = logging.getLogger(__name__)

#: Cap on the total bytes of one task's files.
MAX_TASK_BYTES = 16 * 1024 * 1024
#: Cap on the number of files in one task.
MAX_TASK_FILES = 4096
#: Cap on the total bytes unpacked from one uploaded archive (several tasks).
MAX_ARCHIVE_BYTES = 256 * 1024 * 1024
#: Cap on the number of members of one uploaded archive.
MAX_ARCHIVE_MEMBERS = 65536
#: Room for headers and padding in the tar stream beyond MAX_ARCHIVE_BYTES of file contents.
MAX_ARCHIVE_OVERHEAD = 64 * 1024 * 1024

#: Harbor's defaults (its ``TaskConfig``), so a task that leaves a field out runs as it does there.
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
DEFAULT_SETUP_TIMEOUT_S = 600.0
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 2048
DEFAULT_DISK_MB = 10240
#: Harbor's ``allow_internet`` default: runs reach the internet (under the sandbox's egress
#: rules: never the host or private networks) unless the task says otherwise.
DEFAULT_ALLOW_INTERNET = True

#: The ``task.toml`` keys Forkyard reads, by table; any other is reported at import.
USED_KEYS: Mapping[str, frozenset[str]] = MappingProxyType({
    "": frozenset({"version", "schema_version", "task", "metadata", "agent", "verifier", "environment", "solution"}),
    "task": frozenset({"name", "description", "authors", "keywords"}),
    "agent": frozenset({"timeout_sec"}),
    "verifier": frozenset({"timeout_sec", "env", "tamper"}),
    "solution": frozenset({"env"}),
    "environment": frozenset({
        "docker_image", "cpus", "memory", "memory_mb", "storage", "storage_mb", "network", "allow_internet",
        "setup_timeout_sec", "deterministic_tools", "env",
    }),
})  # fmt: skip

INSTRUCTION_FILE = "instruction.md"
CONFIG_FILE = "task.toml"
DOCKERFILE = "environment/Dockerfile"
SETUP_SCRIPT = "forkyard/reset.sh"
TEST_SCRIPT = "tests/test.sh"
SOLUTION_SCRIPT = "solution/solve.sh"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", re.IGNORECASE)
_MEMORY_UNIT_MB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
# Archive junk that is never part of a task (macOS resource forks and Finder files).
_JUNK_PARTS = {"__MACOSX", ".DS_Store"}
_HASH_DOMAIN = b"forkyard.terminal-task.v1\x00"
# Fixed mtime for archive entries, so the same task always gives the same bytes.
_TAR_MTIME = 0


@dataclass(frozen=True)
class TerminalTask:
    """One validated Harbor-style terminal task, held in memory."""

    family: ClassVar[str] = "terminal"
    name: str
    instruction: str
    metadata: dict[str, Any]
    agent_timeout_s: float
    verifier_timeout_s: float
    cpus: float
    memory_mb: int
    disk_mb: int
    """The sandbox's disk quota (``storage_mb``, or ``storage = "10G"``)."""
    docker_image: str | None
    network: bool
    setup_timeout_s: float
    """Seconds ``forkyard/reset.sh`` may run at a reset."""
    deterministic_tools: bool
    """The tools give the same observation for the same action from the same state."""
    files: Mapping[str, bytes]
    """Every file of the task dir by relative posix path, sorted."""
    content_hash: str
    """sha256 hex of a canonical encoding of the name and the files."""
    warnings: tuple[str, ...] = ()
    """What of ``task.toml`` Forkyard does not use (reported at import, never silently dropped)."""
    environment_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """``[environment] env``: variables every shell of the task's sandboxes starts with."""
    verifier_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """``[verifier] env``: variables ``tests/test.sh`` runs with (beside the image's)."""
    solution_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """``[solution] env``: variables ``solution/solve.sh`` runs with."""
    tamper: TamperPolicy = TamperPolicy.FAIL
    """``[verifier] tamper``: whether the agent's changes to the verifier's tools fail the episode (the
    default) or are only reported (:mod:`workers.envs.tamper`)."""

    def __hash__(self) -> int:
        return hash((self.name, self.content_hash))

    @property
    def dockerfile(self) -> str | None:
        """Return ``environment/Dockerfile`` as text, or None when the task has none."""
        data = self.files.get(DOCKERFILE)
        return None if data is None else data.decode("utf-8")

    @property
    def setup_script(self) -> bytes | None:
        """Return ``forkyard/reset.sh``, or None when the task has none."""
        return self.files.get(SETUP_SCRIPT)

    @property
    def environment_context(self) -> dict[str, bytes]:
        """Return the files under ``environment/`` keyed by their path inside it."""
        return _subtree(self.files, "environment/")

    @property
    def test_files(self) -> dict[str, bytes]:
        """Return the files under ``tests/`` keyed by their path inside it."""
        return _subtree(self.files, "tests/")

    @property
    def solution_files(self) -> dict[str, bytes]:
        """Return the files under ``solution/`` keyed by their path inside it."""
        return _subtree(self.files, "solution/")

    @property
    def has_solution(self) -> bool:
        """Tell whether the task ships an oracle ``solution/solve.sh``."""
        return SOLUTION_SCRIPT in self.files


def _subtree(files: Mapping[str, bytes], prefix: str) -> dict[str, bytes]:
    return {path[len(prefix) :]: data for path, data in files.items() if path.startswith(prefix)}


def content_hash(name: str, files: Mapping[str, bytes]) -> str:
    """Return the sha256 hex of a task's name and files in a canonical encoding."""
    digest = hashlib.sha256(_HASH_DOMAIN)
    encoded_name = name.encode("utf-8")
    digest.update(len(encoded_name).to_bytes(8, "big") + encoded_name)
    for path in sorted(files):
        encoded_path = path.encode("utf-8")
        data = files[path]
        digest.update(len(encoded_path).to_bytes(8, "big") + encoded_path)
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


# --------------------------------------------------------------------------- loading


def load_task_dir(path: str | os.PathLike[str]) -> TerminalTask:
    """Read and validate the task directory at ``path``; its name is the directory's.

    Raises:
        TaskFormatError: the directory is missing, too big, holds a symlink or
            special file, or its contents are malformed.
    """
    root = Path(path)
    files = read_dir(root, max_bytes=MAX_TASK_BYTES, max_files=MAX_TASK_FILES)
    name = root.resolve().name
    return load_task_files(name, files)


def clean_task_files(name: str, files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Return a task directory's files by normalized path, checking the name, the paths and the size.

    Raises:
        TaskFormatError: the name or a path is invalid, a file is given twice or is also a
            directory, or the task is too big.
    """
    validate_task_name(name)
    clean: dict[str, bytes] = {}
    total = 0
    for raw_path, data in files.items():
        path = _normalize_member_path(raw_path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TaskFormatError(f"{path}: file content must be bytes, got {type(data).__name__}", file=path)
        if path in clean:
            raise TaskFormatError(f"{path}: the file appears twice", file=path)
        clean[path] = bytes(data)
        total += len(data)
        _check_size(total, len(clean), file=path)
    for path in clean:
        # A file cannot also be a directory of another file ("a" and "a/b").
        parent = path.rpartition("/")[0]
        while parent:
            if parent in clean:
                raise TaskFormatError(f"{parent}: is both a file and a directory", file=parent)
            parent = parent.rpartition("/")[0]
    return clean


def load_task_files(name: str, files: Mapping[str, bytes]) -> TerminalTask:
    """Validate an in-memory task directory (relative posix path -> bytes).

    Raises:
        TaskFormatError: the name, a path, the size or the contents are invalid.
    """
    clean = clean_task_files(name, files)
    config = _parse_config(_text(clean, CONFIG_FILE))
    if "steps" in config:
        # Harbor runs each step with its own instruction and tests; graded by the top-level
        # tests/ alone (often a placeholder writing 1), any episode would score as they say.
        raise TaskFormatError(
            f"{CONFIG_FILE}: [[steps]] (a multi-step task) is not supported: each step's instruction and tests "
            "would be skipped and tests/test.sh would grade the whole episode",
            file=CONFIG_FILE, field="steps",
        )
    instruction = _text(clean, INSTRUCTION_FILE)
    if not instruction.strip():
        raise TaskFormatError(f"{INSTRUCTION_FILE}: the instruction is empty", file=INSTRUCTION_FILE)

    metadata = _table(config, "metadata")
    agent = _table(config, "agent")
    verifier = _table(config, "verifier")
    environment = _table(config, "environment")
    for key in ("version", "schema_version"):
        if key in config and not isinstance(config[key], str):
            raise TaskFormatError(f"{CONFIG_FILE}: {key} must be a string such as \"1.1\", got {config[key]!r}",
                                  file=CONFIG_FILE, field=key)
    package = _table(config, "task")
    if package:
        metadata = {**metadata, "package": package}
    warnings = unused_keys(config)
    envs = {section: _env_table(config, section) for section in ("environment", "verifier", "solution")}
    for section, env in envs.items():
        templated = sorted(k for k, v in env.items() if "${" in v)
        if templated:
            warnings = (*warnings, f"[{section}] env {', '.join(templated)}: passed as written; Forkyard does not "
                                   "expand the host's variables into a task")

    agent_timeout = _positive_number(agent, "agent", "timeout_sec", DEFAULT_AGENT_TIMEOUT_S)
    verifier_timeout = _positive_number(verifier, "verifier", "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)
    tamper = verifier.get("tamper", TamperPolicy.FAIL.value)
    if tamper not in {p.value for p in TamperPolicy}:
        raise TaskFormatError(
            f"{CONFIG_FILE}: [verifier] tamper must be \"fail\" or \"report\", got {tamper!r}",
            file=CONFIG_FILE, field="verifier.tamper")
    cpus = _positive_number(environment, "environment", "cpus", DEFAULT_CPUS)
    memory_mb = _size_mb(environment, "memory", DEFAULT_MEMORY_MB)
    disk_mb = _size_mb(environment, "storage", DEFAULT_DISK_MB)
    setup_timeout = _positive_number(environment, "environment", "setup_timeout_sec", DEFAULT_SETUP_TIMEOUT_S)
    docker_image = environment.get("docker_image")
    if docker_image is not None and (not isinstance(docker_image, str) or not docker_image.strip()):
        raise TaskFormatError(
            f"{CONFIG_FILE}: [environment] docker_image must be a non-empty string, got {docker_image!r}",
            file=CONFIG_FILE,
            field="environment.docker_image",
        )
    # Forkyard's ``network`` and Harbor's ``allow_internet`` say the same; ``network`` wins.
    network = environment.get("network", environment.get("allow_internet", DEFAULT_ALLOW_INTERNET))
    for key in ("network", "allow_internet"):
        if key in environment and not isinstance(environment[key], bool):
            raise TaskFormatError(
                f"{CONFIG_FILE}: [environment] {key} must be true or false, got {environment[key]!r}",
                file=CONFIG_FILE,
                field=f"environment.{key}",
            )
    if "network" in environment and environment.get("allow_internet", network) != network:
        warnings = (*warnings, "[environment] network and allow_internet disagree; network wins")
    deterministic_tools = environment.get("deterministic_tools", False)
    if not isinstance(deterministic_tools, bool):
        raise TaskFormatError(
            f"{CONFIG_FILE}: [environment] deterministic_tools must be true or false, got {deterministic_tools!r}",
            file=CONFIG_FILE,
            field="environment.deterministic_tools",
        )

    if TEST_SCRIPT not in clean:
        raise TaskFormatError(f"{TEST_SCRIPT}: the verifier script is missing", file=TEST_SCRIPT)
    if docker_image is None and DOCKERFILE not in clean:
        raise TaskFormatError(
            f"{DOCKERFILE}: missing, and {CONFIG_FILE} sets no [environment] docker_image",
            file=DOCKERFILE,
            field="environment.docker_image",
        )
    if DOCKERFILE in clean:
        _text(clean, DOCKERFILE)
    for script in (TEST_SCRIPT, SOLUTION_SCRIPT, SETUP_SCRIPT):
        if script in clean:
            _text(clean, script)

    ordered = {path: clean[path] for path in sorted(clean)}
    return TerminalTask(
        name=name,
        instruction=instruction,
        metadata=metadata,
        agent_timeout_s=agent_timeout,
        verifier_timeout_s=verifier_timeout,
        cpus=cpus,
        memory_mb=memory_mb,
        disk_mb=disk_mb,
        docker_image=docker_image.strip() if docker_image is not None else None,
        network=network,
        setup_timeout_s=setup_timeout,
        deterministic_tools=deterministic_tools,
        files=MappingProxyType(ordered),
        content_hash=content_hash(name, ordered),
        warnings=warnings,
        environment_env=MappingProxyType(envs["environment"]),
        verifier_env=MappingProxyType(envs["verifier"]),
        solution_env=MappingProxyType(envs["solution"]),
        tamper=TamperPolicy(tamper),
    )


def unused_keys(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Return a line for each ``task.toml`` key Forkyard does not use (``[metadata]`` is free-form)."""
    unused = [f"{key}" for key in config if key not in USED_KEYS[""]]
    for table, keys in USED_KEYS.items():
        value = config.get(table) if table else None
        if isinstance(value, dict):
            unused += [f"[{table}] {key}" for key in value if key not in keys]
    return tuple(f"{CONFIG_FILE}: {key} is not used by Forkyard" for key in unused)


def validate_task_name(name: object) -> str:
    """Return ``name`` if it is a valid task name (letters, digits, '-', '_', '.').

    Raises:
        TaskFormatError: the name is empty, too long or has other characters.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise TaskFormatError(
            f"invalid task name {name!r}: use 1-128 letters, digits, '-', '_' or '.', starting with a letter or digit",
            field="name",
        )
    return name


def _check_size(total: int, count: int, *, file: str) -> None:
    if total > MAX_TASK_BYTES:
        raise TaskFormatError(
            f"{file}: the task's files exceed the {MAX_TASK_BYTES // (1024 * 1024)} MiB limit",
            file=file,
        )
    if count > MAX_TASK_FILES:
        raise TaskFormatError(f"{file}: the task has more than {MAX_TASK_FILES} files", file=file)


def _normalize_member_path(raw: object) -> str:
    """Return a task-relative posix path, refusing absolute paths and '..'."""
    if not isinstance(raw, str) or not raw or "\x00" in raw or "\\" in raw:
        raise TaskFormatError(f"invalid file path {raw!r} in the task", file=str(raw))
    if raw.startswith("/"):
        raise TaskFormatError(f"{raw}: absolute paths are not allowed in a task", file=raw)
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise TaskFormatError(f"{raw}: '..' is not allowed in a task file path", file=raw)
    if not parts:
        raise TaskFormatError(f"invalid file path {raw!r} in the task", file=raw)
    return "/".join(parts)


def _text(files: Mapping[str, bytes], path: str) -> str:
    if path not in files:
        raise TaskFormatError(f"{path}: the file is missing", file=path)
    try:
        return files[path].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFormatError(f"{path}: not valid UTF-8 text ({exc.reason} at byte {exc.start})", file=path) from exc


def _parse_config(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"{CONFIG_FILE}: invalid TOML: {exc}", file=CONFIG_FILE) from exc


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def _env_table(config: Mapping[str, Any], section: str) -> dict[str, str]:
    """Return ``[section] env`` (variable name -> string value), validated."""
    env = _table(config, section).get("env", {})
    field = f"{section}.env"
    if not isinstance(env, dict):
        raise TaskFormatError(f"{CONFIG_FILE}: [{section}] env must be a table of names to strings, got {env!r}",
                              file=CONFIG_FILE, field=field)
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            raise TaskFormatError(f"{CONFIG_FILE}: [{section}] env: {key!r} is not a variable name",
                                  file=CONFIG_FILE, field=field)
        if not isinstance(value, str) or "\0" in value:
            raise TaskFormatError(f"{CONFIG_FILE}: [{section}] env {key} must be a string, got {value!r}",
                                  file=CONFIG_FILE, field=field)
    return dict(env)


def _table(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise TaskFormatError(
            f"{CONFIG_FILE}: [{key}] must be a table, got {type(value).__name__}",
            file=CONFIG_FILE,
            field=key,
        )
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_number(table: Mapping[str, Any], section: str, key: str, default: float) -> float:
    value = table.get(key, default)
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise TaskFormatError(
            f"{CONFIG_FILE}: [{section}] {key} must be a positive number, got {value!r}",
            file=CONFIG_FILE,
            field=f"{section}.{key}",
        )
    return float(value)


def _size_mb(environment: Mapping[str, Any], key: str, default: int) -> int:
    """Return ``[environment] <key>_mb`` (a whole number) or ``<key> = "2G"`` (Harbor's older form) in MiB."""
    if f"{key}_mb" in environment:
        value = environment[f"{key}_mb"]
        if not _is_number(value) or not math.isfinite(value) or value != int(value) or value < 1:
            raise TaskFormatError(
                f"{CONFIG_FILE}: [environment] {key}_mb must be a positive whole number, got {value!r}",
                file=CONFIG_FILE,
                field=f"environment.{key}_mb",
            )
        return int(value)
    if key in environment:
        value = environment[key]
        match = _MEMORY_RE.fullmatch(value) if isinstance(value, str) else None
        megabytes = float(match.group(1)) * _MEMORY_UNIT_MB[match.group(2).upper()] if match else 0
        if megabytes < 1:
            raise TaskFormatError(
                f"{CONFIG_FILE}: [environment] {key} must be a size such as '2G' or '512M', got {value!r}",
                file=CONFIG_FILE,
                field=f"environment.{key}",
            )
        return int(megabytes)
    return default


# --------------------------------------------------------------------------- archives


class TaskDir(Protocol):
    """A task held as its directory's files (every family that reads task dirs)."""

    @property
    def name(self) -> str: ...

    @property
    def files(self) -> Mapping[str, bytes]: ...


T = TypeVar("T")


def task_to_tar(task: TaskDir) -> bytes:
    """Return a deterministic tar.gz holding the task as one top-level folder ``<name>/``.

    Entries are sorted, with a fixed mtime, uid/gid 0 and no user names; ``.sh``
    files get mode 0755, others 0644.
    """
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        directories = sorted(
            {"/".join(path.split("/")[:i]) for path in task.files for i in range(1, path.count("/") + 1)}
        )
        entries = [(d, None) for d in directories] + [(p, task.files[p]) for p in task.files]
        for rel, data in sorted(entries, key=lambda item: item[0]):
            info = tarfile.TarInfo(f"{task.name}/{rel}")
            info.mtime = _TAR_MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if data is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                archive.addfile(info)
            else:
                info.mode = 0o755 if rel.endswith(".sh") else 0o644
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def tasks_from_tar(data: bytes) -> list[TerminalTask]:
    """Read the terminal task dirs of a tar archive (see :func:`task_dirs_from_tar`)."""
    return task_dirs_from_tar(data, load_task_files)


def task_dirs_from_tar(data: bytes, load: Callable[[str, Mapping[str, bytes]], T]) -> list[T]:
    """Read the task dirs of a tar archive (plain, gzip, bzip2 or xz).

    The archive holds either one task (``task.toml`` at its top, or in its single
    top-level folder) or several task dirs (each top-level folder with a
    ``task.toml``); a single wrapping folder around several tasks is looked through.
    A task at the very top takes its name from ``[task] name`` (Harbor's schema 1.1:
    ``org/name``, of which the name part) or ``[metadata] name``.

    ``load`` validates each task's files (another family's task dirs pass their own).

    Raises:
        TaskFormatError: the archive is unreadable, too big, holds links, absolute
            or '..' paths, or one of its tasks is malformed.
    """
    files = _read_archive(data)
    if not files:
        raise TaskFormatError("the archive holds no files", file="<archive>")
    prefix = ""
    # Look through wrapping folders ("tasks/a/...", "tasks/b/...") that hold no task themselves.
    while True:
        here = {p[len(prefix) :] for p in files if p.startswith(prefix)}
        if CONFIG_FILE in here or INSTRUCTION_FILE in here:
            return [_single_top_task(files, prefix, load)]
        tops = {p.split("/", 1)[0] for p in here}
        if len(tops) == 1 and all("/" in p for p in here):
            top = tops.pop()
            if f"{top}/{CONFIG_FILE}" in here or f"{top}/{INSTRUCTION_FILE}" in here:
                return [_folder_task(files, prefix, top, load)]
            prefix += top + "/"
            continue
        break
    tasks: list[T] = []
    for top in sorted(tops):
        has_config = f"{top}/{CONFIG_FILE}" in here
        has_instruction = f"{top}/{INSTRUCTION_FILE}" in here
        if has_config or has_instruction:
            tasks.append(_folder_task(files, prefix, top, load))
        else:
            logger.info("archive: ignoring %r, which is not a task directory (no %s)", prefix + top, CONFIG_FILE)
    if not tasks:
        raise TaskFormatError(
            f"the archive holds no task directory (no {CONFIG_FILE} at its top or in a top-level folder)",
            file=CONFIG_FILE,
        )
    return tasks


def _folder_task(files: Mapping[str, bytes], prefix: str, top: str, load: Callable[[str, Mapping[str, bytes]], T]) -> T:
    base = f"{prefix}{top}/"
    members = {p[len(base) :]: d for p, d in files.items() if p.startswith(base)}
    try:
        return load(top, members)
    except TaskFormatError as exc:
        if exc.field == "name":
            raise
        raise TaskFormatError(
            f"task {top!r}: {exc}", file=f"{top}/{exc.file}" if exc.file else top, field=exc.field
        ) from exc


def _single_top_task(files: Mapping[str, bytes], prefix: str, load: Callable[[str, Mapping[str, bytes]], T]) -> T:
    members = {p[len(prefix) :]: d for p, d in files.items() if p.startswith(prefix)}
    name: object = None
    if CONFIG_FILE in members:
        config = _parse_config(_text(members, CONFIG_FILE))
        # Harbor's newer schema names a task in [task] name ("org/name"); the older one in [metadata].
        package = _table(config, "task").get("name")
        name = package.rsplit("/", 1)[-1] if isinstance(package, str) and package else None
        name = name or _table(config, "metadata").get("name")
    if name is None and prefix:
        name = prefix.rstrip("/").rsplit("/", 1)[-1]
    if name is None:
        raise TaskFormatError(
            f"{CONFIG_FILE}: the task is at the archive's top level, so [task] name (or [metadata] name) "
            "must give its name",
            file=CONFIG_FILE,
            field="metadata.name",
        )
    return load(validate_task_name(name), members)


def _read_archive(data: bytes) -> dict[str, bytes]:
    """Return the regular files of a tar archive by normalized path, refusing unsafe members.

    Every limit (unpacked size, compression ratio, members, header sizes) is checked
    while the archive streams (:mod:`workers.archives`), so a bomb costs a fraction of a second.
    """
    files: dict[str, bytes] = {}
    limits = ArchiveLimits(max_unpacked_bytes=MAX_ARCHIVE_BYTES + MAX_ARCHIVE_OVERHEAD, max_members=MAX_ARCHIVE_MEMBERS)
    total = 0
    for member, content in iter_members(data, limits):
        raw_name = member.name
        if raw_name.startswith("/"):
            raise TaskFormatError(f"{raw_name}: absolute paths are not allowed in a task archive", file=raw_name)
        parts = [p for p in raw_name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise TaskFormatError(f"{raw_name}: '..' is not allowed in a task archive path", file=raw_name)
        if any(p in _JUNK_PARTS or p.startswith("._") for p in parts):
            continue
        if member.isdir() or not parts:
            continue
        path = "/".join(parts)
        if member.issym() or member.islnk():
            raise TaskFormatError(f"{path}: links are not allowed in a task archive", file=path)
        if not member.isfile() or content is None:
            raise TaskFormatError(f"{path}: only regular files are allowed in a task archive", file=path)
        total += len(content)
        if total > MAX_ARCHIVE_BYTES:
            raise TaskFormatError(
                f"{path}: the archive unpacks to more than {MAX_ARCHIVE_BYTES // (1024 * 1024)} MiB", file=path
            )
        if path in files:
            raise TaskFormatError(f"{path}: the file appears twice in the archive", file=path)
        files[path] = content
    return files


__all__ = [
    "MAX_TASK_BYTES",
    "TaskDir",
    "TerminalTask",
    "clean_task_files",
    "content_hash",
    "load_task_dir",
    "load_task_files",
    "task_dirs_from_tar",
    "task_to_tar",
    "tasks_from_tar",
    "validate_task_name",
]

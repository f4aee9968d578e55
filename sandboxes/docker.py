"""The ``docker`` backend: one container per sandbox through the Docker Engine SDK.

Each container runs ``bash --noprofile --norc`` under docker-init. Before the container
starts, the backend attaches ONE socket to its stdin/stdout/stderr and keeps it for the
sandbox's life: a reader task splits Docker's 8-byte stream frames into a
:class:`~sandboxes.shell.ShellChannel`, so a command costs one write and one read, never a
``docker exec``.

When the engine shares this host's ``/proc`` (the usual local socket), a timed-out command
is killed from the host (every process of the container started since the command began)
and files are read and written through ``/proc/<init pid>/root`` with ``openat2``
(``RESOLVE_IN_ROOT``), which sees the container's own mounts. With a remote engine the
backend falls back to a small kill script run with ``exec_run`` and to ``get_archive`` /
``put_archive``.

Choices worth knowing:

- ``SandboxSpec.network=True`` puts the container on Docker's default ``bridge``
  network: it can reach the internet but not the host's loopback services (Redis,
  PostgreSQL, the gateway), unlike ``network_mode="host"``.
- ``spec.env`` is exported by the persistent shell, not set as the container's
  environment, because ``docker commit`` would otherwise bake it into every image made
  from the sandbox. Image ENV is set on the container as usual.
- A container's shell lives as long as its attach socket: when this process closes the
  backend or dies, idle shells read EOF and their containers stop (Docker's StdinOnce), so
  such orphans are listed as ``failed``; a shell busy with a command keeps its container
  ``ready`` until the command ends. Either way a reaper destroys them. A running sandbox
  is driven only by the backend instance holding its socket; another one can read and
  write its files and revive it once stopped.
- Containers also inherit labels from the image they start from (``docker commit`` keeps
  the container's labels), so the keys a spec set are recorded in the ``forkyard.labels``
  label and :class:`SandboxInfo.labels` reports only those, plus the node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import io
import ipaddress
import json
import logging
import os
import posixpath
import re
import secrets
import socket
import tarfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
from docker.utils import parse_repository_tag

from sandboxes import fs
from sandboxes.base import (
    DEFAULT_MAX_OUTPUT_BYTES,
    LABEL_NODE,
    ExecResult,
    ImageConfig,
    ImageInfo,
    Revert,
    SandboxInfo,
    SandboxLedger,
    SandboxSpec,
    SandboxState,
    announce_launched,
    create_cancel_safe,
    normalize_sandbox_path,
)
from sandboxes.errors import (
    BackendUnavailableError,
    FileTooLargeError,
    ImageNotFoundError,
    SandboxCrashedError,
    SandboxError,
    SandboxNotFoundError,
)
from sandboxes.layers import LayerStack, layer_dirs_exist, seed_revert
from sandboxes.network import EgressPolicy, apply_ruleset, network_problem
from sandboxes.oci import nofile_limit
from sandboxes.procs import (
    child_pids,
    descendants,
    host_pid_of,
    kill_descendants_since,
    signal_pid,
    ticks_now,
)
from sandboxes.shell import (
    ABORT_SIGNAL,
    KILL_SINCE_SCRIPT,
    SHELL_DIED_EXIT_CODE,
    STDERR,
    STDOUT,
    UPTIME_SCRIPT,
    ShellChannel,
    ansi_c_quote,
)
from sandboxes.snapshots import (
    CAPTURE_COMMAND,
    CAPTURE_MAX_BYTES,
    SNAPSHOT_REPOSITORY,
    Snapshot,
    parse_exported,
    restore_command,
    snapshot_id,
    snapshot_metadata,
    start_branches,
)

logger = logging.getLogger(__name__)

#: Label marking containers made by this backend.
LABEL_BACKEND = "forkyard.backend"
#: Label holding the JSON list of label keys the spec set (the rest came from the image).
LABEL_KEYS = "forkyard.labels"
#: Image labels of snapshots: the snapshot's description (JSON) and the node that made it.
LABEL_SNAPSHOT = "forkyard.snapshot"
LABEL_SNAPSHOT_NODE = "forkyard.snapshot.node"
#: Repository of snapshot images still being made: a random tag names each until it has its own, so
#: one abandoned mid-call (a snapshot() cancelled while the engine commits) can be found and removed.
BUILD_REPOSITORY = "forkyard/snapshot-build"
#: Repository of deleted snapshots whose image a container still used: each is removed, by this tag,
#: once nothing uses it. Never an untagged image: the engine's commit makes the image before it tags
#: it, so an untagged image of this node may be a snapshot still being made.
RETIRED_REPOSITORY = "forkyard/snapshot-retired"
DEFAULT_DOCKER_URL = "unix:///var/run/docker.sock"
SHELL_ARGV = ["/bin/bash", "--noprofile", "--norc"]

_PING_TIMEOUT_S = 10
#: Commits and imports of a few hundred megabytes take a while on a small host.
_API_TIMEOUT_S = 600
#: A build tag this old belongs to a snapshot() cancelled while the engine still worked for it.
_ABANDONED_BUILD_S = 6 * _API_TIMEOUT_S
_READY_TIMEOUT_S = 60.0
#: How long a container may take to stop after its shell exited by itself.
_EXIT_WAIT_S = 5
#: Files at most this big are read/written on the event loop thread; bigger ones in a worker thread.
_INLINE_IO_BYTES = 1 << 20
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_STATES = {
    "created": SandboxState.STARTING,
    "restarting": SandboxState.STARTING,
    "running": SandboxState.READY,
    "paused": SandboxState.READY,
    "removing": SandboxState.STOPPING,
    "exited": SandboxState.FAILED,
    "dead": SandboxState.FAILED,
}

T = TypeVar("T")


@dataclass
class _Sandbox:
    """What this process holds for one live container: its shell channel and socket."""

    id: str
    env: dict[str, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    channel: ShellChannel | None = None
    writer: asyncio.StreamWriter | None = None
    reader: asyncio.Task | None = None
    sdk_socket: Any = None
    pid: int | None = None
    """Host pid of the container's init when this host sees the engine's processes."""
    shell_pid: int = 0
    """The shell's pid inside the container."""
    shell_host_pid: int | None = None
    """The shell's pid on this host (None when the engine's processes are not visible)."""
    shell_chain: frozenset[int] = frozenset()
    """Host pids of the shell and whatever runs between it and the init: a command's kill spares them.

    By pid, not by start time: on a fast host a command can start in the shell's own clock tick.
    """
    rootfd: int | None = None
    """O_PATH descriptor of the container's root as its processes see it (host /proc only)."""
    workdir: str = "/"
    restarting: bool = False
    destroyed: bool = False


def _parse_created(value: Any) -> float:
    """Return Docker's creation time (epoch int or RFC 3339 with nanoseconds) as epoch seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?", str(value))
    if not m:
        return 0.0
    stamp = datetime.fromisoformat(m.group(1) + (m.group(3) or "Z").replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp() + float("0." + (m.group(2) or "0"))


def _env_change(key: str, value: str) -> str:
    """Return a Dockerfile ``ENV`` line that sets ``key`` to ``value`` literally."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("\n", "\\n")
    return f'ENV {key}="{escaped}"'


def _config_changes(config: ImageConfig) -> list[str]:
    """Return the commit/import ``changes`` that store ``config`` with an image."""
    for key in config.env:
        if not _ENV_NAME.match(key):
            raise SandboxError(f"invalid environment variable name {key!r} in the image config")
    changes = [_env_change(k, v) for k, v in config.env.items()]
    changes.append(f"WORKDIR {config.workdir or '/'}")
    changes.append(f"USER {config.user or 'root'}")
    return changes


def _imported_image_id(output: object, what: str) -> str | None:
    """Return the image id ``import_image`` reported in its JSON lines (None if none); raise on its errors."""
    image_id = None
    for line in str(output).splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict):
            continue
        if msg.get("error"):
            raise SandboxError(f"Docker engine failed to import {what}: {msg['error']}")
        status = msg.get("status")
        if isinstance(status, str) and status.startswith("sha256:"):
            image_id = status
    return image_id


def _split_ref(ref: str) -> tuple[str, str]:
    """Split ``name:tag`` (tag defaults to ``latest``)."""
    repo, tag = parse_repository_tag(ref)
    return repo, tag or "latest"


def _rootfs_tar(root: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """Yield an uncompressed tar of directory ``root`` in chunks, never holding a whole file."""
    # A TarFile over a dummy buffer only for gettarinfo(): it remembers inodes so that
    # hard links come out as links instead of second copies.
    meta = tarfile.TarFile(fileobj=io.BytesIO(), mode="w", format=tarfile.PAX_FORMAT)
    buf = bytearray()
    stack = [(root, ".")]
    while stack:
        path, arcname = stack.pop()
        info = meta.gettarinfo(path, arcname)
        if info is None:  # sockets and other types tar cannot carry
            continue
        buf += info.tobuf(meta.format, meta.encoding, meta.errors)
        if info.isreg():
            with open(path, "rb") as fh:
                while block := fh.read(chunk_bytes):
                    buf += block
                    if len(buf) >= chunk_bytes:
                        yield bytes(buf)
                        buf.clear()
            if info.size % tarfile.BLOCKSIZE:
                buf += b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
        elif info.isdir():
            with os.scandir(path) as entries:
                names = sorted(e.name for e in entries)
            stack.extend((os.path.join(path, n), f"{arcname}/{n}") for n in reversed(names))
        if len(buf) >= chunk_bytes:
            yield bytes(buf)
            buf.clear()
    buf += b"\0" * (2 * tarfile.BLOCKSIZE)
    yield bytes(buf)


def _single_file_tar(name: str, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> bytes:
    """Return a tar holding one regular file ``name`` owned by ``owner`` (uid, gid; default root)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = mode & 0o7777
        info.uid, info.gid = owner or (0, 0)
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


#: Engines already warned about (once per process) for having no disk quotas.
_WARNED_NO_QUOTA: set[str] = set()


def _storage_driver(client: docker.DockerClient) -> str:
    try:
        info = client.info()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError):  # answers ping, not info
        return "unknown"
    status = dict(info.get("DriverStatus") or [])
    backing = status.get("Backing Filesystem")
    return f"{info.get('Driver', 'unknown')}" + (f" on {backing}" if backing else "")


def _disk_quota_kind(client: docker.DockerClient) -> str | None:
    """Return how the engine's storage driver limits a container's disk (see ``DockerBackend``)."""
    driver = _storage_driver(client)
    if driver.split()[0] in ("btrfs", "zfs"):
        return "rootfs"
    if driver == "overlay2 on xfs":
        return "layer"
    return None


def _is_ipv4(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 4
    except ValueError:
        return False


class DockerBackend:
    """Run sandboxes as Docker containers, each driven through one attached persistent bash."""

    name = "docker"

    def __init__(self, node: str, base_url: str | None = None, *, egress: EgressPolicy | None = None) -> None:
        """Connect to the engine at ``base_url`` (else DOCKER_HOST, else the local socket).

        ``egress`` is what sandboxes with ``network=True`` may reach (:mod:`sandboxes.network`):
        its nftables table goes into each such container's namespace from the host.

        Raises:
            BackendUnavailableError: no Docker engine answers there.
        """
        self.node = node
        self.egress = egress or EgressPolicy()
        self._ledger = SandboxLedger()
        self.base_url = base_url or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_URL
        client = None
        try:
            if base_url is None:
                client = docker.from_env(timeout=_PING_TIMEOUT_S)
            else:
                client = docker.DockerClient(base_url=base_url, timeout=_PING_TIMEOUT_S)
            client.ping()
            components = client.version().get("Components") or []
        except Exception as exc:
            if client is not None:
                client.close()
            raise BackendUnavailableError(f"No Docker engine answers at {self.base_url}: {exc}") from exc
        client.api.timeout = _API_TIMEOUT_S
        self._client = client
        self._api = client.api
        self._init = any(c.get("Name") == "docker-init" for c in components)
        """Run docker-init as PID 1 so bash is an ordinary process that can be signalled."""
        self._host_proc = True
        """Use host /proc for kills and files when the engine's pids are visible (tests turn it off)."""
        self._disk_quota = _disk_quota_kind(client)
        """How the engine limits a container's disk: ``layer`` (overlay2 on xfs: the writable layer),
        ``rootfs`` (btrfs, zfs: image included), or None (no limit: warned once here)."""
        if self._disk_quota is None and self.base_url not in _WARNED_NO_QUOTA:
            _WARNED_NO_QUOTA.add(self.base_url)
            logger.warning(
                "the Docker engine at %s cannot limit a container's disk (storage driver %s); "
                "docker sandboxes run without disk quotas (btrfs, zfs or overlay2 on xfs with pquota can)",
                self.base_url, _storage_driver(client),
            )
        self._sandboxes: dict[str, _Sandbox] = {}
        self._retired: set[str] = set()
        """The snapshots this backend deleted while restored containers used their images (see :meth:`destroy`)."""
        self._attach_lock = asyncio.Lock()
        self._closed = False
        self.max_snapshot_layers = 48
        """A snapshot image with more layers than this is flattened (export + import) into one.

        Every commit adds a layer and overlay2 refuses images past ~125; a chain of
        snapshots of restored snapshots (sessions forked again and again) would reach it.
        """

    # -- plumbing ---------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking SDK call in a thread; map engine failures to SandboxError."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except docker.errors.NotFound:
            raise
        except docker.errors.APIError as exc:
            # An image removed by a concurrent call (another snapshot's sweep) is answered with a 500.
            if "unrecognized image id" in str(exc.explanation or exc).lower():
                raise docker.errors.NotFound(str(exc.explanation or exc), response=exc.response) from exc
            raise SandboxError(f"Docker engine failed to {what}: {exc.explanation or exc}") from exc
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
            raise SandboxError(f"Docker engine at {self.base_url} failed to {what}: {exc}") from exc

    async def _inspect(self, sandbox_id: str) -> dict:
        """Return the container's inspect data if it is one of this node's sandboxes."""
        try:
            attrs = await self._call("inspect a container", self._api.inspect_container, sandbox_id)
        except docker.errors.NotFound as exc:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on docker node {self.node!r}") from exc
        labels = attrs.get("Config", {}).get("Labels") or {}
        if labels.get(LABEL_NODE) != self.node or labels.get(LABEL_BACKEND) != self.name:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on docker node {self.node!r}")
        return attrs

    def _host_pid(self, attrs: dict) -> int | None:
        """Return the container's init pid if this host's /proc shows that very process."""
        pid = (attrs.get("State") or {}).get("Pid") or 0
        if not self._host_proc or pid <= 0:
            return None
        try:
            with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
                return pid if attrs["Id"] in fh.read() else None
        except OSError:
            return None

    def _bind_host(self, sbx: _Sandbox, attrs: dict) -> None:
        """Record the container's host pid and hold its root open, if this host sees them."""
        _close_fd(sbx.rootfd)
        sbx.rootfd = None
        sbx.pid = self._host_pid(attrs)
        if sbx.pid is None:
            return
        try:
            # Held open, the root stays the container's even if the pid is later reused.
            fd = os.open(f"/proc/{sbx.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            sbx.pid = None
            return
        if self._host_pid(attrs) != sbx.pid:  # the process died in between
            os.close(fd)
            sbx.pid = None
            return
        sbx.rootfd = fd

    async def _attach(self, sbx: _Sandbox) -> None:
        """Attach the long-lived stdin/stdout/stderr socket and start the reader task."""
        sdk_socket = await self._call(
            "attach to a container",
            self._api.attach_socket,
            sbx.id,
            params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1},
        )
        raw = getattr(sdk_socket, "_sock", sdk_socket)
        if not isinstance(raw, socket.socket) or raw.type != socket.SOCK_STREAM:
            _close_sdk_socket(sdk_socket)
            raise SandboxError(
                f"cannot drive a shell over this Docker connection ({self.base_url}); use a unix or tcp socket"
            )
        # asyncio gets its own descriptor; the SDK's objects are closed with the sandbox.
        own = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
        reader, writer = await asyncio.open_connection(sock=own, limit=1 << 20)

        async def write(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        channel = ShellChannel(write)
        sbx.channel, sbx.writer, sbx.sdk_socket = channel, writer, sdk_socket
        sbx.reader = asyncio.create_task(_pump(reader, channel), name=f"docker-attach-{sbx.id[:12]}")

    async def _detach(self, sbx: _Sandbox) -> None:
        """Close the attach socket and stop the reader task."""
        if sbx.reader is not None:
            sbx.reader.cancel()
            try:
                await sbx.reader
            except asyncio.CancelledError:
                pass
        if sbx.writer is not None:
            sbx.writer.close()
        _close_sdk_socket(sbx.sdk_socket)
        _close_fd(sbx.rootfd)
        sbx.reader = sbx.writer = sbx.sdk_socket = sbx.rootfd = None

    async def _start(self, sbx: _Sandbox, *, cwd: str | None = None) -> None:
        """Attach, start the container and wait until its shell answers (restoring env and cwd)."""
        try:
            await self._attach(sbx)
            await self._call("start a container", self._api.start, sbx.id)
            attrs = await self._call("inspect a container", self._api.inspect_container, sbx.id)
            self._bind_host(sbx, attrs)
            await self._prime(sbx, cwd)
            if sbx.destroyed:  # destroy() ran while the shell was starting
                raise SandboxNotFoundError(f"sandbox {sbx.id!r} was destroyed while its shell started")
        except docker.errors.NotFound as exc:
            await self._detach(sbx)
            raise SandboxNotFoundError(f"sandbox {sbx.id!r} disappeared while its shell started") from exc
        except BaseException:
            await self._detach(sbx)
            raise

    async def _prime(self, sbx: _Sandbox, cwd: str | None) -> None:
        """Export the spec's env and cd to ``cwd`` in a fresh shell; fail if it does not answer."""
        parts = [f"export {k}={ansi_c_quote(v)}" for k, v in sbx.env.items()]
        if cwd:
            parts.append(f"cd -- {ansi_c_quote(cwd)}")
        parts.append("echo $$")
        assert sbx.channel is not None
        result = await sbx.channel.run(" && ".join(parts), timeout_s=_READY_TIMEOUT_S)
        if result.exit_code != 0 or result.timed_out or not result.stdout.strip().isdigit():
            raise SandboxCrashedError(
                f"the shell of sandbox {sbx.id[:12]} did not start: exit {result.exit_code} "
                f"{result.stderr.strip()[-500:]}"
            )
        sbx.shell_pid = int(result.stdout.strip())
        sbx.workdir = result.cwd or sbx.workdir
        if sbx.pid is not None:
            sbx.shell_host_pid = await asyncio.to_thread(host_pid_of, sbx.shell_pid, child_pids(sbx.pid))
            sbx.shell_chain = frozenset(pid for pid, _ in await asyncio.to_thread(descendants, sbx.pid))

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the docker sandbox backend is closed")

    async def _sandbox(self, sandbox_id: str) -> _Sandbox:
        """Return the attached sandbox, attaching to (or restarting) an existing container."""
        self._check_open()
        sbx = self._sandboxes.get(sandbox_id)
        if sbx is not None:
            return sbx
        async with self._attach_lock:
            attrs = await self._inspect(sandbox_id)
            sbx = self._sandboxes.get(attrs["Id"])
            if sbx is not None:
                return sbx
            if attrs.get("State", {}).get("Running"):
                # Its shell reads from another backend's attach socket; a second writer would
                # interleave with that one's commands.
                raise SandboxError(
                    f"sandbox {attrs['Id'][:12]} is running under another docker backend instance; "
                    "only that one can run commands in it"
                )
            # Stopped (its owner went away): a fresh shell on the same filesystem.
            sbx = _Sandbox(id=attrs["Id"], workdir=attrs.get("Config", {}).get("WorkingDir") or "/")
            await self._start(sbx)
            self._sandboxes[sbx.id] = sbx
            return sbx

    def _info(self, attrs: dict) -> SandboxInfo:
        """Build a SandboxInfo from inspect data or a container-list entry."""
        cid = attrs["Id"]
        labels = (attrs.get("Config") or {}).get("Labels") or attrs.get("Labels") or {}
        try:
            keys = json.loads(labels.get(LABEL_KEYS, "[]"))
        except ValueError:
            keys = []
        shown = {k: labels[k] for k in keys if k in labels}
        shown[LABEL_NODE] = labels.get(LABEL_NODE, self.node)
        raw_state = attrs["State"]["Status"] if isinstance(attrs.get("State"), dict) else attrs.get("State", "")
        state = _STATES.get(raw_state, SandboxState.FAILED)
        sbx = self._sandboxes.get(cid)
        if sbx is not None:
            if sbx.restarting:
                state = SandboxState.STARTING
            elif state is SandboxState.READY and sbx.lock.locked():
                state = SandboxState.BUSY
        image = (attrs.get("Config") or {}).get("Image") or attrs.get("Image", "")
        return SandboxInfo(
            id=cid,
            backend=self.name,
            node=self.node,
            state=state,
            image=image,
            created_at=_parse_created(attrs.get("Created")),
            labels=shown,
        )

    # -- contract ---------------------------------------------------------------------

    def made_after(self, mark: int) -> tuple[list[SandboxInfo], int]:
        return self._ledger.after(mark)

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Start a container from ``spec.image`` and return once its shell answers."""
        return self._ledger.add(await create_cancel_safe(self._create(spec), self.destroy))

    async def _create(self, spec: SandboxSpec, prepare: Callable[[str], Awaitable[None]] | None = None) -> SandboxInfo:
        """Create and start a container of ``spec``; ``prepare`` gets its id before it starts."""
        self._check_open()
        for key in spec.env:
            if not _ENV_NAME.match(key):
                raise SandboxError(f"invalid environment variable name {key!r}")
        user_labels = {k: v for k, v in spec.labels.items() if k not in (LABEL_NODE, LABEL_BACKEND, LABEL_KEYS)}
        labels = {
            **user_labels,
            LABEL_NODE: self.node,
            LABEL_BACKEND: self.name,
            LABEL_KEYS: json.dumps(sorted(user_labels)),
        }
        res = spec.resources
        memory = f"{int(res.memory_mb)}m"
        kwargs: dict[str, Any] = {
            # As entrypoint (not command) so an image's own ENTRYPOINT and CMD are both replaced.
            "entrypoint": SHELL_ARGV,
            "labels": labels,
            "stdin_open": True,
            "tty": False,
            "network_mode": f"container:{spec.network_of}" if spec.network_of else ("bridge" if spec.network else "none"),
            "mem_limit": memory,
            "memswap_limit": memory,
            "pids_limit": int(res.pids),
            "nano_cpus": int(res.cpus * 1e9),
            "init": self._init or None,
            # As the local backend's spec (sandboxes.oci): no device nodes, no chroot, no setuid
            # elevation, a bounded file table.
            "cap_drop": ["MKNOD", "SYS_CHROOT"],
            "security_opt": ["no-new-privileges"],
            "ulimits": [docker.types.Ulimit(name="nofile", soft=nofile_limit(), hard=nofile_limit())],
        }
        if spec.workdir:
            kwargs["working_dir"] = normalize_sandbox_path(spec.workdir)
        try:
            if self._disk_quota is not None:
                kwargs["storage_opt"] = {"size": f"{await self._disk_limit_mb(spec.image, res.disk_mb)}M"}
            container = await self._create_container(spec.image, kwargs)
        except docker.errors.ImageNotFound as exc:
            raise ImageNotFoundError(f"image {spec.image!r} is not known to the Docker engine") from exc
        except docker.errors.NotFound as exc:
            raise ImageNotFoundError(
                f"image {spec.image!r} is not known to the Docker engine: {exc.explanation}"
            ) from exc
        sbx = _Sandbox(id=container.id, env=dict(spec.env))
        try:
            if prepare is not None:
                await prepare(container.id)
            await self._start(sbx)
            attrs = await self._inspect(sbx.id)
            if spec.network and not spec.network_of:
                await self._filter_egress(attrs)
        except BaseException:
            await self._remove(container.id)
            raise
        self._sandboxes[sbx.id] = sbx
        logger.info("created docker sandbox %s from %s on node %s", sbx.id[:12], spec.image, self.node)
        return self._info(attrs)

    async def _filter_egress(self, attrs: dict[str, Any]) -> None:
        """Install the egress table in a networked container's namespace; refuse the sandbox if it cannot be.

        Docker's bridge alone lets a container reach every address of the host (a service
        bound to 0.0.0.0) and the host's private neighbours.
        """
        pid = int((attrs.get("State") or {}).get("Pid") or 0)
        problem = network_problem()
        if not self._host_proc or pid <= 0 or problem:
            raise SandboxError(
                "a docker sandbox with network needs its egress rules installed from this host "
                f"({problem or 'the engine runs elsewhere'}); refusing to start it unfiltered"
            )
        try:
            with open(attrs.get("ResolvConfPath") or "/nonexistent") as fh:
                servers = [ln.split()[1] for ln in fh if ln.startswith("nameserver") and len(ln.split()) > 1]
        except OSError:
            servers = []
        servers = [a for a in servers if _is_ipv4(a)]
        gateway = ((attrs.get("NetworkSettings") or {}).get("Gateway")) or None
        ruleset = self.egress.ruleset(dns_servers=servers, gateway=gateway)
        await asyncio.to_thread(apply_ruleset, pid, ruleset)

    async def _disk_limit_mb(self, image: str, disk_mb: int) -> int:
        """Return the engine's ``size`` for ``disk_mb`` of writes: btrfs and zfs count the image too."""
        if self._disk_quota != "rootfs":
            return int(disk_mb)
        attrs = await self._call("inspect an image", self._api.inspect_image, image)
        return int(disk_mb) + -(-int(attrs.get("Size") or 0) // (1 << 20))

    async def _create_container(self, image: str, kwargs: dict[str, Any]):
        try:
            return await self._call("create a container", self._client.containers.create, image, **kwargs)
        except SandboxError as exc:
            # overlay2 on xfs mounted without pquota says so only when asked: run on without quotas.
            if "storage_opt" not in kwargs or "storage-opt" not in str(exc):
                raise
            logger.warning("the Docker engine at %s refuses disk quotas (%s); docker sandboxes run without them",
                           self.base_url, exc)
            self._disk_quota = None
            del kwargs["storage_opt"]
            return await self._call("create a container", self._client.containers.create, image, **kwargs)

    async def exec(
        self,
        sandbox_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        """Run ``command`` in the sandbox's persistent shell (cwd and exports persist)."""
        sbx = await self._sandbox(sandbox_id)
        async with sbx.lock:
            if sbx.destroyed:
                raise SandboxNotFoundError(f"sandbox {sandbox_id!r} was destroyed")
            assert sbx.channel is not None
            if sbx.channel.broken:  # the shell exited (`exit`) after the previous command
                await self._restart(sbx, hung=False)
            since = ticks_now()

            async def kill_command() -> None:
                await self._kill_command(sbx, since)

            result = await sbx.channel.run(
                command, timeout_s=timeout_s, max_output_bytes=max_output_bytes, on_timeout=kill_command
            )
            if sbx.channel.broken and not sbx.destroyed:
                result = await self._recover(sbx, result)
            return result

    async def _recover(self, sbx: _Sandbox, result: ExecResult) -> ExecResult:
        """Replace a shell that exited or hung; report its exit code and what was done."""
        assert sbx.channel is not None
        cwd = sbx.channel.cwd or sbx.workdir
        code = result.exit_code
        why = "the shell did not come back after the timeout"
        try:
            status = await self._restart(sbx, hung=result.timed_out)
            if not result.timed_out:
                if status is not None and code == SHELL_DIED_EXIT_CODE:
                    code = status
                why = f"the shell exited with code {code}"
            note = f"[forkyard: {why}; a new shell was started in {sbx.channel.cwd or cwd}]\n"
        except SandboxError as exc:
            logger.error("docker sandbox %s: cannot restart its shell: %s", sbx.id[:12], exc)
            note = f"[forkyard: {why} and could not be restarted: {exc}]\n"
        return dataclasses.replace(result, exit_code=code, stderr=result.stderr + note)

    async def _kill_command(self, sbx: _Sandbox, since_ticks: int) -> None:
        """Kill every process of the container started since the command began, not the shell."""
        if sbx.pid is not None:
            # Abort the command list in the shell first, then kill what it started.
            signal_pid(sbx.shell_host_pid, ABORT_SIGNAL)
            n = await asyncio.to_thread(kill_descendants_since, sbx.pid, since_ticks, spare=sbx.shell_chain)
            logger.debug("killed %d processes of timed-out command in %s", n, sbx.id[:12])
            return
        assert sbx.channel is not None
        started = sbx.channel.command_started_at
        try:
            container = await self._call("find a container", self._client.containers.get, sbx.id)
            # Read the container's clock and place the command's start on it; the error is
            # at most this round trip, taken on the early side so the whole command dies.
            before = time.monotonic()
            clock = await self._call(
                "read the container clock", container.exec_run, ["/bin/bash", "-c", UPTIME_SCRIPT], user="0"
            )
            after = time.monotonic()
            since = int(clock.output.decode().strip()) - int((after - started) * 100) - 1
            logger.debug("container clock round trip %.3fs", after - before)
            out = await self._call(
                "kill a timed-out command",
                container.exec_run,
                ["/bin/bash", "-c", KILL_SINCE_SCRIPT, "forkyard-kill", str(since), str(sbx.shell_pid)],
                user="0",
            )
            logger.debug("kill script in %s: exit %s %r", sbx.id[:12], out.exit_code, out.output[-500:])
        except (SandboxError, docker.errors.NotFound, ValueError):
            logger.warning("could not kill the timed-out command in %s", sbx.id[:12], exc_info=True)

    async def _restart(self, sbx: _Sandbox, *, hung: bool = True) -> int | None:
        """Replace a dead or stuck shell: stop the container, re-attach, start, restore cwd.

        Returns the exit code of a shell that ended by itself (None if it had to be killed).
        """
        assert sbx.channel is not None
        cwd = sbx.channel.cwd or sbx.workdir
        logger.warning(
            "shell of docker sandbox %s %s; restarting the container", sbx.id[:12], "hung" if hung else "exited"
        )
        sbx.restarting = True
        status: int | None = None
        try:
            await self._detach(sbx)
            if not hung:  # init follows the shell out within moments
                try:
                    done = await self._call("wait for a container", self._api.wait, sbx.id, timeout=_EXIT_WAIT_S)
                    status = int(done.get("StatusCode", -1))
                except SandboxError:
                    status = None
            if status is None:
                try:
                    await self._call("kill a container", self._api.kill, sbx.id)
                except SandboxError:
                    pass  # already stopped
                await self._call("wait for a container", self._api.wait, sbx.id)
            await self._start(sbx, cwd=cwd)
            return status
        except docker.errors.NotFound as exc:
            self._sandboxes.pop(sbx.id, None)
            raise SandboxNotFoundError(f"sandbox {sbx.id!r} disappeared while restarting its shell") from exc
        except SandboxNotFoundError:
            raise
        except SandboxError as exc:
            raise SandboxCrashedError(f"could not restart the shell of sandbox {sbx.id[:12]}: {exc}") from exc
        finally:
            sbx.restarting = False

    def _root_fd(self, sbx: _Sandbox) -> int | None:
        """Return the held root of a running container, or None to go through the engine."""
        if sbx.rootfd is None or sbx.channel is None or sbx.channel.closed:
            return None
        return sbx.rootfd

    async def _file_target(self, sandbox_id: str, path: str) -> tuple[_Sandbox, str]:
        """Resolve ``path`` from the shell's cwd; a sandbox this backend does not drive is not revived."""
        self._check_open()
        sbx = self._sandboxes.get(sandbox_id)
        if sbx is None:
            attrs = await self._inspect(sandbox_id)
            sbx = self._sandboxes.get(attrs["Id"]) or _Sandbox(
                id=attrs["Id"], workdir=(attrs.get("Config") or {}).get("WorkingDir") or "/"
            )
        base = (sbx.channel.cwd if sbx.channel is not None else None) or sbx.workdir
        return sbx, normalize_sandbox_path(path, base)

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        """Return the bytes of ``path`` inside the sandbox (relative paths from the shell's cwd), at most ``max_bytes``.

        Raises:
            FileNotFoundError: there is no such file; IsADirectoryError: it is a directory.
            FileTooLargeError: the file is bigger than ``max_bytes``.
        """
        sbx, target = await self._file_target(sandbox_id, path)
        rootfd = self._root_fd(sbx)
        if rootfd is None:
            return await self._read_archive(sbx.id, target, max_bytes)
        try:
            if fs.file_size_in_root(rootfd, target) <= _INLINE_IO_BYTES:
                return fs.read_in_root(rootfd, target, max_bytes)
            return await asyncio.to_thread(fs.read_in_root, rootfd, target, max_bytes)
        except fs.TooLargeError:
            raise FileTooLargeError(f"{target} in sandbox {sbx.id[:12]} is larger than {max_bytes} bytes") from None
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"no file {target} in sandbox {sbx.id[:12]}", target) from None
        except IsADirectoryError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot read {target} in sandbox {sbx.id[:12]}: {exc.strerror}") from exc

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644, owner: tuple[int, int] | None = None
    ) -> None:
        """Write ``data`` to ``path`` inside the sandbox, creating parent directories (owned by ``owner``)."""
        sbx, target = await self._file_target(sandbox_id, path)
        if target == "/":
            raise IsADirectoryError(errno.EISDIR, "cannot write to the sandbox root", target)
        rootfd = self._root_fd(sbx)
        if rootfd is None:
            await self._write_archive(sbx.id, target, bytes(data), mode, owner)
            return
        try:
            if len(data) <= _INLINE_IO_BYTES:
                fs.write_in_root(rootfd, target, bytes(data), mode, owner=owner)
            else:
                await asyncio.to_thread(fs.write_in_root, rootfd, target, bytes(data), mode, owner=owner)
        except IsADirectoryError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot write {target} in sandbox {sbx.id[:12]}: {exc.strerror}") from exc

    async def _read_archive(self, cid: str, target: str, max_bytes: int | None = None) -> bytes:
        """Read one file through ``get_archive``, following symlinks inside the sandbox."""
        for _ in range(40):
            try:
                chunks, stat = await self._call("read a file", self._api.get_archive, cid, target)
                size = int((stat or {}).get("size") or 0)
                if max_bytes is not None and size > max_bytes:
                    raise FileTooLargeError(f"{target} in sandbox {cid[:12]} is larger than {max_bytes} bytes")
                blob = await asyncio.to_thread(b"".join, chunks)
            except docker.errors.NotFound as exc:
                raise FileNotFoundError(errno.ENOENT, f"no file {target} in sandbox {cid[:12]}", target) from exc
            with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                member = tar.next()
                if member is None:
                    raise FileNotFoundError(errno.ENOENT, f"no file {target} in sandbox {cid[:12]}", target)
                if member.issym():
                    # The engine resolved the link within the container (parents included).
                    resolved = (stat or {}).get("linkTarget") or ""
                    if not resolved:
                        link = member.linkname
                        resolved = posixpath.join(posixpath.dirname(target), link)
                    target = normalize_sandbox_path(posixpath.normpath("/" + resolved.lstrip("/")))
                    continue
                if member.isdir():
                    raise IsADirectoryError(errno.EISDIR, f"{target} is a directory in sandbox {cid[:12]}", target)
                fh = tar.extractfile(member)
                if fh is None:
                    raise SandboxError(f"{target!r} is not a regular file in sandbox {cid[:12]}")
                if max_bytes is not None and member.size > max_bytes:
                    raise FileTooLargeError(f"{target} in sandbox {cid[:12]} is larger than {max_bytes} bytes")
                return fh.read()
        raise SandboxError(f"too many levels of symbolic links at {target!r} in sandbox {cid[:12]}")

    async def _write_archive(
        self, cid: str, target: str, data: bytes, mode: int, owner: tuple[int, int] | None = None
    ) -> None:
        """Write one file through ``put_archive``, creating missing parents with ``mkdir -p``."""
        parent, name = posixpath.split(target)
        blob = _single_file_tar(name, data, mode, owner)
        for attempt in range(2):
            try:
                ok = await self._call("write a file", self._api.put_archive, cid, parent, blob)
            except docker.errors.NotFound as exc:
                if attempt:
                    msg = f"cannot create {parent} in sandbox {cid[:12]}"
                    raise FileNotFoundError(errno.ENOENT, msg, parent) from exc
                container = await self._call("find a container", self._client.containers.get, cid)
                await self._call("create directories", container.exec_run, ["mkdir", "-p", "--", parent],
                                 user=f"{owner[0]}:{owner[1]}" if owner else "0")
                continue
            if not ok:
                raise SandboxError(f"Docker engine refused to write {target!r} in sandbox {cid[:12]}")
            return

    async def status(self, sandbox_id: str) -> SandboxInfo:
        """Return the sandbox's current info; raise SandboxNotFoundError if unknown."""
        return self._info(await self._inspect(sandbox_id))

    async def list(self) -> list[SandboxInfo]:
        """Return every container of this node, running or exited (orphans included)."""
        entries = await self._call(
            "list containers",
            self._api.containers,
            all=True,
            filters={"label": [f"{LABEL_NODE}={self.node}", f"{LABEL_BACKEND}={self.name}"]},
        )
        return [self._info(e) for e in entries]

    async def destroy(self, sandbox_id: str) -> None:
        """Kill and remove the container; a second call (or an unknown id) is a no-op.

        The last container restored from a snapshot deleted here takes the snapshot's image with
        it (one this backend's process did not retire, a crash's, goes at the next
        :meth:`delete_snapshot`). A container restored from a live snapshot touches no image.
        """
        try:
            attrs = await self._inspect(sandbox_id)
        except SandboxNotFoundError:
            sbx = self._sandboxes.pop(sandbox_id, None)
            if sbx is not None:
                sbx.destroyed = True
                await self._detach(sbx)
            return
        sbx = self._sandboxes.pop(attrs["Id"], None)
        try:
            if sbx is not None:
                sbx.destroyed = True
                await self._detach(sbx)
        finally:
            await self._remove(attrs["Id"])
        logger.info("destroyed docker sandbox %s", attrs["Id"][:12])
        repository, _, snapshot_id = str((attrs.get("Config") or {}).get("Image") or "").rpartition(":")
        if repository == SNAPSHOT_REPOSITORY and snapshot_id in self._retired:  # its image may go now
            if await self._drop_image(f"{RETIRED_REPOSITORY}:{snapshot_id}"):
                self._retired.discard(snapshot_id)

    async def _remove(self, cid: str) -> None:
        for attempt in range(3):
            try:
                await self._call("remove a container", self._api.remove_container, cid, force=True, v=True)
                return
            except docker.errors.NotFound:
                return
            except SandboxError as exc:
                if "already in progress" in str(exc):
                    return
                # The container exited on its own while the engine killed it ("Could not kill
                # running container ..., cannot remove - Container ... is not running"): it is
                # stopped now, and the next try removes it.
                if "is not running" not in str(exc) or attempt == 2:
                    raise
            await asyncio.sleep(0.1)

    async def commit(self, sandbox_id: str, image: str, config: ImageConfig) -> None:
        """Freeze the container's filesystem into image ``image`` carrying ``config``."""
        attrs = await self._inspect(sandbox_id)
        repo, tag = _split_ref(image)
        # The container's entrypoint (the shell) is kept; CMD is left empty so that
        # `docker run -i <image>` also gives that shell.
        changes = _config_changes(config)
        try:
            await self._call(
                "commit a container", self._api.commit, attrs["Id"], repository=repo, tag=tag, changes=changes
            )
        except docker.errors.NotFound as exc:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on docker node {self.node!r}") from exc
        logger.info("committed docker sandbox %s as %s", attrs["Id"][:12], image)

    async def import_rootfs(self, rootfs: str, image: str, config: ImageConfig) -> None:
        """Stream a root filesystem directory into the engine as image ``image``."""
        root = os.fspath(rootfs)
        if not os.path.isdir(root):
            raise SandboxError(f"root filesystem {root} is not a directory")
        repo, tag = _split_ref(image)
        changes = [*_config_changes(config), f"CMD {json.dumps(SHELL_ARGV)}"]
        try:
            out = await self._call(
                "import a root filesystem",
                self._api.import_image,
                src=_rootfs_tar(root),
                repository=repo,
                tag=tag,
                changes=changes,
                stream_src=True,
            )
        except docker.errors.NotFound as exc:
            raise SandboxError(f"Docker engine failed to import {root!r}: {exc.explanation}") from exc
        _imported_image_id(out, repr(root))
        logger.info("imported %s as docker image %s", root, image)

    async def has_image(self, image: str) -> bool:
        """Tell whether the engine knows image ``image``."""
        try:
            await self._call("inspect an image", self._api.inspect_image, image)
        except docker.errors.NotFound:
            return False
        return True

    async def image_digest(self, image: str) -> str:
        """Return the engine's id of ``image`` (the sha256 of its config, which names its layers)."""
        try:
            attrs = await self._call("inspect an image", self._api.inspect_image, image)
        except docker.errors.NotFound as exc:
            raise ImageNotFoundError(f"image {image!r} is not known to the Docker engine") from exc
        return attrs["Id"]

    async def image_layer_bytes(self, image: str) -> int:
        """Return the bytes the top layer of ``image`` adds to its parent (what a commit of it stored)."""
        try:
            history = await self._call("read an image's history", self._api.history, image)
        except docker.errors.NotFound as exc:
            raise ImageNotFoundError(f"image {image!r} is not known to the Docker engine") from exc
        return int(history[0].get("Size") or 0) if history else 0

    async def remove_image(self, image: str) -> None:
        """Untag and delete image ``image`` (idempotent); fails if a container still uses it."""
        try:
            await self._call("remove an image", self._api.remove_image, image)
        except docker.errors.NotFound:
            pass

    async def list_images(self, repository: str) -> list[ImageInfo]:
        """Return the images of ``repository``, oldest first; size: the bytes no other image shares."""
        images = await self._call("list images", self._api.images, name=repository)
        containers = await self._call("list containers", self._api.containers, all=True)
        used = {c.get("ImageID") for c in containers} | {c.get("Image") for c in containers}
        found = []
        for image in images:
            own = max(0, int(image.get("Size") or 0) - max(0, int(image.get("SharedSize") or 0)))
            for ref in image.get("RepoTags") or []:
                if ref.rsplit(":", 1)[0] == repository:
                    found.append(ImageInfo(ref=ref, size_bytes=own, created_at=float(image.get("Created") or 0),
                                           in_use=image.get("Id") in used or ref in used))
        return sorted(found, key=lambda i: (i.created_at, i.ref))

    # -- snapshots --------------------------------------------------------------------

    async def snapshot(
        self, sandbox_id: str, *, metadata: Mapping[str, str] | None = None, shell_state: bool = True
    ) -> Snapshot:
        """Commit the container (paused while it is copied) to a snapshot image with its shell state.

        The image is ``forkyard/snapshot:<id>`` and carries the snapshot as JSON in its
        ``forkyard.snapshot`` label. Background processes are not captured. With
        ``shell_state=False`` the shell is not asked anything (nor a stopped container
        started): the files alone, exports empty, cwd the workdir.

        The id depends on the image's digest, so the image is first committed under a
        random tag of :data:`BUILD_REPOSITORY`, which names it until it has its own.
        """
        if shell_state:
            sbx = await self._sandbox(sandbox_id)
        else:
            self._check_open()
            known = self._sandboxes.get(sandbox_id)
            if known is None:
                found = await self._inspect(sandbox_id)
                known = self._sandboxes.get(found["Id"]) or _Sandbox(
                    id=found["Id"], workdir=(found.get("Config") or {}).get("WorkingDir") or "/")
            sbx = known
        meta = snapshot_metadata(metadata)
        async with sbx.lock:
            if sbx.destroyed:
                raise SandboxNotFoundError(f"sandbox {sandbox_id!r} was destroyed")
            env: dict[str, str] = {}
            cwd = sbx.workdir
            if shell_state:
                assert sbx.channel is not None
                if sbx.channel.broken:
                    await self._restart(sbx, hung=False)
                state = await sbx.channel.run(CAPTURE_COMMAND, timeout_s=_READY_TIMEOUT_S,
                                              max_output_bytes=CAPTURE_MAX_BYTES)
                if state.exit_code != 0 or state.timed_out or state.truncated:
                    raise SandboxError(
                        f"cannot read the shell state of sandbox {sbx.id[:12]}: exit {state.exit_code} "
                        f"{state.stderr.strip()[-300:]}"
                    )
                env = parse_exported(state.stdout)
                cwd = state.cwd or sbx.workdir
            attrs = await self._inspect(sbx.id)
            config = attrs.get("Config") or {}
            host = attrs.get("HostConfig") or {}
            image = config.get("Image") or ""
            base = {
                "backend": self.name, "node": self.node, "image": image, "cwd": cwd, "env": env,
                "workdir": sbx.workdir, "metadata": meta,
                "resources": {"cpus": (host.get("NanoCpus") or 1e9) / 1e9,
                              "memory_mb": (host.get("Memory") or 1 << 30) // (1 << 20),
                              "pids": host.get("PidsLimit") or 256},
                "network": (host.get("NetworkMode") or "none") != "none",
            }  # fmt: skip
            labels = {LABEL_SNAPSHOT: json.dumps(base), LABEL_SNAPSHOT_NODE: self.node}
            build_tag = secrets.token_hex(16)
            try:
                out = await self._call("commit a snapshot", self._api.commit, sbx.id, repository=BUILD_REPOSITORY,
                                       tag=build_tag, pause=True, conf={"Labels": labels})
            except docker.errors.NotFound as exc:
                raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on docker node {self.node!r}") from exc
            except BaseException:
                await self._untag(f"{BUILD_REPOSITORY}:{build_tag}")  # in case the engine committed it
                raise
        try:
            image_id = await self._bound_layers(out["Id"], labels, build_tag)
            sid = snapshot_id({**base, "digest": image_id})
            await self._call("tag a snapshot", self._api.tag, image_id, SNAPSHOT_REPOSITORY, sid)
        finally:
            # Only untags a finished snapshot; deletes one that failed (nothing else names it).
            await self._untag(f"{BUILD_REPOSITORY}:{build_tag}")
        snap = self._snapshot_from(sid, image_id, base, time.time())
        logger.info("docker sandbox %s: snapshot %s", sbx.id[:12], sid)
        return snap

    async def _bound_layers(self, image_id: str, labels: dict[str, str], build_tag: str) -> str:
        """Return ``image_id``, or a flattened copy of it (same files and config) when its chain is too deep.

        The copy is committed under ``build_tag``, which moves from the deep image to it in
        one step; the imported image beneath it is its parent, deleted along with it. Until
        that commit the imported image has no tag or label to find it by, so a failure
        before it deletes the image here.
        """
        attrs = await self._call("inspect a snapshot image", self._api.inspect_image, image_id)
        depth = len((attrs.get("RootFS") or {}).get("Layers") or [])
        if depth <= self.max_snapshot_layers:
            return image_id
        t = time.monotonic()
        config = attrs.get("Config") or {}
        made: list[str] = []
        flat: str | None = None
        committed: dict | None = None
        try:
            source = await self._call("create a container to flatten", self._api.create_container, image_id,
                                      entrypoint=["true"], labels={"forkyard.squash": self.node})
            made.append(source["Id"])
            chunks = await self._call("export a snapshot", self._api.export, source["Id"], chunk_size=1 << 20)
            out = await self._call("import a flattened snapshot", self._api.import_image, src=chunks,
                                   stream_src=True)
            flat = _imported_image_id(out, "a flattened snapshot")
            if flat is None:
                raise SandboxError(f"Docker engine did not report the id of a flattened snapshot: {str(out)[:300]}")
            holder = await self._call("create a container to label", self._api.create_container, flat,
                                      entrypoint=["true"], labels={"forkyard.squash": self.node})
            made.append(holder["Id"])
            conf = {key: config.get(key) for key in ("Env", "WorkingDir", "User", "Entrypoint", "Cmd")}
            committed = await self._call("commit a flattened snapshot", self._api.commit, holder["Id"],
                                         repository=BUILD_REPOSITORY, tag=build_tag,
                                         conf={**conf, "Labels": labels})
        finally:
            await asyncio.shield(self._clear_flattening(made, None if committed else flat))
        await self._drop_image(image_id)  # the deep one; its untagged parents go with it unless in use
        logger.info("snapshot image %s had %d layers: flattened into %s in %.1f s", image_id[:19], depth,
                    committed["Id"][:19], time.monotonic() - t)
        return committed["Id"]

    async def _clear_flattening(self, containers: list[str], flat: str | None) -> None:
        """Remove the containers a flattening made, then its imported image ``flat`` unless None.

        The containers go first: the holder container keeps ``flat`` in use.
        """
        for cid in containers:
            try:
                await self._call("remove a container", self._api.remove_container, cid, force=True)
            except (docker.errors.NotFound, SandboxError):
                pass
        if flat is not None and not await self._drop_image(flat):
            logger.warning("imported image %s of a failed flattening kept: it may be in use", flat[:19])

    def _snapshot_from(self, sid: str, image_id: str, base: dict, created_at: float) -> Snapshot:
        return Snapshot.from_json(
            {
                **base,
                "id": sid,
                "ref": f"{SNAPSHOT_REPOSITORY}:{sid}",
                "layers": [],
                "digest": image_id,
                "created_at": created_at,
            }
        )

    async def _untag(self, ref: str) -> None:
        """Remove tag ``ref``, and its image if no other tag names it and nothing uses it; never fails.

        What stays is not lost: :meth:`delete_snapshot` sweeps the build tags an abandoned
        snapshot left.
        """
        try:
            await self._call("remove a tag", self._api.remove_image, ref)
        except docker.errors.NotFound:
            pass
        except SandboxError as exc:
            logger.warning("snapshot image tag %s kept: %s", ref, exc)

    async def _drop_image(self, image: str) -> bool:
        """Remove ``image`` unless something still uses it; return whether it is gone."""
        try:
            await self._call("remove a snapshot image", self._api.remove_image, image)
        except docker.errors.NotFound:
            return True
        except SandboxError as exc:
            logger.debug("snapshot image %s kept: %s", image, exc)
            return False
        return True

    async def restore(
        self,
        snapshot: Snapshot,
        n: int = 1,
        *,
        spec: SandboxSpec | None = None,
        revert: Revert | None = None,
        shell_state: bool = True,
    ) -> list[SandboxInfo]:
        """Start ``n`` containers from the snapshot's image and re-apply its cwd and exports.

        ``spec`` (optional) sets resources, network and labels; its env is exported on top
        of the snapshot's and its image is ignored. ``revert`` seeds each container's
        writable layer, before it starts, so its paths read as its base has them (this host
        must see the engine's overlay2 layers); ``shell_state=False`` starts each shell as a
        create would (the image's environment and workdir, no re-applied exports).
        """
        self._check_open()
        if snapshot.backend != self.name or not snapshot.ref:
            raise SandboxError(f"snapshot {snapshot.id} was not made by a docker backend")
        if n < 1:
            raise SandboxError(f"restore needs n >= 1, got {n}")
        if not await self.has_image(snapshot.ref):
            raise SandboxNotFoundError(f"no snapshot {snapshot.id!r} on docker node {self.node!r}")
        # The engine gives every container its own HOSTNAME.
        env = {k: v for k, v in snapshot.env.items() if k != "HOSTNAME"} if shell_state else {}
        env.update(spec.env if spec else {})
        eff = SandboxSpec(
            image=snapshot.ref,
            resources=spec.resources if spec else snapshot.resources,
            network=spec.network if spec else snapshot.network,
            env=env,
            workdir=snapshot.workdir,
            labels=dict(spec.labels) if spec else {},
            network_of=spec.network_of if spec else None,
        )
        command = restore_command(env, snapshot.cwd, keep=["HOSTNAME"]) if shell_state else None
        prepare = None
        if revert is not None and revert.paths:
            top, base = await self.filesystem(snapshot), await self.filesystem(revert.base)
            paths = tuple(revert.paths)

            async def prepare(cid: str) -> None:
                upper = await self._upper_dir(cid)
                await asyncio.to_thread(seed_revert, upper, base=base, top=top, paths=paths)

        async def create() -> SandboxInfo:
            announce_launched()  # the engine does the rest
            return self._ledger.add(await create_cancel_safe(self._create(eff, prepare), self.destroy))

        return await start_branches(self, snapshot, n, create=create, command=command, timeout_s=_READY_TIMEOUT_S)

    async def filesystem(self, source: Snapshot | str) -> LayerStack:
        """Return a host-side view of a snapshot's or an image's overlay2 layers.

        Raises:
            SandboxError: the engine's storage driver is not overlay2, or its layers are not
                on this host (a remote engine).
            ImageNotFoundError: no such image.
        """
        self._check_open()
        if isinstance(source, Snapshot):
            if source.backend != self.name or not source.ref:
                raise SandboxError(f"snapshot {source.id} was not made by a docker backend")
            ref = source.digest or source.ref
        else:
            ref = source
        try:
            attrs = await self._call("inspect an image", self._api.inspect_image, ref)
        except docker.errors.NotFound as exc:
            raise ImageNotFoundError(f"image {ref!r} is not known to the Docker engine") from exc
        return LayerStack(self._overlay_layers(attrs, f"image {ref}"))

    async def _upper_dir(self, cid: str) -> str:
        """Return the host dir of a container's writable overlay2 layer."""
        attrs = await self._call("inspect a container", self._api.inspect_container, cid)
        driver = attrs.get("GraphDriver") or {}
        upper = (driver.get("Data") or {}).get("UpperDir") or ""
        self._overlay_layers(attrs, f"container {cid[:12]}")  # the same checks
        return upper

    def _overlay_layers(self, attrs: dict, what: str) -> list[str]:
        """Return the overlay2 layer dirs (bottom to top) of inspect data, checking this host holds them."""
        driver = attrs.get("GraphDriver") or {}
        data = driver.get("Data") or {}
        if driver.get("Name") != "overlay2" or not data.get("UpperDir"):
            raise SandboxError(
                f"the Docker engine keeps {what} with the {driver.get('Name') or 'unknown'!r} storage driver; reading "
                "a sandbox's files from the host (what verifiers do) needs overlay2"
            )
        lowers = [p for p in (data.get("LowerDir") or "").split(":") if p]
        layers = [*reversed(lowers), data["UpperDir"]]
        if not layer_dirs_exist(layers):
            raise SandboxError(
                f"the layers of {what} are not on this host ({data['UpperDir']}): the Docker engine runs elsewhere; "
                "reading a sandbox's files from the host (what verifiers do) needs a local engine"
            )
        return layers

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete the snapshot: its image goes now, or once no container restored from it is left.

        An image still in use is retagged into :data:`RETIRED_REPOSITORY`; destroying a
        container restored from it removes it once unused, and every call here removes this
        node's retired images nothing uses any more (those a crash left). Build tags older than
        :data:`_ABANDONED_BUILD_S` (a snapshot() cancelled mid-call) are removed too.
        """
        self._check_open()
        ref = f"{SNAPSHOT_REPOSITORY}:{snapshot_id}"
        if not await self._drop_image(ref):  # in use by a container restored from it: retire it
            try:
                await self._call("retire a snapshot", self._api.tag, ref, RETIRED_REPOSITORY, snapshot_id)
            except docker.errors.NotFound:
                pass  # its last user went meanwhile, and the image with it
            else:
                self._retired.add(snapshot_id)
                await self._untag(ref)  # the retired tag still names it
        for ref in await self._node_tags(RETIRED_REPOSITORY, "list retired snapshot images"):
            if await self._drop_image(ref):  # not forced: refused while a container uses it
                self._retired.discard(ref.rpartition(":")[2])
        # A snapshot() cancelled mid-call leaves its build tag: the old ones go, with the images only they named.
        for ref in await self._node_tags(BUILD_REPOSITORY, "list snapshot images being made",
                                         made_before=time.time() - _ABANDONED_BUILD_S):
            await self._untag(ref)

    async def _node_tags(self, repository: str, what: str, *, made_before: float | None = None) -> list[str]:
        """Return the tags in ``repository`` of this node's snapshot images (only those made before ``made_before``)."""
        entries = await self._call(what, self._api.images, name=repository,
                                   filters={"label": f"{LABEL_SNAPSHOT_NODE}={self.node}"})
        return [
            ref for entry in entries
            if made_before is None or float(entry.get("Created") or 0) < made_before
            for ref in entry.get("RepoTags") or [] if ref.startswith(f"{repository}:")
        ]

    async def list_snapshots(self) -> list[Snapshot]:
        """Return the snapshot images of this node."""
        self._check_open()
        entries = await self._call(
            "list snapshot images",
            self._api.images,
            name=SNAPSHOT_REPOSITORY,
            filters={"label": f"{LABEL_SNAPSHOT_NODE}={self.node}"},
        )
        out = []
        for entry in entries:
            labels = entry.get("Labels") or {}
            try:
                base = json.loads(labels.get(LABEL_SNAPSHOT, ""))
            except ValueError:
                continue
            for tag in entry.get("RepoTags") or []:
                repo, _, sid = tag.rpartition(":")
                if repo == SNAPSHOT_REPOSITORY and sid:
                    out.append(self._snapshot_from(sid, entry["Id"], base, float(entry.get("Created") or 0)))
        return out

    async def aclose(self) -> None:
        """Close the attach sockets and the engine client.

        Closing a socket closes the shell's stdin (the SDK sets StdinOnce), so the shells
        exit and their containers stop; they stay listed until destroyed, and ``exec`` on
        one from a new backend starts a fresh shell on the same filesystem.
        """
        if self._closed:
            return
        self._closed = True
        for sbx in list(self._sandboxes.values()):
            await self._detach(sbx)
        self._sandboxes.clear()
        await asyncio.to_thread(self._client.close)


async def _pump(reader: asyncio.StreamReader, channel: ShellChannel) -> None:
    """Split Docker's multiplexed attach stream into the channel until it ends."""
    try:
        while True:
            header = await reader.readexactly(8)
            size = int.from_bytes(header[4:8], "big")
            data = await reader.readexactly(size) if size else b""
            channel.feed(STDERR if header[0] == 2 else STDOUT, data)
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        channel.feed_eof()


def _close_sdk_socket(sdk_socket: Any) -> None:
    """Close the SDK's side of an attach socket and its HTTP response."""
    if sdk_socket is None:
        return
    response = getattr(sdk_socket, "_response", None)
    for obj in (sdk_socket, getattr(sdk_socket, "_sock", None), response):
        if obj is None:
            continue
        try:
            obj.close()
        except (OSError, ValueError):  # a half-closed socket may refuse; it is being dropped anyway
            logger.debug("closing a docker attach socket failed", exc_info=True)


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass

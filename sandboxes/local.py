"""The ``local`` backend: overlayfs layers under an audited OCI runtime (crun or runc), no daemon.

Layout under ``root_dir`` (mode 0700: no host user but root enters it)::

    images/<name>/<tag>.json    {"layers": [abs dirs, bottom..top], "config": {env, workdir, user}, "uid_base"}
    layers/<id>/                 frozen upper dirs (commit, snapshot), squashed layers, imported root filesystems
    snapshots/<id>.json          snapshots: layer list, shell state, source (see snapshot())
    sandboxes/<id>/{upper,work,config.json,run/,meta.json}

and each sandbox's overlay is mounted on ``/run/forkyard/<hash of root_dir>/sandboxes/<id>``:
the runtime sets the rootfs up from inside the sandbox's user namespace, so that path must
be one the sandbox's root may walk (0710, group of the sandboxes' root), wherever root_dir is.

A sandbox is an overlay mount (the image's layers read-only below a private upper
dir, nosuid and nodev) and one persistent ``bash`` that an OCI runtime starts in it
from a generated ``config.json`` (:mod:`sandboxes.oci`): fresh user, mount, pid, ipc,
uts and net namespaces, the seccomp filter of :mod:`sandboxes.seccomp`, masked and
read-only ``/proc`` paths, a minimal ``/dev``, ``no_new_privs``, Docker's default
capabilities less mknod and sys_chroot. Root inside is :data:`~sandboxes.oci.UID_BASE`
outside: every layer is stored with its ids shifted by that much (an imported rootfs
is copied once, shifted), so files the agent makes belong to no host user. The bash is
pid 1 of its pid namespace, so killing it takes every process of the sandbox with it;
a cgroup holds the spec's memory, pids and CPU limits.

Nothing slow sits on the hot paths: create is a handful of syscalls (in a worker
thread, so that many creates at once keep both the event loop and the kernel busy),
the runtime's exec of ``bash`` (crun: a few milliseconds), and one round trip through
the shell; a restored branch's shell starts with the snapshot's exports and goes to its
cwd in that same round trip. Exec is one write to the shell and the read of its
output; files are read and written host-side through the overlay with
``openat2(RESOLVE_IN_ROOT)``.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from sandboxes import fs
from sandboxes.base import (
    DEFAULT_MAX_OUTPUT_BYTES,
    LABEL_NODE,
    ExecResult,
    ImageConfig,
    ImageInfo,
    Resources,
    Revert,
    SandboxInfo,
    SandboxLedger,
    SandboxSpec,
    SandboxState,
    announce_launched,
    create_cancel_safe,
    normalize_sandbox_path,
)
from sandboxes.cgroups import (
    CGROUP_ROOT,
    REQUIRED_CONTROLLERS,
    SandboxCgroup,
    available_controllers,
    cgroup_version,
    favor_dynamic_moves,
)
from sandboxes.disk import DEFAULT_IMAGE as DEFAULT_DISK_IMAGE
from sandboxes.disk import SandboxDisks
from sandboxes.errors import (
    BackendUnavailableError,
    FileTooLargeError,
    ImageNotFoundError,
    SandboxCrashedError,
    SandboxError,
    SandboxNotFoundError,
)
from sandboxes.layers import LayerStack, seed_revert
from sandboxes.network import SLIRP_DNS, EgressPolicy, SandboxNetwork, start_network
from sandboxes.oci import (
    DEFAULT_ISOLATION,
    UID_BASE,
    UID_COUNT,
    CompiledSeccomp,
    container_spec,
    crun_cgroup_problem,
    find_runtime,
    runtime_problem,
    user_namespace_problem,
)
from sandboxes.procs import (
    child_pids,
    kill_descendants_since,
    signal_pid,
    start_ticks,
    ticks_now,
)
from sandboxes.shell import (
    ABORT_SIGNAL,
    KILL_SINCE_SCRIPT,
    SHELL_DIED_EXIT_CODE,
    STDERR,
    STDOUT,
    ShellChannel,
    ansi_c_quote,
)
from sandboxes.snapshots import (
    CAPTURE_COMMAND,
    CAPTURE_MAX_BYTES,
    Snapshot,
    parse_exported,
    snapshot_id,
    snapshot_metadata,
    squash_layers,
    start_branches,
    tree_digest,
)

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2
MS_NOSUID = 0x2
MS_NODEV = 0x4
#: Where sandboxes' overlays are mounted (see the module docstring).
MOUNTS_ROOT = Path("/run/forkyard")
#: Host ids of the sandbox's root: what files the host writes into a sandbox belong to.
ROOT_OWNER = (UID_BASE, UID_BASE)


def _host_ids(owner: tuple[int, int]) -> tuple[int, int]:
    """Return the host ids of (uid, gid) inside a sandbox; refuse ids outside its mapped range."""
    uid, gid = owner
    if not (0 <= uid < UID_COUNT and 0 <= gid < UID_COUNT):
        raise SandboxError(f"owner {uid}:{gid} is outside the sandbox's id range (0..{UID_COUNT - 1})")
    return UID_BASE + uid, UID_BASE + gid

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
READY_TIMEOUT_S = 30.0
#: After killing a timed-out command, how long the shell gets to print its marker.
KILL_GRACE_S = 2.0
#: Files at most this big are read/written on the event loop thread; bigger ones in a worker thread.
INLINE_IO_BYTES = 1 << 20

_NAME_RE = re.compile(r"[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: Variables naming a locale: every program reading them loads locale files.
_LOCALE_VAR = re.compile(r"LANG|LC_[A-Z]+")


def is_root() -> bool:
    """Tell whether this process runs as root."""
    return os.geteuid() == 0


def has_overlayfs() -> bool:
    """Tell whether the kernel offers overlayfs."""
    try:
        with open("/proc/filesystems") as fh:
            return any(line.split()[-1:] == ["overlay"] for line in fh)
    except OSError:
        return False


def host_problem(cgroup_root: Path = CGROUP_ROOT, isolation: str = DEFAULT_ISOLATION) -> str | None:
    """Return one sentence saying why this host cannot run local sandboxes of tier ``isolation``, or None."""
    if not is_root():
        return "the local sandbox backend must run as root (it mounts overlays and starts an OCI runtime)"
    if not has_overlayfs():
        return "the local sandbox backend needs overlayfs, which this kernel does not offer (try `modprobe overlay`)"
    problem = user_namespace_problem() or runtime_problem(isolation, cgroup_root=cgroup_root)
    if problem is not None:
        return problem
    if cgroup_version(cgroup_root) == 0:
        return f"the local sandbox backend needs cgroups, and none are mounted at {cgroup_root}"
    missing = [c for c in REQUIRED_CONTROLLERS if c not in available_controllers(cgroup_root)]
    if missing:
        return f"the local sandbox backend needs the {' and '.join(missing)} cgroup controllers, missing at {cgroup_root}"
    return None


def parse_image_ref(ref: str) -> tuple[str, str]:
    """Split ``name:tag`` (tag defaults to ``latest``) and check both parts."""
    name, tag = ref, "latest"
    if ":" in ref.rsplit("/", 1)[-1]:
        name, tag = ref.rsplit(":", 1)
    if not _NAME_RE.fullmatch(name) or not _TAG_RE.fullmatch(tag):
        raise SandboxError(f"invalid image reference {ref!r}; expected lowercase name:tag like 'forkyard/base:1'")
    return name, tag


def _config_to_json(config: ImageConfig) -> dict:
    return {"env": dict(config.env), "workdir": config.workdir or "/", "user": config.user or "root"}


def _config_from_json(data: dict) -> ImageConfig:
    return ImageConfig(env=dict(data.get("env") or {}), workdir=data.get("workdir") or "/", user=data.get("user") or "root")


def _check_layer_path(path: str) -> None:
    # Overlay mount options are split on ',' and lowerdir on ':'.
    if any(ch in path for ch in ",:\\\n"):
        raise SandboxError(f"path {path!r} cannot be an overlay layer: it contains ',', ':' or '\\'")


def rootfs_signature(root: Path) -> str:
    """Return a digest of the names, types, modes, owners, sizes and mtimes under ``root`` (no content read)."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted([*dirnames, *filenames]):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            rel = os.path.relpath(full, root)
            digest.update(f"{rel}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_rdev}\n".encode(errors="surrogateescape"))
    return digest.hexdigest()


def shift_ids(root: Path, base: int) -> None:
    """Add ``base`` to the uid and gid of every file under ``root`` (ids past UID_COUNT become nobody's)."""

    def shifted(value: int) -> int:
        return base + (value if value < UID_COUNT else UID_COUNT - 2)

    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames] + (["."] if dirpath == str(root) else []):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            os.lchown(full, shifted(st.st_uid), shifted(st.st_gid))
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(full, stat.S_IMODE(st.st_mode))  # chown cleared them


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(data))  # one write: json.dump streams hundreds of small ones (twice as slow)
    os.replace(tmp, path)


def _alive(pid: int | None, start: int | None) -> bool:
    """Tell whether ``pid`` still runs and is the process that started at ``start``."""
    if not pid:
        return False
    now = start_ticks(pid)
    return now is not None and (start is None or now == start)


def _child_pid(pid: int) -> int | None:
    """Return the (single) child of ``pid``."""
    kids = child_pids(pid)
    return kids[0] if kids else None


def _gvisor_sandbox_pid(pid: int) -> int | None:
    """Return the child of runsc ``pid`` that is gVisor's sandbox (its kernel), not its file gofer."""
    for kid in child_pids(pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as fh:
                if fh.read(64).startswith(b"runsc-sandbox\0"):
                    return kid
        except OSError:
            continue
    return None


def _loopback_up(pid: int) -> None:
    """Bring up the loopback of process ``pid``'s network namespace (blocking)."""
    proc = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "ip", "link", "set", "lo", "up"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SandboxError(f"cannot bring up the sandbox's loopback: {proc.stderr.strip()[-300:]}")


def _mount_overlay(lowers: list[str], upper: Path, work: Path, merged: Path, volatile: bool) -> bool:
    """Mount an overlay on ``merged``; return whether the ``volatile`` option was used."""
    opts = f"lowerdir={':'.join(reversed(lowers))},upperdir={upper},workdir={work}"
    tries = [opts + ",volatile", opts] if volatile else [opts]
    err = 0
    for data in tries:
        if _libc.mount(b"overlay", os.fsencode(merged), b"overlay", MS_NOSUID | MS_NODEV, data.encode()) == 0:
            return data.endswith(",volatile")
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            break
    # mount(8) knows tricks we do not (e.g. the new mount API for very long option strings).
    proc = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", f"nosuid,nodev,{opts}", str(merged)],
        check=False, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SandboxError(
            f"cannot mount the sandbox overlay on {merged}: {os.strerror(err)}; mount(8) said: {proc.stderr.strip()}"
        )
    return False


def _umount(path: Path) -> None:
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise SandboxError(f"cannot unmount {path}: {os.strerror(err)}")


def _in_cgroup(cgroup: SandboxCgroup, pid: int) -> bool:
    """Tell whether process ``pid`` is in every group of ``cgroup``."""
    member = str(pid)
    try:
        return all(member in procs.read_text().split() for procs in cgroup.procs_files)
    except OSError:
        return False


def _in_fresh_thread(fn: Callable[[], object]) -> asyncio.Future:
    """Run ``fn`` in a new thread and return a future of its result; the event loop goes on meanwhile.

    ``_thread`` starts it without waiting for it to run (``threading.Thread.start`` waits,
    which with many sandboxes starting at once stalls the event loop for milliseconds).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if done.done():  # cancelled: nobody waits for the result
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def target() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    _thread.start_new_thread(target, ())
    return done


def _enter_cgroup(cgroup: SandboxCgroup, pid: int, limits: Resources | None) -> None:
    """Create ``cgroup`` with ``limits`` (unless None: it exists) and move ``pid`` into it.

    A failed move is left to the check made once the shell has started.
    """
    if limits is not None:
        cgroup.create(limits)
    try:
        cgroup.add(pid)
    except OSError as exc:
        logger.debug("process %s could not join cgroup %s: %s", pid, cgroup.name, exc)


class _ShellProcess:
    """The shell's process (the OCI runtime) and its pipes: output feeds the channel, the exit resolves ``exited``.

    Not asyncio's subprocess transport: that forks in the event loop's thread (a vfork
    holds the caller until the child has exec'd, a millisecond or more while many
    sandboxes start) and starts a thread per process to wait for it. Here the process
    is spawned in a thread of its own (not queued behind other work) and its exit is
    watched with a pidfd by the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, proc: subprocess.Popen) -> None:
        self._loop = loop
        self._proc = proc
        self.pid = proc.pid
        self.channel = ShellChannel(self.write)
        self.exited: asyncio.Future[int] = loop.create_future()
        self._stdin: asyncio.WriteTransport | None = None
        self._outputs: list[asyncio.BaseTransport] = []
        self._open = {STDOUT, STDERR}
        self._pidfd: int | None = None
        self._closed = False

    @classmethod
    async def spawn(cls, argv: list[str], env: Mapping[str, str]) -> _ShellProcess:
        """Start ``argv`` in a new session with piped stdio, from a thread of its own."""
        popen = functools.partial(
            subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, cwd="/", start_new_session=True,
        )  # fmt: skip
        spawning = _in_fresh_thread(popen)
        try:
            proc = await asyncio.shield(spawning)
        except asyncio.CancelledError:
            await asyncio.wait([spawning])  # the process may be there already: do not leave it behind
            if spawning.exception() is None:
                spawning.result().kill()
                await asyncio.to_thread(spawning.result().communicate)
            raise
        process = cls(asyncio.get_running_loop(), proc)
        try:
            await process._connect()
        except BaseException:
            process.close()
            raise
        return process

    async def _connect(self) -> None:
        self._stdin, _ = await self._loop.connect_write_pipe(asyncio.BaseProtocol, _loop_pipe(self._loop, self._proc.stdin))
        for stream, pipe in ((STDOUT, self._proc.stdout), (STDERR, self._proc.stderr)):
            transport, _ = await self._loop.connect_read_pipe(
                functools.partial(_Output, self, stream), _loop_pipe(self._loop, pipe))
            self._outputs.append(transport)
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:  # no pidfds before Linux 5.3: a thread waits instead
            _thread.start_new_thread(self._wait_in_thread, ())
        else:
            self._loop.add_reader(self._pidfd, self._reap)

    async def write(self, data: bytes) -> None:
        """Write ``data`` to the shell's stdin."""
        if self._stdin is None or self._stdin.is_closing():
            raise ConnectionError("the sandbox shell's stdin is closed")
        self._stdin.write(data)

    def output_closed(self, stream: int) -> None:
        """Note that ``stream`` reached its end; once both have, the channel has everything."""
        self._open.discard(stream)
        if not self._open:
            self.channel.feed_eof()

    def _reap(self) -> None:
        returncode = self._proc.poll()
        if returncode is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        self._exited(returncode)

    def _wait_in_thread(self) -> None:
        returncode = self._proc.wait()
        try:
            self._loop.call_soon_threadsafe(self._exited, returncode)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _exited(self, returncode: int) -> None:
        if not self.exited.done():
            self.exited.set_result(returncode)
        # The pipes close with the sandbox's last process; do not wait for them forever.
        self._loop.call_later(1.0, self.channel.feed_eof)

    def close(self) -> None:
        """Close the pipes and kill the process if it still runs."""
        if self._closed:
            return
        self._closed = True
        for transport in (self._stdin, *self._outputs):
            if transport is not None:
                transport.close()
        self._proc.kill()  # Popen knows when it has reaped it and then sends nothing


def _loop_pipe(loop: asyncio.AbstractEventLoop, pipe: IO[bytes] | None) -> IO[bytes]:
    """Return the pipe to hand ``loop``'s ``connect_*_pipe``, which then owns its descriptor.

    asyncio's loops close the file object they are given, once. uvloop's give libuv the file
    object's descriptor, let libuv close it, then close the file object too: the same number
    closed twice, the second time perhaps a descriptor another thread opened in between, such
    as a new sandbox's root (MagicStack/uvloop#763). There libuv gets a duplicate, and a file
    object that never closes it; the original is closed here.
    """
    assert pipe is not None
    if type(loop).__module__.partition(".")[0] != "uvloop":
        return pipe
    fd = os.dup(pipe.fileno())
    pipe.close()
    return open(fd, "rb" if "r" in pipe.mode else "wb", buffering=0, closefd=False)  # noqa: SIM115 - libuv closes fd


class _Output(asyncio.Protocol):
    """Feed one output pipe of the shell straight into its channel (no reader tasks needed)."""

    def __init__(self, process: _ShellProcess, stream: int) -> None:
        self.process = process
        self.stream = stream

    def data_received(self, data: bytes) -> None:
        self.process.channel.feed(self.stream, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.process.output_closed(self.stream)


@dataclass
class _Shell:
    process: _ShellProcess
    pid: int  # the runtime, our child
    init_pid: int  # the bash, pid 1 of the sandbox's pid namespace
    init_start: int | None
    network: SandboxNetwork | None = None  # slirp4netns, for sandboxes with network
    clock_offset: float = 0.0  # gVisor: its uptime minus our monotonic clock (its processes' start times)

    @property
    def channel(self) -> ShellChannel:
        return self.process.channel


@dataclass
class _User:
    uid: int
    gid: int
    name: str | None
    home: str
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Restore:
    """What a restored sandbox starts from instead of its image: a snapshot's layers and shell state."""

    layers: list[str]
    config: ImageConfig
    cwd: str
    """The shell's directory."""
    seed: Callable[[Path], object] | None = None
    """Fills the new upper dir before it is mounted (:func:`~sandboxes.layers.seed_revert`)."""
    shell_state: bool = True
    """False: the shell starts with a create's environment (defaults, image, spec), not the snapshot's exports."""


@dataclass
class _Sandbox:
    id: str
    dir: Path
    image: str
    layers: list[str]
    spec: SandboxSpec
    config: ImageConfig
    workdir: str
    env: dict[str, str]
    user: _User | None
    cgroup: SandboxCgroup
    rootfd: int
    created_at: float
    labels: dict[str, str]
    merged: Path
    state: SandboxState = SandboxState.STARTING
    shell: _Shell | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    destroyed: bool = False
    starts: int = 0
    """Shells started so far; each runs as container ``shell-<n>`` of the runtime."""
    seccomp_to_learn: str | None = None
    """The seccomp profile its latest shell's runtime compiled (none was known): keep the program."""



class LocalBackend:
    """Sandboxes made of Linux namespaces, an overlayfs and cgroups, with no daemon."""

    name = "local"

    def __init__(
        self,
        root_dir: str | os.PathLike,
        node: str,
        *,
        cgroup_root: Path = CGROUP_ROOT,
        isolation: str = DEFAULT_ISOLATION,
        runtime: str | None = None,
        egress: EgressPolicy | None = None,
        disk_quotas: bool = True,
        disk_image: Path = DEFAULT_DISK_IMAGE,
        favor_cgroup_moves: bool = True,
    ) -> None:
        """Open the backend over ``root_dir`` (made 0700).

        Args:
            isolation: ``standard`` (crun, else runc) or ``gvisor`` (runsc).
            runtime: insist on this runtime of the tier (``crun``, ``runc``, ``runsc``).
            egress: what sandboxes with ``network=True`` may reach (:mod:`sandboxes.network`).
            disk_quotas: hold each sandbox to its ``resources.disk_mb`` (:mod:`sandboxes.disk`);
                where that cannot be set up the backend warns and runs without.
            disk_image: the sparse image of the sandboxes' disk filesystem.
            favor_cgroup_moves: remount the host's cgroup2 tree with ``favordynmods``, so
                that a sandbox start does not wait ~10 ms for an RCU grace period when it
                moves its runtime into the sandbox's cgroup
                (:func:`~sandboxes.cgroups.favor_dynamic_moves`).
        """
        problem = host_problem(cgroup_root, isolation) or runtime_problem(
            isolation, preferred=runtime, cgroup_root=cgroup_root
        )
        if problem is not None:
            raise BackendUnavailableError(problem[0].upper() + problem[1:] + ".")
        self.node = node
        self._ledger = SandboxLedger()
        self.root_dir = Path(root_dir).absolute()
        _check_layer_path(str(self.root_dir))
        self.cgroup_root = Path(cgroup_root)
        self.isolation = isolation
        self.egress = egress or EgressPolicy()
        found = find_runtime(isolation, preferred=runtime, cgroup_root=cgroup_root)
        assert found is not None  # runtime_problem said it is there
        self.runtime = found
        self._seccomp = CompiledSeccomp(found)
        if found.name == "runc" and runtime is None:
            logger.warning(
                "local sandboxes run under runc, which starts each in ~40 ms (crun takes ~5): %s",
                crun_cgroup_problem(cgroup_root) or "crun is not installed (apt-get install crun)",
            )
        # No host user but root may enter: the layers hold files made by agents.
        self.root_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root_dir, 0o700)
        key = hashlib.sha256(str(self.root_dir).encode()).hexdigest()[:16]
        self._mounts_dir = MOUNTS_ROOT / key / "sandboxes"
        self._disks: SandboxDisks | None = None
        self._disks_dir = self.root_dir / "sandboxes"
        if disk_quotas:
            try:
                self._disks = SandboxDisks.ensure(disk_image)
            except SandboxError as exc:
                logger.warning("local sandboxes get no disk quota (one can fill the host's disk): %s", exc)
            else:
                self._disks_dir = self._disks.mountpoint / key
        if favor_cgroup_moves and self.cgroup_root == CGROUP_ROOT:  # not over a test's stand-in tree
            try:
                changed = favor_dynamic_moves()
            except OSError as exc:
                logger.warning("each sandbox start may wait ~10 ms to join its cgroup: cannot set favordynmods: %s", exc)
            else:
                if changed:
                    logger.info("cgroup2 at %s now favors dynamic moves (favordynmods): sandboxes join "
                                "their cgroups without waiting for an RCU grace period", changed)
        self._ensure_run_dirs()
        self._images = self.root_dir / "images"
        self._layers = self.root_dir / "layers"
        self._sandboxes_dir = self.root_dir / "sandboxes"
        self._snapshots = self.root_dir / "snapshots"
        self.max_snapshot_layers = 16
        """A snapshot with more layers than this gets its upper layers squashed into one."""
        for d in (self._images, self._layers, self._sandboxes_dir, self._snapshots):
            d.mkdir(parents=True, exist_ok=True)
        self._sandboxes: dict[str, _Sandbox] = {}
        self._destroying: dict[str, asyncio.Future[None]] = {}
        self._images_lock = asyncio.Lock()
        self._mounting: Counter[str] = Counter()
        """Layers that creates and restores in flight mount before any meta.json names them; the layer GC keeps them."""
        self._retired_layers: set[str] = set()
        """Layers of deleted snapshots only sandboxes still use: freed when the last of them goes."""
        self._retired_scan: asyncio.Future[None] | None = None
        """The one look for the retired layers of sandboxes an earlier process left (see :meth:`_find_retired_layers`)."""
        self._volatile = True
        self._closed = False

    # ----------------------------------------------------------------- images

    def _manifest_path(self, image: str) -> Path:
        name, tag = parse_image_ref(image)
        return self._images / name / f"{tag}.json"

    def _load_manifest(self, image: str, *, usable: bool = False) -> dict:
        try:
            with open(self._manifest_path(image)) as fh:
                manifest = json.load(fh)
        except FileNotFoundError:
            raise ImageNotFoundError(f"image {image!r} is not known to the local backend") from None
        if usable and manifest.get("uid_base") != UID_BASE:
            raise ImageNotFoundError(
                f"image {image!r} was stored by an older Forkyard whose sandboxes had no user namespace; "
                "import or build it again"
            )
        return manifest

    async def import_rootfs(self, rootfs: str, image: str, config: ImageConfig) -> None:
        """Register a copy of directory ``rootfs``, ids shifted to the sandboxes' range, as ``image``.

        The shifted copy is made once per content: it sits beside ``rootfs`` (in a 0700
        directory) where that is writable, else under root_dir/layers, and a re-import of
        the same tree reuses it.
        """
        path = Path(rootfs).absolute()
        if not path.is_dir():
            raise SandboxError(f"root filesystem {rootfs} is not a directory")
        _check_layer_path(str(path))
        manifest = self._manifest_path(image)
        async with self._images_lock:  # no layer GC between the copy and its manifest
            layer = await asyncio.to_thread(self._shifted_copy, path)
            manifest.parent.mkdir(parents=True, exist_ok=True)
            _write_json(
                manifest,
                {"layers": [str(layer)], "config": _config_to_json(config), "created_at": time.time(),
                 "uid_base": UID_BASE, "source": str(path)},
            )  # fmt: skip

    def _shifted_copy(self, source: Path) -> Path:
        """Return a copy of ``source`` with every uid and gid shifted by UID_BASE, making it if needed (blocking)."""
        key = rootfs_signature(source)[:24]
        homes = [source.parent / f".forkyard-uid{UID_BASE}", self._layers]
        for home in homes:
            try:
                home.mkdir(mode=0o700, exist_ok=True)
                os.chmod(home, 0o700)
                final = home / f"rootfs-{key}"
                if final.is_dir():
                    return final
                tmp = home / f".tmp-rootfs-{secrets.token_hex(8)}"
                break
            except OSError:
                continue
        else:
            raise SandboxError(f"no writable place for the shifted copy of {source} (tried {homes[0]} and {homes[1]})")
        proc = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", f"{source}/.", str(tmp)], check=False, capture_output=True, text=True
        )
        try:
            if proc.returncode != 0:
                raise SandboxError(f"cannot copy root filesystem {source}: {proc.stderr.strip()[-300:]}")
            shift_ids(tmp, UID_BASE)
            try:
                os.rename(tmp, final)
            except OSError:  # another process made the same copy meanwhile
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("imported root filesystem %s as %s (ids shifted by %d)", source, final, UID_BASE)
        return final

    async def has_image(self, image: str) -> bool:
        """Tell whether ``image`` has a manifest here whose layers are in the sandboxes' id range."""
        try:
            return self._load_manifest(image).get("uid_base") == UID_BASE
        except (SandboxError, OSError, ValueError):  # unknown, or a ref no local image can have (a digest)
            return False

    async def image_digest(self, image: str) -> str:
        """Return the sha256 of ``image``'s layer list and config (a rebuild makes new layers, so a new digest)."""
        manifest = self._load_manifest(image)
        content = {"layers": manifest.get("layers", []), "config": manifest.get("config", {})}
        return "sha256:" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    async def remove_image(self, image: str) -> None:
        """Delete the manifest of ``image`` and every layer under root_dir/layers nothing else uses."""
        path = self._manifest_path(image)
        async with self._images_lock:
            path.unlink(missing_ok=True)
            parent = path.parent
            while parent != self._images:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent
            # Also collects layers freed since by destroyed sandboxes, so a repeat call is useful.
            await self._free_layers()

    async def list_images(self, repository: str) -> list[ImageInfo]:
        """Return the images of ``repository``, oldest first; size: the layers no other image shares."""
        return await asyncio.to_thread(self._list_images, repository)

    def _list_images(self, repository: str) -> list[ImageInfo]:
        manifests = {}
        for path in self._images.rglob("*.json"):
            try:
                manifests[path] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        uses: Counter[str] = Counter(layer for m in manifests.values() for layer in set(m.get("layers", [])))
        in_use = {(self._read_meta(d.name) or {}).get("image") for d in self._sandboxes_dir.iterdir()}
        found = []
        for path, manifest in manifests.items():
            name = path.parent.relative_to(self._images).as_posix()
            if name != repository:
                continue
            ref = f"{name}:{path.stem}"
            own = [layer for layer in set(manifest.get("layers", [])) if uses[layer] == 1]
            found.append(ImageInfo(ref=ref, size_bytes=sum(fs.tree_bytes(Path(layer)) for layer in own),
                                   created_at=path.stat().st_mtime, in_use=ref in in_use))
        return sorted(found, key=lambda i: (i.created_at, i.ref))

    def _layer_users(self, mounting: Iterable[str]) -> tuple[set[str], set[str]]:
        """Return the layers images, snapshots and ``mounting`` (mounts in flight) use, and those sandboxes use.

        Blocking: it reads every manifest, snapshot and sandbox record.
        """
        stored: set[str] = set(mounting)
        for path in (*self._images.rglob("*.json"), *self._snapshots.glob("*.json")):
            try:
                stored.update(json.loads(path.read_text()).get("layers", []))
            except (OSError, ValueError):
                continue
        live: set[str] = set()
        for sdir in self._sandboxes_dir.iterdir():
            live.update((self._read_meta(sdir.name) or {}).get("layers", []))
        return stored, live

    async def _free_layers(self, only: Iterable[str] | None = None) -> set[str]:
        """Remove the layers (of ``only``, if given) nothing uses; return those sandboxes alone still use.

        The caller holds :attr:`_images_lock`. The scan and the removals run in a worker thread:
        on the event loop, the scan held every other request for as long as it read records.
        The mounts in flight are read here, on the loop, where :meth:`_pinned` changes them.
        """
        return await asyncio.to_thread(self._free_layers_now, set(self._mounting),
                                       None if only is None else list(only))

    def _free_layers_now(self, mounting: set[str], only: list[str] | None) -> set[str]:
        """:meth:`_free_layers`, blocking."""
        stored, live = self._layer_users(mounting)
        candidates = [str(p) for p in self._layers.iterdir() if not p.name.startswith(".")] if only is None else only
        for layer in candidates:
            if layer not in stored and layer not in live:
                shutil.rmtree(layer, True)
        return live - stored

    async def _seal_upper(
        self, sandbox_id: str, *, digest: bool = False, copied: Callable[[], None] | None = None,
    ) -> tuple[Path, str]:
        """Copy the sandbox's upper dir into a new immutable layer; return its path and, if ``digest``, its digest.

        ``cp -a`` as root keeps overlay whiteouts (0/0 char devices) and the
        ``trusted.overlay.opaque`` xattrs, so the layer means the same as a lower layer.
        The :func:`tree_digest` ("" unless ``digest``) is taken in the copy's thread: one hop
        less than a thread of its own. ``copied`` is called in that thread as soon as the copy
        ends (before the digest: a snapshot thaws the sandbox there).
        """
        sdir = self._sandbox_dir(sandbox_id)
        upper = self._disk_dir(sandbox_id) / "upper"
        if not sdir.is_dir() or not upper.is_dir():
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on node {self.node!r}")
        layer_id = secrets.token_hex(16)
        tmp = self._layers / f".tmp-{layer_id}"
        tmp.mkdir()
        # Spawned and waited for in a thread of its own: asyncio's subprocess forks in the event
        # loop's thread, which in the gateway held every other request ~0.7 ms per snapshot.
        def copy() -> tuple[subprocess.CompletedProcess, str]:
            done = subprocess.run(["cp", "-a", "--", f"{upper}/.", str(tmp)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
            if copied is not None:
                copied()
            return done, tree_digest(tmp) if digest and done.returncode == 0 else ""

        copying = _in_fresh_thread(copy)
        try:
            done, tree = await asyncio.shield(copying)
        except asyncio.CancelledError:  # the copy goes on: let it finish, then drop it
            await asyncio.wait([copying])
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise
        if done.returncode != 0:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            err = done.stderr.decode(errors="replace").strip()
            raise SandboxError(f"cannot copy the upper layer of sandbox {sandbox_id}: {err}")
        final = self._layers / layer_id
        os.rename(tmp, final)  # the digest lists paths relative to the layer: it holds
        return final, tree

    async def commit(self, sandbox_id: str, image: str, config: ImageConfig) -> None:
        """Freeze the sandbox's filesystem into ``image``: its layers plus a copy of its upper dir."""
        manifest = self._manifest_path(image)
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None:
            layers = list(sb.layers)
        else:
            meta = self._read_meta(sandbox_id) if _ID_RE.fullmatch(sandbox_id) else None
            if not meta or "layers" not in meta:
                raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on node {self.node!r}")
            layers = list(meta["layers"])
        async with self._images_lock:
            if sb is not None:
                async with sb.lock:  # no command writes while we copy
                    layer, _ = await self._seal_upper(sandbox_id)
            else:
                layer, _ = await self._seal_upper(sandbox_id)
            manifest.parent.mkdir(parents=True, exist_ok=True)
            _write_json(
                manifest,
                {"layers": [*layers, str(layer)], "config": _config_to_json(config), "created_at": time.time(),
                 "uid_base": UID_BASE},
            )

    # -------------------------------------------------------------- snapshots

    def _snapshot_path(self, snapshot_id: str) -> Path:
        if not _ID_RE.fullmatch(snapshot_id):
            raise SandboxError(f"invalid snapshot id {snapshot_id!r}")
        return self._snapshots / f"{snapshot_id}.json"

    def _freeze(self, sb: _Sandbox) -> list[int]:
        """SIGSTOP the sandbox's processes other than its shell so its upper dir holds still."""
        shell = sb.shell
        # Under gVisor the sandbox's processes are threads of its kernel: stop all of it.
        skip = set() if shell is None else {shell.pid} if self.runtime.name == "runsc" else {shell.pid, shell.init_pid}
        stopped = []
        for pid in sb.cgroup.pids():
            if pid in skip:
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        return stopped

    @staticmethod
    def _thaw(pids: list[int]) -> None:
        """SIGCONT what :meth:`_freeze` stopped, once: ``pids`` is emptied."""
        while pids:
            pid = pids.pop()
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    async def snapshot(
        self, sandbox_id: str, *, metadata: Mapping[str, str] | None = None, shell_state: bool = True
    ) -> Snapshot:
        """Capture the sandbox's filesystem, cwd and exports as an immutable snapshot.

        The sandbox's upper dir is copied (``cp -a``, whiteouts and opaque dirs kept) into
        a new read-only layer while its other processes are stopped (SIGSTOP) and no command
        runs, and the copy listed for its digest in the same thread, the sandbox's processes
        already running again (the copy is the snapshot's own); the live sandbox goes
        on with its own upper dir, which now sits on the same content as the snapshot. An
        overlay cannot swap the upper dir of a mounted sandbox, and copying a small change
        costs milliseconds. Restoring then mounts fresh overlays over the snapshot's layers,
        with no copy per branch. More than :attr:`max_snapshot_layers` layers are squashed
        into two (the bottom image layer and one merged layer). Background processes are
        not captured. With ``shell_state=False`` the shell is not asked anything (nor
        started again if it died): the files alone, exports empty, cwd the workdir.
        """
        self._check_open()
        sb = self._live(sandbox_id)
        meta = snapshot_metadata(metadata)
        async with self._images_lock:  # no layer GC while the new layer has no owner yet
            async with sb.lock:
                if sb.destroyed:
                    raise SandboxNotFoundError(f"sandbox {sandbox_id} was destroyed")
                env: dict[str, str] = {}
                cwd = sb.workdir
                if shell_state:
                    if sb.shell is None or sb.shell.channel.closed:
                        await self._respawn(sb, sb.shell.channel.cwd if sb.shell else None)
                    assert sb.shell is not None
                    state = await sb.shell.channel.run(
                        CAPTURE_COMMAND, timeout_s=READY_TIMEOUT_S, max_output_bytes=CAPTURE_MAX_BYTES
                    )
                    if state.exit_code != 0 or state.timed_out or state.truncated:
                        raise SandboxError(
                            f"cannot read the shell state of sandbox {sandbox_id}: exit {state.exit_code} "
                            f"{state.stderr.strip()[-300:]}"
                        )
                    env = parse_exported(state.stdout)
                    cwd = state.cwd or sb.workdir
                stopped = self._freeze(sb)
                try:
                    layer, digest = await self._seal_upper(sandbox_id, digest=True,
                                                           copied=functools.partial(self._thaw, stopped))
                finally:
                    self._thaw(stopped)
            layers = [*sb.layers, str(layer)]
            if len(layers) > self.max_snapshot_layers:
                layers = [layers[0], str(await self._squash(layers[1:]))]
                await asyncio.to_thread(shutil.rmtree, layer, True)
                digest = await asyncio.to_thread(tree_digest, layers[-1])
            description = {
                "backend": self.name, "node": self.node, "image": sb.image, "digest": digest,
                "layers": [os.path.basename(p) if p.startswith(str(self._layers)) else p for p in layers],
                "cwd": cwd, "env": env, "workdir": sb.workdir, "metadata": meta,
            }  # fmt: skip
            snap = Snapshot(
                id=snapshot_id(description), backend=self.name, node=self.node, image=sb.image, ref="",
                layers=tuple(layers), cwd=cwd, env=env, workdir=sb.workdir, config=sb.config,
                resources=sb.spec.resources, network=sb.spec.network, digest=digest, created_at=time.time(),
                metadata=meta,
            )  # fmt: skip
            _write_json(self._snapshot_path(snap.id), snap.to_json())
        logger.debug("sandbox %s: snapshot %s (%d layers)", sandbox_id, snap.id, len(layers))
        return snap

    async def _squash(self, layers: list[str]) -> Path:
        """Merge ``layers`` (bottom to top) into one new layer dir and return it."""
        layer_id = secrets.token_hex(16)
        tmp = self._layers / f".tmp-{layer_id}"
        tmp.mkdir()
        try:
            await asyncio.to_thread(squash_layers, layers, tmp)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise
        final = self._layers / layer_id
        os.rename(tmp, final)
        return final

    async def restore(
        self,
        snapshot: Snapshot,
        n: int = 1,
        *,
        spec: SandboxSpec | None = None,
        revert: Revert | None = None,
        shell_state: bool = True,
    ) -> list[SandboxInfo]:
        """Start ``n`` sandboxes on fresh overlays over the snapshot's layers, with its cwd and exports.

        ``spec`` (optional) sets resources, network and labels; its env is exported on top
        of the snapshot's and its image is ignored (the filesystem is the snapshot's).
        ``revert`` seeds each branch's upper dir so its paths read as its base has them;
        ``shell_state=False`` starts each shell as a create would (image env, workdir).
        """
        self._check_open()
        if snapshot.backend != self.name or not snapshot.layers:
            raise SandboxError(f"snapshot {snapshot.id} was not made by a local backend")
        if n < 1:
            raise SandboxError(f"restore needs n >= 1, got {n}")
        base_layers: tuple[str, ...] = ()
        if revert is not None:
            base_layers = self._source_layers(revert.base)
        with self._pinned(snapshot.layers + base_layers):
            seed = None
            if revert is not None and revert.paths:
                top, base, paths = LayerStack(snapshot.layers), LayerStack(base_layers), tuple(revert.paths)
                seed = functools.partial(seed_revert, base=base, top=top, paths=paths)
            return await self._restore(snapshot, n, spec, seed=seed, shell_state=shell_state)

    def _source_layers(self, source: Snapshot | str) -> tuple[str, ...]:
        """Return the layers of a snapshot of this backend or of an image it holds."""
        if isinstance(source, Snapshot):
            if source.backend != self.name or not source.layers:
                raise SandboxError(f"snapshot {source.id} was not made by a local backend")
            if not self._snapshot_path(source.id).is_file():
                raise SandboxNotFoundError(f"no snapshot {source.id!r} on node {self.node!r}")
            return tuple(source.layers)
        return tuple(self._load_manifest(source, usable=True)["layers"])

    async def filesystem(self, source: Snapshot | str) -> LayerStack:
        """Return a host-side view of a snapshot's or an image's layers."""
        self._check_open()
        return LayerStack(self._source_layers(source))

    async def _restore(
        self, snapshot: Snapshot, n: int, spec: SandboxSpec | None, *,
        seed: Callable[[Path], object] | None = None, shell_state: bool = True,
    ) -> list[SandboxInfo]:
        """Restore ``n`` branches of ``snapshot``, whose layers the caller keeps pinned."""
        if not self._snapshot_path(snapshot.id).is_file():
            raise SandboxNotFoundError(f"no snapshot {snapshot.id!r} on node {self.node!r}")
        env = {**(snapshot.env if shell_state else {}), **(spec.env if spec else {})}
        eff = SandboxSpec(
            image=snapshot.image,
            resources=spec.resources if spec else snapshot.resources,
            network=spec.network if spec else snapshot.network,
            env=env,
            workdir=snapshot.workdir,
            labels=dict(spec.labels) if spec else {},
            network_of=spec.network_of if spec else None,
        )
        # Each shell starts with the snapshot's exports as its environment and cds to its
        # cwd in the command that checks it is up: no extra round trip per branch.
        source = _Restore(layers=list(snapshot.layers), config=snapshot.config,
                          cwd=snapshot.cwd if shell_state else snapshot.workdir, seed=seed, shell_state=shell_state)
        return await start_branches(
            self, snapshot, n, create=lambda: self._recorded(create_cancel_safe(self._create(eff, source), self.destroy))
        )

    @contextlib.contextmanager
    def _pinned(self, layers: tuple[str, ...]) -> Iterator[None]:
        """Keep ``layers`` from the layer GC while a create or restore of them is in flight.

        A sandbox's meta.json names its layers only once its overlay is mounted, in a
        worker thread and without :attr:`_images_lock` (holding it would serialize the
        creates and restores of many sandboxes). Pinned as soon as the image's manifest
        is read, or before a restore checks that its snapshot exists, the layers survive
        a :meth:`remove_image` or :meth:`delete_snapshot` that runs meanwhile.
        """
        self._mounting.update(layers)
        try:
            yield
        finally:
            for layer in layers:
                self._mounting[layer] -= 1
                if self._mounting[layer] <= 0:
                    del self._mounting[layer]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete the snapshot and every layer nothing else (image, sandbox, snapshot) uses."""
        path = self._snapshot_path(snapshot_id)
        async with self._images_lock:
            try:
                layers = set(json.loads(path.read_text()).get("layers", []))
            except (OSError, ValueError):
                layers = set()
            path.unlink(missing_ok=True)
            # The layers its restored sandboxes still use go with the last of them (see destroy).
            self._retired_layers |= layers & await self._free_layers()

    async def list_snapshots(self) -> list[Snapshot]:
        """Return the snapshots stored under root_dir/snapshots for this node."""
        out = []
        for path in sorted(self._snapshots.glob("*.json")):
            try:
                snap = Snapshot.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                logger.warning("unreadable snapshot file %s", path)
                continue
            if snap.node == self.node:
                out.append(snap)
        return out

    # -------------------------------------------------------------- sandboxes

    def _ensure_run_dirs(self) -> None:
        """Make the dirs sandboxes are mounted and kept in (another backend of this root may remove them when idle)."""
        for d in (MOUNTS_ROOT, self._mounts_dir.parent, self._mounts_dir):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            os.chown(d, 0, UID_BASE)  # walkable by root and by the sandboxes' root, by nobody else
            os.chmod(d, 0o710)
        if self._disks is not None:
            self._disks_dir.mkdir(mode=0o700, exist_ok=True)

    def _merged_dir(self, sandbox_id: str) -> Path:
        return self._mounts_dir / sandbox_id

    def _resolv_conf(self, sandbox_id: str) -> Path:
        return self._mounts_dir / f"{sandbox_id}.resolv.conf"

    def _disk_dir(self, sandbox_id: str) -> Path:
        """Return the dir holding the sandbox's upper and work dirs (its quota'd subvolume, where there are quotas)."""
        if self._disks is not None:
            return self._disks_dir / sandbox_id
        return self._sandboxes_dir / sandbox_id

    def _sandbox_dir(self, sandbox_id: str) -> Path:
        if not _ID_RE.fullmatch(sandbox_id):
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on node {self.node!r}")
        return self._sandboxes_dir / sandbox_id

    def _read_meta(self, sandbox_id: str) -> dict | None:
        try:
            with open(self._sandboxes_dir / sandbox_id / "meta.json") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def _write_meta(self, sb: _Sandbox, shell: _Shell | None = None, state: SandboxState | None = None) -> None:
        """Record the sandbox in meta.json, with ``shell`` and ``state`` in place of its own when given."""
        shell = shell or sb.shell
        state = state or sb.state
        _write_json(
            sb.dir / "meta.json",
            {
                "id": sb.id,
                "node": self.node,
                "image": sb.image,
                "layers": sb.layers,
                "labels": sb.labels,
                "created_at": sb.created_at,
                "state": state.value,
                "pid": shell.pid if shell else None,
                "pid_start": start_ticks(shell.pid) if shell else None,
                "init_pid": shell.init_pid if shell else None,
                "init_start": shell.init_start if shell else None,
                "workdir": sb.workdir,
            },
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the local sandbox backend is closed")

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Mount an overlay of ``spec.image``, start its shell in new namespaces and a cgroup."""
        return self._ledger.add(await create_cancel_safe(self._create(spec), self.destroy))

    async def _recorded(self, made: Awaitable[SandboxInfo]) -> SandboxInfo:
        return self._ledger.add(await made)

    def made_after(self, mark: int) -> tuple[list[SandboxInfo], int]:
        return self._ledger.after(mark)

    async def _create(self, spec: SandboxSpec, source: _Restore | None = None) -> SandboxInfo:
        """Create a sandbox of ``spec``, or (``source``) one restored from a snapshot."""
        self._check_open()
        res = spec.resources
        if res.cpus <= 0 or res.memory_mb <= 0 or res.pids <= 0:
            raise SandboxError(f"resources must be positive, got {res}")
        if source is not None:  # restore() keeps the snapshot's layers pinned
            return await self._create_on(spec, list(source.layers), source.config, source)
        manifest = self._load_manifest(spec.image, usable=True)
        layers = list(manifest["layers"])
        with self._pinned(tuple(layers)):  # no await since the read: remove_image() cannot come between
            return await self._create_on(spec, layers, _config_from_json(manifest.get("config") or {}), None)

    async def _create_on(
        self, spec: SandboxSpec, layers: list[str], config: ImageConfig, source: _Restore | None
    ) -> SandboxInfo:
        """Create a sandbox of ``spec`` over ``layers``, which the caller keeps pinned until it returns."""
        for _ in range(8):  # ids are 48 random bits: a second try is already rare
            sid = secrets.token_hex(6)
            # The blocking part (directories, the overlay mount, meta.json) runs in a worker
            # thread: on this filesystem a mkdir can take half a millisecond, and while forks
            # of many branches run, the event loop would otherwise be the bottleneck.
            making = asyncio.ensure_future(asyncio.to_thread(self._make_sandbox, sid, spec, layers, config, source))
            sb: _Sandbox | None = None
            try:
                sb = await asyncio.shield(making)
                if sb is None:
                    continue  # the id is taken
                self._sandboxes[sid] = sb
                ready = "true" if source is None else f"cd -- {ansi_c_quote(source.cwd)}"
                cwd = sb.workdir if source is None or not source.shell_state else "/"
                sb.shell = await self._start_shell(sb, cwd, ready=ready, limits=spec.resources)
                sb.state = SandboxState.READY
            except BaseException:
                if not making.done():  # cancelled while the thread works: let it finish first
                    await asyncio.wait([making])
                if sb is None and not making.cancelled() and making.exception() is None:
                    sb = making.result()
                    if sb is None:  # the id was taken: nothing here is ours
                        raise
                self._sandboxes.pop(sid, None)
                try:
                    await asyncio.shield(self._teardown(sid, sb))
                except Exception:  # the original error matters more
                    logger.exception("cleanup of half-created sandbox %s failed", sid)
                raise
            logger.debug("sandbox %s ready (image %s)", sid, spec.image)
            return self._info(sb)
        raise SandboxError(f"no free sandbox id under {self._sandboxes_dir} after 8 tries")

    def _make_sandbox(
        self, sid: str, spec: SandboxSpec, layers: list[str], config: ImageConfig, source: _Restore | None
    ) -> _Sandbox | None:
        """Make sandbox ``sid``'s directories, overlay and meta.json (blocking); None if ``sid`` is taken.

        A restored sandbox's rootfs is left as the snapshot has it: its layers already
        hold what :meth:`_prepare_rootfs` did for the sandbox it was taken from.
        """
        sdir = self._sandboxes_dir / sid
        try:
            sdir.mkdir()
        except FileExistsError:
            return None
        (sdir / "run").mkdir()
        self._ensure_run_dirs()
        disk = self._disk_dir(sid)
        if self._disks is not None:
            self._disks.create(disk, limit_bytes=int(spec.resources.disk_mb) << 20)
        for sub in ("upper", "work"):
            (disk / sub).mkdir()
        if source is not None and source.seed is not None:
            source.seed(disk / "upper")
        merged = self._merged_dir(sid)
        merged.mkdir(exist_ok=True)
        # The overlay's root takes the upper dir's owner and mode: root of the sandbox, not of the host.
        os.chown(disk / "upper", UID_BASE, UID_BASE)
        workdir = normalize_sandbox_path(spec.workdir or config.workdir or "/")
        rootfd = -1
        try:
            self._volatile = _mount_overlay(layers, disk / "upper", disk / "work", merged, self._volatile)
            rootfd = os.open(merged, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            if source is None:
                self._prepare_rootfs(rootfd, workdir)
            user = self._resolve_user(rootfd, config.user)
            if source is None or not source.shell_state:
                env = {"PATH": DEFAULT_PATH, "HOME": user.home if user else "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
                env.update(config.env)
                env.update(spec.env)
            else:  # exactly the snapshot's exports (and the caller's), no defaults
                env = dict(spec.env)
            cgroup = SandboxCgroup(sid, root=self.cgroup_root)
            sb = _Sandbox(
                id=sid, dir=sdir, image=spec.image, layers=layers, spec=spec, config=config, workdir=workdir,
                env=env, user=user, cgroup=cgroup, rootfd=rootfd,
                created_at=time.time(), labels={**spec.labels, LABEL_NODE: self.node}, merged=merged,
            )  # fmt: skip
            self._write_meta(sb)
        except BaseException:
            if rootfd >= 0:
                os.close(rootfd)
            raise
        return sb

    @staticmethod
    def _prepare_rootfs(rootfd: int, workdir: str) -> None:
        """Make sure the workdir exists (the runtime makes /dev, /proc and /sys)."""
        fs.mkdirs_in_root(rootfd, workdir, owner=ROOT_OWNER)

    @staticmethod
    def _resolve_user(rootfd: int, spec: str) -> _User | None:
        """Turn an image USER (``name``, ``uid``, ``name:group``...) into ids via the image's files."""
        user, _, group = (spec or "root").partition(":")
        if user in ("", "root", "0") and group in ("", "root", "0"):
            return None

        def table(path: str) -> list[list[str]]:
            try:
                text = fs.read_in_root(rootfd, path).decode("utf-8", "replace")
            except OSError:
                return []
            return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]

        passwd = [row for row in table("/etc/passwd") if len(row) >= 7]
        entry = next((row for row in passwd if row[0] == user or (user.isdigit() and row[2] == user)), None)
        if entry is None and not user.isdigit():
            raise SandboxError(f"user {user!r} of the image is not in its /etc/passwd")
        uid = int(entry[2]) if entry else int(user)
        gid = int(entry[3]) if entry else uid
        if group:
            if group.isdigit():
                gid = int(group)
            else:
                row = next((r for r in table("/etc/group") if len(r) >= 3 and r[0] == group), None)
                if row is None:
                    raise SandboxError(f"group {group!r} of the image is not in its /etc/group")
                gid = int(row[2])
        if uid == 0 and gid == 0:
            return None
        name = entry[0] if entry else None
        groups = sorted({int(r[2]) for r in table("/etc/group") if len(r) >= 4 and name and name in r[3].split(",")} - {gid})
        return _User(uid=uid, gid=gid, name=name, home=entry[5] if entry else "/", groups=tuple(groups))

    def _shell_argv(self, sb: _Sandbox, cwd: str, env: Mapping[str, str]) -> list[str]:
        """Write the bundle's config.json for a shell in ``cwd`` with ``env``; return the runtime's command."""
        sb.starts += 1
        user = sb.user
        joined = None
        networked = sb.spec.network
        if sb.spec.network_of is not None:
            peer = self._live(sb.spec.network_of)
            if peer.shell is None or not _alive(peer.shell.init_pid, peer.shell.init_start):
                raise SandboxError(f"sandbox {peer.id}, whose network sandbox {sb.id} joins, has no running shell")
            joined = f"/proc/{peer.shell.init_pid}/ns"
            networked = peer.spec.network
        resolv_conf = None
        if networked:
            # slirp4netns's resolver, on a file of the sandbox's own (its root may edit it, as in
            # docker), beside its mount point where the runtime's user namespace can reach it.
            resolv_conf = self._resolv_conf(sb.id)
            if not resolv_conf.exists():
                resolv_conf.write_text(f"nameserver {SLIRP_DNS}\n")
                os.chown(resolv_conf, UID_BASE, UID_BASE)
        spec = container_spec(
            args=["/bin/bash", "--noprofile", "--norc"], env=env, cwd=cwd,
            uid=user.uid if user else 0, gid=user.gid if user else 0, additional_gids=user.groups if user else (),
            hostname=sb.id, network_namespace=f"{joined}/net" if joined else None,
            # runsc's gofer (a Go program) cannot join a user namespace; its sandbox joins the
            # peer's network namespace from the host's and gets a user namespace of its own.
            user_namespace=f"{joined}/user" if joined and self.runtime.name != "runsc" else None,
            # runc makes cgroups of its own (crun is told not to): nest them in the sandbox's.
            cgroups_path=f"/{sb.cgroup.parent}/{sb.id}/runtime" if self.runtime.name == "runc" else None,
            resolv_conf=str(resolv_conf) if resolv_conf else None,
        )  # fmt: skip
        spec["root"]["path"] = str(sb.merged)
        self.runtime.adapt_spec(spec, pids=sb.spec.resources.pids)
        sb.seccomp_to_learn = self._seccomp.annotate(spec)
        _write_json(sb.dir / "config.json", spec)
        return self.runtime.run_argv(str(sb.dir), f"shell-{sb.starts}", str(sb.dir / "run"))

    async def _start_shell(
        self,
        sb: _Sandbox,
        cwd: str,
        *,
        ready: str = "true",
        state: SandboxState = SandboxState.READY,
        limits: Resources | None = None,
    ) -> _Shell:
        """Start the sandbox's bash in its overlay at ``cwd``, wait until it answers ``ready`` with 0.

        Meanwhile the sandbox's cgroup is created with ``limits`` (None: it exists already).
        Then the shell joins the cgroup, gets its hostname and loopback, and is recorded in
        meta.json with the sandbox in ``state``.
        """
        # Loading the locale costs every program a few hundred microseconds; only the bash
        # needs it, so it exports the locale variables in its first command.
        env = {k: v for k, v in sb.env.items() if not _LOCALE_VAR.fullmatch(k)}
        ready = "".join(f"export {k}={ansi_c_quote(v)}; " for k, v in sb.env.items() if k not in env) + ready
        gvisor = self.runtime.name == "runsc"
        if gvisor:  # gVisor's kernel has a clock of its own: read it, to place commands on it
            ready += ' && { read -r __fy_up _ < /proc/uptime; printf "\\n%s\\n" "$__fy_up"; unset __fy_up; }'
        process = await _ShellProcess.spawn(self._shell_argv(sb, cwd, env), {"PATH": DEFAULT_PATH})
        announce_launched()  # the runtime starts the sandbox in a process of its own from here
        shell = _Shell(process=process, pid=process.pid, init_pid=0, init_start=None)
        # Joining a cgroup waits for an RCU grace period (milliseconds) unless a process joined
        # one just before, so the cgroup is made and the runtime joins it from a thread while the
        # shell starts.
        if limits is not None:
            limits = dataclasses.replace(limits, pids=self.runtime.host_pids(limits.pids))
        joining = _in_fresh_thread(functools.partial(_enter_cgroup, sb.cgroup, shell.pid, limits))
        finishing: asyncio.Future | None = None
        try:
            answer = await process.channel.run(ready, timeout_s=READY_TIMEOUT_S, grace_s=0.1)
            if answer.exit_code != 0:
                detail = answer.stderr.strip().splitlines()[-1:] or [f"exit code {answer.exit_code}"]
                raise SandboxError(f"the shell of sandbox {sb.id} did not start: {detail[0]}")
            # Under gVisor the host sees the runtime's two processes; the sandbox's own run in
            # gVisor's kernel, the process that owns its namespaces.
            if gvisor:
                # Read just after the answer: an offset early by at most the round trip.
                shell.clock_offset = float(answer.stdout.split()[-1]) - time.monotonic()
            init_pid = _gvisor_sandbox_pid(shell.pid) if gvisor else _child_pid(shell.pid)
            if init_pid is None:
                raise SandboxError(f"the shell of sandbox {sb.id} vanished while starting")
            if sb.seccomp_to_learn is not None:
                self._seccomp.learn(sb.seccomp_to_learn, sb.dir / "run" / f"shell-{sb.starts}")
            shell.init_pid, shell.init_start = init_pid, start_ticks(init_pid)
            await asyncio.shield(joining)
            # Two threads at once: one puts the shell into the cgroups and its namespaces (a
            # fresh one, as setns(2) moves only the calling thread: a failed return trip can
            # never leave the event loop's thread inside a sandbox), one writes meta.json.
            finishing = asyncio.gather(
                _in_fresh_thread(functools.partial(self._settle_shell, sb, shell, self.runtime.name == "runsc")),
                _in_fresh_thread(functools.partial(self._write_meta, sb, shell, state)),
                return_exceptions=True,
            )
            for outcome in await asyncio.shield(finishing):
                if isinstance(outcome, BaseException):
                    raise outcome
            if sb.spec.network and sb.spec.network_of is None:
                shell.network = await asyncio.shield(start_network(shell.init_pid, self.egress))
        except BaseException:
            for work in (joining, finishing):
                if work is not None and not work.done():  # let the threads finish before cleaning up
                    await asyncio.wait([work])
            joining.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, awaited or not
            await self._stop_shell(shell)
            raise
        return shell

    @staticmethod
    def _settle_shell(sb: _Sandbox, shell: _Shell, gvisor: bool = False) -> None:
        """Put a started shell into the cgroups (blocking)."""
        # The runtime may have forked the bash before it joined. The bash has run only builtins
        # so far, so once it is inside, every process of the sandbox is.
        try:
            if not _in_cgroup(sb.cgroup, shell.init_pid):
                sb.cgroup.add(shell.init_pid)
        except OSError as exc:
            raise SandboxError(f"cannot put the shell of sandbox {sb.id} into its cgroup: {exc}") from exc
        if gvisor and sb.spec.network_of is None:
            # crun and runc bring a new namespace's loopback up; runsc, whose sockets are the
            # host's inside that namespace, leaves it down.
            _loopback_up(shell.init_pid)

    async def _stop_shell(self, shell: _Shell) -> None:
        """Kill the shell (and with it its pid namespace) and reap the runtime."""
        if shell.init_pid and _alive(shell.init_pid, shell.init_start):
            try:
                os.kill(shell.init_pid, 9)
            except ProcessLookupError:
                pass
        if shell.network is not None:
            await asyncio.to_thread(shell.network.stop)
        shell.process.close()  # kills the runtime if still running
        try:
            await asyncio.wait_for(asyncio.shield(shell.process.exited), 5.0)
        except TimeoutError:
            logger.warning("runtime process %s did not exit after SIGKILL", shell.pid)

    def _live(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.destroyed:
            return sb
        if _ID_RE.fullmatch(sandbox_id) and (self._sandboxes_dir / sandbox_id).is_dir():
            raise SandboxCrashedError(
                f"sandbox {sandbox_id} was left by another process of this node and cannot be used; destroy it"
            )
        raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on node {self.node!r}")

    async def exec(
        self,
        sandbox_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        """Run ``command`` in the sandbox's persistent shell; a dead shell is replaced."""
        sb = self._live(sandbox_id)
        async with sb.lock:
            if sb.destroyed:
                raise SandboxNotFoundError(f"sandbox {sandbox_id} was destroyed")
            if sb.shell is None or sb.shell.channel.closed:
                await self._respawn(sb, sb.shell.channel.cwd if sb.shell else None)
            shell = sb.shell
            sb.state = SandboxState.BUSY
            since = ticks_now()

            async def on_timeout() -> None:
                if self.runtime.name == "runsc":
                    await self._gvisor_kill_command(sb, shell)
                    return
                # Abort the command list in the shell first, then kill what it started.
                signal_pid(shell.init_pid, ABORT_SIGNAL)
                await asyncio.to_thread(kill_descendants_since, shell.init_pid, since)

            try:
                result = await shell.channel.run(
                    command, timeout_s=timeout_s, max_output_bytes=max_output_bytes,
                    on_timeout=on_timeout, grace_s=KILL_GRACE_S,
                )  # fmt: skip
                if shell.channel.broken and not sb.destroyed:
                    result = await self._recover(sb, shell, result)
            finally:
                if sb.state is SandboxState.BUSY:
                    sb.state = SandboxState.READY
            return result

    async def _gvisor_kill_command(self, sb: _Sandbox, shell: _Shell) -> None:
        """Abort a timed-out command under gVisor, whose processes the host cannot see: from inside."""
        since_ticks = int((shell.channel.command_started_at + shell.clock_offset) * 100) - 1
        argv = self.runtime.exec_argv(
            str(sb.dir / "run"), f"shell-{sb.starts}",
            ["/bin/bash", "--noprofile", "--norc", "-c", KILL_SINCE_SCRIPT, "forkyard-kill", str(since_ticks), "1"],
        )  # fmt: skip
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), 10.0)
        except (OSError, TimeoutError) as exc:
            logger.warning("sandbox %s: cannot kill its timed-out command: %s", sb.id, exc)
            return
        if proc.returncode != 0:
            logger.warning("sandbox %s: the kill of its timed-out command failed: %s", sb.id, err.decode()[-300:])

    async def _recover(self, sb: _Sandbox, shell: _Shell, result: ExecResult) -> ExecResult:
        """Replace a shell that exited or hung, keeping the sandbox usable."""
        code = result.exit_code
        if result.timed_out:
            why = "the shell did not come back after the timeout"
        else:
            try:
                rc = await asyncio.wait_for(asyncio.shield(shell.process.exited), 2.0)
            except TimeoutError:
                rc = None
            if rc is not None and code == SHELL_DIED_EXIT_CODE:
                code = rc if rc >= 0 else 128 - rc
            why = f"the shell exited with code {code}"
        cwd = shell.channel.cwd
        try:
            await self._respawn(sb, cwd)
            note = f"[forkyard: {why}; a new shell was started in {sb.shell.channel.cwd or cwd}]\n"
        except SandboxError as exc:
            sb.state = SandboxState.FAILED
            logger.error("sandbox %s: cannot restart its shell: %s", sb.id, exc)
            note = f"[forkyard: {why} and could not be restarted: {exc}]\n"
        return dataclasses.replace(result, exit_code=code, stderr=result.stderr + note)

    async def _respawn(self, sb: _Sandbox, cwd: str | None) -> None:
        if sb.shell is not None:
            await self._stop_shell(sb.shell)
            sb.shell = None
        start = sb.workdir
        for candidate in (cwd, sb.workdir, "/"):
            if not candidate:
                continue
            try:
                os.close(fs.open_in_root(sb.rootfd, candidate, os.O_PATH | os.O_DIRECTORY))
                start = candidate
                break
            except OSError:
                continue
        state = SandboxState.READY if sb.state is SandboxState.FAILED else sb.state
        try:
            sb.shell = await self._start_shell(sb, start, state=state)
        except SandboxError as exc:
            sb.state = SandboxState.FAILED
            raise SandboxCrashedError(f"the shell of sandbox {sb.id} died and could not be restarted: {exc}") from exc
        sb.state = state
        # Prime the channel's cwd so the next result reports where the new shell is.
        sb.shell.channel.cwd = start
        logger.info("sandbox %s: restarted its shell in %s", sb.id, start)

    # ------------------------------------------------------------------ files

    def _host_path(self, sb: _Sandbox, path: str) -> str:
        return normalize_sandbox_path(path, sb.workdir)

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        """Return the bytes of ``path`` inside the sandbox (symlinks resolve inside it), at most ``max_bytes``."""
        sb = self._live(sandbox_id)
        inner = self._host_path(sb, path)
        try:
            if fs.file_size_in_root(sb.rootfd, inner) <= INLINE_IO_BYTES:
                return fs.read_in_root(sb.rootfd, inner, max_bytes)
            return await asyncio.to_thread(fs.read_in_root, sb.rootfd, inner, max_bytes)
        except fs.TooLargeError:
            raise FileTooLargeError(f"{inner} in sandbox {sandbox_id} is larger than {max_bytes} bytes") from None
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"no file {inner} in sandbox {sandbox_id}", inner) from None
        except IsADirectoryError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot read {inner} in sandbox {sandbox_id}: {exc.strerror}") from exc

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644, owner: tuple[int, int] | None = None
    ) -> None:
        """Write ``data`` to ``path`` inside the sandbox, creating parent directories (owned by ``owner``)."""
        sb = self._live(sandbox_id)
        inner = self._host_path(sb, path)
        if inner == "/":
            raise IsADirectoryError(errno.EISDIR, "cannot write to the sandbox root", inner)
        host_owner = ROOT_OWNER if owner is None else _host_ids(owner)
        try:
            if len(data) <= INLINE_IO_BYTES:
                fs.write_in_root(sb.rootfd, inner, bytes(data), mode, owner=host_owner)
            else:
                await asyncio.to_thread(fs.write_in_root, sb.rootfd, inner, bytes(data), mode, owner=host_owner)
        except IsADirectoryError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot write {inner} in sandbox {sandbox_id}: {exc.strerror}") from exc

    # ------------------------------------------------------------ inspection

    def _info(self, sb: _Sandbox) -> SandboxInfo:
        state = sb.state
        if state is SandboxState.READY and (sb.shell is None or sb.shell.process.exited.done()):
            state = SandboxState.FAILED  # died between commands; the next exec restarts it
        return SandboxInfo(
            id=sb.id, backend=self.name, node=self.node, state=state, image=sb.image,
            created_at=sb.created_at, labels=dict(sb.labels),
        )  # fmt: skip

    def _orphan_info(self, sandbox_id: str) -> SandboxInfo | None:
        sdir = self._sandboxes_dir / sandbox_id
        if not sdir.is_dir():
            return None
        meta = self._read_meta(sandbox_id)
        if meta is None:
            return SandboxInfo(
                id=sandbox_id, backend=self.name, node=self.node, state=SandboxState.FAILED, image="",
                created_at=sdir.stat().st_mtime, labels={LABEL_NODE: self.node},
            )  # fmt: skip
        try:
            state = SandboxState(meta.get("state", "failed"))
        except ValueError:
            state = SandboxState.FAILED
        if not _alive(meta.get("pid"), meta.get("pid_start")):
            state = SandboxState.FAILED
        return SandboxInfo(
            id=sandbox_id, backend=self.name, node=meta.get("node", self.node), state=state,
            image=meta.get("image", ""), created_at=float(meta.get("created_at") or sdir.stat().st_mtime),
            labels=dict(meta.get("labels") or {LABEL_NODE: self.node}),
        )  # fmt: skip

    async def status(self, sandbox_id: str) -> SandboxInfo:
        """Return the sandbox's info; raise SandboxNotFoundError if there is no such sandbox."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is not None and not sb.destroyed:
            return self._info(sb)
        info = self._orphan_info(sandbox_id) if _ID_RE.fullmatch(sandbox_id) else None
        if info is None:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on node {self.node!r}")
        return info

    async def list(self) -> list[SandboxInfo]:
        """Return every sandbox under root_dir, live or left behind by a crashed process."""
        out: list[SandboxInfo] = []
        for sdir in sorted(self._sandboxes_dir.iterdir()):
            if not sdir.is_dir() or not _ID_RE.fullmatch(sdir.name):
                continue
            sb = self._sandboxes.get(sdir.name)
            info = self._info(sb) if sb is not None and not sb.destroyed else self._orphan_info(sdir.name)
            if info is not None and info.node == self.node:
                out.append(info)
        return out

    # -------------------------------------------------------------- teardown

    async def destroy(self, sandbox_id: str) -> None:
        """Kill the sandbox's processes, unmount and delete it; unknown ids are a no-op."""
        if not _ID_RE.fullmatch(sandbox_id):
            return
        task = self._destroying.get(sandbox_id)
        layers: list[str] = []
        if task is None:
            sb = self._sandboxes.pop(sandbox_id, None)
            if sb is None and not (self._sandboxes_dir / sandbox_id).exists():
                return
            if sb is None:  # another process made it (a restart, a reaper): its layers are on disk
                layers = list((self._read_meta(sandbox_id) or {}).get("layers", []))
                teardown = self._teardown_found(sandbox_id)
            else:
                layers = sb.layers
                teardown = self._teardown(sandbox_id, sb)
            # Concurrent destroys of one id share this task; it runs to the end even if a caller is cancelled.
            task = asyncio.ensure_future(teardown)
            self._destroying[sandbox_id] = task
            task.add_done_callback(lambda _t: self._destroying.pop(sandbox_id, None))
        await asyncio.shield(task)
        retired = self._retired_layers.intersection(layers)
        if retired:  # restored from a deleted snapshot: its layers go once no other sandbox uses them
            async with self._images_lock:
                still = await self._free_layers(retired)
                self._retired_layers -= retired - still

    async def _teardown_found(self, sandbox_id: str) -> None:
        """Tear down a sandbox another process made, once the layers only sandboxes use are counted as retired."""
        await self._find_retired_layers()  # while its record still counts among them
        await self._teardown(sandbox_id, None)

    async def _find_retired_layers(self) -> None:
        """Count as retired the layers only sandboxes use, once per backend (an earlier process deleted their snapshots).

        Every removal checks again that nothing uses them.
        """
        if self._retired_scan is None:  # concurrent teardowns share the one scan
            self._retired_scan = asyncio.ensure_future(self._scan_retired_layers())
        await asyncio.wait([self._retired_scan])

    async def _scan_retired_layers(self) -> None:
        try:
            stored, live = await asyncio.to_thread(self._layer_users, set(self._mounting))
        except Exception as exc:  # it counts nothing, and the teardowns go on
            logger.warning("looking for the retired layers under %s failed: %s", self._layers, exc)
            return
        self._retired_layers |= live - stored

    async def _teardown(self, sandbox_id: str, sb: _Sandbox | None) -> None:
        sdir = self._sandboxes_dir / sandbox_id
        if sb is not None:
            sb.destroyed = True
            sb.state = SandboxState.STOPPING
            if sb.shell is not None:
                await self._stop_shell(sb.shell)
            if sb.rootfd >= 0:
                os.close(sb.rootfd)
                sb.rootfd = -1
        else:
            meta = self._read_meta(sandbox_id) or {}
            for pid_key, start_key in (("init_pid", "init_start"), ("pid", "pid_start")):
                if _alive(meta.get(pid_key), meta.get(start_key)):
                    try:
                        os.kill(meta[pid_key], 9)
                    except ProcessLookupError:
                        pass
        cgroup = sb.cgroup if sb is not None else SandboxCgroup(sandbox_id, root=self.cgroup_root)
        await asyncio.to_thread(cgroup.kill_all)
        merged = self._merged_dir(sandbox_id)
        _umount(merged)
        await asyncio.to_thread(cgroup.remove)
        if os.path.ismount(merged):
            raise SandboxError(f"sandbox {sandbox_id}: {merged} is still mounted; not deleting it")
        with contextlib.suppress(FileNotFoundError):
            merged.rmdir()
        with contextlib.suppress(FileNotFoundError):
            self._resolv_conf(sandbox_id).unlink()
        if self._disks is not None:
            await asyncio.to_thread(self._disks.destroy, self._disk_dir(sandbox_id))
        if sdir.exists():
            await asyncio.to_thread(shutil.rmtree, sdir)
        logger.debug("sandbox %s destroyed", sandbox_id)

    async def aclose(self) -> None:
        """Close the shells' pipes; the sandboxes stay on disk for destroy() or a reaper."""
        self._closed = True
        waits = []
        for sb in self._sandboxes.values():
            if sb.shell is not None:
                if sb.shell.network is not None:
                    sb.shell.network.stop()
                sb.shell.process.close()
                waits.append(asyncio.shield(sb.shell.process.exited))
            if sb.rootfd >= 0:
                os.close(sb.rootfd)
                sb.rootfd = -1
        self._sandboxes.clear()
        if waits:
            await asyncio.wait(waits, timeout=5.0)
        # This root's mount and disk dirs go once no sandbox (live or orphaned) is in them.
        for d in (self._mounts_dir, self._mounts_dir.parent, self._disks_dir if self._disks else None):
            if d is not None:
                with contextlib.suppress(OSError):
                    d.rmdir()


__all__ = ["LocalBackend", "host_problem", "parse_image_ref"]

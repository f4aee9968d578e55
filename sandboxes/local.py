"""The ``local`` backend: Linux namespaces + overlayfs layers, no daemon.

Layout under ``root_dir``::

    images/<name>/<tag>.json    {"layers": [abs dirs, bottom..top], "config": {env, workdir, user}}
    layers/<id>/                 frozen upper dirs (commit, snapshot) and squashed layers
    snapshots/<id>.json          snapshots: layer list, shell state, source (see snapshot())
    sandboxes/<id>/{upper,work,merged,meta.json}

A sandbox is an overlay mount (the image's layers read-only below a private upper
dir) and one persistent ``bash`` in fresh mount, pid, ipc, uts and (unless
``spec.network``) net namespaces, chrooted into the overlay by ``unshare --root``
and kept inside a cgroup with the spec's memory, pids and CPU limits. The bash is
pid 1 of its pid namespace, so killing it takes every process of the sandbox with
it. Where the image has ``setpriv`` the shell also loses the capabilities Docker
drops by default plus ``mknod`` and ``sys_chroot`` (chroot would undo ``--root``).

Nothing slow sits on the hot paths: create is a handful of syscalls, two execs
(``sh`` then ``unshare``) and one round trip through the shell; exec is one write to
the shell and the read of its output; files are read and written host-side through
the overlay with ``openat2(RESOLVE_IN_ROOT)``.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandboxes import fs
from sandboxes.base import (
    DEFAULT_MAX_OUTPUT_BYTES,
    LABEL_NODE,
    ExecResult,
    ImageConfig,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    create_cancel_safe,
    normalize_sandbox_path,
)
from sandboxes.cgroups import (
    CGROUP_ROOT,
    REQUIRED_CONTROLLERS,
    SandboxCgroup,
    available_controllers,
    cgroup_version,
)
from sandboxes.errors import (
    BackendUnavailableError,
    ImageNotFoundError,
    SandboxCrashedError,
    SandboxError,
    SandboxNotFoundError,
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
    SHELL_DIED_EXIT_CODE,
    STDERR,
    STDOUT,
    ShellChannel,
)
from sandboxes.snapshots import (
    CAPTURE_COMMAND,
    CAPTURE_MAX_BYTES,
    Snapshot,
    parse_exported,
    restore_command,
    snapshot_id,
    snapshot_metadata,
    squash_layers,
    start_branches,
    tree_digest,
)

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Docker's default capability set, less mknod and sys_chroot.
KEEP_CAPS = (
    "chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
    "net_bind_service", "net_raw", "audit_write", "setfcap",
)  # fmt: skip
#: Device nodes every sandbox gets in /dev when its image lacks them.
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
READY_TIMEOUT_S = 30.0
#: After killing a timed-out command, how long the shell gets to print its marker.
KILL_GRACE_S = 2.0
#: Files at most this big are read/written on the event loop thread; bigger ones in a worker thread.
INLINE_IO_BYTES = 1 << 20

_NAME_RE = re.compile(r"[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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


def find_unshare() -> str | None:
    """Return the path of util-linux ``unshare``, or None."""
    return shutil.which("unshare") or next(
        (p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None
    )


@functools.lru_cache(maxsize=4)
def unshare_is_recent(path: str) -> bool:
    """Tell whether ``unshare`` has --root, --wd, --kill-child and --mount-proc (util-linux 2.36+).

    Those versions chroot into --root before mounting /proc, which the sandbox relies on.
    """
    try:
        out = subprocess.run([path, "--help"], check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return all(opt in out for opt in ("--root", "--wd", "--kill-child", "--mount-proc"))


def host_problem(cgroup_root: Path = CGROUP_ROOT) -> str | None:
    """Return one sentence saying why this host cannot run local sandboxes, or None."""
    if not is_root():
        return "the local sandbox backend must run as root (it mounts overlays and creates namespaces)"
    if not has_overlayfs():
        return "the local sandbox backend needs overlayfs, which this kernel does not offer (try `modprobe overlay`)"
    unshare = find_unshare()
    if unshare is None:
        return "the local sandbox backend needs the `unshare` program from util-linux, which is not installed"
    if not unshare_is_recent(unshare):
        return f"the local sandbox backend needs util-linux 2.36 or newer, and {unshare} lacks --root/--wd/--kill-child"
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


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
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


def _mount_overlay(lowers: list[str], upper: Path, work: Path, merged: Path, volatile: bool) -> bool:
    """Mount an overlay on ``merged``; return whether the ``volatile`` option was used."""
    opts = f"lowerdir={':'.join(reversed(lowers))},upperdir={upper},workdir={work}"
    tries = [opts + ",volatile", opts] if volatile else [opts]
    err = 0
    for data in tries:
        if _libc.mount(b"overlay", os.fsencode(merged), b"overlay", 0, data.encode()) == 0:
            return data.endswith(",volatile")
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            break
    # mount(8) knows tricks we do not (e.g. the new mount API for very long option strings).
    proc = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], check=False, capture_output=True, text=True
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


def _setup_namespaces(pid: int, hostname: str, loopback: bool) -> None:
    """Name the sandbox's UTS namespace and bring its loopback up, from a throwaway thread.

    setns(2) on a thread only moves that thread; using a fresh one means a failed
    return trip can never leave the event loop's thread inside a sandbox.
    """
    errors: list[BaseException] = []

    def work() -> None:
        fds: list[int] = []
        try:
            own_uts = os.open("/proc/thread-self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
            fds.append(own_uts)
            uts = os.open(f"/proc/{pid}/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
            fds.append(uts)
            name = hostname.encode()
            if _libc.setns(uts, CLONE_NEWUTS) != 0:
                raise OSError(ctypes.get_errno(), "setns(uts)")
            try:
                if _libc.sethostname(name, len(name)) != 0:
                    raise OSError(ctypes.get_errno(), "sethostname")
            finally:
                if _libc.setns(own_uts, CLONE_NEWUTS) != 0:
                    raise OSError(ctypes.get_errno(), "setns back (uts)")
            if loopback:
                own_net = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                fds.append(own_net)
                net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                fds.append(net)
                if _libc.setns(net, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns(net)")
                try:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # lives in the sandbox's netns
                finally:
                    if _libc.setns(own_net, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns back (net)")
                with sock:
                    req = struct.pack("16sh22x", b"lo", 0)
                    flags = struct.unpack("16sh", fcntl.ioctl(sock, SIOCGIFFLAGS, req)[:18])[1]
                    fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
        finally:
            for fd in fds:
                os.close(fd)

    thread = threading.Thread(target=work, name="forkyard-setns", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


class _ShellProtocol(asyncio.SubprocessProtocol):
    """Feed the shell's stdout/stderr straight into its channel (no reader tasks needed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport: asyncio.SubprocessTransport | None = None
        self.channel = ShellChannel(self.write)
        self.exited: asyncio.Future[int] = loop.create_future()
        self._open = {0, 1, 2}

    async def write(self, data: bytes) -> None:
        pipe = self.transport.get_pipe_transport(0) if self.transport is not None else None
        if pipe is None or pipe.is_closing():
            raise ConnectionError("the sandbox shell's stdin is closed")
        pipe.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.channel.feed(STDOUT if fd == 1 else STDERR, data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd in self._open:
            self._open.discard(fd)
            if not self._open - {0}:  # stdout and stderr both closed: everything was delivered
                self.channel.feed_eof()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(self.transport.get_returncode())
        # The pipes close with the sandbox's last process; do not wait for them forever.
        asyncio.get_running_loop().call_later(1.0, self.channel.feed_eof)


@dataclass
class _Shell:
    protocol: _ShellProtocol
    pid: int  # unshare, our child
    init_pid: int  # the bash, pid 1 of the sandbox's pid namespace
    init_start: int | None

    @property
    def channel(self) -> ShellChannel:
        return self.protocol.channel


@dataclass
class _User:
    uid: int
    gid: int
    name: str | None
    home: str


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
    setpriv: str | None
    cgroup: SandboxCgroup
    rootfd: int
    created_at: float
    labels: dict[str, str]
    state: SandboxState = SandboxState.STARTING
    shell: _Shell | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    destroyed: bool = False

    @property
    def merged(self) -> Path:
        return self.dir / "merged"


class LocalBackend:
    """Sandboxes made of Linux namespaces, an overlayfs and cgroups, with no daemon."""

    name = "local"

    def __init__(self, root_dir: str | os.PathLike, node: str, *, cgroup_root: Path = CGROUP_ROOT) -> None:
        problem = host_problem(cgroup_root)
        if problem is not None:
            raise BackendUnavailableError(problem[0].upper() + problem[1:] + ".")
        self.node = node
        self.root_dir = Path(root_dir).absolute()
        _check_layer_path(str(self.root_dir))
        self.cgroup_root = Path(cgroup_root)
        self._unshare = find_unshare()
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
        self._volatile = True
        self._closed = False
        self._warned_images: set[str] = set()

    # ----------------------------------------------------------------- images

    def _manifest_path(self, image: str) -> Path:
        name, tag = parse_image_ref(image)
        return self._images / name / f"{tag}.json"

    def _load_manifest(self, image: str) -> dict:
        try:
            with open(self._manifest_path(image)) as fh:
                return json.load(fh)
        except FileNotFoundError:
            raise ImageNotFoundError(f"image {image!r} is not known to the local backend") from None

    async def import_rootfs(self, rootfs: str, image: str, config: ImageConfig) -> None:
        """Register directory ``rootfs`` as the single layer of ``image`` (no copy is made)."""
        path = Path(rootfs).absolute()
        if not path.is_dir():
            raise SandboxError(f"root filesystem {rootfs} is not a directory")
        _check_layer_path(str(path))
        manifest = self._manifest_path(image)
        manifest.parent.mkdir(parents=True, exist_ok=True)
        _write_json(manifest, {"layers": [str(path)], "config": _config_to_json(config), "created_at": time.time()})

    async def has_image(self, image: str) -> bool:
        """Tell whether ``image`` has a manifest here."""
        return self._manifest_path(image).is_file()

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
            used = self._used_layers()
            for layer in self._layers.iterdir():
                if not layer.name.startswith(".") and str(layer) not in used:
                    await asyncio.to_thread(shutil.rmtree, layer, True)

    def _used_layers(self) -> set[str]:
        used: set[str] = set()
        for manifest in self._images.rglob("*.json"):
            try:
                used.update(json.loads(manifest.read_text()).get("layers", []))
            except (OSError, ValueError):
                continue
        for sdir in self._sandboxes_dir.iterdir():
            meta = self._read_meta(sdir.name) or {}
            used.update(meta.get("layers", []))
        for snap in self._snapshots.glob("*.json"):
            try:
                used.update(json.loads(snap.read_text()).get("layers", []))
            except (OSError, ValueError):
                continue
        return used

    async def seal_upper(self, sandbox_id: str) -> Path:
        """Copy the sandbox's upper dir into a new immutable layer and return its path.

        ``cp -a`` as root keeps overlay whiteouts (0/0 char devices) and the
        ``trusted.overlay.opaque`` xattrs, so the layer means the same as a lower layer.
        """
        sdir = self._sandbox_dir(sandbox_id)
        if not (sdir / "upper").is_dir():
            raise SandboxNotFoundError(f"no sandbox {sandbox_id!r} on node {self.node!r}")
        layer_id = secrets.token_hex(16)
        tmp = self._layers / f".tmp-{layer_id}"
        tmp.mkdir()
        proc = await asyncio.create_subprocess_exec(
            "cp", "-a", "--", f"{sdir / 'upper'}/.", str(tmp),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        if proc.returncode != 0:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise SandboxError(f"cannot copy the upper layer of sandbox {sandbox_id}: {err.decode(errors='replace').strip()}")
        final = self._layers / layer_id
        os.rename(tmp, final)
        return final

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
                    layer = await self.seal_upper(sandbox_id)
            else:
                layer = await self.seal_upper(sandbox_id)
            manifest.parent.mkdir(parents=True, exist_ok=True)
            _write_json(
                manifest,
                {"layers": [*layers, str(layer)], "config": _config_to_json(config), "created_at": time.time()},
            )

    # -------------------------------------------------------------- snapshots

    def _snapshot_path(self, snapshot_id: str) -> Path:
        if not _ID_RE.fullmatch(snapshot_id):
            raise SandboxError(f"invalid snapshot id {snapshot_id!r}")
        return self._snapshots / f"{snapshot_id}.json"

    def _freeze(self, sb: _Sandbox) -> list[int]:
        """SIGSTOP the sandbox's processes other than its shell so its upper dir holds still."""
        shell = sb.shell
        skip = {shell.pid, shell.init_pid} if shell is not None else set()
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
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    async def snapshot(self, sandbox_id: str, *, metadata: Mapping[str, str] | None = None) -> Snapshot:
        """Capture the sandbox's filesystem, cwd and exports as an immutable snapshot.

        The sandbox's upper dir is copied (``cp -a``, whiteouts and opaque dirs kept) into
        a new read-only layer while its other processes are stopped (SIGSTOP) and no
        command runs; the live sandbox goes on with its own upper dir, which now sits on
        the same content as the snapshot. An overlay cannot swap the upper dir of a
        mounted sandbox, and copying a small change costs milliseconds. Restoring then
        mounts fresh overlays over the snapshot's layers, with no copy per branch. More
        than :attr:`max_snapshot_layers` layers are squashed into two (the bottom image
        layer and one merged layer). Background processes are not captured.
        """
        self._check_open()
        sb = self._live(sandbox_id)
        meta = snapshot_metadata(metadata)
        async with self._images_lock:  # no layer GC while the new layer has no owner yet
            async with sb.lock:
                if sb.destroyed:
                    raise SandboxNotFoundError(f"sandbox {sandbox_id} was destroyed")
                if sb.shell is None or sb.shell.channel.closed:
                    await self._respawn(sb, sb.shell.channel.cwd if sb.shell else None)
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
                    layer = await self.seal_upper(sandbox_id)
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

    async def restore(self, snapshot: Snapshot, n: int = 1, *, spec: SandboxSpec | None = None) -> list[SandboxInfo]:
        """Start ``n`` sandboxes on fresh overlays over the snapshot's layers, with its cwd and exports.

        ``spec`` (optional) sets resources, network and labels; its env is exported on top
        of the snapshot's and its image is ignored (the filesystem is the snapshot's).
        """
        self._check_open()
        if snapshot.backend != self.name or not snapshot.layers:
            raise SandboxError(f"snapshot {snapshot.id} was not made by a local backend")
        if n < 1:
            raise SandboxError(f"restore needs n >= 1, got {n}")
        if not self._snapshot_path(snapshot.id).is_file():
            raise SandboxNotFoundError(f"no snapshot {snapshot.id!r} on node {self.node!r}")
        env = {**snapshot.env, **(spec.env if spec else {})}
        eff = SandboxSpec(
            image=snapshot.image,
            resources=spec.resources if spec else snapshot.resources,
            network=spec.network if spec else snapshot.network,
            env=env,
            workdir=snapshot.workdir,
            labels=dict(spec.labels) if spec else {},
        )
        source = (list(snapshot.layers), snapshot.config)
        command = restore_command(env, snapshot.cwd)

        return await start_branches(
            self, snapshot, n, create=lambda: create_cancel_safe(self._create(eff, source), self.destroy), command=command, timeout_s=READY_TIMEOUT_S
        )

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete the snapshot and every layer nothing else (image, sandbox, snapshot) uses."""
        path = self._snapshot_path(snapshot_id)
        async with self._images_lock:
            path.unlink(missing_ok=True)
            used = self._used_layers()
            for layer in self._layers.iterdir():
                if not layer.name.startswith(".") and str(layer) not in used:
                    await asyncio.to_thread(shutil.rmtree, layer, True)

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

    def _write_meta(self, sb: _Sandbox) -> None:
        shell = sb.shell
        _write_json(
            sb.dir / "meta.json",
            {
                "id": sb.id,
                "node": self.node,
                "image": sb.image,
                "layers": sb.layers,
                "labels": sb.labels,
                "created_at": sb.created_at,
                "state": sb.state.value,
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
        return await create_cancel_safe(self._create(spec), self.destroy)

    async def _create(self, spec: SandboxSpec, source: tuple[list[str], ImageConfig] | None = None) -> SandboxInfo:
        """Create a sandbox of ``spec``; ``source`` (layers, config) replaces the image's (restore)."""
        self._check_open()
        res = spec.resources
        if res.cpus <= 0 or res.memory_mb <= 0 or res.pids <= 0:
            raise SandboxError(f"resources must be positive, got {res}")
        if source is None:
            manifest = self._load_manifest(spec.image)
            layers = list(manifest["layers"])
            config = _config_from_json(manifest.get("config") or {})
        else:
            layers, config = list(source[0]), source[1]
        while True:
            sid = secrets.token_hex(6)
            sdir = self._sandboxes_dir / sid
            try:
                sdir.mkdir()
                break
            except FileExistsError:
                continue
        for sub in ("upper", "work", "merged"):
            (sdir / sub).mkdir()
        labels = {**spec.labels, LABEL_NODE: self.node}
        workdir = normalize_sandbox_path(spec.workdir or config.workdir or "/")
        sb: _Sandbox | None = None
        rootfd = -1
        try:
            self._volatile = _mount_overlay(layers, sdir / "upper", sdir / "work", sdir / "merged", self._volatile)
            rootfd = os.open(sdir / "merged", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self._prepare_rootfs(rootfd, workdir)
            user = self._resolve_user(rootfd, config.user)
            env = {"PATH": DEFAULT_PATH, "HOME": user.home if user else "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
            env.update(config.env)
            env.update(spec.env)
            cgroup = SandboxCgroup(sid, root=self.cgroup_root)
            sb = _Sandbox(
                id=sid, dir=sdir, image=spec.image, layers=layers, spec=spec, config=config, workdir=workdir,
                env=env, user=user, setpriv=self._find_setpriv(rootfd), cgroup=cgroup, rootfd=rootfd,
                created_at=time.time(), labels=labels,
            )  # fmt: skip
            self._sandboxes[sid] = sb
            self._write_meta(sb)
            cgroup.create(res)
            sb.shell = await self._start_shell(sb, workdir)
            sb.state = SandboxState.READY
            self._write_meta(sb)
        except BaseException:
            if sb is None and rootfd >= 0:
                os.close(rootfd)
            self._sandboxes.pop(sid, None)
            try:
                await asyncio.shield(self._teardown(sid, sb))
            except Exception:  # the original error matters more
                logger.exception("cleanup of half-created sandbox %s failed", sid)
            raise
        logger.debug("sandbox %s ready (image %s)", sid, spec.image)
        return self._info(sb)

    def _prepare_rootfs(self, rootfd: int, workdir: str) -> None:
        """Make sure /dev has the basic device nodes, /proc exists and the workdir exists."""
        fs.mkdirs_in_root(rootfd, "/dev")
        devfd = fs.open_in_root(rootfd, "/dev", os.O_PATH | os.O_DIRECTORY)
        try:
            for name, (major, minor) in DEVICES.items():
                try:
                    os.stat(name, dir_fd=devfd, follow_symlinks=False)
                except FileNotFoundError:
                    os.mknod(name, stat.S_IFCHR | 0o666, os.makedev(major, minor), dir_fd=devfd)
                    os.chmod(name, 0o666, dir_fd=devfd)
            for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                                 ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
                try:
                    os.symlink(target, name, dir_fd=devfd)
                except FileExistsError:
                    pass
            for name, mode in (("pts", 0o755), ("shm", 0o1777)):
                try:
                    os.mkdir(name, mode, dir_fd=devfd)
                    os.chmod(name, mode, dir_fd=devfd)  # past the umask
                except FileExistsError:
                    pass
        finally:
            os.close(devfd)
        fs.mkdirs_in_root(rootfd, "/proc")
        fs.mkdirs_in_root(rootfd, workdir)

    @staticmethod
    def _find_setpriv(rootfd: int) -> str | None:
        for path in ("/usr/bin/setpriv", "/bin/setpriv"):
            try:
                fd = fs.open_in_root(rootfd, path, os.O_PATH)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                return path
        return None

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
        return _User(uid=uid, gid=gid, name=entry[0] if entry else None, home=entry[5] if entry else "/")

    def _shell_argv(self, sb: _Sandbox, cwd: str) -> list[str]:
        argv = [self._unshare, "--mount", "--pid", "--ipc", "--uts"]
        if not sb.spec.network:
            argv.append("--net")
        argv += ["--fork", "--kill-child", "--mount-proc", f"--root={sb.merged}", f"--wd={cwd}"]
        if sb.setpriv:
            argv.append(sb.setpriv)
            if sb.user is not None:
                argv += [f"--reuid={sb.user.uid}", f"--regid={sb.user.gid}"]
                argv.append("--init-groups" if sb.user.name else "--clear-groups")
            argv += ["--bounding-set=-all," + ",".join(f"+{c}" for c in KEEP_CAPS), "--"]
        else:
            if sb.image not in self._warned_images:
                self._warned_images.add(sb.image)
                logger.warning("image %s has no setpriv: its sandboxes keep every root capability", sb.image)
            if sb.user is not None:
                argv += [f"--setgid={sb.user.gid}", f"--setuid={sb.user.uid}"]
        return argv + ["/bin/bash", "--noprofile", "--norc"]

    async def _start_shell(self, sb: _Sandbox, cwd: str) -> _Shell:
        """Start the sandbox's bash in its overlay at ``cwd`` and wait until it answers."""
        loop = asyncio.get_running_loop()
        # The sh puts itself into the cgroups before becoming unshare, so every process
        # of the sandbox is born inside them.
        script = "".join(f"echo $$ > {shlex.quote(str(p))} && " for p in sb.cgroup.procs_files)
        script += "exec " + shlex.join(self._shell_argv(sb, cwd))
        transport, protocol = await loop.subprocess_exec(
            lambda: _ShellProtocol(loop), "/bin/sh", "-c", script,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=sb.env, cwd="/", start_new_session=True,
        )  # fmt: skip
        shell = _Shell(protocol=protocol, pid=transport.get_pid(), init_pid=0, init_start=None)
        try:
            ready = await protocol.channel.run("true", timeout_s=READY_TIMEOUT_S, grace_s=0.1)
            if ready.exit_code != 0:
                detail = ready.stderr.strip().splitlines()[-1:] or [f"exit code {ready.exit_code}"]
                raise SandboxError(f"the shell of sandbox {sb.id} did not start: {detail[0]}")
            init_pid = _child_pid(shell.pid)
            if init_pid is None:
                raise SandboxError(f"the shell of sandbox {sb.id} vanished while starting")
            shell.init_pid, shell.init_start = init_pid, start_ticks(init_pid)
            _setup_namespaces(init_pid, sb.id, loopback=not sb.spec.network)
        except BaseException:
            await self._stop_shell(shell)
            raise
        return shell

    async def _stop_shell(self, shell: _Shell) -> None:
        """Kill the shell (and with it its pid namespace) and reap unshare."""
        if shell.init_pid and _alive(shell.init_pid, shell.init_start):
            try:
                os.kill(shell.init_pid, 9)
            except ProcessLookupError:
                pass
        transport = shell.protocol.transport
        if transport is not None:
            transport.close()  # kills unshare if still running; --kill-child takes the bash
        try:
            await asyncio.wait_for(asyncio.shield(shell.protocol.exited), 5.0)
        except TimeoutError:
            logger.warning("unshare process %s did not exit after SIGKILL", shell.pid)

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

    async def _recover(self, sb: _Sandbox, shell: _Shell, result: ExecResult) -> ExecResult:
        """Replace a shell that exited or hung, keeping the sandbox usable."""
        code = result.exit_code
        if result.timed_out:
            why = "the shell did not come back after the timeout"
        else:
            try:
                rc = await asyncio.wait_for(asyncio.shield(shell.protocol.exited), 2.0)
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
        try:
            sb.shell = await self._start_shell(sb, start)
        except SandboxError as exc:
            sb.state = SandboxState.FAILED
            raise SandboxCrashedError(f"the shell of sandbox {sb.id} died and could not be restarted: {exc}") from exc
        if sb.state is SandboxState.FAILED:
            sb.state = SandboxState.READY
        # Prime the channel's cwd so the next result reports where the new shell is.
        sb.shell.channel.cwd = start
        self._write_meta(sb)
        logger.info("sandbox %s: restarted its shell in %s", sb.id, start)

    # ------------------------------------------------------------------ files

    def _host_path(self, sb: _Sandbox, path: str) -> str:
        return normalize_sandbox_path(path, sb.workdir)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """Return the bytes of ``path`` inside the sandbox (symlinks resolve inside it)."""
        sb = self._live(sandbox_id)
        inner = self._host_path(sb, path)
        try:
            fd = fs.open_file_in_root(sb.rootfd, inner, os.O_RDONLY)
            with os.fdopen(fd, "rb") as fh:
                if os.fstat(fd).st_size <= INLINE_IO_BYTES:
                    return fh.read()
                return await asyncio.to_thread(fh.read)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"no file {inner} in sandbox {sandbox_id}", inner) from None
        except IsADirectoryError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot read {inner} in sandbox {sandbox_id}: {exc.strerror}") from exc

    async def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` inside the sandbox, creating parent directories."""
        sb = self._live(sandbox_id)
        inner = self._host_path(sb, path)
        if inner == "/":
            raise IsADirectoryError(errno.EISDIR, "cannot write to the sandbox root", inner)
        try:
            if len(data) <= INLINE_IO_BYTES:
                fs.write_in_root(sb.rootfd, inner, bytes(data), mode)
            else:
                await asyncio.to_thread(fs.write_in_root, sb.rootfd, inner, bytes(data), mode)
        except IsADirectoryError:
            raise
        except OSError as exc:
            raise SandboxError(f"cannot write {inner} in sandbox {sandbox_id}: {exc.strerror}") from exc

    # ------------------------------------------------------------ inspection

    def _info(self, sb: _Sandbox) -> SandboxInfo:
        state = sb.state
        if state is SandboxState.READY and (sb.shell is None or sb.shell.protocol.exited.done()):
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
        if task is None:
            sb = self._sandboxes.pop(sandbox_id, None)
            if sb is None and not (self._sandboxes_dir / sandbox_id).exists():
                return
            # Concurrent destroys of one id share this task; it runs to the end even if a caller is cancelled.
            task = asyncio.ensure_future(self._teardown(sandbox_id, sb))
            self._destroying[sandbox_id] = task
            task.add_done_callback(lambda _t: self._destroying.pop(sandbox_id, None))
        await asyncio.shield(task)

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
        merged = sdir / "merged"
        _umount(merged)
        await asyncio.to_thread(cgroup.remove)
        if os.path.ismount(merged):
            raise SandboxError(f"sandbox {sandbox_id}: {merged} is still mounted; not deleting it")
        if sdir.exists():
            await asyncio.to_thread(shutil.rmtree, sdir)
        logger.debug("sandbox %s destroyed", sandbox_id)

    async def aclose(self) -> None:
        """Close the shells' pipes; the sandboxes stay on disk for destroy() or a reaper."""
        self._closed = True
        waits = []
        for sb in self._sandboxes.values():
            if sb.shell is not None and sb.shell.protocol.transport is not None:
                sb.shell.protocol.transport.close()
                waits.append(asyncio.shield(sb.shell.protocol.exited))
            if sb.rootfd >= 0:
                os.close(sb.rootfd)
                sb.rootfd = -1
        self._sandboxes.clear()
        if waits:
            await asyncio.wait(waits, timeout=5.0)


__all__ = ["LocalBackend", "host_problem", "parse_image_ref"]

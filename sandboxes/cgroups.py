"""Per-sandbox cgroups: memory, process-count and CPU limits on cgroup v1 or v2.

v1 (a hierarchy per controller): a ``forkyard/<name>`` group in each of the
``memory``, ``pids`` and ``cpu`` hierarchies. v2 (one unified tree): one
``forkyard/<name>`` group, with ``+memory +pids +cpu`` enabled in the parents'
``cgroup.subtree_control``. The ``forkyard`` parent is shared and never removed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from sandboxes.base import Resources
from sandboxes.errors import SandboxError

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Controllers we use: one v1 hierarchy each (``<root>/<name>``), or these names in v2.
CONTROLLERS = ("memory", "pids", "cpu")
#: Without these a sandbox could eat the host's memory or process table.
REQUIRED_CONTROLLERS = ("memory", "pids")
CPU_PERIOD_US = 100_000
DEFAULT_PARENT = "forkyard"


class CgroupError(SandboxError):
    """The host's cgroups could not be set up for a sandbox."""


def cgroup_version(root: Path = CGROUP_ROOT) -> int:
    """Return 2 for a unified (v2) host, 1 for a v1 (or hybrid) host, 0 if neither is usable."""
    root = Path(root)
    if (root / "cgroup.controllers").exists():
        return 2
    if any((root / ctl / "cgroup.procs").exists() for ctl in CONTROLLERS):
        return 1
    return 0


def available_controllers(root: Path = CGROUP_ROOT) -> list[str]:
    """Return which of memory, pids and cpu this host's cgroups offer."""
    root = Path(root)
    version = cgroup_version(root)
    if version == 2:
        offered = (root / "cgroup.controllers").read_text().split()
        return [c for c in CONTROLLERS if c in offered]
    if version == 1:
        return [c for c in CONTROLLERS if (root / c / "cgroup.procs").exists()]
    return []


#: mount(2) flags of the per-mount options a remount must restate (it resets the ones it leaves out).
_MOUNT_FLAGS = {"ro": 0x1, "nosuid": 0x2, "nodev": 0x4, "noexec": 0x8, "noatime": 0x400, "nodiratime": 0x800,
                "relatime": 0x200000, "strictatime": 0x1000000}  # fmt: skip
_MS_REMOUNT = 0x20
FAVOR_DYNMODS = "favordynmods"


def _mount(target: str, flags: int, data: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"cgroup2", os.fsencode(target), b"cgroup2", flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def favor_dynamic_moves(
    mountinfo: Path = Path("/proc/self/mountinfo"),
    features: Path = Path("/sys/kernel/cgroup/features"),
    mount: Callable[[str, int, str], None] = _mount,
) -> str | None:
    """Remount the host's cgroup2 tree with ``favordynmods``; return its mount point if this changed it.

    Moving a process into a cgroup (every sandbox start does, for its runtime) takes a
    global lock for writing, and unless another move took it a moment before, that waits
    for an RCU grace period: 9-15 ms on an idle 2-core host against 0.3 ms right after
    another move, so a fork that came alone paid it every time. ``favordynmods`` (Linux
    6.0+) keeps that lock where writers do not wait, for a few more atomic operations in
    every fork and exit on the host. It is a flag of the whole hierarchy (on some kernels
    it stays set until reboot) and it works from the cgroup2 mount on a hybrid host too;
    with no cgroup2 mount or a kernel without it, nothing changes and this returns None.

    Raises:
        OSError: the remount failed.
    """
    try:
        offered = features.read_text().split()
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    if FAVOR_DYNMODS not in offered:
        return None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 3 or rest[0] != "cgroup2":
            continue
        target = fields[4].replace("\\040", " ")
        per_mount, options = fields[5].split(","), [o for o in rest[2].split(",") if o not in ("rw", "ro")]
        if FAVOR_DYNMODS in options:
            return None
        flags = _MS_REMOUNT
        for option in per_mount:
            flags |= _MOUNT_FLAGS.get(option, 0)
        mount(target, flags, ",".join([*options, FAVOR_DYNMODS]))
        return target
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


class SandboxCgroup:
    """The cgroup(s) of one sandbox: create(limits), add(pid), pids(), kill_all(), remove()."""

    def __init__(self, name: str, *, root: Path = CGROUP_ROOT, parent: str = DEFAULT_PARENT) -> None:
        self.name = name
        self.root = Path(root)
        self.parent = parent
        self.version = cgroup_version(self.root)
        if self.version == 2:
            self.paths = [self.root / parent / name]
        elif self.version == 1:
            self.paths = [self.root / ctl / parent / name for ctl in available_controllers(self.root)]
        else:
            raise CgroupError(f"no cgroup v1 or v2 hierarchy is mounted at {self.root}")

    @property
    def procs_files(self) -> list[Path]:
        """Return the ``cgroup.procs`` file of each group (write a pid there to add it)."""
        return [p / "cgroup.procs" for p in self.paths]

    def exists(self) -> bool:
        """Tell whether any of this sandbox's groups is still there."""
        return any(p.exists() for p in self.paths)

    def create(self, limits: Resources) -> None:
        """Create the group(s) and apply ``limits``."""
        try:
            if self.version == 2:
                self._create_v2(limits)
            else:
                self._create_v1(limits)
        except OSError as exc:
            raise CgroupError(f"cannot set up cgroup {self.parent}/{self.name}: {exc}") from exc

    def _create_v1(self, limits: Resources) -> None:
        memory = limits.memory_mb * 1024 * 1024
        for path in self.paths:
            path.mkdir(parents=True, exist_ok=True)
            ctl = path.parent.parent.name
            if ctl == "memory":
                _write(path / "memory.limit_in_bytes", str(memory))
                memsw = path / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # no swapping around the limit
                    _write(memsw, str(memory))
            elif ctl == "pids":
                _write(path / "pids.max", str(limits.pids))
            elif ctl == "cpu":
                _write(path / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(path / "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CPU_PERIOD_US))))

    def _enable_controllers(self, directory: Path) -> None:
        available = (self.root / "cgroup.controllers").read_text().split()
        wanted = [c for c in CONTROLLERS if c in available]
        control = directory / "cgroup.subtree_control"
        try:
            enabled = control.read_text().split()
        except OSError:
            enabled = []
        missing = [c for c in wanted if c not in enabled]
        if not missing:
            return
        try:
            _write(control, " ".join(f"+{c}" for c in missing))
        except OSError:
            for c in missing:  # one at a time, so that cpu failing does not lose memory/pids
                try:
                    _write(control, f"+{c}")
                except OSError as exc:
                    if c != "cpu":
                        raise
                    logger.warning("cannot enable the cpu controller in %s: %s", directory, exc)

    def _create_v2(self, limits: Resources) -> None:
        group = self.paths[0]
        parent = group.parent
        if not parent.is_dir():
            parent.mkdir(parents=True, exist_ok=True)
        self._enable_controllers(self.root)
        self._enable_controllers(parent)
        group.mkdir(exist_ok=True)
        _write(group / "memory.max", str(limits.memory_mb * 1024 * 1024))
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", "0")
        _write(group / "pids.max", str(limits.pids))
        try:
            _write(group / "cpu.max", f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        except OSError as exc:  # the cpu controller could not be enabled above
            logger.warning("no CPU limit for cgroup %s: %s", group, exc)

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the group(s)."""
        for procs in self.procs_files:
            _write(procs, str(pid))

    def pids(self) -> list[int]:
        """Return the pids in the group(s); empty once they are gone."""
        found: set[int] = set()
        for procs in self.procs_files:
            try:
                found.update(int(x) for x in procs.read_text().split())
            except FileNotFoundError:
                continue
        return sorted(found)

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every member until the group is empty; return False if some survived."""
        deadline = time.monotonic() + timeout_s
        kill_file = self.paths[0] / "cgroup.kill" if self.version == 2 else None
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                logger.warning("cgroup %s/%s still has processes %s", self.parent, self.name, pids[:10])
                return False
            if kill_file is not None and kill_file.exists():
                try:
                    _write(kill_file, "1")
                except OSError:
                    kill_file = None
            else:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.005)

    def _all_paths(self) -> list[Path]:
        """Return the group's dirs in every hierarchy, deepest first (an OCI runtime may nest its own inside)."""
        tops = list(self.paths)
        if self.version == 1:
            for hierarchy in sorted(self.root.iterdir()):
                candidate = hierarchy / self.parent / self.name
                if candidate not in tops and (hierarchy / "cgroup.procs").exists() and candidate.is_dir():
                    tops.append(candidate)
        found: list[Path] = []
        for top in tops:
            if top.is_dir():
                nested = [Path(d) for d, _, _ in os.walk(top)]
                found += sorted(nested, key=lambda p: len(p.parts), reverse=True)
            else:
                found.append(top)
        return found

    def remove(self, timeout_s: float = 5.0) -> None:
        """Remove the group(s); they must be empty (see kill_all). Missing groups are fine."""
        deadline = time.monotonic() + timeout_s
        for path in self._all_paths():
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    # EBUSY while the last members are being reaped.
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove cgroup {path}: {exc}") from exc
                    time.sleep(0.01)

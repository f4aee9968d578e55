"""The OCI runtime spec of a local sandbox, and the runtimes that run it (crun, runc, runsc).

A local sandbox's shell is started by an audited OCI runtime from Debian over a
``config.json`` generated here, never by hand-made namespaces. What the spec gives,
beyond what Docker gives a container by default:

- a **user namespace**: root inside is :data:`UID_BASE` on the host, an id no host
  user or file has; the data directory is 0700 root, so no unprivileged host user can
  reach a sandbox's files (or run a setuid binary made inside one);
- the **seccomp** filter of :mod:`sandboxes.seccomp` (keyrings, mounts, bpf, new
  namespaces, kernel modules, io_uring... refused);
- masked ``/proc/kcore``, ``/proc/keys``, ``/proc/timer_list``... and read-only
  ``/proc/sys``, ``/proc/sysrq-trigger``, ``/proc/irq``, ``/sys``;
- a minimal ``/dev`` (null, zero, full, random, urandom, tty, pts, shm: no console,
  no host device), ``no_new_privs``, and a rootfs mounted nosuid and nodev;
- capabilities: Docker's default set less ``mknod`` and ``sys_chroot``; none in the
  effective set of a non-root image user; ``oom_score_adj`` 1000 so the kernel's OOM
  killer picks a sandbox before the host's own processes.

The runtime runs in the foreground (``run``, not ``create``/``start``): its stdio are
the persistent shell's pipes, and the shell (pid 1 of the sandbox's pid namespace) is
its child. Cgroups stay Forkyard's own (:mod:`sandboxes.cgroups`), so the runtime is
told to leave them alone.
"""

from __future__ import annotations

import base64
import errno
import functools
import hashlib
import json
import os
import re
import resource
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandboxes.seccomp import seccomp_profile

#: Host uid (and gid) that uid 0 of every local sandbox maps to; ids 0..UID_COUNT-1 map above it.
UID_BASE = 1_000_000
UID_COUNT = 65_536

#: Docker's default capability set, less mknod and sys_chroot.
KEEP_CAPS = (
    "chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
    "net_bind_service", "net_raw", "audit_write", "setfcap",
)  # fmt: skip

#: /proc and /sys files no sandbox may read (Docker's list, and /proc/keys for the keyrings).
MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/key-users",
    "/proc/latency_stats", "/proc/sched_debug", "/proc/scsi", "/proc/timer_list", "/proc/timer_stats",
    "/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/security",
)  # fmt: skip
#: /proc files a sandbox may read but never write.
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

#: Open files per process (at most the host's own hard limit); the pids limit bounds the sandbox's total.
NOFILE_LIMIT = 65_536


def nofile_limit() -> int:
    """Return the open-file limit of a sandbox's processes: :data:`NOFILE_LIMIT`, or the host's hard limit if lower."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return NOFILE_LIMIT if hard == resource.RLIM_INFINITY else min(NOFILE_LIMIT, hard)

#: Runtimes by isolation tier, in order of preference: ``standard`` shares the host's kernel
#: behind namespaces and seccomp; ``gvisor`` puts a user-space kernel between the agent and it.
RUNTIMES: Mapping[str, tuple[str, ...]] = {"standard": ("crun", "runc"), "gvisor": ("runsc",)}
ISOLATION_TIERS = tuple(RUNTIMES)
DEFAULT_ISOLATION = "standard"
#: The Debian package of each runtime.
PACKAGES = {"crun": "crun", "runc": "runc", "runsc": "runsc"}


@dataclass(frozen=True)
class Runtime:
    """One OCI runtime binary: its name (crun, runc, runsc) and path."""

    name: str
    path: str

    def run_argv(self, bundle: str, container_id: str, state_dir: str) -> list[str]:
        """Return the command that runs the bundle's container in the foreground, its state in ``state_dir``."""
        args = [self.path, f"--root={state_dir}"]
        if self.name == "crun":
            args.append("--cgroup-manager=disabled")  # the cgroups are Forkyard's (sandboxes.cgroups)
        elif self.name == "runsc":
            args += self.GVISOR_FLAGS
        return [*args, "run", f"--bundle={bundle}", container_id]

    #: gVisor's flags. The host's cgroups stay Forkyard's. Files go straight to the overlay
    #: upper dir (not into gVisor's in-memory overlay), so snapshots and quotas see them.
    #: Sockets are the host kernel's *inside the sandbox's own network namespace* (gVisor's
    #: "host" network): slirp4netns and the nftables egress rules work as with crun, and a
    #: verifier fork joining that namespace reaches services the agent started.
    GVISOR_FLAGS = ("--ignore-cgroups", "--overlay2=none", "--file-access=shared", "--network=host", "--oci-seccomp")

    #: Host tasks a gVisor sandbox holds per process inside it (its systrap stub process and
    #: threads, ~2.1 measured), and its sentry's own (~25 idle; Go threads grow with load).
    GVISOR_TASKS_PER_PROCESS = 3
    GVISOR_SENTRY_TASKS = 64

    def host_pids(self, pids: int) -> int:
        """Return the host cgroup's ``pids.max`` for a sandbox allowed ``pids`` processes.

        crun and runc: ``pids`` itself. gVisor: the limit is ``RLIMIT_NPROC`` inside (see
        :meth:`adapt_spec`: a fork past it gets EAGAIN, as under a pids cgroup), and the
        host's is a backstop sized for the sentry, which dies when it cannot make a thread:
        with ``pids`` on the host a sandbox of 40 processes (of 64) crashed.
        """
        if self.name != "runsc":
            return pids
        return pids * self.GVISOR_TASKS_PER_PROCESS + self.GVISOR_SENTRY_TASKS

    def adapt_spec(self, spec: dict, *, pids: int) -> None:
        """Adjust a sandbox's ``config.json`` (its ``root.path`` set) to what this runtime needs.

        Only gVisor needs anything: its processes limit as ``RLIMIT_NPROC`` (a sandbox's root
        has no ``CAP_SYS_RESOURCE`` to raise it), the rootfs's /tmp kept on disk, and the
        seccomp rules it cannot answer dropped.
        """
        if self.name != "runsc":
            return
        spec["process"]["rlimits"].append({"type": "RLIMIT_NPROC", "hard": pids, "soft": pids})
        _keep_tmp_on_disk(spec, Path(spec["root"]["path"]))
        # gVisor answers EPERM for every errno rule of a spec's filter, and glibc falls back
        # from clone3 to clone only on ENOSYS; gVisor's own clone3 is ENOSYS already.
        rules = spec["linux"]["seccomp"]["syscalls"]
        rules[:] = [r for r in rules if r.get("errnoRet") != errno.ENOSYS]

    def exec_argv(self, state_dir: str, container_id: str, argv: Sequence[str]) -> list[str]:
        """Return the command that runs ``argv`` as root (with CAP_KILL) in a running container."""
        if self.name != "runsc":
            raise NotImplementedError(f"{self.name}: the local backend reaches its sandboxes from the host")
        return [self.path, f"--root={state_dir}", *self.GVISOR_FLAGS, "exec", "--user=0:0", "--cap=CAP_KILL",
                container_id, *argv]  # fmt: skip


#: crun's annotation for a compiled seccomp filter (base64 BPF): crun loads it instead of compiling the profile.
SECCOMP_BPF_ANNOTATION = "run.oci.seccomp_bpf_data"
#: Largest filter the kernel loads: BPF_MAXINSNS instructions of 8 bytes.
_MAX_BPF_BYTES = 4096 * 8


class CompiledSeccomp:
    """The filter crun compiled from each seccomp profile, handed back to it for later sandboxes.

    crun compiles a spec's ``linux.seccomp`` with libseccomp at every start (about 2 ms of a
    15 ms start here) and writes the program it loads to ``<state dir>/<container>/seccomp.bpf``.
    The first sandbox of a profile is started as usual; its program, crun's own output for
    that profile, is kept (in memory, by the profile's digest) and passed to later sandboxes
    in :data:`SECCOMP_BPF_ANNOTATION`, the profile staying in the spec. crun only; the state
    dir is root's alone, out of every sandbox's reach.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.enabled = runtime.name == "crun"
        self._programs: dict[str, str] = {}

    def annotate(self, spec: dict) -> str | None:
        """Add the compiled filter of ``spec``'s profile if known; else return the profile's key, to :meth:`learn`."""
        profile = spec.get("linux", {}).get("seccomp")
        if not self.enabled or profile is None:
            return None
        key = hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()
        program = self._programs.get(key)
        if program is None:
            return key
        spec.setdefault("annotations", {})[SECCOMP_BPF_ANNOTATION] = program
        return None

    def learn(self, key: str, container_state: Path) -> None:
        """Keep the filter crun compiled for profile ``key`` (from a started container's state dir), if sound."""
        if key in self._programs:
            return
        try:
            program = (container_state / "seccomp.bpf").read_bytes()
        except OSError:
            return  # compiled again next time
        if program and len(program) % 8 == 0 and len(program) <= _MAX_BPF_BYTES:
            self._programs[key] = base64.b64encode(program).decode("ascii")


def _keep_tmp_on_disk(spec: dict, rootfs: Path) -> None:
    """Bind the rootfs's own ``/tmp`` over itself: gVisor would otherwise put an empty /tmp in memory.

    Files there would then escape snapshots, forks and the disk quota. Only a real
    directory is bound (the host resolves the source: never follow a sandbox's symlink).
    """
    tmp = rootfs / "tmp"
    try:
        if not stat.S_ISDIR(os.lstat(tmp).st_mode):
            return
    except OSError:
        return
    spec["mounts"].append({"destination": "/tmp", "type": "bind", "source": str(tmp), "options": ["rbind"]})


@functools.lru_cache(maxsize=8)
def _version_line(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


def crun_cgroup_problem(cgroup_root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """Return why crun refuses this host's cgroups (a v1 host whose v2 tree holds controllers), or None.

    crun 1.8 refuses such hybrid hosts even when it is told to leave cgroups alone.
    """
    controllers = Path(cgroup_root) / "unified" / "cgroup.controllers"
    try:
        held = controllers.read_text().split()
    except OSError:
        return None
    if not held:
        return None
    first = held[0]
    return (
        f"crun refuses this hybrid cgroup host while the v2 tree holds the {' '.join(held)} controller(s); "
        f"bind them to v1 (mkdir {cgroup_root}/{first} && mount -t cgroup -o {first} cgroup {cgroup_root}/{first}) "
        "as .ci/bootstrap does"
    )


#: The oldest gVisor release (its date) whose statx accepts what Debian 12's coreutils pass
#: (``AT_NO_AUTOMOUNT``): with Debian 12's own runsc (2022-12-19) every ``ls`` fails with EINVAL.
MIN_RUNSC_RELEASE = 20240101


def runsc_problem(path: str) -> str | None:
    """Return why the runsc at ``path`` is too old to run Debian userlands, or None."""
    line = _version_line(path)
    found = re.search(r"(20\d{6})", line)
    if found is None or int(found.group(1)) >= MIN_RUNSC_RELEASE:
        return None
    return (
        f"{path} is gVisor {found.group(1)}, older than {MIN_RUNSC_RELEASE}: its statx refuses what Debian's "
        "coreutils pass, so ls and stat fail in every sandbox; install Debian 13's runsc package "
        "(one static binary; .ci/bootstrap does)"
    )


def _installed(name: str) -> str | None:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.access(p, os.X_OK)), None
    )
    return path if path and _version_line(path) else None


def find_runtime(
    isolation: str, *, preferred: str | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")
) -> Runtime | None:
    """Return the first usable runtime of tier ``isolation`` (``preferred`` alone if given), or None."""
    names = list(RUNTIMES.get(isolation, ()))
    if preferred:
        names = [preferred] if preferred in names else []
    for name in names:
        path = _installed(name)
        if path is None:
            continue
        if name == "crun" and crun_cgroup_problem(cgroup_root) is not None:
            continue
        if name == "runsc" and runsc_problem(path) is not None:
            continue
        return Runtime(name=name, path=path)
    return None


def runtime_problem(
    isolation: str, *, preferred: str | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")
) -> str | None:
    """Return one sentence saying why tier ``isolation`` cannot run here, or None."""
    if isolation not in RUNTIMES:
        return f"unknown isolation tier {isolation!r}; choose one of {', '.join(ISOLATION_TIERS)}"
    if preferred and preferred not in RUNTIMES[isolation]:
        return f"runtime {preferred!r} is not one of the {isolation!r} tier's ({', '.join(RUNTIMES[isolation])})"
    if find_runtime(isolation, preferred=preferred, cgroup_root=cgroup_root) is not None:
        return None
    names = [preferred] if preferred else list(RUNTIMES[isolation])
    if "crun" in names and _installed("crun") and len(names) == 1:
        return crun_cgroup_problem(cgroup_root)
    if names == ["runsc"]:
        runsc = _installed("runsc")
        problem = runsc_problem(runsc) if runsc else None
        if problem:
            return f"the local sandbox backend's {isolation!r} isolation cannot use {problem}"
        how = "apt-get install runsc, from Debian 13; Debian 12's is too old"
    else:
        how = "apt-get install " + " or ".join(PACKAGES[n] for n in names)
    return (
        f"the local sandbox backend's {isolation!r} isolation needs the OCI runtime {' or '.join(names)}, "
        f"which is not installed ({how})"
    )


def user_namespace_problem() -> str | None:
    """Return one sentence saying why this kernel cannot give sandboxes a user namespace, or None."""
    try:
        with open("/proc/sys/user/max_user_namespaces") as fh:
            if int(fh.read().strip() or 0) <= 0:
                return "the local sandbox backend needs user namespaces, and user.max_user_namespaces is 0"
    except (OSError, ValueError):
        return "the local sandbox backend needs user namespaces, which this kernel does not offer"
    return None


def container_spec(
    *,
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    uid: int = 0,
    gid: int = 0,
    additional_gids: Sequence[int] = (),
    hostname: str,
    network_namespace: str | None,
    user_namespace: str | None = None,
    private_network: bool = True,
    shm_bytes: int = 64 << 20,
    cgroups_path: str | None = None,
    resolv_conf: str | None = None,
) -> dict:
    """Return the OCI ``config.json`` of a sandbox whose root is the bundle's ``rootfs``.

    Args:
        network_namespace: a path (``/proc/<pid>/ns/net``, a bind-mounted netns) to join;
            None with ``private_network`` makes a fresh one with only a loopback.
        user_namespace: a user namespace to join (the one owning ``network_namespace``)
            instead of making one; its id mapping is then that namespace's.
        resolv_conf: a host file bind-mounted on ``/etc/resolv.conf`` (a networked sandbox's resolver).
        cgroups_path: where a runtime that manages cgroups (runc) puts its own, in every
            hierarchy; inside the sandbox's cgroup, so they go with it.
        private_network: False keeps the runtime's network namespace (the host's): never
            for a sandbox; :mod:`sandboxes.network` gives sandboxes their outbound network.
    """
    caps = [f"CAP_{c.upper()}" for c in KEEP_CAPS]
    nofile = nofile_limit()
    namespaces: list[dict] = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    namespaces.append({"type": "user", "path": user_namespace} if user_namespace else {"type": "user"})
    if network_namespace is not None:
        namespaces.append({"type": "network", "path": network_namespace})
    elif private_network:
        namespaces.append({"type": "network"})
    mapping = [{"containerID": 0, "hostID": UID_BASE, "size": UID_COUNT}]
    spec: dict = {
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs", "readonly": False},
        "hostname": hostname,
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": list(additional_gids)},
            "args": list(args),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": cwd,
            "capabilities": {
                "bounding": caps,
                "effective": caps if uid == 0 else [],
                "permitted": caps if uid == 0 else [],
                "inheritable": [],
                "ambient": [],
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
            "oomScoreAdj": 1000,
        },
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_bytes}"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": {
            "namespaces": namespaces,
            "uidMappings": mapping,
            "gidMappings": mapping,
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": seccomp_profile(),
        },
    }
    if resolv_conf is not None:
        spec["mounts"].append(
            {"destination": "/etc/resolv.conf", "type": "bind", "source": resolv_conf,
             "options": ["rbind", "nosuid", "nodev", "noexec"]}
        )  # fmt: skip
    if user_namespace:
        del spec["linux"]["uidMappings"], spec["linux"]["gidMappings"]
    if cgroups_path:
        spec["linux"]["cgroupsPath"] = cgroups_path
    return spec


__all__ = [
    "SECCOMP_BPF_ANNOTATION",
    "CompiledSeccomp",
    "DEFAULT_ISOLATION",
    "ISOLATION_TIERS",
    "KEEP_CAPS",
    "MASKED_PATHS",
    "READONLY_PATHS",
    "UID_BASE",
    "UID_COUNT",
    "Runtime",
    "container_spec",
    "crun_cgroup_problem",
    "find_runtime",
    "runsc_problem",
    "runtime_problem",
    "user_namespace_problem",
]

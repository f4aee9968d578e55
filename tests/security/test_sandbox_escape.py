"""The escape suite, sandbox level: a hostile agent's attempts, each against every backend.

Every test is one attempt that a real agent could make through ``bash``; it asserts the
attempt fails *and* that its effect is absent (not merely that a command exited
non-zero), then that the backend still serves a fresh sandbox. The escape suite's
results table in the README lists these by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest

from sandboxes.base import Resources, SandboxSpec
from sandboxes.oci import NOFILE_LIMIT, UID_BASE
from tests.sandboxes.conftest import BACKENDS, BASE_REF, GVISOR, fresh_backend

pytestmark = pytest.mark.timeout(240)

_libc = ctypes.CDLL(None, use_errno=True)
SYS_ADD_KEY, SYS_KEYCTL = 248, 250
KEY_SPEC_USER_KEYRING = -4
KEYCTL_INVALIDATE = 21


async def run(backend, sid: str, command: str, timeout_s: float = 60):
    return await backend.exec(sid, command, timeout_s=timeout_s)


def py(code: str) -> str:
    """Return a shell command running ``code`` with the sandbox's python3."""
    return f"python3 -c {shlex.quote(code)}"


# ------------------------------------------------------------ /proc/sys and the kernel


@pytest.mark.parametrize(
    "path",
    [
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/kernel/panic",
        "/proc/sys/kernel/pid_max",
        "/proc/sys/vm/overcommit_memory",
        "/proc/sys/vm/drop_caches",
        "/proc/sys/fs/file-max",
        "/proc/sysrq-trigger",
    ],
)
async def test_proc_sys_is_read_only(backend, still_serving, path):
    host = Path(path).read_text() if path != "/proc/sysrq-trigger" and os.access(path, os.R_OK) else None
    info = await backend.create(SandboxSpec(image=BASE_REF))
    payload = "|/tmp/pwn.sh" if path.endswith("core_pattern") else "1"
    r = await run(backend, info.id, f"echo {shlex.quote(payload)} > {path}")
    assert r.exit_code != 0
    # gVisor's own /proc/sys answers EPERM or EIO; the host's value is what must not change.
    refusals = ("Read-only file system", "Permission denied", "Operation not permitted", "Input/output error")
    refusals += () if Path(path).exists() else ("No such file",)
    assert any(word in r.stderr for word in refusals), r.stderr
    if host is not None:
        assert Path(path).read_text() == host
    await still_serving()


async def test_core_pattern_cannot_run_a_host_command(backend, still_serving, tmp_path):
    """The classic: point core_pattern at a script in the sandbox and crash a process."""
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    info = await backend.create(SandboxSpec(image=BASE_REF))
    marker = tmp_path / "pwned"
    script = f"#!/bin/sh\ntouch {marker}\n"
    await backend.write_file(info.id, "/tmp/x.sh", script.encode(), mode=0o755)
    await run(backend, info.id, "echo '|/tmp/x.sh' > /proc/sys/kernel/core_pattern; ulimit -c unlimited; sh -c 'kill -SEGV $$'")
    assert Path("/proc/sys/kernel/core_pattern").read_text() == before
    assert not marker.exists()
    await still_serving()


# ------------------------------------------------------------------------ keyrings


async def test_host_keyring_is_out_of_reach(backend, still_serving):
    name = f"forkyard-escape-{uuid.uuid4().hex[:8]}".encode()
    key = _libc.syscall(SYS_ADD_KEY, b"user", name, b"host-secret", 11, KEY_SPEC_USER_KEYRING)
    assert key > 0, os.strerror(ctypes.get_errno())
    try:
        info = await backend.create(SandboxSpec(image=BASE_REF))
        r = await run(backend, info.id, f"cat /proc/keys 2>/dev/null | grep -c {name.decode()} || true")
        assert r.stdout.strip() in ("", "0")
        search = py(
            "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            f"print(libc.syscall(250, 10, -4, b'user', {name!r}, 0), ctypes.get_errno())"
        )
        r = await run(backend, info.id, search)
        found, err = r.stdout.split()
        assert int(found) < 0 and int(err) != 0, r.stdout
        add = py(
            "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            "print(libc.syscall(248, b'user', b'forkyard-from-sandbox', b'x', 1, -4), ctypes.get_errno())"
        )
        r = await run(backend, info.id, add)
        made, err = r.stdout.split()
        assert int(made) < 0 and int(err) != 0, r.stdout
        assert b"forkyard-from-sandbox" not in Path("/proc/keys").read_bytes()
    finally:
        _libc.syscall(SYS_KEYCTL, KEYCTL_INVALIDATE, key)
    await still_serving()


# ---------------------------------------------------------- devices, mounts, namespaces


async def test_mknod_of_a_host_disk_is_refused(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF))
    r = await run(backend, info.id, "mknod /tmp/disk b 253 0 && echo made; head -c 512 /tmp/disk | wc -c")
    assert "made" not in r.stdout and r.stdout.strip() == "0", r
    await still_serving()


async def test_dev_holds_no_host_device(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF))
    r = await run(backend, info.id, "ls -1 /dev; test -e /dev/console && echo console-present; ls /dev/[sv]d* /dev/nvme* /dev/mem /dev/kmsg 2>/dev/null | wc -l")
    names = set(r.stdout.split())
    assert "console-present" not in names
    assert r.stdout.rstrip().endswith("0")
    assert {"null", "zero", "urandom", "pts", "shm"} <= names
    await still_serving()


async def test_mount_is_refused(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF))
    r = await run(backend, info.id, "mount -t tmpfs none /mnt && echo mounted; mount --bind / /mnt && echo bound; grep -c ' /mnt ' /proc/mounts")
    assert "mounted" not in r.stdout and "bound" not in r.stdout
    assert r.stdout.strip().endswith("0")
    await still_serving()


async def test_new_user_namespace_cannot_mount(backend, still_serving):
    """``unshare -U`` would hand the agent every capability in a namespace of its own."""
    info = await backend.create(SandboxSpec(image=BASE_REF))
    r = await run(backend, info.id, "unshare -Urm sh -c 'mount -t tmpfs none /mnt && echo mounted-in-userns'; echo rc=$?")
    assert "mounted-in-userns" not in r.stdout and "rc=0" not in r.stdout, r
    clone = py(
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "print(libc.unshare(0x10000000), ctypes.get_errno())"
    )
    r = await run(backend, info.id, clone)
    rc, err = r.stdout.split()
    assert int(rc) == -1 and int(err) != 0
    await still_serving()


async def test_host_processes_are_invisible_and_untraceable(backend, still_serving):
    host_pid = os.getpid()
    info = await backend.create(SandboxSpec(image=BASE_REF))
    r = await run(backend, info.id, "ls /proc | grep -c '^[0-9]'")
    assert int(r.stdout) < 10  # only the sandbox's own processes
    attach = py(
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        f"print(libc.ptrace(16, {host_pid}, 0, 0), ctypes.get_errno())"
    )
    r = await run(backend, info.id, f"kill -0 {host_pid} 2>/dev/null && echo signalled; {attach}")
    assert "signalled" not in r.stdout
    rc, err = r.stdout.split()[-2:]
    assert int(rc) == -1 and int(err) != 0
    await still_serving()


async def test_proc_1_root_is_the_sandbox_root(backend, still_serving, tmp_path):
    marker = Path("/tmp") / f"forkyard-host-marker-{uuid.uuid4().hex[:8]}"
    marker.write_text("host")
    try:
        info = await backend.create(SandboxSpec(image=BASE_REF))
        r = await run(backend, info.id, f"for p in /proc/[0-9]*; do cat $p/root{marker} 2>/dev/null; done; echo done")
        assert "host" not in r.stdout and r.stdout.endswith("done\n")
    finally:
        marker.unlink()
    await still_serving()


# ------------------------------------------------------------------ the data directory


def _host_copies(backend, sid: str, inner: str) -> list[Path]:
    """Return where the host sees a sandbox's file (upper dir, merged mount)."""
    if backend.name == "local":
        upper = backend._disk_dir(sid) / "upper"
        return [upper / inner.lstrip("/"), backend._merged_dir(sid) / inner.lstrip("/")]
    import docker

    client = docker.from_env()
    try:
        data = client.api.inspect_container(sid)["GraphDriver"]["Data"]
    finally:
        client.close()
    return [Path(data[k]) / inner.lstrip("/") for k in ("UpperDir", "MergedDir") if data.get(k)]


async def test_setuid_binary_made_inside_is_no_host_root(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF))
    r = await run(backend, info.id, "cp /bin/bash /tmp/rootbash && chmod 4755 /tmp/rootbash && echo ok")
    assert r.stdout == "ok\n"
    copies = _host_copies(backend, info.id, "/tmp/rootbash")
    assert copies
    for path in copies:
        if backend.name == "local":
            assert path.stat().st_uid == UID_BASE  # root inside is nobody's uid outside
        # An unprivileged host user can neither reach it nor get euid 0 from it.
        # (Through a shell: setpriv itself would find the program while still root.)
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/bin/sh", "-c",
             f"{shlex.quote(str(path))} -p -c 'id -u'"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert proc.returncode != 0 or proc.stdout.strip() != "0", (path, proc.returncode, proc.stdout, proc.stderr)
    await still_serving()


# ------------------------------------------------------------------------- network


@contextlib.asynccontextmanager
async def host_listener(host: str = "127.0.0.1"):
    """Yield the port of a TCP server on the host (127.0.0.1 by default) that records who connected."""
    seen: list[str] = []

    async def handle(reader, writer):
        seen.append("connected")
        writer.write(b"host-secret\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, host, 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("network", [False, True], ids=["offline", "network"])
async def test_host_loopback_is_unreachable(backend, still_serving, network):
    async with host_listener() as (port, seen):
        info = await backend.create(SandboxSpec(image=BASE_REF, network=network))
        probe = py(
            "import socket\n"
            "try:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=3); print(s.recv(64))\n"
            "except OSError as exc:\n"
            "    print('refused', exc)"
        )
        r = await run(backend, info.id, probe)
        assert "host-secret" not in r.stdout and "refused" in r.stdout, r
        assert seen == []
    await still_serving()


@pytest.mark.parametrize("kind", [*BACKENDS, GVISOR])
async def test_host_services_on_its_own_addresses_are_unreachable_even_on_an_allowed_port(
    kind, created, backend_root, node_name
):
    """A host service bound to 0.0.0.0 answers on the host's public address too; no sandbox may reach it."""
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()[0]
    async with host_listener("0.0.0.0") as (port, seen):
        # The port is one the egress policy allows: only the host-address rule stands in the way.
        async for backend in fresh_backend(kind, created, backend_root, node_name, egress_ports=[port, 443]):
            info = await backend.create(SandboxSpec(image=BASE_REF, network=True))
            probe = py(
                "import socket\n"
                f"for host in ('{host_ip}', '172.17.0.1'):\n"
                "    try:\n"
                f"        s = socket.create_connection((host, {port}), timeout=3); print(host, s.recv(64))\n"
                "    except OSError as exc:\n"
                "        print(host, 'refused', exc)"
            )
            r = await run(backend, info.id, probe)
            assert "host-secret" not in r.stdout and r.stdout.count("refused") == 2, r
        assert seen == []


# ----------------------------------------------------------------------- resources


async def test_fork_bomb_is_contained(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF, resources=Resources(pids=64)))
    await run(backend, info.id, "bomb() { bomb | bomb & }; bomb", timeout_s=5)
    await still_serving()
    r = await run(backend, info.id, "echo back", timeout_s=30)
    assert r.stdout.endswith("back\n") or r.exit_code != 0  # the sandbox itself may stay wedged


async def test_memory_bomb_is_contained(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF, resources=Resources(memory_mb=128)))
    r = await run(backend, info.id, py("x = []\nwhile True: x.append(bytearray(16 << 20))"), timeout_s=60)
    assert r.exit_code != 0 and not r.timed_out
    await still_serving()


async def test_cpu_hog_leaves_the_host_serving(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF, resources=Resources(cpus=0.5)))
    await run(backend, info.id, "for i in 1 2 3 4 5 6 7 8; do (while :; do :; done) & done; echo spinning")
    try:
        # 8 spinners under a quota of half a CPU: the sandbox gets no more than its share.
        r = await run(backend, info.id, "sleep 2; ps -o times= -p $(pgrep -d, -f 'while') 2>/dev/null | awk '{s+=$1} END {print s+0}'")
        await still_serving()
        used = float(r.stdout.strip() or 0)
        assert used <= 0.5 * 4 + 1.5, f"{used} CPU seconds in ~2-4 s at 0.5 CPUs"
    finally:
        await run(backend, info.id, "pkill -f 'while' || true")


async def test_open_files_are_bounded(backend, still_serving):
    info = await backend.create(SandboxSpec(image=BASE_REF))
    hog = py(
        "import os\nfds = []\n"
        "try:\n"
        f"    for _ in range({NOFILE_LIMIT} + 1000): fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "    print('unbounded', len(fds))\n"
        "except OSError as exc:\n"
        "    print('bounded', len(fds), exc.errno)"
    )
    r = await run(backend, info.id, hog, timeout_s=60)
    assert r.stdout.startswith("bounded"), r
    assert int(r.stdout.split()[1]) <= NOFILE_LIMIT
    await still_serving()


async def test_disk_fill_stops_at_the_sandbox_quota(backend, still_serving, request):
    if backend.name == "docker":
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="this engine's overlay2 on ext4 cannot limit a container's disk "
                                "(test_docker_disk_quota runs a btrfs engine that can)"))
    info = await backend.create(SandboxSpec(image=BASE_REF, resources=Resources(disk_mb=64)))
    r = await run(backend, info.id, "dd if=/dev/zero of=/tmp/fill bs=1M count=256 2>&1; sync; "
                                    "du -sm /tmp/fill | cut -f1", timeout_s=120)
    assert "Disk quota exceeded" in r.stdout or "No space left" in r.stdout, r
    assert int(r.stdout.split()[-1]) <= 64
    # The sandbox still runs commands once full, and frees its space when it is gone.
    assert (await run(backend, info.id, "rm /tmp/fill && echo freed")).stdout == "freed\n"
    await still_serving()


# ------------------------------------------------------------ warm pools


async def test_a_pooled_sandbox_carries_nothing_from_another_claim(backend, still_serving):
    """An agent plants files, shared memory and a process, hoping the next episode's pooled sandbox inherits them."""
    from sandboxes.base import LABEL_OWNER
    from workers.pool import PoolPolicy, WarmPool

    pool = WarmPool(backend, PoolPolicy(max_idle=2, headroom=2.0))
    spec = SandboxSpec(image=BASE_REF, labels={LABEL_OWNER: "ep_hostile"})
    try:
        await backend.destroy((await pool.create(spec)).id)  # a miss: the key now wants 2
        for _ in range(600):
            await pool.reconcile()
            if pool.stats()["idle"] == 2 and pool.stats()["filling"] == 0:
                break
            await asyncio.sleep(0.05)
        hostile = await pool.create(spec)
        plant = ("echo planted > /tmp/plant; echo planted > /dev/shm/plant; echo planted > /root/plant; "
                 "(exec -a forkyard-plant sleep 600) >/dev/null 2>&1 & echo started")
        assert (await run(backend, hostile.id, plant)).stdout.strip() == "started"
        victim = await pool.create(SandboxSpec(image=BASE_REF, labels={LABEL_OWNER: "ep_victim"}))
        assert pool.stats()["hits"] == 2 and victim.id != hostile.id
        look = ("cat /tmp/plant /dev/shm/plant /root/plant 2>&1; "
                "grep -l 'forkyard-pla[n]t' /proc/[0-9]*/cmdline 2>/dev/null | wc -l")
        planted = await run(backend, hostile.id, look)  # the probe does see a plant where there is one
        assert planted.stdout.count("planted") == 3 and planted.stdout.strip().endswith("1"), planted.stdout
        probe = await run(backend, victim.id, look)
        assert "planted" not in probe.stdout and probe.stdout.strip().endswith("0"), probe.stdout
        await backend.destroy(hostile.id)
        await backend.destroy(victim.id)
    finally:
        await pool.aclose()

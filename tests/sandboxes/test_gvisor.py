"""The local backend's gVisor tier: what runsc does differently from crun, and must not change.

gVisor runs the sandbox's processes inside its own kernel, so the host sees two runtime
processes, not the sandbox's; files must still land in the overlay (snapshots, forks,
quotas), host-written files must be seen at once, timeouts must kill only the command,
and the network rules of the standard tier must hold.
"""

from __future__ import annotations

import asyncio
import shlex

import pytest

from sandboxes import oci
from sandboxes.base import Resources, SandboxSpec
from tests.sandboxes.conftest import (
    BASE_REF,
    local_backend,
)

pytestmark = [
    pytest.mark.local,
    pytest.mark.skipif(oci.runtime_problem("gvisor") is not None, reason=str(oci.runtime_problem("gvisor"))),
]

SPEC = SandboxSpec(image=BASE_REF)


@pytest.fixture
async def gv(backend_root, base_rootfs, node_name):
    """A gVisor-tier LocalBackend with the base image; checks that nothing is left."""
    async for backend in local_backend(backend_root, base_rootfs, node_name, isolation="gvisor"):
        yield backend


async def test_runs_in_gvisors_kernel_as_the_unprivileged_host_range(gv):
    assert gv.runtime.name == "runsc"
    info = await gv.create(SPEC)
    r = await gv.exec(info.id, "uname -r; id -u; ls / >/dev/null && echo ls-ok; echo data > /root/f")
    release, uid, ls_ok = r.stdout.splitlines()
    assert uid == "0" and ls_ok == "ls-ok", r  # Debian's coreutils work (statx)
    assert release != __import__("platform").release()  # not the host's kernel
    upper = gv._disk_dir(info.id) / "upper" / "root" / "f"
    assert upper.read_text() == "data\n" and upper.stat().st_uid == oci.UID_BASE


async def test_files_in_tmp_are_on_disk_and_survive_a_fork(gv):
    """gVisor would put an empty /tmp in memory: files there would miss snapshots and quotas."""
    info = await gv.create(SPEC)
    await gv.exec(info.id, "echo kept > /tmp/k; cd /tmp; export X=1")
    assert (gv._disk_dir(info.id) / "upper" / "tmp" / "k").read_text() == "kept\n"
    snap = await gv.snapshot(info.id)
    (branch,) = await gv.restore(snap, 1)
    r = await gv.exec(branch.id, "cat /tmp/k; pwd; echo $X")
    assert r.stdout == "kept\n/tmp\n1\n", r


async def test_a_file_the_host_writes_is_seen_after_a_failed_lookup(gv):
    """The verifier's /tests arrive from the host after the agent may have looked for them."""
    info = await gv.create(SPEC)
    assert (await gv.exec(info.id, "ls /tests")).exit_code != 0
    await gv.write_file(info.id, "/tests/test.sh", b"#!/bin/bash\necho ran\n", mode=0o755)
    assert (await gv.exec(info.id, "/tests/test.sh")).stdout == "ran\n"


async def test_timeout_kills_the_command_not_the_shell_or_earlier_services(gv):
    info = await gv.create(SPEC)
    await gv.exec(info.id, "(sleep 300 &) ; echo started")
    await asyncio.sleep(0.05)  # a step later (a policy call at least), as an agent would
    r = await gv.exec(info.id, "sleep 100; echo never", timeout_s=1)
    assert r.timed_out and "never" not in r.stdout, r
    r = await gv.exec(info.id, "while :; do :; done", timeout_s=1)
    assert r.timed_out, r
    r = await gv.exec(info.id, "echo alive; ps -eo args | grep -c '^sleep 300'; ps -eo args | grep -c '^sleep 100'")
    assert r.stdout == "alive\n1\n0\n", r  # the earlier background process lives on, the timed-out one is gone


async def test_threads_work_and_namespaces_are_refused(gv):
    """gVisor answers EPERM for every errno rule of the spec's seccomp filter; glibc needs ENOSYS for clone3."""
    info = await gv.create(SPEC)
    r = await gv.exec(info.id, "python3 -c 'import threading; t = threading.Thread(target=print, args=(\"thread\",)); "
                               "t.start(); t.join()'; unshare -U true 2>&1 || echo refused")
    assert r.stdout.splitlines()[0] == "thread" and "refused" in r.stdout, r


async def test_network_dns_filter_and_a_verifier_fork_sharing_it(gv):
    info = await gv.create(SandboxSpec(image=BASE_REF, network=True))
    r = await gv.exec(info.id, "cat /etc/resolv.conf; "
                               "(cd /tmp && python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 &); "
                               "python3 -c 'import socket; s = socket.socket(); s.settimeout(2); "
                               "print(s.connect_ex((\"10.0.2.2\", 6379)))'", timeout_s=30)  # fmt: skip
    assert r.stdout.splitlines()[0] == "nameserver 10.0.2.3", r
    assert r.stdout.splitlines()[-1] != "0", r  # the host (slirp's gateway) is dropped
    snap = await gv.snapshot(info.id)
    (verifier,) = await gv.restore(snap, 1, spec=SandboxSpec(image=BASE_REF, network_of=info.id))
    fetch = ("for i in $(seq 50); do python3 -c 'import urllib.request; "
             "print(urllib.request.urlopen(\"http://127.0.0.1:8123/\", timeout=2).status)' 2>/dev/null && break; "
             "sleep 0.2; done")  # fmt: skip
    r = await gv.exec(verifier.id, fetch, timeout_s=30)
    assert r.stdout.strip() == "200", r


async def test_memory_limit_holds_for_gvisors_kernel(gv):
    """The host's memory cgroup holds gVisor's kernel: past the limit the whole sandbox is killed, then restarted."""
    info = await gv.create(SandboxSpec(image=BASE_REF, resources=Resources(memory_mb=256)))
    hog = "python3 -c 'b = bytearray(1 << 30); b[::4096] = b\"x\" * (1 << 18); print(\"filled\")'"
    r = await gv.exec(info.id, hog, timeout_s=60)
    assert r.exit_code != 0 and "filled" not in r.stdout, r
    assert (await gv.exec(info.id, "echo after")).stdout == "after\n"


async def test_pids_limit_counts_the_sandboxs_processes_not_gvisors_threads(gv):
    """The host sees gVisor's kernel threads and stub processes (~2 per process inside), not the processes.

    With the limit on the host alone, 40 sleeps of a 64-process sandbox killed gVisor's
    kernel. Inside, the limit is RLIMIT_NPROC: 48 processes run, the next forks get EAGAIN
    (as under a pids cgroup) and the sandbox keeps serving.
    """
    info = await gv.create(SandboxSpec(image=BASE_REF, resources=Resources(pids=64)))
    many = "for i in $(seq 48); do sleep 30 & done; sleep 1; pgrep -c sleep"
    r = await gv.exec(info.id, many, timeout_s=30)
    assert r.stdout.strip() == "48", r
    fork_on = (
        "import os, time\n"
        "for n in range(100):\n"
        "    try:\n"
        "        if os.fork() == 0: time.sleep(30); os._exit(0)\n"
        "    except BlockingIOError: print('EAGAIN after', n); break"
    )
    r = await gv.exec(info.id, f"python3 -c {shlex.quote(fork_on)}", timeout_s=60)
    assert r.stdout.startswith("EAGAIN after") and int(r.stdout.split()[-1]) < 64 - 48, r
    r = await gv.exec(info.id, "pkill sleep; ulimit -Hu unlimited || echo refused", timeout_s=30)
    assert "refused" in r.stdout + r.stderr, r  # root inside has no CAP_SYS_RESOURCE to lift it
    assert (await gv.exec(info.id, "echo after")).stdout == "after\n"

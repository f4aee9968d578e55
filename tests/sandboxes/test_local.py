"""What only the ``local`` backend has: host checks, cgroup layouts, layers, orphans, confinement."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import tempfile
import uuid
from pathlib import Path

import pytest

from sandboxes import fs, local, oci
from sandboxes.backends import create_backend
from sandboxes.base import ImageConfig, Resources, SandboxSpec, SandboxState
from sandboxes.cgroups import FAVOR_DYNMODS, SandboxCgroup, cgroup_version, favor_dynamic_moves
from sandboxes.errors import BackendUnavailableError, SandboxCrashedError, SandboxError
from sandboxes.local import LocalBackend
from sandboxes.network import EgressPolicy, list_ruleset
from tests.sandboxes.conftest import (
    BASE_CONFIG,
    BASE_REF,
    local_backend,
    local_leftovers,
)

pytestmark = pytest.mark.local

SPEC = SandboxSpec(image=BASE_REF)


@pytest.fixture
async def lb(backend_root, base_rootfs, node_name):
    """A LocalBackend with the base image; destroys its sandboxes and checks nothing is left."""
    async for backend in local_backend(backend_root, base_rootfs, node_name):
        yield backend


# ----------------------------------------------------------------- host checks


@pytest.mark.parametrize(
    ("module", "check", "words"),
    [
        (local, "has_overlayfs", "overlayfs"),
        (local, "is_root", "root"),
        (oci, "_installed", "apt-get install crun or runc"),
        (oci, "user_namespace_problem", "user namespaces"),
    ],
)
def test_unavailable_host_is_one_clear_sentence(monkeypatch, backend_root, module, check, words):
    fakes = {
        "_installed": lambda name: None,
        "user_namespace_problem": lambda: "the local sandbox backend needs user namespaces, which this kernel lacks",
    }
    monkeypatch.setattr(module, check, fakes.get(check, lambda: False))
    if check == "user_namespace_problem":
        monkeypatch.setattr(local, check, fakes[check])
    with pytest.raises(BackendUnavailableError) as info:
        LocalBackend(backend_root, "n")
    message = str(info.value)
    assert words in message
    assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message
    with pytest.raises(BackendUnavailableError):
        create_backend("local", node="n", root_dir=backend_root)


def test_missing_pids_controller_is_refused(backend_root, tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "cgroup.procs").write_text("")
    with pytest.raises(BackendUnavailableError, match="pids cgroup controller"):
        LocalBackend(backend_root, "n", cgroup_root=tmp_path)


async def test_create_backend_kinds(backend_root):
    backend = create_backend("local", node="n", root_dir=backend_root)
    try:
        assert isinstance(backend, LocalBackend) and backend.name == "local" and backend.node == "n"
        with pytest.raises(ValueError, match="unknown sandbox backend"):
            create_backend("qemu", node="n", root_dir=backend_root)
    finally:
        await backend.aclose()  # its run dirs under /run/forkyard go with it


# -------------------------------------------------------------------- cgroups


def test_cgroup_v1_layout_and_limits(tmp_path):
    for ctl in ("memory", "pids", "cpu"):
        (tmp_path / ctl).mkdir()
        (tmp_path / ctl / "cgroup.procs").write_text("")
    (tmp_path / "unified").mkdir()  # a hybrid host's empty v2 mount changes nothing
    assert cgroup_version(tmp_path) == 1
    cg = SandboxCgroup("abc", root=tmp_path)
    assert cg.version == 1
    assert cg.paths == [tmp_path / c / "forkyard" / "abc" for c in ("memory", "pids", "cpu")]
    cg.create(Resources(cpus=0.5, memory_mb=128, pids=64))
    assert (tmp_path / "memory/forkyard/abc/memory.limit_in_bytes").read_text() == str(128 << 20)
    assert (tmp_path / "pids/forkyard/abc/pids.max").read_text() == "64"
    assert (tmp_path / "cpu/forkyard/abc/cpu.cfs_quota_us").read_text() == "50000"
    assert (tmp_path / "cpu/forkyard/abc/cpu.cfs_period_us").read_text() == "100000"
    assert cg.procs_files[0] == tmp_path / "memory/forkyard/abc/cgroup.procs"


def test_cgroup_v2_layout_and_limits(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "memory").mkdir()  # a stray dir must not make it look like v1
    assert cgroup_version(tmp_path) == 2
    cg = SandboxCgroup("abc", root=tmp_path)
    assert cg.version == 2 and cg.paths == [tmp_path / "forkyard" / "abc"]
    cg.create(Resources(cpus=2, memory_mb=256, pids=100))
    group = tmp_path / "forkyard" / "abc"
    assert (group / "memory.max").read_text() == str(256 << 20)
    assert (group / "pids.max").read_text() == "100"
    assert (group / "cpu.max").read_text() == "200000 100000"
    for parent in (tmp_path, tmp_path / "forkyard"):
        assert (parent / "cgroup.subtree_control").read_text().split() == ["+memory", "+pids", "+cpu"]


def test_no_cgroups_at_all(tmp_path):
    assert cgroup_version(tmp_path) == 0
    with pytest.raises(SandboxError):
        SandboxCgroup("abc", root=tmp_path)


def test_this_host_cgroup_version_matches_its_mounts():
    expected = 2 if Path("/sys/fs/cgroup/cgroup.controllers").exists() else 1
    assert cgroup_version() == expected


_HYBRID = (
    "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755\n"
    "31 30 0:27 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory\n"
    "41 30 0:38 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)


@pytest.mark.parametrize(
    ("mountinfo", "features", "expected"),
    [
        # A hybrid host: the cgroup2 mount is remounted with its own options kept, and its per-mount
        # flags restated (a remount resets those it leaves out).
        (_HYBRID, "nsdelegate\nfavordynmods\n",
         ("/sys/fs/cgroup/unified", 0x20 | 0x2 | 0x4 | 0x8 | 0x200000, "nsdelegate,memory_recursiveprot,favordynmods")),
        (_HYBRID.replace("memory_recursiveprot", "favordynmods"), "favordynmods\n", None),  # set already
        (_HYBRID, "nsdelegate\nmemory_localevents\n", None),  # a kernel before 6.0
        (_HYBRID.replace("cgroup2", "ext4"), "favordynmods\n", None),  # no cgroup2 mount
        ("41 30 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n", "favordynmods\n",
         ("/sys/fs/cgroup", 0x20 | 0x200000, "favordynmods")),
    ],
)  # fmt: skip
def test_favor_dynamic_moves_remounts_only_what_needs_it(tmp_path, mountinfo, features, expected):
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "features").write_text(features)
    calls = []
    changed = favor_dynamic_moves(tmp_path / "mountinfo", tmp_path / "features", mount=lambda *a: calls.append(a))
    assert calls == ([expected] if expected else [])
    assert changed == (expected[0] if expected else None)


def test_favor_dynamic_moves_on_this_host(backend_root):
    """A started backend leaves the host's cgroup2 tree favoring moves, where the kernel offers it."""
    features = Path("/sys/kernel/cgroup/features")
    if FAVOR_DYNMODS not in (features.read_text().split() if features.exists() else []):
        pytest.skip("this kernel has no favordynmods (Linux < 6.0)")
    asyncio.run(LocalBackend(backend_root, "n").aclose())  # closed: its mount and disk dirs go with it
    mounts = [line.split(" - ")[1].split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    options = [m[2].split(",") for m in mounts if m[0] == "cgroup2"]
    assert options, "no cgroup2 mount on this host"
    assert FAVOR_DYNMODS in options[0]  # the one favor_dynamic_moves() remounts: the first
    assert favor_dynamic_moves() is None  # a second backend changes nothing


# -------------------------------------------------------- confinement of files


@pytest.fixture(params=["openat2", "walk"])
def fs_mode(request):
    fs._force_walk(request.param == "walk")
    try:
        yield request.param
    finally:
        fs._force_walk(False)


def test_fs_resolves_everything_inside_the_root(fs_mode, tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("inner\n")
    (root / "abs").symlink_to("/etc/hostname")
    (root / "climb").symlink_to("../../../../../../etc/hostname")
    (root / "etcdir").symlink_to("/etc")
    (root / "loop").symlink_to("loop")
    (root / "dangling-dir").symlink_to("/nowhere")
    os.mkfifo(root / "fifo")

    assert fs.read_in_root(root, "/abs") == b"inner\n"
    assert fs.read_in_root(root, "climb") == b"inner\n"
    assert fs.read_in_root(root, "/etcdir/hostname") == b"inner\n"
    assert fs.read_in_root(root, "/etcdir/../etc/../../etc/hostname") == b"inner\n"
    with pytest.raises(OSError) as info:
        fs.read_in_root(root, "/loop")
    assert info.value.errno == errno.ELOOP
    with pytest.raises(OSError):  # refused at once instead of blocking on a FIFO
        fs.read_in_root(root, "/fifo")
    with pytest.raises(IsADirectoryError):
        fs.read_in_root(root, "/etc")
    with pytest.raises(FileNotFoundError):
        fs.read_in_root(root, "/etc/missing")

    token = uuid.uuid4().hex
    fs.write_in_root(root, f"/etcdir/new-{token}/deep/file", b"data", 0o600)
    assert (root / "etc" / f"new-{token}" / "deep" / "file").read_bytes() == b"data"
    assert (root / "etc" / f"new-{token}" / "deep" / "file").stat().st_mode & 0o777 == 0o600
    assert not Path(f"/etc/new-{token}").exists()
    fs.write_in_root(root, "/abs", b"through the link\n")  # overwrites the target inside
    assert (root / "etc" / "hostname").read_text() == "through the link\n"
    with pytest.raises(OSError):
        fs.write_in_root(root, "/dangling-dir/x", b"x")
    assert not Path("/nowhere").exists()


# ------------------------------------------------------------------ sandboxes


async def test_namespaces_and_dropped_capabilities(lb):
    info = await lb.create(SPEC)
    r = await lb.exec(info.id, "echo $$; hostname; ls /proc | grep -c '^[0-9]'")
    pid, hostname, nprocs = r.stdout.split()
    assert pid == "1" and hostname == info.id and int(nprocs) < 5
    # mknod and chroot are gone: /dev cannot reach new host devices and --root cannot be undone.
    r = await lb.exec(info.id, "mknod /tmp/disk b 8 0")
    assert r.exit_code != 0 and "not permitted" in r.stderr
    r = await lb.exec(info.id, "chroot / /bin/true")
    assert r.exit_code != 0 and "not permitted" in r.stderr
    r = await lb.exec(info.id, "mount -t tmpfs none /mnt")
    assert r.exit_code != 0
    r = await lb.exec(info.id, "echo x > /dev/null && head -c 4 /dev/urandom | wc -c")
    assert r.stdout == "4\n"


async def test_later_sandboxes_load_the_seccomp_filter_crun_compiled_for_the_first(lb):
    """crun compiles the profile once per backend; the others get its program back and are filtered the same."""
    import base64

    if lb.runtime.name != "crun":
        pytest.skip("only crun takes a compiled filter")
    first, second = await lb.create(SPEC), await lb.create(SPEC)

    def config(info):
        return json.loads((lb._sandbox_dir(info.id) / "config.json").read_text())

    assert oci.SECCOMP_BPF_ANNOTATION not in config(first).get("annotations", {})
    handed = config(second)["annotations"][oci.SECCOMP_BPF_ANNOTATION]
    compiled = (lb._sandbox_dir(first.id) / "run" / "shell-1" / "seccomp.bpf").read_bytes()
    assert base64.b64decode(handed) == compiled and config(second)["linux"]["seccomp"] == config(first)["linux"]["seccomp"]
    for info in (first, second):
        r = await lb.exec(info.id, "grep -E '^Seccomp(_filters)?:' /proc/self/status; unshare -U true; echo rc=$?")
        assert "Seccomp:\t2" in r.stdout and "Seccomp_filters:\t1" in r.stdout and "rc=1" in r.stdout, r
        assert "Operation not permitted" in r.stderr, r


async def test_image_user_runs_the_shell(lb, base_rootfs):
    await lb.import_rootfs(str(base_rootfs), "forkyard/base:nobody", ImageConfig(user="nobody", workdir="/tmp"))
    info = await lb.create(SandboxSpec(image="forkyard/base:nobody"))
    r = await lb.exec(info.id, "id -u; id -g; echo $HOME; pwd; grep CapEff /proc/self/status")
    uid, gid, home, cwd, caps = r.stdout.splitlines()
    assert (uid, gid, home, cwd) == ("65534", "65534", "/nonexistent", "/tmp")
    assert caps.split()[1] == "0000000000000000"
    await lb.import_rootfs(str(base_rootfs), "forkyard/base:ghost", ImageConfig(user="no-such-user"))
    with pytest.raises(SandboxError, match="no-such-user"):
        await lb.create(SandboxSpec(image="forkyard/base:ghost"))


async def test_network_true_is_user_mode_and_filtered(lb):
    info = await lb.create(SandboxSpec(image=BASE_REF, network=True))
    sb = lb._sandboxes[info.id]
    slirp = sb.shell.network.pid
    r = await lb.exec(info.id, "cat /sys/class/net/tap0/address >/dev/null && grep -c tap0 /proc/net/route")
    assert r.exit_code == 0 and int(r.stdout) >= 1, r.stderr  # tap0 carries the default route
    rules = list_ruleset(sb.shell.init_pid)
    assert "policy drop" in rules and "tcp dport { 80, 443 } accept" in rules and "127.0.0.0/8" in rules
    # Its root cannot lift the filter: no CAP_NET_ADMIN in its namespace.
    r = await lb.exec(info.id, "ip link set tap0 down 2>&1 || echo refused; grep -c tap0 /proc/net/route")
    assert "refused" in r.stdout or "not permitted" in r.stdout.lower(), r.stdout
    # Its own loopback works.
    r = await lb.exec(info.id, "python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
                      "c = socket.create_connection(s.getsockname(), 5); print('loopback ok')\"")
    assert r.stdout == "loopback ok\n", r.stderr
    await lb.destroy(info.id)
    assert not Path(f"/proc/{slirp}").exists() or "slirp4netns" not in Path(f"/proc/{slirp}/cmdline").read_text()


def test_egress_policy_is_checked():
    with pytest.raises(ValueError, match="70000"):
        EgressPolicy(tcp_ports=(70000,))
    with pytest.raises(ValueError):
        EgressPolicy(allow_networks=("not-a-network",))
    rules = EgressPolicy(tcp_ports=(443,), allow_networks=("10.1.0.0/16",)).ruleset()
    assert "ip daddr { 10.1.0.0/16 } tcp dport { 443 } accept" in rules
    # The allowed private network comes before the private ranges are dropped.
    assert rules.index("10.1.0.0/16") < rules.index("10.0.0.0/8")


async def test_commit_keeps_whiteouts_and_opaque_dirs(lb, backend_root, base_rootfs):
    info = await lb.create(SPEC)
    r = await lb.exec(
        info.id,
        "echo new > /opt/new.txt && rm /etc/hostname"
        " && rm -rf /etc/apt && mkdir /etc/apt && echo only > /etc/apt/only.txt",
    )
    assert r.exit_code == 0, r.stderr
    await lb.commit(info.id, "forkyard/test:one", ImageConfig(env={"LAYER": "1"}))
    manifest = json.loads((backend_root / "images/forkyard/test/one.json").read_text())
    # The imported base is a copy of the cached rootfs with ids shifted into the sandboxes' range.
    base_layer = Path(manifest["layers"][0])
    assert base_layer != base_rootfs and base_layer.parent.name == f".forkyard-uid{oci.UID_BASE}"
    assert base_layer.stat().st_uid == oci.UID_BASE and (base_layer / "etc/passwd").stat().st_uid == oci.UID_BASE
    layer = Path(manifest["layers"][1])
    assert layer.parent == backend_root / "layers" and layer.is_dir()
    assert manifest["config"] == {"env": {"LAYER": "1"}, "workdir": "/", "user": "root"}

    child = await lb.create(SandboxSpec(image="forkyard/test:one"))
    r = await lb.exec(child.id, "cat /opt/new.txt; test -e /etc/hostname || echo no-hostname; ls /etc/apt; echo $LAYER")
    assert r.stdout == "new\nno-hostname\nonly.txt\n1\n"
    # A second generation stacks another layer on top.
    await lb.exec(child.id, "rm /opt/new.txt && echo two > /opt/two.txt")
    await lb.commit(child.id, "forkyard/test:two", ImageConfig())
    grandchild = await lb.create(SandboxSpec(image="forkyard/test:two"))
    r = await lb.exec(grandchild.id, "ls /opt; test -e /etc/hostname || echo no-hostname")
    assert r.stdout == "two.txt\nno-hostname\n"
    assert len(json.loads((backend_root / "images/forkyard/test/two.json").read_text())["layers"]) == 3
    # The base rootfs is never touched.
    assert (base_rootfs / "etc/hostname").exists() and (base_rootfs / "etc/apt/sources.list").exists()

    # Layers still used by an image or a live sandbox survive remove_image; the rest go.
    await lb.remove_image("forkyard/test:one")
    assert layer.is_dir()  # "two" and the sandboxes still use it
    for sid in (info.id, child.id, grandchild.id):
        await lb.destroy(sid)
    await lb.remove_image("forkyard/test:two")
    assert sorted(p.name for p in (backend_root / "layers").iterdir()) == []
    assert not (backend_root / "images/forkyard/test").exists()


async def test_missing_device_nodes_are_recreated(lb):
    info = await lb.create(SPEC)
    await lb.exec(info.id, "rm -f /dev/zero /dev/urandom")
    await lb.commit(info.id, "forkyard/test:nodev", ImageConfig())
    child = await lb.create(SandboxSpec(image="forkyard/test:nodev"))
    r = await lb.exec(child.id, "head -c 3 /dev/zero | wc -c; head -c 2 /dev/urandom | wc -c")
    assert r.stdout == "3\n2\n"


async def test_large_files_round_trip(lb):
    info = await lb.create(SPEC)
    data = os.urandom(3 << 20)
    await lb.write_file(info.id, "/tmp/big.bin", data)
    assert await lb.read_file(info.id, "/tmp/big.bin") == data
    await lb.exec(info.id, "mkfifo /tmp/pipe")
    with pytest.raises(SandboxError):
        await asyncio.wait_for(lb.read_file(info.id, "/tmp/pipe"), 5)


async def test_shell_killed_between_commands_comes_back(lb):
    info = await lb.create(SPEC)
    await lb.exec(info.id, "cd /usr && export GONE=1")
    meta = json.loads((lb.root_dir / "sandboxes" / info.id / "meta.json").read_text())
    os.kill(meta["init_pid"], signal.SIGKILL)
    for _ in range(100):
        if (await lb.status(info.id)).state is SandboxState.FAILED:
            break
        await asyncio.sleep(0.02)
    assert (await lb.status(info.id)).state is SandboxState.FAILED
    r = await lb.exec(info.id, "pwd; echo ${GONE:-unset}")
    assert r.stdout == "/usr\nunset\n"
    assert (await lb.status(info.id)).state is SandboxState.READY


async def test_orphan_after_a_crash_is_listed_and_destroyed(backend_root, base_rootfs, node_name):
    node = f"{node_name}-{uuid.uuid4().hex[:6]}"
    first = LocalBackend(backend_root, node)
    await first.import_rootfs(str(base_rootfs), BASE_REF, BASE_CONFIG)
    crashed = await first.create(SandboxSpec(image=BASE_REF, labels={"forkyard.owner": "dead-worker"}))
    closed = await first.create(SPEC)
    ids = [crashed.id, closed.id]
    second = LocalBackend(backend_root, node)
    try:
        await first.exec(crashed.id, "sleep 300 &")
        meta = json.loads((backend_root / "sandboxes" / crashed.id / "meta.json").read_text())
        os.kill(meta["pid"], signal.SIGKILL)  # the unshare process: --kill-child takes the shell
        # aclose is what a clean shutdown does: the sandboxes stay for a reaper.
        await first.aclose()

        listed = {i.id: i for i in await second.list()}
        assert set(ids) <= set(listed)
        assert listed[crashed.id].state is SandboxState.FAILED
        assert listed[closed.id].state is SandboxState.FAILED
        assert listed[crashed.id].labels["forkyard.owner"] == "dead-worker"
        assert (await second.status(crashed.id)).image == BASE_REF
        with pytest.raises(SandboxCrashedError):
            await second.exec(crashed.id, "true")
        assert local_leftovers(backend_root, ids) != []  # there is something to reap
        for sid in ids:
            await second.destroy(sid)
        assert await second.list() == []
        assert local_leftovers(backend_root, ids) == []
    finally:
        for sid in ids:
            await second.destroy(sid)
        await second.aclose()


async def test_a_snapshot_stops_the_sandbox_only_for_its_copy(lb, monkeypatch):
    """Its processes are stopped while the upper dir is copied and run again before the copy is listed."""
    info = await lb.create(SPEC)
    await lb.exec(info.id, "nohup sleep 300 >/dev/null 2>&1 &")
    cgroup = lb._live(info.id).cgroup
    states: dict[str, list[str]] = {}

    def state_of(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "gone"

    def sleepers() -> list[int]:
        return [pid for pid in cgroup.pids() if b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    real_run, real_digest = local.subprocess.run, local.tree_digest

    def run(args, **kwargs):
        if args[:2] == ["cp", "-a"]:
            states["copy"] = [state_of(pid) for pid in sleepers()]
        return real_run(args, **kwargs)

    def digest(path):
        states["digest"] = [state_of(pid) for pid in sleepers()]
        return real_digest(path)

    for _ in range(100):  # until the background fork has exec'd sleep (bounded: 2 s)
        if sleepers():
            break
        await asyncio.sleep(0.02)
    assert sleepers(), "the background process runs"
    monkeypatch.setattr(local.subprocess, "run", run)
    monkeypatch.setattr(local, "tree_digest", digest)
    snap = await lb.snapshot(info.id)
    assert states["copy"] == ["T"]  # stopped: the upper dir holds still
    assert states["digest"] and "T" not in states["digest"], states  # running again while the copy is listed
    assert snap.digest
    assert [state_of(pid) for pid in sleepers()] != ["T"]
    await lb.delete_snapshot(snap.id)


async def test_a_branch_an_earlier_process_left_takes_its_deleted_snapshot_with_it(
    backend_root, base_rootfs, node_name
):
    """A snapshot deleted under running branches is freed when the last goes, even by the next process."""
    node = f"{node_name}-{uuid.uuid4().hex[:6]}"
    first = LocalBackend(backend_root, node)
    await first.import_rootfs(str(base_rootfs), BASE_REF, BASE_CONFIG)
    info = await first.create(SPEC)
    await first.exec(info.id, "echo kept > /blob")  # the snapshot's own layer holds it
    snap = await first.snapshot(info.id)
    branches = await first.restore(snap, 2)
    ids = [info.id, *(b.id for b in branches)]
    layer = Path(snap.layers[-1])
    second = None
    try:
        await first.delete_snapshot(snap.id)
        assert layer.exists()  # the branches stand on it
        await first.aclose()  # a restart: the sandboxes stay
        second = LocalBackend(backend_root, node)  # it can only destroy what the first left
        # At once: both wait for the one look for retired layers, taken while both were there.
        await asyncio.gather(*(second.destroy(b.id) for b in branches))
        assert not layer.exists()
        await second.destroy(info.id)
        assert local_leftovers(backend_root, ids) == []
    finally:
        backend = second or first
        for sid in ids:
            await backend.destroy(sid)
        await backend.aclose()


async def test_half_created_sandbox_is_cleaned_up(lb, backend_root, monkeypatch):
    info = await lb.create(SPEC)
    await lb.exec(info.id, "rm /usr/bin/bash")
    await lb.commit(info.id, "forkyard/test:nobash", ImageConfig())
    names: list[str] = []

    class RecordingCgroup(SandboxCgroup):
        def __init__(self, name, **kwargs):
            names.append(name)
            super().__init__(name, **kwargs)

    monkeypatch.setattr(local, "SandboxCgroup", RecordingCgroup)
    with pytest.raises(SandboxError, match="did not start"):
        await lb.create(SandboxSpec(image="forkyard/test:nobash"))
    assert len(names) == 1
    assert local_leftovers(backend_root, names) == []
    assert [i.id for i in await lb.list()] == [info.id]


def test_image_refs_are_validated():
    assert local.parse_image_ref("forkyard/base:3f2a9c1d0b4e") == ("forkyard/base", "3f2a9c1d0b4e")
    assert local.parse_image_ref("forkyard/env") == ("forkyard/env", "latest")
    for bad in ("Forkyard/Base:1", "../x:1", "x:../y", "a//b:1", "x:"):
        with pytest.raises(SandboxError):
            local.parse_image_ref(bad)


def test_layer_paths_with_separators_are_refused():
    with tempfile.TemporaryDirectory(prefix="forkyard,bad-") as tmp, pytest.raises(SandboxError, match="overlay layer"):
        LocalBackend(tmp, "n")


@pytest.mark.parametrize("runtime", ["crun", "runc"])
async def test_each_oci_runtime_runs_the_same_sandbox(backend_root, base_rootfs, node_name, runtime):
    lb = LocalBackend(backend_root, f"{node_name}-{runtime}", runtime=runtime)
    ids: list[str] = []
    try:
        assert lb.runtime.name == runtime
        await lb.import_rootfs(str(base_rootfs), BASE_REF, BASE_CONFIG)
        info = await lb.create(SPEC)
        ids.append(info.id)
        r = await lb.exec(info.id, "id -u; cat /proc/self/uid_map; grep NoNewPrivs /proc/self/status; cd /tmp; export X=1")
        uid, mapping, nnp = r.stdout.splitlines()
        assert uid == "0" and mapping.split() == ["0", str(oci.UID_BASE), str(oci.UID_COUNT)]
        assert nnp.split()[1] == "1"
        snap = await lb.snapshot(info.id)
        branches = await lb.restore(snap, 2)
        ids += [b.id for b in branches]
        r = await lb.exec(branches[1].id, "pwd; echo $X")
        assert r.stdout == "/tmp\n1\n"
        for sid in ids:
            await lb.destroy(sid)
        await lb.delete_snapshot(snap.id)
        assert local_leftovers(backend_root, ids) == []
        # runc makes cgroups in every hierarchy; none may stay (crun is told to make none).
        stray = [str(p) for p in Path("/sys/fs/cgroup").glob("*/forkyard/*") if p.is_dir() and p.name in ids]
        stray += [str(p) for p in Path("/sys/fs/cgroup").glob("*/shell-*")]
        assert stray == []
    finally:
        for sid in ids:
            await lb.destroy(sid)
        await lb.aclose()


def test_runtime_outside_the_tier_is_refused(backend_root):
    with pytest.raises(BackendUnavailableError, match="not one of the 'standard' tier"):
        LocalBackend(backend_root, "n", runtime="runsc")


def test_gvisor_without_runsc_or_with_debian_12s_is_one_sentence(backend_root, monkeypatch):
    real = oci._installed
    monkeypatch.setattr(oci, "_installed", lambda name: None if name == "runsc" else real(name))
    with pytest.raises(BackendUnavailableError, match="apt-get install runsc, from Debian 13"):
        LocalBackend(backend_root, "n", isolation="gvisor")
    monkeypatch.setattr(oci, "_installed", lambda name: "/usr/bin/runsc" if name == "runsc" else real(name))
    monkeypatch.setattr(oci, "_version_line", lambda path: "runsc version 0.0~20221219.0")
    with pytest.raises(BackendUnavailableError, match=r"gVisor 20221219, older than 20240101: its statx") as err:
        LocalBackend(backend_root, "n", isolation="gvisor")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(oci, "_version_line", lambda path: "runsc version 0.0~20240729.0")
    assert oci.find_runtime("gvisor") == oci.Runtime(name="runsc", path="/usr/bin/runsc")

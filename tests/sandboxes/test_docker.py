"""Docker-only behaviour of the ``docker`` backend, against the real engine.

The shared contract (exec, files, limits, commit...) lives in test_contract.py; this file
covers what only Docker has: the engine connection, container settings, labels inherited
through commits, the rootfs import, orphans left by another process, foreign containers,
and the fallbacks used when the engine's processes are not visible on this host.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid

import docker
import pytest

from sandboxes.base import LABEL_NODE, ImageConfig, Resources, SandboxSpec, SandboxState
from sandboxes.docker import LABEL_BACKEND, DockerBackend
from sandboxes.errors import (
    BackendUnavailableError,
    ImageNotFoundError,
    PathEscapeError,
    SandboxError,
    SandboxNotFoundError,
)

pytestmark = pytest.mark.docker

BASE_REF = "forkyard/base:test-docker"
BASE_CONFIG = ImageConfig(
    env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "FY_IMAGE": "base image"},
    workdir="/root",
    user="root",
)


@pytest.fixture(scope="module")
def engine():
    """A plain Docker SDK client, to look at containers and images behind the backend's back."""
    client = docker.from_env()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
async def base_image(base_rootfs, engine):
    """Import the Debian rootfs as ``forkyard/base:test-docker`` with our backend; remove it after."""
    backend = DockerBackend(f"test-docker-import-{uuid.uuid4().hex[:6]}")
    try:
        await backend.import_rootfs(str(base_rootfs), BASE_REF, BASE_CONFIG)
        yield BASE_REF
    finally:
        try:
            await backend.remove_image(BASE_REF)
            assert not await backend.has_image(BASE_REF)
        finally:
            await backend.aclose()


def node_containers(engine, node: str) -> list[str]:
    """Return the ids of every container, running or not, labelled with ``node``."""
    return [c.id for c in engine.containers.list(all=True, filters={"label": f"{LABEL_NODE}={node}"})]


@pytest.fixture
async def backend(base_image, engine):
    """A backend on a node of its own; every container of that node is removed after the test."""
    node = f"test-docker-{uuid.uuid4().hex[:8]}"
    backend = DockerBackend(node)
    try:
        yield backend
    finally:
        try:
            for info in await backend.list():
                await backend.destroy(info.id)
        finally:
            await backend.aclose()
            left = node_containers(engine, node)
            for cid in left:
                engine.api.remove_container(cid, force=True)
        assert left == [], f"containers left behind on node {node}: {left}"


@pytest.fixture(params=["host-proc", "engine-only"])
def host_proc(request, backend):
    """Run the test once with host /proc access and once as if the engine were remote."""
    backend._host_proc = request.param == "host-proc"
    return backend._host_proc


def test_no_engine_is_a_clear_error():
    url = f"unix:///tmp/forkyard-no-docker-{uuid.uuid4().hex[:6]}.sock"
    with pytest.raises(BackendUnavailableError) as err:
        DockerBackend("test-node", base_url=url)
    assert str(err.value).startswith(f"No Docker engine answers at {url}: ")


async def test_import_rootfs_keeps_config_modes_and_links(backend, base_image, base_rootfs, engine):
    image = engine.api.inspect_image(base_image)["Config"]
    assert "FY_IMAGE=base image" in image["Env"]
    assert (image["WorkingDir"], image["User"]) == ("/root", "root")

    info = await backend.create(SandboxSpec(image=base_image))
    r = await backend.exec(info.id, 'echo "$FY_IMAGE"; pwd; id -un; stat -c %a /usr/bin/passwd /tmp; readlink /bin/sh')
    expected_sh = os.readlink(base_rootfs / "bin/sh")
    assert r.stdout == f"base image\n/root\nroot\n4755\n1777\n{expected_sh}\n", r
    # Hard links arrive as links, not copies.
    files = [p for p in sorted((base_rootfs / "usr/bin").iterdir()) if p.is_file() and not p.is_symlink()]
    linked = next(p for p in files if p.stat().st_nlink > 1)
    twins = [p for p in files if p.stat().st_ino == linked.stat().st_ino]
    assert len(twins) > 1
    r = await backend.exec(info.id, "stat -c %i " + " ".join(f"/usr/bin/{p.name}" for p in twins))
    assert len(set(r.stdout.split())) == 1, r


async def test_container_settings(backend, base_image, engine):
    spec = SandboxSpec(
        image=base_image,
        resources=Resources(cpus=0.5, memory_mb=256, pids=100),
        env={"FY_SPEC": "from spec"},
        workdir="/srv/work",
        labels={"forkyard.owner": "owner-1", "forkyard.task": "t-9"},
    )
    info = await backend.create(spec)
    attrs = engine.api.inspect_container(info.id)
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL_NODE] == backend.node and labels[LABEL_BACKEND] == "docker"
    assert (labels["forkyard.owner"], labels["forkyard.task"]) == ("owner-1", "t-9")
    assert info.labels == {LABEL_NODE: backend.node, "forkyard.owner": "owner-1", "forkyard.task": "t-9"}
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["Memory"] == host["MemorySwap"] == 256 << 20
    assert (host["PidsLimit"], host["NanoCpus"]) == (100, 500_000_000)
    assert attrs["Config"]["WorkingDir"] == "/srv/work"
    assert attrs["Config"]["OpenStdin"] and not attrs["Config"]["Tty"]
    # spec.env lives in the shell only, so a commit cannot bake it into an image.
    assert not any(e.startswith("FY_SPEC=") for e in attrs["Config"]["Env"])
    r = await backend.exec(info.id, 'echo "$FY_SPEC|$FY_IMAGE"; pwd; ls /sys/class/net')
    assert r.stdout == "from spec|base image\n/srv/work\nlo\n"
    # bash is not PID 1 when the engine has docker-init, so signals reach it normally.
    if host.get("Init"):
        r = await backend.exec(info.id, "cat /proc/1/comm; echo $$")
        comm, shell_pid = r.stdout.split()
        assert comm == "docker-init" and shell_pid != "1"


async def test_network_flag_uses_the_default_bridge(backend, base_image, engine):
    info = await backend.create(SandboxSpec(image=base_image, network=True))
    assert engine.api.inspect_container(info.id)["HostConfig"]["NetworkMode"] == "bridge"
    r = await backend.exec(info.id, "ls /sys/class/net")
    assert "eth0" in r.stdout.split()


async def test_commit_keeps_files_and_config_but_not_sandbox_env_or_labels(backend, base_image, engine):
    parent = await backend.create(
        SandboxSpec(image=base_image, env={"FY_PARENT_ONLY": "1"}, labels={"forkyard.owner": "parent-owner"})
    )
    r = await backend.exec(parent.id, "echo kept > /srv/kept.txt && rm /etc/issue && export FY_EXPORTED=1")
    assert r.exit_code == 0, r.stderr
    ref = f"forkyard/test-docker-commit:{uuid.uuid4().hex[:12]}"
    tricky = 'quote " dollar $HOME back\\slash'
    await backend.commit(parent.id, ref, ImageConfig(env={**BASE_CONFIG.env, "FY_TRICKY": tricky}, workdir="/srv"))
    try:
        child = await backend.create(SandboxSpec(image=ref, labels={"forkyard.session": "s-2"}))
        r = await backend.exec(
            child.id,
            'cat kept.txt; pwd; printf "%s\\n" "$FY_TRICKY"; echo "[$FY_PARENT_ONLY$FY_EXPORTED]";'
            " test -e /etc/issue || echo issue-gone",
        )
        assert r.stdout == f"kept\n/srv\n{tricky}\n[]\nissue-gone\n", r
        # The image carries the parent's labels (docker commit keeps them), yet the child
        # reports only its own: a reaper must not see it as the parent owner's.
        assert engine.api.inspect_image(ref)["Config"]["Labels"]["forkyard.owner"] == "parent-owner"
        assert child.labels == {LABEL_NODE: backend.node, "forkyard.session": "s-2"}
        assert (await backend.status(child.id)).labels == child.labels
        # `docker run -i <image>` would give the same shell.
        assert engine.api.inspect_image(ref)["Config"]["Entrypoint"] == ["/bin/bash", "--noprofile", "--norc"]
        await backend.destroy(child.id)
    finally:
        await backend.remove_image(ref)
    assert not await backend.has_image(ref)
    await backend.remove_image(ref)


async def test_orphans_are_listed_revived_and_destroyed(base_image, engine):
    node = f"test-docker-orphan-{uuid.uuid4().hex[:6]}"
    first = DockerBackend(node)
    second = DockerBackend(node)
    try:
        orphan = await first.create(SandboxSpec(image=base_image, labels={"forkyard.owner": "gone-process"}))
        await first.exec(orphan.id, "echo on-disk > /srv/state.txt && cd /tmp")
        # The owning process goes away: the attach socket closes, the shell reads EOF and the
        # container stops, like a local sandbox whose shell lost its pipe.
        await first.aclose()
        assert engine.api.wait(orphan.id, timeout=30)["StatusCode"] == 0

        listed = await second.list()
        assert [(i.id, i.state) for i in listed] == [(orphan.id, SandboxState.FAILED)]
        assert listed[0].labels == {LABEL_NODE: node, "forkyard.owner": "gone-process"}

        # Another process can bring it back: a new shell on the same filesystem.
        r = await second.exec(orphan.id, "cat /srv/state.txt")
        assert (r.stdout, r.exit_code) == ("on-disk\n", 0)
        assert (await second.status(orphan.id)).state is SandboxState.READY

        await second.destroy(orphan.id)
        await second.destroy(orphan.id)
        assert await second.list() == []
        assert node_containers(engine, node) == []
    finally:
        await first.aclose()
        await second.aclose()
        for cid in node_containers(engine, node):
            engine.api.remove_container(cid, force=True)


async def test_a_running_sandbox_is_driven_by_its_own_backend_only(backend, base_image):
    info = await backend.create(SandboxSpec(image=base_image, workdir="/srv"))
    await backend.exec(info.id, "echo shared > /srv/file.txt")
    other = DockerBackend(backend.node)
    try:
        assert (await other.status(info.id)).state is SandboxState.READY
        with pytest.raises(SandboxError, match="another docker backend"):
            await other.exec(info.id, "echo intruder")
        # Files do not need the shell: they go through the engine.
        assert await other.read_file(info.id, "file.txt") == b"shared\n"
        await other.write_file(info.id, "/srv/from-other.txt", b"hi")
    finally:
        await other.aclose()
    r = await backend.exec(info.id, "cat /srv/from-other.txt; echo; echo still mine")
    assert r.stdout == "hi\nstill mine\n"


async def test_foreign_containers_are_left_alone(backend, base_image, engine):
    foreign = engine.containers.create(base_image, ["sleep", "60"], labels={LABEL_NODE: "some-other-node"})
    try:
        for sid in (foreign.id, foreign.id[:12]):
            with pytest.raises(SandboxNotFoundError):
                await backend.status(sid)
            with pytest.raises(SandboxNotFoundError):
                await backend.exec(sid, "true")
            await backend.destroy(sid)
        engine.api.inspect_container(foreign.id)  # still there
        assert foreign.id not in {i.id for i in await backend.list()}
    finally:
        foreign.remove(force=True)


async def test_failed_create_leaves_nothing(backend, base_image, engine):
    with pytest.raises(ImageNotFoundError):
        await backend.create(SandboxSpec(image=f"forkyard/no-such-image:{uuid.uuid4().hex[:8]}"))
    with pytest.raises(SandboxError):
        await backend.create(SandboxSpec(image=base_image, env={"not a name": "x"}))
    assert node_containers(engine, backend.node) == []


async def test_short_ids_reach_the_same_sandbox(backend, base_image):
    info = await backend.create(SandboxSpec(image=base_image))
    await backend.exec(info.id, "export FY_MARK=same-shell")
    r = await backend.exec(info.id[:12], 'echo "$FY_MARK"')
    assert r.stdout == "same-shell\n"
    assert (await backend.status(info.id[:12])).id == info.id


async def test_interleaved_output_is_demultiplexed(backend, base_image):
    info = await backend.create(SandboxSpec(image=base_image))
    script = (
        "import sys\n"
        "for i in range(2000):\n"
        "    sys.stdout.write('o%05d' % i * 20 + '\\n'); sys.stdout.flush()\n"
        "    sys.stderr.write('e%05d' % i * 7 + '\\n'); sys.stderr.flush()\n"
    )
    await backend.write_file(info.id, "/tmp/interleave.py", script.encode())
    r = await backend.exec(info.id, "python3 /tmp/interleave.py", max_output_bytes=1 << 22, timeout_s=60)
    want_out = "".join(f"o{i:05d}" * 20 + "\n" for i in range(2000))
    want_err = "".join(f"e{i:05d}" * 7 + "\n" for i in range(2000))
    assert hashlib.sha256(r.stdout.encode()).hexdigest() == hashlib.sha256(want_out.encode()).hexdigest()
    assert r.stderr == want_err and not r.truncated


async def test_timeout_kills_the_command_but_not_older_jobs(backend, base_image, host_proc):
    info = await backend.create(SandboxSpec(image=base_image))
    # An older background job must survive; the wait keeps it clear of the next command's start.
    r = await backend.exec(info.id, "cd /tmp; export KEEP=1; sleep 1000 & echo $! > old.pid; sleep 1")
    assert r.exit_code == 0
    r = await backend.exec(info.id, "(sleep 300 &); bash -c 'sleep 200 & wait' & sleep 100", timeout_s=1)
    assert r.timed_out and "timed out" in r.stderr
    r = await backend.exec(info.id, "ps -eo pid=,args= | grep '[s]leep'; echo \"$KEEP $(cat old.pid)\"")
    lines = r.stdout.splitlines()
    old_pid = lines[-1].split()[1]
    assert lines[-1].split()[0] == "1"  # same shell: exports survived
    sleepers = [line.split(None, 1) for line in lines[:-1]]
    assert sleepers == [[old_pid, "sleep 1000"]], r


async def test_files_through_either_path(backend, base_image, host_proc):
    info = await backend.create(SandboxSpec(image=base_image))
    data = os.urandom(70_000)
    await backend.write_file(info.id, "/opt/deep/er/blob.bin", data, mode=0o600)
    assert await backend.read_file(info.id, "/opt/deep/er/blob.bin") == data
    await backend.write_file(info.id, "/usr/local/bin/fy-hello", b"#!/bin/sh\necho hello\n", mode=0o755)
    r = await backend.exec(info.id, "stat -c %a /opt/deep/er/blob.bin /tmp; fy-hello")
    assert r.stdout == "600\n1777\nhello\n"  # parents made, existing dirs untouched

    r = await backend.exec(info.id, "ln -s /etc /tmp/etc-link && ln -s ../../etc/os-release /tmp/rel-link && cd /srv")
    assert r.exit_code == 0, r.stderr
    assert b"Debian" in await backend.read_file(info.id, "/tmp/rel-link")
    assert b"Debian" in await backend.read_file(info.id, "/tmp/etc-link/os-release")
    token = uuid.uuid4().hex
    await backend.write_file(info.id, "relative.txt", token.encode())  # from the shell's cwd
    r = await backend.exec(info.id, "cat /srv/relative.txt")
    assert r.stdout == token

    with pytest.raises(FileNotFoundError):
        await backend.read_file(info.id, "/no/such/file")
    with pytest.raises(IsADirectoryError):
        await backend.read_file(info.id, "/etc")
    with pytest.raises(PathEscapeError):
        await backend.read_file(info.id, "../../../etc/passwd")


async def test_destroy_during_a_command_ends_it(backend, base_image):
    info = await backend.create(SandboxSpec(image=base_image))
    busy = asyncio.ensure_future(backend.exec(info.id, "sleep 100", timeout_s=60))
    await asyncio.sleep(0.3)
    await backend.destroy(info.id)
    result = await asyncio.wait_for(busy, 30)
    assert result.exit_code != 0
    with pytest.raises(SandboxNotFoundError):
        await backend.status(info.id)


async def test_a_container_that_exits_while_removed_is_removed_on_the_next_try(backend, base_image, engine, monkeypatch):
    info = await backend.create(SandboxSpec(image=base_image))
    real, calls = backend._api.remove_container, []

    def remove_container(cid, **kwargs):
        calls.append(cid)
        if len(calls) == 1:  # what the engine answers when the container exits as it kills it
            response = type("Response", (), {"status_code": 500, "reason": "Internal Server Error", "url": ""})()
            raise docker.errors.APIError("500 Server Error", response=response, explanation=(
                f"Could not kill running container {cid}, cannot remove - Container {cid} is not running"))
        return real(cid, **kwargs)

    monkeypatch.setattr(backend._api, "remove_container", remove_container)
    await backend.destroy(info.id)
    assert len(calls) == 2
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(info.id)

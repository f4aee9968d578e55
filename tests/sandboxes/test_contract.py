"""The sandbox backend contract, run against every backend (real namespaces, real engine).

Timeouts are kept short so the suite stays quick; nothing here measures speed.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import uuid
from pathlib import Path

import pytest

from sandboxes.base import LABEL_NODE, ImageConfig, Resources, SandboxSpec, SandboxState
from sandboxes.errors import ImageNotFoundError, PathEscapeError, SandboxNotFoundError
from sandboxes.shell import TIMEOUT_EXIT_CODE
from tests.sandboxes.conftest import BASE_REF, find_leftovers

SPEC = SandboxSpec(image=BASE_REF)


async def test_create_then_exec(backend):
    info = await backend.create(SandboxSpec(image=BASE_REF, labels={"forkyard.owner": "test-owner"}))
    assert info.backend == backend.name
    assert info.node == backend.node
    assert info.state is SandboxState.READY
    assert info.image == BASE_REF
    assert info.labels[LABEL_NODE] == backend.node
    assert info.labels["forkyard.owner"] == "test-owner"

    r = await backend.exec(info.id, "echo hello; echo $FORKYARD_TEST_IMAGE")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("hello\nbase\n", "", 0, False)
    r = await backend.exec(info.id, "false")
    assert r.exit_code == 1
    r = await backend.exec(info.id, "echo 'syntax error' (")
    assert r.exit_code != 0 and "syntax" in r.stderr
    r = await backend.exec(info.id, "echo still here")
    assert r.stdout == "still here\n"


async def test_spec_env_and_workdir_override_the_image(backend):
    spec = SandboxSpec(image=BASE_REF, env={"GREETING": "hello world", "FORKYARD_TEST_IMAGE": "spec"}, workdir="/srv/app")
    info = await backend.create(spec)
    r = await backend.exec(info.id, 'pwd; echo "$GREETING"; echo $FORKYARD_TEST_IMAGE; echo $PATH')
    lines = r.stdout.splitlines()
    assert lines[:3] == ["/srv/app", "hello world", "spec"]
    assert "/usr/bin" in lines[3].split(":")
    assert r.cwd == "/srv/app"
    # Relative file paths start at the working directory.
    await backend.write_file(info.id, "notes/rel.txt", b"relative\n")
    r = await backend.exec(info.id, "cat /srv/app/notes/rel.txt")
    assert r.stdout == "relative\n"
    assert await backend.read_file(info.id, "notes/rel.txt") == b"relative\n"


async def test_cwd_and_exports_persist(backend):
    info = await backend.create(SPEC)
    r = await backend.exec(info.id, "mkdir -p /tmp/work && cd /tmp/work && export FOO='bar baz'")
    assert r.exit_code == 0 and r.cwd == "/tmp/work"
    r = await backend.exec(info.id, 'pwd; echo "$FOO"; f() { echo fn; }')
    assert r.stdout == "/tmp/work\nbar baz\n"
    r = await backend.exec(info.id, "f")
    assert r.stdout == "fn\n"


async def _sleep_count(backend, sid: str) -> int:
    r = await backend.exec(sid, "ps -eo comm= | grep -c '^sleep$' || true")
    return int(r.stdout.strip())


async def test_timeout_kills_the_whole_process_tree(backend):
    info = await backend.create(SPEC)
    await backend.exec(info.id, "cd /tmp && export KEEP=1")

    r = await backend.exec(info.id, "sleep 100", timeout_s=1)
    assert r.timed_out and r.exit_code != 0
    assert "timed out" in r.stderr
    assert await _sleep_count(backend, info.id) == 0

    r = await backend.exec(info.id, "bash -c 'sleep 100 & sleep 100; wait' & sleep 100 & wait", timeout_s=1)
    assert r.timed_out
    assert await _sleep_count(backend, info.id) == 0

    # The same shell answers: cwd and exports survived.
    r = await backend.exec(info.id, "echo alive $KEEP; pwd")
    assert r.stdout == "alive 1\n/tmp\n"


async def test_timeout_aborts_the_rest_of_the_command(backend):
    info = await backend.create(SPEC)
    r = await backend.exec(info.id, "echo before; sleep 100; echo never", timeout_s=1)
    assert r.timed_out and r.exit_code == TIMEOUT_EXIT_CODE
    assert r.stdout == "before\n"


async def test_builtin_loop_times_out_in_the_same_shell(backend):
    info = await backend.create(SPEC)
    await backend.exec(info.id, "cd /tmp && export KEEP=2")
    r = await backend.exec(info.id, "while :; do :; done; echo never", timeout_s=1)
    assert r.timed_out and r.exit_code == TIMEOUT_EXIT_CODE
    assert "never" not in r.stdout and "new shell" not in r.stderr
    # No shell restart was needed: the exported variable is still there.
    r = await backend.exec(info.id, "echo alive $KEEP; pwd")
    assert (r.stdout, r.exit_code) == ("alive 2\n/tmp\n", 0)


async def test_shell_that_ignores_the_abort_is_replaced(backend):
    info = await backend.create(SPEC)
    await backend.exec(info.id, "cd /tmp")
    r = await backend.exec(info.id, "trap '' USR1; while :; do :; done", timeout_s=1)
    assert r.timed_out and r.exit_code != 0
    r = await backend.exec(info.id, "echo alive; pwd")
    assert (r.stdout, r.exit_code) == ("alive\n/tmp\n", 0)


async def test_exit_reports_its_code_and_the_sandbox_recovers(backend):
    info = await backend.create(SPEC)
    await backend.exec(info.id, "cd /var")
    r = await backend.exec(info.id, "echo bye; exit 3")
    assert r.exit_code == 3 and r.stdout == "bye\n"
    r = await backend.exec(info.id, "echo alive; pwd")
    assert (r.stdout, r.exit_code) == ("alive\n/var\n", 0)
    assert (await backend.status(info.id)).state is SandboxState.READY


async def test_output_is_capped_with_a_visible_marker(backend):
    info = await backend.create(SPEC)
    r = await backend.exec(info.id, "head -c 1000000 /dev/zero | tr '\\0' a; echo tail-end", max_output_bytes=4096)
    assert r.exit_code == 0 and r.truncated
    assert len(r.stdout) < 4096 + 200
    assert "truncated" in r.stdout
    assert r.stdout.startswith("a" * 1000) and r.stdout.endswith("tail-end\n")
    r = await backend.exec(info.id, "head -c 3000 /dev/zero | tr '\\0' b", max_output_bytes=4096)
    assert not r.truncated and r.stdout == "b" * 3000


async def test_stderr_is_separate(backend):
    info = await backend.create(SPEC)
    r = await backend.exec(info.id, "echo out; echo err >&2; echo out2")
    assert (r.stdout, r.stderr) == ("out\nout2\n", "err\n")


async def test_file_round_trip(backend):
    info = await backend.create(SPEC)
    data = bytes(range(256)) * 64 + b"\x00tail"
    await backend.write_file(info.id, "/tmp/a/b/c/data.bin", data)
    assert await backend.read_file(info.id, "/tmp/a/b/c/data.bin") == data
    r = await backend.exec(info.id, "sha256sum /tmp/a/b/c/data.bin; stat -c %a /tmp/a/b/c/data.bin")
    digest, mode = r.stdout.split("\n")[0].split()[0], r.stdout.split("\n")[1]
    assert digest == hashlib.sha256(data).hexdigest()
    assert mode == "644"

    await backend.write_file(info.id, "/usr/local/bin/hello", b"#!/bin/sh\necho hi from script\n", mode=0o755)
    r = await backend.exec(info.id, "hello; stat -c %a /usr/local/bin/hello")
    assert r.stdout == "hi from script\n755\n"

    # Overwriting truncates; a file the shell wrote reads back.
    await backend.write_file(info.id, "/tmp/a/b/c/data.bin", b"short")
    assert await backend.read_file(info.id, "/tmp/a/b/c/data.bin") == b"short"
    await backend.exec(info.id, "printf 'from the shell' > /tmp/shell.txt")
    assert await backend.read_file(info.id, "/tmp/shell.txt") == b"from the shell"
    with pytest.raises(FileNotFoundError):
        await backend.read_file(info.id, "/tmp/does-not-exist")


async def test_paths_cannot_escape_the_sandbox(backend):
    info = await backend.create(SPEC)
    for bad in ("../../etc/passwd", "/tmp/../../etc/passwd", ""):
        with pytest.raises(PathEscapeError):
            await backend.read_file(info.id, bad)
    with pytest.raises(PathEscapeError):
        await backend.write_file(info.id, "../../tmp/escaped", b"x")

    token = uuid.uuid4().hex
    r = await backend.exec(
        info.id,
        f"echo inside-{token} > /etc/hostname && ln -s /etc/hostname /tmp/abs-link"
        " && ln -s ../../../../../../../etc/hostname /tmp/rel-link && ln -s /root /tmp/root-link",
    )
    assert r.exit_code == 0, r.stderr
    host_hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else b""
    for link in ("/tmp/abs-link", "/tmp/rel-link"):
        content = await backend.read_file(info.id, link)
        assert content == f"inside-{token}\n".encode()
        assert content != host_hostname
    # Writing through a symlink to an absolute directory lands inside the sandbox.
    await backend.write_file(info.id, f"/tmp/root-link/forkyard-{token}", b"inside")
    assert not Path(f"/root/forkyard-{token}").exists()
    r = await backend.exec(info.id, f"cat /root/forkyard-{token}")
    assert r.stdout == "inside"


async def test_no_network_by_default(backend):
    info = await backend.create(SPEC)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = await backend.exec(
            info.id,
            f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2); print('connected')\"",
            timeout_s=20,
        )
        assert r.exit_code != 0 and "connected" not in r.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
    # The sandbox's own loopback works, so the failure above is isolation, not a broken python.
    script = (
        "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "c = socket.create_connection(s.getsockname(), 2); print('loopback ok')"
    )
    r = await backend.exec(info.id, f'python3 -c "{script}"', timeout_s=20)
    assert r.stdout == "loopback ok\n", r.stderr


async def test_memory_limit_kills_a_hog_and_the_sandbox_survives(backend):
    info = await backend.create(SandboxSpec(image=BASE_REF, resources=Resources(memory_mb=128)))
    r = await backend.exec(
        info.id, "python3 -c \"b = b'x' * (1 << 30); print('allocated', len(b))\"", timeout_s=60
    )
    assert r.exit_code != 0
    assert "allocated" not in r.stdout
    r = await backend.exec(info.id, "python3 -c \"b = b'x' * (16 << 20); print('small ok')\"", timeout_s=60)
    assert r.stdout == "small ok\n"


FORK_PROBE = """
import os, time
kids = []
err = None
try:
    for _ in range(300):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        kids.append(pid)
except OSError as exc:
    err = exc.errno
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(len(kids), err)
"""


async def test_pids_limit_stops_a_fork_bomb(backend):
    info = await backend.create(SandboxSpec(image=BASE_REF, resources=Resources(pids=64)))
    await backend.write_file(info.id, "/tmp/fork_probe.py", FORK_PROBE.encode())
    r = await backend.exec(info.id, "python3 /tmp/fork_probe.py", timeout_s=60)
    forks, err = r.stdout.split()
    assert 0 < int(forks) < 64 and err == "11", r  # EAGAIN: the cgroup said no
    # Only with the limit proven do we unleash a real fork bomb.
    r = await backend.exec(info.id, ":(){ :|:& };:; sleep 5", timeout_s=2)
    assert r.timed_out
    r = await backend.exec(info.id, "echo alive", timeout_s=30)
    assert r.stdout == "alive\n"
    r = await backend.exec(info.id, "ps -e --no-headers | wc -l", timeout_s=30)
    assert r.exit_code == 0 and int(r.stdout) < 10, r


async def test_status_and_list(backend):
    a = await backend.create(SandboxSpec(image=BASE_REF, labels={"forkyard.owner": "owner-a"}))
    b = await backend.create(SandboxSpec(image=BASE_REF, labels={"forkyard.owner": "owner-b"}))
    listed = {i.id: i for i in await backend.list()}
    assert {a.id, b.id} <= set(listed)
    assert listed[a.id].labels["forkyard.owner"] == "owner-a"
    assert listed[b.id].labels[LABEL_NODE] == backend.node
    assert all(i.node == backend.node for i in listed.values())
    st = await backend.status(a.id)
    assert (st.id, st.state, st.image) == (a.id, SandboxState.READY, BASE_REF)
    with pytest.raises(SandboxNotFoundError):
        await backend.status("no-such-sandbox")

    await backend.destroy(a.id)
    assert a.id not in {i.id for i in await backend.list()}
    with pytest.raises(SandboxNotFoundError):
        await backend.status(a.id)
    # The ledger still has it, as made: a listing that missed it can ask for what was made since.
    made, mark = backend.made_after(0)
    assert [i.id for i in made[-2:]] == [a.id, b.id] and made[-2].labels["forkyard.owner"] == "owner-a"
    assert backend.made_after(mark) == ([], mark)


async def test_destroy_is_idempotent(backend):
    info = await backend.create(SPEC)
    await backend.destroy(info.id)
    await backend.destroy(info.id)
    await backend.destroy("no-such-sandbox")
    with pytest.raises(SandboxNotFoundError):
        await backend.exec(info.id, "true")
    with pytest.raises(SandboxNotFoundError):
        await backend.read_file(info.id, "/etc/hostname")


async def test_unknown_image_is_refused(backend):
    with pytest.raises(ImageNotFoundError):
        await backend.create(SandboxSpec(image="forkyard/no-such-image:0"))
    assert not await backend.has_image("forkyard/no-such-image:0")


async def test_commit_makes_an_image_with_its_config(backend):
    info = await backend.create(SPEC)
    r = await backend.exec(info.id, "mkdir -p /opt/app && echo committed > /opt/app/file.txt && rm /etc/debian_version")
    assert r.exit_code == 0, r.stderr
    ref = f"forkyard/test-commit:{uuid.uuid4().hex[:12]}"
    config = ImageConfig(env={"FROM_COMMIT": "yes"}, workdir="/opt/app", user="nobody")
    await backend.commit(info.id, ref, config)
    try:
        assert await backend.has_image(ref)
        child = await backend.create(SandboxSpec(image=ref))
        r = await backend.exec(child.id, "cat file.txt; whoami; pwd; echo $FROM_COMMIT; test -e /etc/debian_version || echo gone")
        assert r.stdout == "committed\nnobody\n/opt/app\nyes\ngone\n", r
        # The parent keeps working and is unaffected by the child.
        await backend.exec(child.id, "echo child-only > /tmp/child.txt")
        r = await backend.exec(info.id, "cat /opt/app/file.txt; test -e /tmp/child.txt || echo absent")
        assert r.stdout == "committed\nabsent\n"
        await backend.destroy(child.id)
    finally:
        await backend.remove_image(ref)
    assert not await backend.has_image(ref)
    await backend.remove_image(ref)  # idempotent
    with pytest.raises(ImageNotFoundError):
        await backend.create(SandboxSpec(image=ref))


async def test_nothing_is_left_behind(backend, backend_root, created):
    infos = [await backend.create(SPEC) for _ in range(3)]
    await backend.exec(infos[0].id, "sleep 100 &")  # a background job the destroy must reap
    await backend.exec(infos[1].id, "trap '' USR1; while :; do :; done", timeout_s=1)  # a replaced shell
    await backend.exec(infos[2].id, "exit 7")  # another replaced shell
    busy = asyncio.ensure_future(backend.exec(infos[2].id, "sleep 100", timeout_s=60))
    await asyncio.sleep(0.2)
    await asyncio.gather(*(backend.destroy(i.id) for i in infos))
    await asyncio.wait_for(busy, 30)  # destroy ends a running command rather than hanging it
    assert {i.id for i in infos} <= set(created)
    assert not {i.id for i in infos} & {i.id for i in await backend.list()}
    assert find_leftovers(backend, backend_root, [i.id for i in infos]) == []


@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.05, 0.2])
async def test_cancelled_create_leaves_nothing(backend, backend_root, delay_s):
    task = asyncio.ensure_future(backend.create(SPEC))
    await asyncio.sleep(delay_s)
    task.cancel()
    try:
        info = await task
    except asyncio.CancelledError:
        pass
    else:  # it finished before the cancel arrived: the caller owns it
        await backend.destroy(info.id)
    assert await backend.list() == []

"""The persistent-shell protocol against a real bash on the host (no sandbox)."""

import asyncio
import os
import signal
import subprocess
import time

import pytest

from sandboxes.base import normalize_sandbox_path
from sandboxes.errors import PathEscapeError
from sandboxes.procs import descendants, kill_descendants_since, ticks_now
from sandboxes.shell import (
    ABORT_SIGNAL,
    STDERR,
    STDOUT,
    TIMEOUT_EXIT_CODE,
    ShellChannel,
    ansi_c_quote,
)


@pytest.fixture
async def channel():
    proc = await asyncio.create_subprocess_exec(
        "bash", "--noprofile", "--norc",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )

    async def write(data: bytes) -> None:
        proc.stdin.write(data)
        await proc.stdin.drain()

    ch = ShellChannel(write)
    ch.pid = proc.pid  # for the abort test

    async def pump(reader, stream):
        while chunk := await reader.read(65536):
            ch.feed(stream, chunk)
        ch.feed_eof()

    pumps = [asyncio.create_task(pump(proc.stdout, STDOUT)), asyncio.create_task(pump(proc.stderr, STDERR))]
    try:
        yield ch
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        for t in pumps:
            t.cancel()


@pytest.mark.parametrize(
    "text",
    ["plain", "it's", "back\\slash", "new\nline", "tab\there", "bell\x07", "ünïcode ✓", "$HOME `x` $(y)", "'\"'"],
)
def test_ansi_c_quote_round_trips_through_bash(text):
    out = subprocess.run(["bash", "-c", f"printf %s {ansi_c_quote(text)}"], capture_output=True, check=True)
    assert out.stdout.decode() == text


async def test_exit_code_stdout_stderr_are_separate(channel):
    r = await channel.run("echo out; echo err >&2; exit_code() { return 7; }; exit_code", timeout_s=5)
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 7)


async def test_cwd_and_exports_persist(channel):
    await channel.run("cd /tmp && export FY_TEST=42", timeout_s=5)
    r = await channel.run('echo "$PWD $FY_TEST"', timeout_s=5)
    assert r.stdout == "/tmp 42\n"
    assert r.cwd == "/tmp"


async def test_output_without_trailing_newline_is_exact(channel):
    r = await channel.run("printf abc", timeout_s=5)
    assert r.stdout == "abc"


async def test_syntax_error_is_an_exit_code_not_a_hang(channel):
    r = await channel.run("echo 'unterminated", timeout_s=5)
    assert r.exit_code != 0 and not r.timed_out
    assert (await channel.run("echo still here", timeout_s=5)).stdout == "still here\n"


async def test_command_cannot_read_the_protocol_from_stdin(channel):
    r = await channel.run("cat", timeout_s=5)
    assert r.exit_code == 0 and r.stdout == ""


async def test_output_cap_keeps_head_and_tail_with_marker(channel):
    r = await channel.run("seq 1 100000", timeout_s=10, max_output_bytes=1000)
    assert r.truncated
    assert r.stdout.startswith("1\n2\n3\n")
    assert r.stdout.endswith("99999\n100000\n")
    assert "bytes of output truncated" in r.stdout
    assert len(r.stdout) < 1200


async def test_timeout_calls_the_killer_and_reports(channel):
    called = []

    async def on_timeout():
        called.append(True)

    r = await channel.run("sleep 0.3; echo late", timeout_s=0.05, on_timeout=on_timeout)
    assert r.timed_out and called
    assert "timed out" in r.stderr


async def test_abort_signal_skips_the_rest_of_the_command(channel):
    async def on_timeout():
        os.kill(channel.pid, ABORT_SIGNAL)
        kill_descendants_since(channel.pid, since)

    since = ticks_now()
    r = await channel.run("echo a; sleep 30; echo never", timeout_s=0.5, on_timeout=on_timeout)
    assert (r.stdout, r.exit_code, r.timed_out) == ("a\n", TIMEOUT_EXIT_CODE, True)
    since = ticks_now()
    r = await channel.run("export X=1; while :; do :; done", timeout_s=0.5, on_timeout=on_timeout)
    assert r.exit_code == TIMEOUT_EXIT_CODE
    assert (await channel.run("echo $X", timeout_s=5)).stdout == "1\n"


async def test_an_abort_that_misses_is_repeated_before_the_shell_is_given_up(channel):
    # On a loaded host the first abort can land before the command started what it
    # starts (here: the sweep finds nothing to kill); the next attempt must finish the job.
    attempts = []

    async def on_timeout():
        attempts.append(ticks_now())
        if len(attempts) > 1:
            os.kill(channel.pid, ABORT_SIGNAL)
            kill_descendants_since(channel.pid, since)

    since = ticks_now()
    r = await channel.run("export Y=2; sleep 30; echo never", timeout_s=0.3, on_timeout=on_timeout, grace_s=3.0)
    assert (r.exit_code, r.timed_out, r.stdout) == (TIMEOUT_EXIT_CODE, True, "")
    assert len(attempts) == 2 and not channel.broken
    assert (await channel.run("echo $Y", timeout_s=5)).stdout == "2\n"


async def test_a_shell_that_ignores_every_abort_is_marked_broken(channel):
    attempts = []

    async def on_timeout():
        attempts.append(True)

    since = ticks_now()
    r = await channel.run("sleep 30", timeout_s=0.1, on_timeout=on_timeout, grace_s=0.4)
    assert r.timed_out and channel.broken
    assert len(attempts) >= 2
    kill_descendants_since(channel.pid, since)  # what a backend does when it replaces the shell


def test_a_kill_spares_the_named_processes_whatever_their_start_tick():
    """A container's shell is a descendant of its init: a command started in its clock tick dies, it does not."""
    tree = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        for _ in range(500):  # bounded: the two sleeps start within milliseconds
            children = [pid for pid, _ in descendants(tree.pid)]
            if len(children) == 2:
                break
            time.sleep(0.01)
        spared, _doomed = children
        assert kill_descendants_since(tree.pid, 0, spare={spared}) >= 1
        assert [pid for pid, _ in descendants(tree.pid)] == [spared]
        assert kill_descendants_since(tree.pid, 0) >= 1  # unnamed, it goes too
        assert descendants(tree.pid) == []
    finally:
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait(timeout=10)


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/etc/passwd", "/etc/passwd"), ("a/b", "/work/a/b"), ("/a/../b", "/b"), ("./x//y/", "/work/x/y")],
)
def test_normalize_sandbox_path(path, expected):
    assert normalize_sandbox_path(path, "/work") == expected


@pytest.mark.parametrize("path", ["../../etc/passwd", "/..", "/a/../../b", "", "a\x00b"])
def test_normalize_sandbox_path_refuses_escapes(path):
    with pytest.raises(PathEscapeError):
        normalize_sandbox_path(path, "/")

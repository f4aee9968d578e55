"""One long-lived bash per sandbox, driven with sentinel-framed commands.

Both backends own a byte channel to a ``bash --noprofile --norc`` (a pipe pair for
``local``, the attach socket for ``docker``) and feed what it prints into a
:class:`ShellChannel`. No process is spawned per command: a command costs one write
and the read of its output, which is what keeps ``exec`` under a millisecond.

Each command is sent as ``__fy_run $'<quoted>' </dev/null`` (a shell function that
``eval``s it) followed by a ``printf`` of a per-sandbox random marker with the exit code
and ``$PWD``. ``eval`` runs in the shell itself so ``cd`` and ``export`` persist, a
syntax error in the command is just a non-zero exit, and the command cannot swallow the
lines after it from stdin.

A timeout aborts the whole command, not only the process running at that moment: the
backend sends the shell ``SIGUSR1`` (see :data:`ABORT_SIGNAL`) and then kills every
process the command started. The shell's ``USR1`` trap runs ``return`` inside
``__fy_run``, so the rest of the command list is skipped (``sleep 100; echo never``
prints nothing) and even a builtin loop (``while :; do :; done``) stops, without
restarting the shell. The exit code of a timed-out command is :data:`TIMEOUT_EXIT_CODE`.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import Awaitable, Callable

from sandboxes.base import DEFAULT_MAX_OUTPUT_BYTES, ExecResult

STDOUT = 1
STDERR = 2

#: Exit code reported when the shell itself died during a command.
SHELL_DIED_EXIT_CODE = -1
#: Exit code of a command aborted by its timeout (as coreutils ``timeout`` reports).
TIMEOUT_EXIT_CODE = 124
#: Signal a backend sends the shell to abort the running command (before killing its processes).
ABORT_SIGNAL = signal.SIGUSR1
#: How many times a timed-out command is aborted within the grace period before the shell is replaced.
_ABORT_ATTEMPTS = 4

# The sandbox's clock in ticks (1/100 s, the unit of /proc/PID/stat starttime).
UPTIME_SCRIPT = r"""read -r up _ < /proc/uptime; echo "$((10#${up/./}))" """
#: Run inside a sandbox whose processes the host cannot see (a remote engine, gVisor): abort
#: the shell's command (USR1), then kill every process but PID 1, the shell (pid $2) and this
#: script that started at or after tick $1 (the timed-out command and all it spawned,
#: reparented or not). Only builtins, so the script forks nothing that could kill itself.
KILL_SINCE_SCRIPT = r"""
since=$1 shell=$2
kill -USR1 "$shell" 2>/dev/null
for round in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  n=0
  for f in /proc/[0-9]*/stat; do
    p=${f#/proc/}; p=${p%/stat}
    { [ "$p" = 1 ] || [ "$p" = "$$" ] || [ "$p" = "$shell" ]; } && continue
    read -r l < "$f" 2>/dev/null || continue
    set -- ${l##*) }
    [ "${20}" -ge "$since" ] 2>/dev/null && kill -9 "$p" 2>/dev/null && n=$((n + 1))
  done
  [ "$n" = 0 ] && break
done
"""

# Installed before every command (user code may reset traps). The trap only returns
# when it fires inside a function, so a late signal while the shell idles is harmless.
_PRELUDE = (
    f"trap 'case ${{FUNCNAME[0]-}} in ?*) return {TIMEOUT_EXIT_CODE};; esac' USR1\n"
    "__fy_run() { local __fy_cmd=$1; shift; eval \"$__fy_cmd\"; }\n"
)


def ansi_c_quote(text: str) -> str:
    """Quote ``text`` as a bash ``$'...'`` word that reproduces it byte for byte."""
    out = ["$'"]
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append("'")
    return "".join(out)


class _Capture:
    """Collect one stream of one command, keeping a head and a tail under a byte cap."""

    def __init__(self, marker: bytes, trailer_fields: int) -> None:
        self.marker = b"\n" + marker
        self.trailer_fields = trailer_fields
        self.pending = bytearray()
        self.reset(DEFAULT_MAX_OUTPUT_BYTES)

    def reset(self, cap: int) -> None:
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.done = False
        self.trailer: list[bytes] = []

    def _keep(self, data: bytes | bytearray) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        extra = len(self.tail) - self.half
        if extra > 0:
            del self.tail[:extra]
            self.dropped += extra

    def feed(self, data: bytes) -> bool:
        """Take ``data``; return True once this command's marker line has arrived."""
        if self.done:
            # Output of a background job after the marker belongs to the next command.
            self.pending += data
            return True
        self.pending += data
        idx = self.pending.find(self.marker)
        if idx < 0:
            safe = len(self.pending) - len(self.marker)
            if safe > 0:
                self._keep(self.pending[:safe])
                del self.pending[:safe]
            return False
        end = self.pending.find(b"\n", idx + len(self.marker))
        if end < 0:
            return False  # the marker line is not complete yet
        self._keep(self.pending[:idx])
        line = bytes(self.pending[idx + len(self.marker) : end])
        self.trailer = line.split(b" ", self.trailer_fields)[1:] if self.trailer_fields else []
        del self.pending[: end + 1]
        self.done = True
        return True

    def text(self) -> tuple[str, bool]:
        """Return the captured output and whether bytes were dropped."""
        body = bytes(self.head)
        if self.dropped:
            note = f"\n[... forkyard: {self.dropped} bytes of output truncated ...]\n".encode()
            body += note
        body += bytes(self.tail)
        return body.decode("utf-8", errors="replace"), bool(self.dropped)


class ShellChannel:
    """Run commands one at a time in a persistent bash reached through ``write``."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        self._marker = f"__FORKYARD_{secrets.token_hex(8)}__".encode()
        self._out = _Capture(self._marker, trailer_fields=2)
        self._err = _Capture(self._marker, trailer_fields=0)
        self._out.done = self._err.done = True
        self._lock = asyncio.Lock()
        self._finished = asyncio.Event()
        self.closed = False
        self.broken = False
        """True once the shell died or stopped answering; the backend must replace it."""
        self.cwd: str | None = None
        self.command_started_at: float = 0.0

    def feed(self, stream: int, data: bytes) -> None:
        """Hand bytes the shell printed on ``stream`` (STDOUT or STDERR) to the channel."""
        cap = self._out if stream == STDOUT else self._err
        cap.feed(data)
        if self._out.done and self._err.done:
            self._finished.set()

    def feed_eof(self) -> None:
        """Tell the channel the shell is gone."""
        for cap in (self._out, self._err):
            if not cap.done and cap.pending:
                # Bytes held back in case they began a marker are plain output after all.
                cap._keep(cap.pending)
                cap.pending.clear()
        self.closed = True
        self.broken = True
        self._finished.set()

    async def _abort(self, on_timeout: Callable[[], Awaitable[None]] | None, grace_s: float) -> bool:
        """Abort the running command within ``grace_s``; return whether the shell answered.

        The abort is repeated a few times: on a loaded host the signal can reach the shell
        before it has entered the command's function (where the trap returns), and a
        process can be forked just after a kill sweep. Each retry is cheap, and replacing
        the shell (the alternative) loses its cwd and exports.
        """
        deadline = time.monotonic() + grace_s
        for attempt in range(_ABORT_ATTEMPTS):
            if on_timeout is not None:
                await on_timeout()
            left = deadline - time.monotonic()
            wait = left if attempt == _ABORT_ATTEMPTS - 1 else min(left, grace_s / _ABORT_ATTEMPTS)
            try:
                await asyncio.wait_for(self._finished.wait(), max(wait, 0.0))
                return True
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return False
        return self._finished.is_set()

    async def run(
        self,
        command: str,
        *,
        timeout_s: float,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
        grace_s: float = 3.0,
    ) -> ExecResult:
        """Run ``command``; on timeout call ``on_timeout`` to kill it and wait ``grace_s``."""
        async with self._lock:
            if self.closed:
                return ExecResult("", "shell is gone\n", SHELL_DIED_EXIT_CODE)
            self._out.reset(max_output_bytes)
            self._err.reset(max_output_bytes)
            self._finished.clear()
            m = self._marker.decode()
            script = (
                f"{_PRELUDE}__fy_run {ansi_c_quote(command)} </dev/null\n"
                f"__fy_rc=$?; printf '\\n{m} %d %s\\n' \"$__fy_rc\" \"$PWD\"; printf '\\n{m}\\n' >&2\n"
            )
            start = time.perf_counter()
            self.command_started_at = time.monotonic()
            # Leftovers from background jobs that printed between commands come first.
            for cap, stream in ((self._out, STDOUT), (self._err, STDERR)):
                if cap.pending:
                    data = bytes(cap.pending)
                    cap.pending.clear()
                    self.feed(stream, data)
            try:
                await self._write(script.encode())
            except (ConnectionError, OSError):
                self.feed_eof()
            timed_out = False
            try:
                await asyncio.wait_for(self._finished.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
                if not await self._abort(on_timeout, grace_s):
                    # A shell that ignores the abort (`trap '' USR1; while :; do :; done`)
                    # cannot be stopped apart from itself: the backend replaces the shell.
                    self.broken = True
            stdout, t1 = self._out.text()
            stderr, t2 = self._err.text()
            if self._out.done and self._out.trailer:
                exit_code = int(self._out.trailer[0])
                self.cwd = self._out.trailer[1].decode("utf-8", "replace") if len(self._out.trailer) > 1 else self.cwd
            else:
                exit_code = SHELL_DIED_EXIT_CODE if not timed_out else TIMEOUT_EXIT_CODE
            if timed_out:
                note = f"\n[forkyard: command timed out after {timeout_s:g}s and was killed]\n"
                stderr += note
            return ExecResult(
                stdout=stdout,
                stderr=stderr,
                exit_code=exit_code,
                timed_out=timed_out,
                truncated=t1 or t2,
                duration_s=time.perf_counter() - start,
                cwd=self.cwd,
            )

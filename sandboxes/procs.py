"""Host-side process-tree helpers: find and kill what a timed-out command started."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection

CLK_TCK = os.sysconf("SC_CLK_TCK")


def ticks_now() -> int:
    """Return CLOCK_BOOTTIME in clock ticks, the unit of /proc/PID/stat starttime."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLK_TCK)


def _stat(pid: int) -> tuple[int, int] | None:
    """Return (ppid, starttime) of ``pid``, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    # fields[0] is the state (field 3); ppid is field 4, starttime field 22.
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[19])


def start_ticks(pid: int) -> int | None:
    """Return the start time of ``pid`` in clock ticks, or None if it is gone."""
    st = _stat(pid)
    return None if st is None else st[1]


def child_pids(pid: int) -> list[int]:
    """Return the children of ``pid`` (from /proc/PID/task/*/children, else a /proc scan).

    Every thread's list counts: a multi-threaded parent (runc is Go) forks from any thread.
    """
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        found: list[int] = []
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found.extend(int(k) for k in fh.read().split())
        return found
    except OSError:
        pass
    kids = []
    for name in os.listdir("/proc"):  # kernels without CONFIG_PROC_CHILDREN
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] == pid:
                kids.append(int(name))
    return kids


def descendants(root_pid: int) -> list[tuple[int, int]]:
    """Return (pid, starttime) for every live descendant of ``root_pid``."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    found: list[tuple[int, int]] = []
    stack = [root_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child[0])
    return found


def host_pid_of(ns_pid: int, candidates: list[int]) -> int | None:
    """Return which of ``candidates`` (host pids) is ``ns_pid`` in its own pid namespace."""
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return pid
                        break
        except OSError:
            continue
    return None


def signal_pid(pid: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid``; return False if it is gone."""
    if not pid:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_descendants_since(root_pid: int, since_ticks: int, *, spare: Collection[int] = (), rounds: int = 50) -> int:
    """SIGKILL every descendant of ``root_pid`` started at or after ``since_ticks``, but those in ``spare``.

    ``spare`` names by pid what must live although it may have started in the same clock
    tick (10 ms) as the command: a container's shell, when ``root_pid`` is its init.

    Repeats (bounded) because a fork bomb keeps making new processes while we kill.
    Returns how many processes were signalled.
    """
    killed = 0
    for _ in range(rounds):
        victims = [pid for pid, start in descendants(root_pid) if start >= since_ticks and pid not in spare]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return killed

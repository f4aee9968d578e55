"""Host-side file access confined to a sandbox's root directory.

Every path is resolved as if ``root`` were ``/``: ``..`` stops at the root and
symlinks (absolute ones included) are followed inside it, never into the host. The
kernel does this for us with ``openat2(2)`` and ``RESOLVE_IN_ROOT`` (Linux 5.6+);
older kernels get a component-by-component walk that applies the same rules.

Only regular files are read or written: a FIFO or a device node inside a sandbox
must not block the host or reach a host device.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat

_libc = ctypes.CDLL(None, use_errno=True)

#: openat2 is 437 on every architecture that uses the unified syscall table (5.1+).
SYS_OPENAT2 = 437 if platform.machine() != "alpha" else 547
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_MAX_SYMLINKS = 40


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2_works: bool | None = None


def _openat2(dirfd: int, path: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    raw = os.fsencode(path)
    for _ in range(16):
        fd = _libc.syscall(SYS_OPENAT2, dirfd, raw, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.EAGAIN:  # a concurrent rename raced the ".." check: retry
            continue
        raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def _walk_open(rootfd: int, path: str, flags: int, mode: int) -> int:
    """Resolve ``path`` under ``rootfd`` in user space, then open its last component."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    stack = [os.dup(rootfd)]  # fds of the directories from the root down to the current one
    links = 0
    try:
        while pending:
            name = pending.pop(0)
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            last = not pending
            cur = stack[-1]
            try:
                st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            except FileNotFoundError:
                if last and flags & os.O_CREAT:
                    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=cur)
                raise
            if stat.S_ISLNK(st.st_mode):
                if last and flags & os.O_CREAT and flags & os.O_EXCL:
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink(name, dir_fd=cur)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                pending[:0] = [p for p in target.split("/") if p not in ("", ".")]
                continue
            if last:
                return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=cur)
            stack.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur))
        # The path named the root itself.
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def open_in_root(root: str | os.PathLike | int, path: str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` resolved inside ``root`` (a directory path or an open directory fd).

    Returns a new file descriptor; the caller closes it.
    """
    global _openat2_works
    rootfd = root if isinstance(root, int) else os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _openat2_works is not False:
            try:
                fd = _openat2(rootfd, path, flags, mode)
                _openat2_works = True
                return fd
            except OSError as exc:
                if exc.errno != errno.ENOSYS or _openat2_works:
                    raise
                _openat2_works = False
        return _walk_open(rootfd, path, flags, mode)
    finally:
        if not isinstance(root, int):
            os.close(rootfd)


def _with_root(root: str | os.PathLike | int) -> tuple[int, bool]:
    """Return (directory fd, whether the caller must close it)."""
    if isinstance(root, int):
        return root, False
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), True


def _reopen(pathfd: int, flags: int) -> int:
    """Turn an O_PATH descriptor into a real one on the very same inode."""
    return os.open(f"/proc/self/fd/{pathfd}", flags | os.O_CLOEXEC)


def open_file_in_root(root: str | os.PathLike | int, path: str, flags: int) -> int:
    """Open the existing regular file ``path`` inside ``root``; refuse directories, FIFOs and devices.

    The type is checked on an O_PATH descriptor, which opens nothing, and the file is
    then reopened through that very descriptor, so a swap in between cannot fool it.
    """
    rootfd, owned = _with_root(root)
    try:
        pathfd = open_in_root(rootfd, path, os.O_PATH)
        try:
            st = os.fstat(pathfd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            return _reopen(pathfd, flags)
        finally:
            os.close(pathfd)
    finally:
        if owned:
            os.close(rootfd)


def file_size_in_root(root: str | os.PathLike | int, path: str) -> int:
    """Return the size of the regular file ``path`` inside ``root``."""
    fd = open_file_in_root(root, path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


class TooLargeError(OSError):
    """A file is bigger than the caller's cap (``args``: errno EFBIG, message, path)."""


def read_in_root(root: str | os.PathLike | int, path: str, max_bytes: int | None = None) -> bytes:
    """Return the bytes of the regular file ``path`` inside ``root``, at most ``max_bytes`` of them.

    Raises:
        TooLargeError: the file holds more than ``max_bytes`` (checked by size, then by what a read returns).
    """
    rootfd, owned = _with_root(root)
    try:
        fd = open_file_in_root(rootfd, path, os.O_RDONLY)
        with open(fd, "rb", closefd=True) as fh:
            if max_bytes is None:
                return fh.read()
            if os.fstat(fd).st_size > max_bytes:
                raise TooLargeError(errno.EFBIG, f"larger than {max_bytes} bytes", path)
            data = fh.read(max_bytes + 1)  # it may grow meanwhile
            if len(data) > max_bytes:
                raise TooLargeError(errno.EFBIG, f"larger than {max_bytes} bytes", path)
            return data
    finally:
        if owned:
            os.close(rootfd)


def mkdirs_in_root(
    root: str | os.PathLike | int, path: str, mode: int = 0o755, owner: tuple[int, int] | None = None
) -> None:
    """Create directory ``path`` and its missing parents inside ``root``, owned by ``owner`` (uid, gid) if given."""
    rootfd, owned = _with_root(root)
    try:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        for i in range(len(parts)):
            prefix = "/".join(parts[: i + 1])
            try:
                os.close(open_in_root(rootfd, prefix, os.O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFoundError:
                pass
            parent = open_in_root(rootfd, "/".join(parts[:i]) or "/", os.O_PATH | os.O_DIRECTORY)
            try:
                # One plain name relative to an already-confined directory cannot escape.
                os.mkdir(parts[i], mode, dir_fd=parent)
                if owner is not None:
                    os.chown(parts[i], *owner, dir_fd=parent, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.close(parent)
            # A dangling symlink in the way makes this raise: better than guessing.
            os.close(open_in_root(rootfd, prefix, os.O_PATH | os.O_DIRECTORY))
    finally:
        if owned:
            os.close(rootfd)


def write_in_root(
    root: str | os.PathLike | int,
    path: str,
    data: bytes,
    mode: int = 0o644,
    make_parents: bool = True,
    owner: tuple[int, int] | None = None,
) -> None:
    """Write ``data`` to ``path`` inside ``root`` with permission bits ``mode``.

    A file or directory this makes belongs to ``owner`` (uid, gid) if given; an existing
    file keeps its owner.
    """
    rootfd, owned = _with_root(root)
    try:
        parent = path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else ""
        if make_parents and parent:
            mkdirs_in_root(rootfd, parent, owner=owner)
        try:
            fd = open_in_root(rootfd, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & 0o7777)
            if owner is not None:
                os.fchown(fd, *owner)
        except FileExistsError:
            fd = open_file_in_root(rootfd, path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.fchmod(fd, mode & 0o7777)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    finally:
        if owned:
            os.close(rootfd)


def tree_bytes(path: str | os.PathLike) -> int:
    """Return the disk bytes of the tree at ``path`` (symlinks not followed, hard links counted once)."""
    total, seen, stack = 0, set(), [os.fspath(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


def _force_walk(enabled: bool) -> None:
    """Use the user-space resolver even where openat2 exists (tests of the fallback)."""
    global _openat2_works
    _openat2_works = False if enabled else None


__all__ = ["TooLargeError", "file_size_in_root", "mkdirs_in_root", "open_file_in_root", "open_in_root", "read_in_root",
           "tree_bytes", "write_in_root"]


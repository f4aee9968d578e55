"""Host-side reading of layered filesystems: what a snapshot changed, and paths put back as they were.

Both backends keep a sandbox's files as overlayfs layers on this host: the local backend
in its own layer dirs, the Docker engine's ``overlay2`` driver in its ``diff`` dirs. A
:class:`LayerStack` reads such a stack as the merged filesystem a sandbox sees, from the
host and never through the sandbox's own programs: whiteouts (0/0 character devices)
hide, ``trusted.overlay.opaque`` directories cut off the layers below, and no symbolic
link is ever followed (a link is an entry like any other, read with ``readlink``).

Only immutable layers are read (a snapshot's, an image's): nothing can swap a directory
for a link between a check and a use. Nothing here knows what the files mean; a caller
decides what matters (:mod:`workers.envs.tamper` decides what a verifier must not trust).

- :func:`diff` lists what one stack changed against another (an agent's snapshot against
  the image or the setup it started from): added, modified (content, type, mode, owner or
  link target; a new mtime alone is not a change) and deleted paths.
- :func:`seed_revert` fills a new sandbox's empty upper dir so that, mounted over a
  snapshot's layers, chosen paths read as another stack has them (a whiteout where that
  stack has nothing, a private copy otherwise, a whole directory made opaque).
"""

from __future__ import annotations

import enum
import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandboxes.errors import FileTooLargeError, SandboxError

#: The xattr that makes an overlay directory hide what the layers below hold under it.
OVERLAY_OPAQUE_XATTR = "trusted.overlay.opaque"
#: Most entries :func:`diff` lists before it gives up (a snapshot that rewrote a whole OS).
MAX_CHANGES = 500_000


class EntryKind(str, enum.Enum):
    """What a path is."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"
    """A device node, FIFO or socket."""


@dataclass(frozen=True)
class Entry:
    """One path of a merged view, as the topmost layer that has it holds it."""

    path: str
    """Absolute inside the sandbox."""
    kind: EntryKind
    mode: int
    """``st_mode`` (type and permission bits)."""
    uid: int
    gid: int
    size: int
    mtime_ns: int
    target: str
    """A link's target ("" for anything else)."""
    host: str
    """Where the entry lives on the host (inside one layer dir)."""
    rdev: int = 0

    def same_as(self, other: Entry) -> bool:
        """Tell whether ``other`` holds what this entry does (type, mode, owner, target, device, bytes).

        The mtime is not compared: rewriting a file with the same bytes is not a change.
        """
        if (self.kind, self.mode, self.uid, self.gid, self.target, self.rdev) != (
            other.kind, other.mode, other.uid, other.gid, other.target, other.rdev
        ):
            return False
        if self.kind is not EntryKind.FILE:
            return True
        if self.size != other.size:
            return False
        if self.host == other.host:
            return True
        a, b = os.lstat(self.host), os.lstat(other.host)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            return True  # hard links between layers (a squash links what it keeps)
        return _file_digest(self.host) == _file_digest(other.host)


def _file_digest(host: str) -> bytes:
    h = hashlib.sha256()
    fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.digest()


def _kind(mode: int) -> EntryKind:
    if stat.S_ISREG(mode):
        return EntryKind.FILE
    if stat.S_ISDIR(mode):
        return EntryKind.DIR
    if stat.S_ISLNK(mode):
        return EntryKind.SYMLINK
    return EntryKind.OTHER


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(host: str) -> bool:
    try:
        return os.getxattr(host, OVERLAY_OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _parts(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts) or "\x00" in path:
        raise SandboxError(f"not a normalized absolute path: {path!r}")
    return parts


def _join(parts: Sequence[str]) -> str:
    return "/" + "/".join(parts)


class LayerStack:
    """A read-only, host-side view of overlay layers (bottom to top) as the merged filesystem."""

    def __init__(self, layers: Iterable[str | os.PathLike[str]]) -> None:
        self.layers: tuple[str, ...] = tuple(os.fspath(layer) for layer in layers)
        if not self.layers:
            raise SandboxError("a layer stack needs at least one layer")
        self._dirs: dict[str, tuple[str, ...] | None] = {"/": tuple(reversed(self.layers))}
        """Directory path -> the layers (top first) whose dirs merge into it; None: not a directory."""

    def __repr__(self) -> str:
        return f"LayerStack({len(self.layers)} layers, top {self.layers[-1]})"

    def _merge(self, path: str) -> tuple[str, ...] | None:
        """Return the layers (top first) holding the directory ``path`` of the merged view, or None."""
        if path in self._dirs:
            return self._dirs[path]
        parent, _, name = path.rpartition("/")
        chain = self._merge(parent or "/")
        merged: list[str] = []
        if chain is not None:
            for layer in chain:
                host = layer + path
                try:
                    st = os.lstat(host)
                except FileNotFoundError:
                    continue
                if _is_whiteout(st) or not stat.S_ISDIR(st.st_mode):
                    break  # hides this path in every layer below
                merged.append(layer)
                if _is_opaque(host):
                    break
        result = tuple(merged) if merged else None
        self._dirs[path] = result
        return result

    def lookup(self, path: str) -> Entry | None:
        """Return what ``path`` (absolute) is in the merged view, or None where it does not exist."""
        parts = _parts(path)
        if not parts:
            return self._entry("/", self.layers[-1])
        clean = _join(parts)
        chain = self._merge(_join(parts[:-1]) if len(parts) > 1 else "/")
        if chain is None:
            return None
        for layer in chain:
            host = layer + clean
            try:
                st = os.lstat(host)
            except FileNotFoundError:
                continue
            if _is_whiteout(st):
                return None
            return self._make(clean, host, st)
        return None

    def _entry(self, path: str, layer: str) -> Entry:
        host = layer + (path if path != "/" else "")
        return self._make(path, host or "/", os.lstat(host or "/"))

    @staticmethod
    def _make(path: str, host: str, st: os.stat_result) -> Entry:
        kind = _kind(st.st_mode)
        return Entry(
            path=path, kind=kind, mode=st.st_mode, uid=st.st_uid, gid=st.st_gid,
            size=st.st_size if kind is EntryKind.FILE else 0, mtime_ns=st.st_mtime_ns,
            target=os.readlink(host) if kind is EntryKind.SYMLINK else "", host=host,
            rdev=st.st_rdev if kind is EntryKind.OTHER else 0,
        )  # fmt: skip

    def children(self, path: str) -> dict[str, Entry]:
        """Return the entries of directory ``path`` in the merged view, by name (empty if it is no directory)."""
        parts = _parts(path)
        clean = _join(parts)
        chain = self._merge(clean)
        if chain is None:
            return {}
        found: dict[str, Entry] = {}
        hidden: set[str] = set()
        base = "" if clean == "/" else clean
        for layer in chain:
            with os.scandir(layer + base) as it:
                for item in it:
                    name = item.name
                    if name in found or name in hidden:
                        continue
                    st = os.lstat(item.path)
                    if _is_whiteout(st):
                        hidden.add(name)
                    else:
                        found[name] = self._make(f"{base}/{name}", item.path, st)
        return found

    def walk(self, path: str = "/") -> Iterator[Entry]:
        """Yield every entry under directory ``path`` (not ``path`` itself), parents before children."""
        stack = [path]
        while stack:
            current = stack.pop()
            for _name, entry in sorted(self.children(current).items(), reverse=True):
                yield entry
                if entry.kind is EntryKind.DIR:
                    stack.append(entry.path)

    def read(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Return the bytes of regular file ``path`` (no link followed).

        Raises:
            FileNotFoundError: no such path; IsADirectoryError: a directory.
            SandboxError: a link or special file; FileTooLargeError: bigger than ``max_bytes``.
        """
        entry = self.lookup(path)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        if entry.kind is EntryKind.DIR:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if entry.kind is not EntryKind.FILE:
            raise SandboxError(f"{path} is a {entry.kind.value}, not a regular file")
        if max_bytes is not None and entry.size > max_bytes:
            raise FileTooLargeError(f"{path} is larger than {max_bytes} bytes")
        fd = os.open(entry.host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            return fh.read() if max_bytes is None else fh.read(max_bytes)


class ChangeKind(str, enum.Enum):
    """How a path differs between two views."""

    ADDED = "added"
    MODIFIED = "modified"
    DELETED = "deleted"


@dataclass(frozen=True)
class FileChange:
    """One path that differs between a base view and a later one."""

    path: str
    kind: ChangeKind
    before: Entry | None
    after: Entry | None


def _layer_paths(layer: str) -> Iterator[tuple[str, bool]]:
    """Yield (path, opaque dir) for every entry of one layer dir, without following links."""
    for dirpath, dirnames, filenames in os.walk(layer, followlinks=False):
        rel = dirpath[len(layer):] or ""
        for name in dirnames:
            host = os.path.join(dirpath, name)
            yield f"{rel}/{name}", (not os.path.islink(host)) and _is_opaque(host)
        for name in filenames:
            yield f"{rel}/{name}", False


def diff(base: LayerStack, top: LayerStack) -> list[FileChange]:
    """Return what ``top`` changed against ``base``, sorted by path.

    Where ``top`` is ``base`` plus layers of its own (a snapshot of a sandbox started
    from ``base``), only those layers are read. Otherwise (layers squashed or flattened)
    every path of ``top``'s own layers is compared. A deleted or replaced directory lists
    its descendants as deleted too.

    Raises:
        SandboxError: more than :data:`MAX_CHANGES` paths to compare.
    """
    if top.layers[:len(base.layers)] == base.layers:
        own = top.layers[len(base.layers):]
    else:  # squashed or flattened: base's own layers may hold what top deleted, with no whiteout left
        shared = set(base.layers) & set(top.layers)
        own = tuple(layer for layer in (*top.layers, *base.layers) if layer not in shared)
    candidates: set[str] = set()
    for layer in own:
        for path, opaque in _layer_paths(layer):
            candidates.add(path)
            if opaque:  # whatever base had under it is gone unless the layer has it again
                candidates.update(e.path for e in base.walk(path))
            if len(candidates) > MAX_CHANGES:
                raise SandboxError(f"more than {MAX_CHANGES} changed paths to compare")
    changes: list[FileChange] = []
    for path in sorted(candidates):
        before, after = base.lookup(path), top.lookup(path)
        if before is None and after is None:
            continue
        if before is None:
            changes.append(FileChange(path, ChangeKind.ADDED, None, after))
        elif after is None:
            changes.append(FileChange(path, ChangeKind.DELETED, before, None))
            if before.kind is EntryKind.DIR:
                changes.extend(FileChange(e.path, ChangeKind.DELETED, e, None) for e in base.walk(path)
                               if e.path not in candidates)
        elif not before.same_as(after):
            changes.append(FileChange(path, ChangeKind.MODIFIED, before, after))
            if before.kind is EntryKind.DIR and after.kind is not EntryKind.DIR:
                changes.extend(FileChange(e.path, ChangeKind.DELETED, e, None) for e in base.walk(path)
                               if e.path not in candidates)
    changes.sort(key=lambda c: c.path)
    return changes


def _copy_meta(entry: Entry, dst: str) -> None:
    os.chown(dst, entry.uid, entry.gid, follow_symlinks=False)
    if entry.kind is not EntryKind.SYMLINK:
        os.chmod(dst, stat.S_IMODE(entry.mode))
    try:
        for name in os.listxattr(entry.host, follow_symlinks=False):
            if name == OVERLAY_OPAQUE_XATTR:
                continue
            os.setxattr(dst, name, os.getxattr(entry.host, name, follow_symlinks=False), follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EPERM, errno.ENODATA):
            raise
    os.utime(dst, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


def _place(entry: Entry, dst: str) -> None:
    """Make ``dst`` a private copy of ``entry`` (a directory: empty; the caller fills it)."""
    if entry.kind is EntryKind.DIR:
        os.mkdir(dst)
    elif entry.kind is EntryKind.SYMLINK:
        os.symlink(entry.target, dst)
    elif entry.kind is EntryKind.FILE:
        # A copy, never a link: the new sandbox may write to it, and a layer is shared.
        src = os.open(entry.host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                with os.fdopen(src, "rb", closefd=False) as fin, os.fdopen(out, "wb", closefd=False) as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
            finally:
                os.close(out)
        finally:
            os.close(src)
    elif stat.S_ISFIFO(entry.mode):
        os.mkfifo(dst, 0o600)
    elif stat.S_ISCHR(entry.mode) or stat.S_ISBLK(entry.mode):
        os.mknod(dst, entry.mode, entry.rdev)
    else:
        return  # a socket is not part of a filesystem
    _copy_meta(entry, dst)


def seed_revert(upper: str | os.PathLike[str], *, base: LayerStack, top: LayerStack, paths: Iterable[str]) -> list[str]:
    """Fill the empty upper dir of a new sandbox over ``top`` so that ``paths`` read as in ``base``.

    A path ``base`` lacks gets a whiteout; a file or link a private copy; a directory a
    private copy of its whole tree, made opaque so nothing ``top`` added under it shows.
    Directories made on the way take ``top``'s owner and mode and stay transparent.
    A path under one already reverted is covered by it. Returns the paths reverted.

    Raises:
        SandboxError: a parent of a path is no directory in ``top`` (revert the parent instead).
    """
    root = os.fspath(upper)
    done: list[str] = []
    for path in sorted(set(_join(_parts(p)) for p in paths), key=lambda p: (p.count("/"), p)):
        if path == "/" or any(path.startswith(d + "/") for d in done):
            continue
        parts = _parts(path)
        for i in range(1, len(parts)):
            sub = _join(parts[:i])
            dst = root + sub
            if os.path.lexists(dst):
                continue
            entry = top.lookup(sub)
            if entry is None or entry.kind is not EntryKind.DIR:
                raise SandboxError(f"cannot revert {path}: {sub} is no directory in the snapshot")
            os.mkdir(dst)
            _copy_meta(entry, dst)
        dst = root + path
        before = base.lookup(path)
        if before is None:
            os.mknod(dst, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        else:
            _place(before, dst)
            if before.kind is EntryKind.DIR:
                os.setxattr(dst, OVERLAY_OPAQUE_XATTR, b"y", follow_symlinks=False)
                for entry in base.walk(path):
                    _place(entry, root + entry.path)
                for entry in (e for e in base.walk(path) if e.kind is EntryKind.DIR):
                    os.utime(root + entry.path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
                os.utime(dst, ns=(before.mtime_ns, before.mtime_ns), follow_symlinks=False)
        done.append(path)
    return done


def layer_dirs_exist(layers: Sequence[str]) -> bool:
    """Tell whether every layer dir is a directory on this host (a remote engine's are not)."""
    return all(Path(layer).is_dir() for layer in layers)


__all__ = [
    "MAX_CHANGES",
    "OVERLAY_OPAQUE_XATTR",
    "ChangeKind",
    "Entry",
    "EntryKind",
    "FileChange",
    "LayerStack",
    "diff",
    "layer_dirs_exist",
    "seed_revert",
]

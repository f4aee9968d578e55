"""Snapshots of a sandbox: the :class:`Snapshot` value type and helpers both backends share.

A snapshot is immutable and content-addressed. It holds:

- the filesystem: for ``local`` the overlay layer list (the image's layers plus a sealed
  copy of the sandbox's upper dir); for ``docker`` an image committed from the container
  (repository ``forkyard/snapshot``, tag = the snapshot id);
- the logical state of the persistent shell: its working directory and its exported
  variables (not shell-local variables, functions, aliases or traps);
- where it came from (source image, workdir, resources, network) so ``restore`` can make
  sandboxes like the original.

Background processes are NOT captured: a restored sandbox starts with only its shell.
Every snapshot says so in ``metadata["background_processes"]``.

The id is the first 32 hex digits of the sha256 of the snapshot's canonical description
(:func:`snapshot_id`): its backend, node, filesystem reference (layer refs plus a digest of
the new layer's tree listing, or the committed image's id), shell state and metadata.
Equal ids therefore mean equal content; the creation time is not part of it.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from sandboxes.base import SandboxBackend, SandboxInfo, Snapshot
from sandboxes.errors import SandboxError
from sandboxes.layers import OVERLAY_OPAQUE_XATTR
from sandboxes.shell import ansi_c_quote

#: Metadata key (and value) every snapshot carries: running processes are not part of it.
BACKGROUND_PROCESSES_KEY = "background_processes"
BACKGROUND_PROCESSES_NOT_CAPTURED = "not captured"
#: Docker repository of snapshot images; the tag is the snapshot id.
SNAPSHOT_REPOSITORY = "forkyard/snapshot"
#: Variables the shell maintains itself; never captured nor restored.
SHELL_OWNED_VARS = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
#: Output cap when reading a shell's exported variables.
CAPTURE_MAX_BYTES = 16 << 20

_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Only builtins: prints NAME=VALUE\0 for every exported variable (values may hold newlines).
CAPTURE_COMMAND = 'for __fy_n in $(compgen -e); do printf \'%s=%s\\0\' "$__fy_n" "${!__fy_n}"; done; unset __fy_n'


def snapshot_metadata(extra: Mapping[str, str] | None) -> dict[str, str]:
    """Return the caller's metadata plus the note that background processes are not captured."""
    out = {str(k): str(v) for k, v in (extra or {}).items()}
    out[BACKGROUND_PROCESSES_KEY] = BACKGROUND_PROCESSES_NOT_CAPTURED
    return out


def snapshot_id(description: Mapping[str, Any]) -> str:
    """Return the content address of a snapshot's canonical description."""
    blob = json.dumps(
        description, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def parse_exported(stdout: str) -> dict[str, str]:
    """Parse :data:`CAPTURE_COMMAND` output into {name: value}, leaving out shell-owned names."""
    env: dict[str, str] = {}
    for item in stdout.split("\0"):
        name, sep, value = item.partition("=")
        if sep and _VAR_NAME.match(name) and name not in SHELL_OWNED_VARS:
            env[name] = value
    return env


def restore_command(
    env: Mapping[str, str], cwd: str, *, keep: Iterable[str] = ()
) -> str:
    """Return a shell command making the exports exactly ``env`` (plus ``keep`` as is) and the cwd ``cwd``."""
    names = {n for n in [*env, *keep] if _VAR_NAME.match(n)} | SHELL_OWNED_VARS
    pattern = "|".join(sorted(names))
    parts = [
        f'for __fy_n in $(compgen -e); do case $__fy_n in {pattern}) ;; *) unset "$__fy_n" 2>/dev/null;; esac; done',
        "unset __fy_n",
    ]
    parts += [
        f"export {n}={ansi_c_quote(env[n])}" for n in sorted(env) if _VAR_NAME.match(n)
    ]
    parts.append(f"cd -- {ansi_c_quote(cwd)}")
    return "; ".join(parts)


def tree_digest(root: str | os.PathLike) -> str:
    """Return the sha256 of a directory tree's listing (names, modes, owners, sizes, mtimes, xattrs)."""
    h = hashlib.sha256()
    base = os.fspath(root)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, base)
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            try:
                xattrs = sorted(os.listxattr(path, follow_symlinks=False))
            except OSError:
                xattrs = []
            h.update(
                f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_mtime_ns}\0"
                f"{st.st_rdev}\0{target}\0{','.join(xattrs)}\n".encode(
                    "utf-8", "surrogateescape"
                )
            )
    return h.hexdigest()


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _copy_meta(src: str, dst: str, st: os.stat_result) -> None:
    """Give ``dst`` the owner, mode, xattrs and times of ``src``."""
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    try:
        for name in os.listxattr(src, follow_symlinks=False):
            os.setxattr(
                dst,
                name,
                os.getxattr(src, name, follow_symlinks=False),
                follow_symlinks=False,
            )
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EPERM):
            raise
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def apply_layer(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Lay overlay layer ``src`` on top of layer dir ``dst`` as overlayfs would, keeping whiteouts.

    Regular files are hard-linked (layers are immutable); a whiteout replaces what ``dst``
    had and stays a whiteout (it may hide a file of a layer below both); an opaque
    directory replaces ``dst``'s directory.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    dir_times: list[tuple[str, os.stat_result]] = []
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        s = entry.path
        d = os.path.join(dst, entry.name)
        st = os.lstat(s)
        if stat.S_ISDIR(st.st_mode):
            opaque = False
            try:
                opaque = (
                    os.getxattr(s, OVERLAY_OPAQUE_XATTR, follow_symlinks=False) == b"y"
                )
            except OSError:
                pass
            try:
                dst_is_dir = stat.S_ISDIR(os.lstat(d).st_mode)
            except FileNotFoundError:
                dst_is_dir = None
            if dst_is_dir is False or (dst_is_dir and opaque):
                _remove(d)
                dst_is_dir = None
            if dst_is_dir is None:
                os.mkdir(d)
            _copy_meta(s, d, st)
            apply_layer(s, d)
            dir_times.append((d, st))
            continue
        _remove(d)
        if _is_whiteout(st) or stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            os.mknod(d, st.st_mode, st.st_rdev)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(s), d)
        elif stat.S_ISFIFO(st.st_mode):
            os.mkfifo(d, stat.S_IMODE(st.st_mode))
        elif stat.S_ISREG(st.st_mode):
            try:
                os.link(s, d)
                continue  # shares the inode and with it every attribute
            except OSError:
                shutil.copyfile(s, d, follow_symlinks=False)
        else:
            continue  # sockets are not part of a filesystem snapshot
        _copy_meta(s, d, st)
    for d, st in dir_times:  # children changed the mtimes; put them back
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def squash_layers(layers: list[str], dst: str | os.PathLike) -> None:
    """Merge overlay ``layers`` (bottom to top) into the empty dir ``dst``, keeping whiteouts."""
    target = Path(dst)
    if not target.is_dir():
        raise SandboxError(f"cannot squash layers into {dst}: not a directory")
    for layer in layers:
        apply_layer(layer, target)


__all__ = [
    "BACKGROUND_PROCESSES_KEY",
    "BACKGROUND_PROCESSES_NOT_CAPTURED",
    "CAPTURE_COMMAND",
    "SNAPSHOT_REPOSITORY",
    "Snapshot",
    "apply_layer",
    "parse_exported",
    "restore_command",
    "snapshot_id",
    "snapshot_metadata",
    "squash_layers",
    "tree_digest",
]


async def start_branches(
    backend: SandboxBackend,
    snapshot: Snapshot,
    n: int,
    *,
    create: Callable[[], Awaitable[SandboxInfo]],
    command: str | None = None,
    timeout_s: float = 30.0,
) -> list[SandboxInfo]:
    """Start ``n`` sandboxes with ``create`` and run the shell-state ``command`` in each; all or nothing.

    Without ``command``, ``create`` itself restores the shell state (the local backend
    starts its shells in it). A branch whose shell state cannot be restored is
    destroyed, and so are the others made so far, before the first error is raised.
    """

    async def one() -> SandboxInfo:
        info = await create()
        if command is None:
            return info
        try:
            r = await backend.exec(info.id, command, timeout_s=timeout_s)
            if r.exit_code != 0:
                raise SandboxError(
                    f"cannot restore the shell state of snapshot {snapshot.id} in sandbox {info.id}: "
                    f"{r.stderr.strip()[-300:]}"
                )
        except BaseException:
            await asyncio.shield(backend.destroy(info.id))
            raise
        return info

    if n == 1:  # nothing to undo if it fails (it cleans up after itself), and no task hop on the way
        return [await one()]
    results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    made = [r for r in results if isinstance(r, SandboxInfo)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for info in made:
            await backend.destroy(info.id)
        raise failed[0]
    return made

"""Per-sandbox disk quotas for the local backend: one btrfs subvolume with a qgroup limit per sandbox.

The sandboxes' writable layers (overlay upper and work dirs) live on a btrfs filesystem
made once in a sparse image file and loop-mounted at ``/run/forkyard/disk``, shared by
every backend on the host. Each sandbox gets a subvolume there with a quota group
limit, so an agent that fills its disk gets ``EDQUOT`` ("Disk quota exceeded") inside
its own sandbox while the host's disk and every other sandbox are untouched.

btrfs, not ext4 or xfs project quotas: those need the kernel's generic quota support
(``CONFIG_QUOTA``), which some kernels (this project's CI VMs) lack; btrfs qgroups are
its own. Creating a subvolume and setting its limit are two ioctls, cheap enough for
the fork path.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

from sandboxes.errors import SandboxError

logger = logging.getLogger(__name__)

#: ioctls of linux/btrfs.h: (type 0x94) SUBVOL_CREATE 14, SNAP_DESTROY 15 (struct of 4096 bytes), QGROUP_LIMIT 43.
BTRFS_IOC_SUBVOL_CREATE = 0x5000940E
BTRFS_IOC_SNAP_DESTROY = 0x5000940F
BTRFS_IOC_QGROUP_LIMIT = 0x8030942B
BTRFS_QGROUP_LIMIT_MAX_RFER = 1
_VOL_NAME_MAX = 4087
_QGROUP_LIMIT = struct.Struct("=QQQQQQ")  # qgroupid, flags, max_rfer, max_excl, rsv_rfer, rsv_excl

DEFAULT_IMAGE = Path("/var/lib/forkyard/sandbox-disk.img")
DEFAULT_MOUNTPOINT = Path("/run/forkyard/disk")


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if not raw or len(raw) > _VOL_NAME_MAX or b"/" in raw:
        raise SandboxError(f"invalid subvolume name {name!r}")
    buf = bytearray(4096)
    buf[8 : 8 + len(raw)] = raw
    return buf


class SandboxDisks:
    """The shared btrfs filesystem of sandbox upper dirs: make a limited subvolume, drop one."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint

    @classmethod
    def ensure(cls, image: Path = DEFAULT_IMAGE, mountpoint: Path = DEFAULT_MOUNTPOINT,
               size_bytes: int | None = None) -> SandboxDisks:  # fmt: skip
        """Return the filesystem, making its sparse image and mounting it first if need be (blocking).

        Raises:
            SandboxError: one sentence saying what is missing (btrfs, mkfs.btrfs, a loop device...).
        """
        if not _mounted(mountpoint):
            if shutil.which("mkfs.btrfs") is None or shutil.which("btrfs") is None:
                raise SandboxError("per-sandbox disk quotas need btrfs-progs (apt-get install btrfs-progs)")
            image.parent.mkdir(parents=True, exist_ok=True)
            fresh = not image.exists()
            if fresh:
                free = shutil.disk_usage(image.parent).free
                size = size_bytes or min(max(free * 9 // 10, 8 << 30), 1 << 40)
                with open(image, "wb") as fh:
                    fh.truncate(size)
                os.chmod(image, 0o600)
                _run(["mkfs.btrfs", "-q", "-f", str(image)], "make the sandboxes' disk filesystem")
            mountpoint.mkdir(parents=True, exist_ok=True)
            _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(mountpoint)], "mount the sandboxes' disks")
            _run(["btrfs", "quota", "enable", str(mountpoint)], "enable btrfs quotas on the sandboxes' disks")
            logger.info("sandbox disks: %s mounted on %s (btrfs qgroups)", image, mountpoint)
        os.chmod(mountpoint, 0o711)
        return cls(mountpoint)

    def create(self, path: Path, *, limit_bytes: int) -> None:
        """Make ``path`` (a new name in a directory of this filesystem) a subvolume holding at most ``limit_bytes``."""
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(parent, BTRFS_IOC_SUBVOL_CREATE, _vol_args(path.name))
        except OSError as exc:
            raise SandboxError(f"cannot make the disk of sandbox {path.name}: {exc.strerror}") from exc
        finally:
            os.close(parent)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # qgroupid 0: the subvolume the descriptor is in.
            args = bytearray(_QGROUP_LIMIT.pack(0, BTRFS_QGROUP_LIMIT_MAX_RFER, limit_bytes, 0, 0, 0))
            fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, args)
        except OSError as exc:
            self.destroy(path)
            raise SandboxError(f"cannot limit the disk of sandbox {path.name}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    @staticmethod
    def destroy(path: Path) -> None:
        """Delete subvolume ``path`` with everything in it (missing is fine)."""
        if not path.exists():
            return
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(parent, BTRFS_IOC_SNAP_DESTROY, _vol_args(path.name))
        except OSError as exc:
            # Not a subvolume (made before quotas were on): a plain tree.
            logger.debug("subvolume destroy of %s failed (%s); removing it as a tree", path, exc.strerror)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(parent)


def _mounted(mountpoint: Path) -> bool:
    target = str(mountpoint)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == target for line in fh)
    return False


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    except OSError as exc:
        raise SandboxError(f"cannot {what}: {exc}") from exc
    if proc.returncode != 0:
        raise SandboxError(f"cannot {what}: {(proc.stderr or proc.stdout).strip()[-300:]}")


__all__ = ["DEFAULT_IMAGE", "DEFAULT_MOUNTPOINT", "SandboxDisks"]

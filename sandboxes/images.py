"""Offline base images: a Debian root filesystem made by debootstrap, shared by both backends.

The base image is content-addressed: its tag is a digest of the recipe (suite, variant,
packages, image config, builder version), so a recipe change is a new image and an
unchanged recipe is built once per host and then reused. A build runs in a temporary
directory beside the cache entry and is renamed into place only when complete, under
an exclusive ``flock`` so that two processes never debootstrap the same recipe at once.

Layout of the cache directory::

    <cache_dir>/<tag>/rootfs        the finished root filesystem
    <cache_dir>/<tag>/recipe.json   what was built, from which mirror, when
    <cache_dir>/.<tag>.lock         held while building
    <cache_dir>/.<tag>.tmp-*        a build in progress (or the wreck of a crashed one)
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sandboxes.base import ImageConfig, SandboxBackend
from sandboxes.errors import SandboxError

logger = logging.getLogger(__name__)

#: Where built root filesystems live unless the caller says otherwise (FORKYARD_IMAGE_CACHE).
DEFAULT_IMAGE_CACHE = Path("/var/cache/forkyard/images")
#: Debian mirror debootstrap downloads from unless the caller names another.
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Repository name of base images; the tag is the recipe digest.
BASE_IMAGE_NAME = "forkyard/base"

BASE_SUITE = "bookworm"
BASE_VARIANT = "minbase"
#: Packages installed on top of the minbase variant (which already has tar, gzip, grep,
#: sed, findutils, diffutils...). pytest lets verifiers run with no network.
BASE_PACKAGES: tuple[str, ...] = (
    "bash",
    "coreutils",
    "python3",
    "git",
    "procps",
    "util-linux",
    "ca-certificates",
    "xz-utils",
    "python3-pytest",
)
#: Runtime defaults stored with the base image.
BASE_IMAGE_CONFIG = ImageConfig(
    env={
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    },
    workdir="/",
    user="root",
)
#: Bump when the post-debootstrap steps change what a rootfs contains.
BUILDER_VERSION = 1

HOSTNAME = "sandbox"

Progress = Callable[[str], None]


class BaseImageError(SandboxError):
    """The base root filesystem could not be built (no debootstrap, mirror failure...)."""


def _recipe() -> dict[str, object]:
    """Return everything that decides the content of the base image."""
    return {
        "suite": BASE_SUITE,
        "variant": BASE_VARIANT,
        "packages": sorted(BASE_PACKAGES),
        "config": {
            "env": dict(sorted(BASE_IMAGE_CONFIG.env.items())),
            "workdir": BASE_IMAGE_CONFIG.workdir,
            "user": BASE_IMAGE_CONFIG.user,
        },
        "builder_version": BUILDER_VERSION,
    }


def _recipe_tag() -> str:
    canonical = json.dumps(_recipe(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:12]


def base_image_ref() -> str:
    """Return the base image reference, ``forkyard/base:<12 hex of the recipe digest>``."""
    return f"{BASE_IMAGE_NAME}:{_recipe_tag()}"


def cached_base_rootfs(cache_dir: str | os.PathLike[str]) -> Path | None:
    """Return the finished base rootfs in ``cache_dir``, or None if it was never built."""
    entry = Path(cache_dir) / _recipe_tag()
    if (entry / "recipe.json").is_file() and (entry / "rootfs").is_dir():
        return entry / "rootfs"
    return None


def build_base_rootfs(
    cache_dir: str | os.PathLike[str],
    *,
    mirror: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Debootstrap the base rootfs into ``cache_dir`` once and return its directory.

    Blocking (debootstrap takes about a minute); call it through ``asyncio.to_thread``
    from async code. ``progress`` receives debootstrap's ``I:``/``W:``/``E:`` lines and
    the builder's own steps, from the calling thread.

    Raises:
        BaseImageError: debootstrap is missing, the caller is not root, or the build failed.
    """
    cache_dir = Path(cache_dir)
    found = cached_base_rootfs(cache_dir)
    if found is not None:
        return found
    tag = _recipe_tag()
    ref = f"{BASE_IMAGE_NAME}:{tag}"
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise BaseImageError("debootstrap is not installed: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise BaseImageError("building the base image runs debootstrap, which needs root")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BaseImageError(f"cannot create the image cache directory {cache_dir}: {exc}") from exc
    with _build_lock(cache_dir / f".{tag}.lock", ref, progress):
        found = cached_base_rootfs(cache_dir)
        if found is not None:  # another process finished it while we waited
            return found
        for stale in cache_dir.glob(f".{tag}.tmp-*"):
            logger.info("removing %s left by an interrupted build", stale)
            _remove_tree(stale)
        final = cache_dir / tag
        if final.exists():  # an entry without recipe.json was not made by this builder
            logger.warning("removing incomplete image cache entry %s", final)
            _remove_tree(final)
        work = Path(tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=cache_dir))
        try:
            mirror = mirror or DEFAULT_MIRROR
            _emit(progress, f"building {ref}: debootstrap {BASE_SUITE} from {mirror}")
            version = _run_debootstrap(debootstrap, work / "rootfs", mirror, progress)
            _emit(progress, f"finishing {ref}: cleaning apt caches, writing /etc files")
            _finish_rootfs(work / "rootfs")
            manifest = {
                "ref": ref,
                **_recipe(),
                "mirror": mirror,
                "debootstrap": version,
                "built_at": datetime.datetime.now(datetime.UTC).isoformat(),
            }
            (work / "recipe.json").write_text(json.dumps(manifest, indent=2) + "\n")
            os.chmod(work, 0o755)
            os.rename(work, final)
        except BaseException:
            _remove_tree(work)
            raise
    _emit(progress, f"built {ref} in {final / 'rootfs'}")
    return final / "rootfs"


async def ensure_base_image(
    backend: SandboxBackend,
    cache_dir: str | os.PathLike[str],
    *,
    mirror: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Make the base image known to ``backend`` (building the rootfs if needed); return its ref."""
    ref = base_image_ref()
    if await backend.has_image(ref):
        return ref
    rootfs = await asyncio.to_thread(build_base_rootfs, cache_dir, mirror=mirror, progress=progress)
    _emit(progress, f"importing {ref} into the {backend.name} backend")
    await backend.import_rootfs(str(rootfs), ref, BASE_IMAGE_CONFIG)
    return ref


def _emit(progress: Progress | None, line: str) -> None:
    logger.info("%s", line)
    if progress is not None:
        progress(line)


@contextmanager
def _build_lock(path: Path, ref: str, progress: Progress | None) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _emit(progress, f"waiting for another process building {ref} (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def _run_debootstrap(debootstrap: str, target: Path, mirror: str, progress: Progress | None) -> str:
    """Run debootstrap into ``target``; return its version string."""
    version = subprocess.run([debootstrap, "--version"], check=False, capture_output=True, text=True).stdout.strip()
    argv = [
        debootstrap,
        f"--variant={BASE_VARIANT}",
        f"--include={','.join(BASE_PACKAGES)}",
        BASE_SUITE,
        str(target),
        mirror,
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "LC_ALL": "C",
        "DEBIAN_FRONTEND": "noninteractive",
    }
    logger.info("running %s", " ".join(argv))
    tail: collections.deque[str] = collections.deque(maxlen=30)
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        errors="replace",
    )
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            if not line:
                continue
            tail.append(line)
            if line[:3] in ("I: ", "W: ", "E: "):
                if progress is not None:
                    progress(line)
            else:
                logger.debug("debootstrap: %s", line)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        log_tail = _tail_of(target / "debootstrap" / "debootstrap.log", 15)
        detail = "\n".join(tail) + (f"\n--- debootstrap.log ---\n{log_tail}" if log_tail else "")
        raise BaseImageError(f"debootstrap failed with exit code {rc} (mirror {mirror}):\n{detail}")
    return version


def _tail_of(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _finish_rootfs(root: Path) -> None:
    """Make a fresh debootstrap tree a clean, small, sandbox-ready image."""
    _remove_tree(root / "debootstrap")
    for rel in ("var/cache/apt/archives", "var/cache/apt/archives/partial", "var/lib/apt/lists"):
        directory = root / rel
        if not directory.is_dir():
            continue
        for child in directory.iterdir():
            if child.name in ("partial", "lock"):
                continue
            if child.is_dir() and not child.is_symlink():
                _remove_tree(child)
            else:
                child.unlink()
    for pattern in ("var/cache/apt/*.bin", "var/log/apt/*", "var/log/dpkg.log", "var/log/bootstrap.log"):
        for path in root.glob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()
    for rel, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("logs", 0o1777)):
        path = root / rel
        if path.is_symlink():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
    _write(root, "etc/hostname", f"{HOSTNAME}\n")
    _write(
        root,
        "etc/hosts",
        f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )
    # debootstrap copies the host's resolver; the backend supplies one when networking is on.
    _write(root, "etc/resolv.conf", "# written by the sandbox backend when the network is on\n")
    # Services must not start inside an image build (the Debian docker images do the same).
    _write(root, "usr/sbin/policy-rc.d", "#!/bin/sh\nexit 101\n", mode=0o755)
    if (root / "etc/machine-id").exists():
        _write(root, "etc/machine-id", "")


def _write(root: Path, rel: str, text: str, *, mode: int = 0o644) -> None:
    """Write a file inside ``root`` without following a symlink out of it."""
    path = root / rel
    for parent in reversed(path.relative_to(root).parents[:-1]):
        if (root / parent).is_symlink():
            raise BaseImageError(f"unexpected symlink {parent} in the new root filesystem")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(info.st_mode):
            raise BaseImageError(f"{rel} is a directory in the new root filesystem")
        os.unlink(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)


_MNT_DETACH = 2


def _mounts_under(path: Path) -> list[str]:
    """Return mount points at or below ``path``, deepest first."""
    prefix = os.path.realpath(path)
    found = []
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    """Remove a build tree, first detaching what a killed debootstrap left mounted in it."""
    if not os.path.lexists(path):
        return
    mounts = _mounts_under(path)
    if mounts:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        for point in mounts:
            if libc.umount2(point.encode(), _MNT_DETACH) != 0:
                err = ctypes.get_errno()
                if err not in (errno.EINVAL, errno.ENOENT):
                    raise BaseImageError(f"cannot unmount {point} left by an interrupted build: {os.strerror(err)}")
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    shutil.rmtree(path)

"""Host-side layer reading (sandboxes.layers): overlay semantics, diffs and reverts, on real layer dirs.

Layers are made here as overlayfs keeps them (whiteouts are 0/0 character devices, opaque
directories carry ``trusted.overlay.opaque``), and one test mounts a real overlay to check
that a seeded upper dir reads as the base does.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
from pathlib import Path

import pytest

from sandboxes.errors import FileTooLargeError, SandboxError
from sandboxes.layers import (
    OVERLAY_OPAQUE_XATTR,
    ChangeKind,
    EntryKind,
    LayerStack,
    diff,
    seed_revert,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted xattrs need root")


def _write(root: Path, rel: str, data: bytes = b"x", mode: int = 0o644) -> Path:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def _whiteout(root: Path, rel: str) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _opaque(root: Path, rel: str) -> None:
    path = root / rel.lstrip("/")
    path.mkdir(parents=True, exist_ok=True)
    os.setxattr(path, OVERLAY_OPAQUE_XATTR, b"y")


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """A two-file 'image' layer: /usr/bin/env, /usr/bin/bash, /etc/os-release, /usr/lib/py/os.py."""
    layer = tmp_path / "image"
    _write(layer, "/usr/bin/env", b"ENV-BINARY", 0o755)
    _write(layer, "/usr/bin/bash", b"BASH-BINARY", 0o755)
    _write(layer, "/etc/os-release", b"debian")
    _write(layer, "/usr/lib/py/os.py", b"import posix")
    _write(layer, "/usr/lib/py/json/__init__.py", b"json")
    (layer / "usr/bin/sh").symlink_to("bash")
    return layer


def test_lookup_follows_overlay_rules_and_no_link(tmp_path: Path, image: Path) -> None:
    top = tmp_path / "top"
    _write(top, "/usr/bin/env", b"FORGED", 0o755)
    _whiteout(top, "/etc/os-release")
    _opaque(top, "/usr/lib/py")
    _write(top, "/usr/lib/py/new.py", b"new")
    (top / "app").mkdir()
    (top / "app/escape").symlink_to("/etc")  # a link to a host path: never followed
    stack = LayerStack([image, top])

    env = stack.lookup("/usr/bin/env")
    assert env is not None and env.kind is EntryKind.FILE and stack.read("/usr/bin/env") == b"FORGED"
    assert stack.lookup("/etc/os-release") is None
    assert stack.lookup("/usr/lib/py/os.py") is None  # hidden by the opaque dir
    assert set(stack.children("/usr/lib/py")) == {"new.py"}
    assert stack.lookup("/usr/bin/sh").target == "bash"  # type: ignore[union-attr]
    link = stack.lookup("/app/escape")
    assert link is not None and link.kind is EntryKind.SYMLINK and link.target == "/etc"
    assert stack.lookup("/app/escape/passwd") is None
    with pytest.raises(SandboxError, match="symlink"):
        stack.read("/app/escape")
    with pytest.raises(FileTooLargeError):
        stack.read("/usr/bin/bash", max_bytes=3)
    with pytest.raises(SandboxError, match="normalized"):
        stack.lookup("/usr/../etc/shadow")


def test_a_file_above_hides_a_directory_below(tmp_path: Path, image: Path) -> None:
    top = tmp_path / "top"
    _write(top, "/usr/lib", b"not a dir")
    stack = LayerStack([image, top])
    assert stack.lookup("/usr/lib/py/os.py") is None
    assert stack.children("/usr/lib") == {}


def test_diff_lists_what_changed_and_ignores_a_rewrite_with_the_same_bytes(tmp_path: Path, image: Path) -> None:
    top = tmp_path / "top"
    _write(top, "/usr/bin/env", b"FORGED", 0o755)  # modified
    _write(top, "/usr/bin/bash", b"BASH-BINARY", 0o755)  # rewritten, same bytes: no change
    os.utime(top / "usr/bin/bash", (1, 1))
    _write(top, "/etc/os-release", b"debian", 0o600)  # mode only: a change
    _whiteout(top, "/usr/lib/py/json")  # a deleted dir lists its files
    _write(top, "/app/out.txt", b"result")  # added (and /app with it)
    changes = {c.path: c.kind for c in diff(LayerStack([image]), LayerStack([image, top]))}
    assert changes == {
        "/usr/bin/env": ChangeKind.MODIFIED,
        "/etc/os-release": ChangeKind.MODIFIED,
        "/usr/lib/py/json": ChangeKind.DELETED,
        "/usr/lib/py/json/__init__.py": ChangeKind.DELETED,
        "/app": ChangeKind.ADDED,
        "/app/out.txt": ChangeKind.ADDED,
    }


def test_diff_of_a_squashed_stack_compares_contents(tmp_path: Path, image: Path) -> None:
    """A squashed top shares no layer with its base: every path is compared, deletions included."""
    flat = tmp_path / "flat"
    subprocess.run(["cp", "-a", f"{image}/.", str(flat)], check=True)
    (flat / "etc/os-release").unlink()  # gone, with no whiteout left
    _write(flat, "/usr/bin/env", b"FORGED", 0o755)
    changes = {c.path: c.kind for c in diff(LayerStack([image]), LayerStack([flat]))}
    assert changes == {"/etc/os-release": ChangeKind.DELETED, "/usr/bin/env": ChangeKind.MODIFIED}


def test_seed_revert_puts_back_files_hides_additions_and_restores_whole_dirs(tmp_path: Path, image: Path) -> None:
    top = tmp_path / "top"
    _write(top, "/usr/bin/env", b"FORGED", 0o755)
    _write(top, "/usr/bin/python3", b"NEW")  # not in the base: hidden
    _whiteout(top, "/usr/lib/py/os.py")
    _write(top, "/usr/lib/py/evil.pth", b"import os")
    _write(top, "/app/kept.txt", b"kept")
    base, stack = LayerStack([image]), LayerStack([image, top])
    upper = tmp_path / "upper"
    upper.mkdir()
    done = seed_revert(upper, base=base, top=stack, paths=["/usr/bin/env", "/usr/bin/python3", "/usr/lib/py",
                                                            "/usr/lib/py/evil.pth"])
    assert done == ["/usr/bin/env", "/usr/bin/python3", "/usr/lib/py"]  # evil.pth is under a whole dir
    view = LayerStack([image, top, upper])
    assert view.read("/usr/bin/env") == b"ENV-BINARY"
    assert stat.S_IMODE(view.lookup("/usr/bin/env").mode) == 0o755  # type: ignore[union-attr]
    assert view.lookup("/usr/bin/python3") is None
    assert set(view.children("/usr/lib/py")) == {"os.py", "json"}
    assert view.read("/usr/lib/py/json/__init__.py") == b"json"
    assert view.read("/app/kept.txt") == b"kept"
    assert diff(base, view) == [c for c in diff(base, view) if c.path.startswith("/app")]
    # A private copy, never a link to the shared layer.
    assert os.lstat(upper / "usr/bin/env").st_ino != os.lstat(image / "usr/bin/env").st_ino


def _mount_overlay(lowers: list[Path], upper: Path, work: Path, merged: Path) -> None:
    opts = f"lowerdir={':'.join(str(p) for p in reversed(lowers))},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], check=True, capture_output=True)


def test_a_seeded_upper_reads_as_the_base_in_a_real_overlay(tmp_path: Path, image: Path) -> None:
    top = tmp_path / "top"
    _write(top, "/usr/bin/env", b"FORGED", 0o755)
    _opaque(top, "/usr/lib/py")
    _write(top, "/usr/lib/py/sitecustomize.py", b"import evil")
    _write(top, "/app/work.txt", b"agent's work")
    upper, work, merged = (tmp_path / n for n in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    seed_revert(upper, base=LayerStack([image]), top=LayerStack([image, top]),
                paths=["/usr/bin/env", "/usr/lib/py"])
    _mount_overlay([image, top], upper, work, merged)
    try:
        assert (merged / "usr/bin/env").read_bytes() == b"ENV-BINARY"
        assert sorted(os.listdir(merged / "usr/lib/py")) == ["json", "os.py"]
        assert (merged / "app/work.txt").read_bytes() == b"agent's work"
        assert (merged / "usr/bin/bash").read_bytes() == b"BASH-BINARY"
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(os.fsencode(merged), 2)


def test_seed_revert_refuses_a_parent_that_is_no_directory(tmp_path: Path, image: Path) -> None:
    top = tmp_path / "top"
    _write(top, "/usr/lib", b"file")
    upper = tmp_path / "upper"
    upper.mkdir()
    with pytest.raises(SandboxError, match="no directory"):
        seed_revert(upper, base=LayerStack([image]), top=LayerStack([image, top]), paths=["/usr/lib/py/os.py"])
    # Reverting the parent itself works.
    seed_revert(upper, base=LayerStack([image]), top=LayerStack([image, top]), paths=["/usr/lib"])
    assert LayerStack([image, top, upper]).read("/usr/lib/py/os.py") == b"import posix"

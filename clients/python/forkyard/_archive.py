"""Pack task directories into the tar.gz the gateway's task import accepts."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

__all__ = ["find_task_dirs", "pack_task_dirs"]

_TASK_MARKERS = ("task.toml", "instruction.md")
_SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".mypy_cache"})


def _is_task_dir(path: Path) -> bool:
    return any((path / marker).is_file() for marker in _TASK_MARKERS)


def find_task_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """Return the task dirs at path: path itself if it is one, else its task subdirectories."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"No such task directory: {root}")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory; pass a task directory or a directory of them.")
    root = root.resolve()
    if _is_task_dir(root):
        return [root]
    found = sorted(child for child in root.iterdir() if child.is_dir() and _is_task_dir(child))
    if not found:
        raise ValueError(
            f"{root} is neither a task directory (no task.toml or instruction.md) "
            "nor a directory of task directories."
        )
    return found


def _task_files(task_dir: Path) -> list[tuple[str, Path]]:
    """Return (relative posix path, file) for every regular file of a task dir, sorted."""
    files: list[tuple[str, Path]] = []
    for current, dirnames, filenames in os.walk(task_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for filename in filenames:
            file = Path(current, filename)
            if file.is_file():  # follows a symlink to a file; skips sockets, dangling links
                files.append((file.relative_to(task_dir).as_posix(), file))
    files.sort()
    return files


def pack_task_dirs(task_dirs: list[Path]) -> bytes:
    """Return a deterministic tar.gz holding each task dir as a top-level folder."""
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for task_dir in task_dirs:
            for relative, file in _task_files(task_dir):
                data = file.read_bytes()
                executable = os.stat(file).st_mode & stat.S_IXUSR
                info = tarfile.TarInfo(f"{task_dir.name}/{relative}")
                info.size = len(data)
                info.mode = 0o755 if executable else 0o644
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()

"""Reading uploaded tar archives with every limit checked while streaming.

A task upload is hostile input: a few kilobytes of xz can unpack to gigabytes, and a
single PAX extended header can ask ``tarfile`` to read half a gigabyte into memory
before any member is seen. :func:`iter_members` decompresses the upload itself, a
block at a time, and counts as it goes: the bytes unpacked (total and per compressed
byte), the bytes of each member's headers, the number of members. The first limit
crossed ends the read with a :class:`~workers.errors.TaskFormatError` naming it.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from workers.errors import TaskFormatError

ARCHIVE = "<archive>"
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ArchiveLimits:
    """What one uploaded archive may hold."""

    max_unpacked_bytes: int = 256 * 1024 * 1024
    """Bytes of the tar stream once decompressed (headers and padding included)."""
    max_members: int = 65536
    """Entries of the archive (files, directories, links...)."""
    max_header_bytes: int = 1024 * 1024
    """Bytes of one member's headers (PAX extended headers, GNU long names)."""
    max_ratio: float = 200.0
    """Unpacked bytes per compressed byte, checked once more than :attr:`ratio_floor_bytes` are unpacked."""
    ratio_floor_bytes: int = 8 * 1024 * 1024


class _Decompressed(io.RawIOBase):
    """A read-only stream of the upload's tar bytes, decompressed on demand and counted."""

    def __init__(self, data: bytes, limits: ArchiveLimits) -> None:
        self._data = memoryview(data)
        self._limits = limits
        self._pos = 0
        self._pending = b""
        self.out = 0
        self.header_budget: int | None = None
        """While set, reads may return at most this many more bytes (a member's headers)."""
        magic = bytes(self._data[:6])
        self._decoder: zlib._Decompress | bz2.BZ2Decompressor | lzma.LZMADecompressor | None  # type: ignore[name-defined]
        if magic[:2] == b"\x1f\x8b":
            self._kind, self._decoder = "gzip", zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif magic[:3] == b"BZh":
            self._kind, self._decoder = "bzip2", bz2.BZ2Decompressor()
        elif magic == b"\xfd7zXZ\x00":
            self._kind, self._decoder = "xz", lzma.LZMADecompressor()
        else:
            self._kind, self._decoder = "plain", None

    def readable(self) -> bool:
        return True

    def _next_input(self) -> bytes:
        src = bytes(self._data[self._pos : self._pos + _CHUNK])
        self._pos += len(src)
        return src

    def _more(self, want: int) -> bytes:
        """Return up to ``want`` new tar bytes (b"" at the end)."""
        decoder = self._decoder
        if decoder is None:
            src = bytes(self._data[self._pos : self._pos + want])
            self._pos += len(src)
            return src
        while True:
            if self._kind == "gzip":
                src = decoder.unconsumed_tail  # type: ignore[union-attr]
                if not src:
                    if decoder.eof:
                        return b""
                    src = self._next_input()
                    if not src:
                        return decoder.flush()  # type: ignore[union-attr]
                out = decoder.decompress(src, want)
            else:
                if decoder.eof:
                    return b""
                src = b""
                if decoder.needs_input:  # type: ignore[union-attr]
                    src = self._next_input()
                    if not src:
                        return b""
                out = decoder.decompress(src, max_length=want)  # type: ignore[call-arg]
            if out:
                return out

    def readinto(self, buffer) -> int:  # type: ignore[override]
        want = len(buffer)
        if self.header_budget is not None:
            if self.header_budget <= 0 and want:
                raise TaskFormatError(
                    f"a tar header of the archive is larger than {self._limits.max_header_bytes // 1024} KiB "
                    "(the limit on one member's headers)",
                    file=ARCHIVE,
                )
            want = min(want, self.header_budget)
        if not self._pending:
            self._pending = self._more(max(want, _CHUNK))
        chunk, self._pending = self._pending[:want], self._pending[want:]
        buffer[: len(chunk)] = chunk
        self.out += len(chunk)
        if self.header_budget is not None:
            self.header_budget -= len(chunk)
        self._check()
        return len(chunk)

    def _check(self) -> None:
        limits = self._limits
        if self.out > limits.max_unpacked_bytes:
            raise TaskFormatError(
                f"the archive unpacks to more than {limits.max_unpacked_bytes // (1024 * 1024)} MiB "
                "(the limit on an upload's unpacked size)",
                file=ARCHIVE,
            )
        if self.out > limits.ratio_floor_bytes and self.out > limits.max_ratio * max(self._pos, 1):
            raise TaskFormatError(
                f"the archive unpacks to more than {limits.max_ratio:g} times its compressed size "
                "(the limit on an upload's compression ratio)",
                file=ARCHIVE,
            )


def iter_members(data: bytes, limits: ArchiveLimits | None = None) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """Yield each member of the tar(.gz|.bz2|.xz) ``data`` with the bytes of regular files (None otherwise).

    Raises:
        TaskFormatError: the upload is not a tar archive, or it crosses one of ``limits``.
    """
    limits = limits or ArchiveLimits()
    stream = _Decompressed(data, limits)
    try:
        # Stream mode: tarfile pulls the bytes in records, never seeks, and holds one member at a time.
        stream.header_budget = limits.max_header_bytes
        archive = tarfile.open(fileobj=stream, mode="r|")
        count = 0
        while True:
            stream.header_budget = limits.max_header_bytes
            member = archive.next()
            stream.header_budget = None
            if member is None:
                return
            count += 1
            if count > limits.max_members:
                raise TaskFormatError(
                    f"the archive has more than {limits.max_members} entries (the limit on an upload's members)",
                    file=ARCHIVE,
                )
            content = None
            if member.isfile():
                extracted = archive.extractfile(member)
                content = extracted.read() if extracted is not None else None
            yield member, content
    except TaskFormatError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as exc:
        raise TaskFormatError(f"the upload is not a readable tar archive: {exc}", file=ARCHIVE) from exc


def pack_files(files: Mapping[str, bytes], *, mode: Callable[[str], int] = lambda path: 0o644) -> bytes:
    """Return a tar.gz of ``files`` (relative posix path -> bytes), sorted, mtime 0, ``mode(path)`` each.

    What a family writes into a sandbox in one ``write_file`` and unpacks with one exec.
    """
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), mode(path)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


__all__ = ["ArchiveLimits", "iter_members", "pack_files"]


def read_dir(path: str | os.PathLike[str], *, max_bytes: int, max_files: int) -> dict[str, bytes]:
    """Return the regular files under ``path`` by relative posix path, refusing links and special files.

    Raises:
        TaskFormatError: the directory is missing, holds a symlink or a special file, or
            more than ``max_bytes`` / ``max_files``.
    """
    root = Path(path)
    if not root.is_dir():
        raise TaskFormatError(f"task directory {str(root)!r} does not exist or is not a directory", file=str(root))
    files: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for entry in sorted(dirnames + filenames):
            full = base / entry
            rel = full.relative_to(root).as_posix()
            st = full.lstat()
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                raise TaskFormatError(f"{rel}: symbolic links are not allowed in a task directory", file=rel)
            if not stat.S_ISREG(st.st_mode):
                raise TaskFormatError(f"{rel}: only regular files are allowed in a task directory", file=rel)
            total += st.st_size
            if total > max_bytes:
                raise TaskFormatError(f"{rel}: the task's files exceed the {max_bytes // (1024 * 1024)} MiB limit",
                                      file=rel)
            if len(files) + 1 > max_files:
                raise TaskFormatError(f"{rel}: the task has more than {max_files} files", file=rel)
            files[rel] = full.read_bytes()
    return files

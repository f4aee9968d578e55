"""The escape suite, upload level: task archives built to exhaust or escape the gateway.

Each bomb goes through ``POST /v1/tasks`` as a real upload: it must be refused with a
4xx naming the limit it crossed, in well under a second of the gateway's time and
without the gateway holding the unpacked bytes; afterwards the gateway still imports a
good task.
"""

from __future__ import annotations

import gzip
import io
import lzma
import resource
import tarfile
import time

import pytest

from tests.gateway.conftest import assert_error, gateway, tar_of, task_files  # noqa: F401 - the fixture
from workers.archives import ArchiveLimits, iter_members
from workers.errors import TaskFormatError


def _pax_bomb(header_mib: int = 32) -> bytes:
    """An xz'd tar whose first member is a PAX extended header of ``header_mib`` MiB."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = header_mib << 20
    comp = lzma.LZMACompressor(format=lzma.FORMAT_XZ, preset=0)
    parts = [comp.compress(info.tobuf(format=tarfile.USTAR_FORMAT))]
    record = b"%d comment=" % (header_mib << 20) + b"A" * (1 << 20)
    parts += [comp.compress(record[: 1 << 20]) for _ in range(header_mib)]
    parts.append(comp.flush())
    return b"".join(parts)


def _task_tar(name: str, extra: tarfile.TarInfo, content: bytes | None = None) -> bytes:
    """A plain tar of a small valid task ``name`` plus one more member."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for path, text in task_files(name).items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}/{path}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        archive.addfile(extra, io.BytesIO(content) if content is not None else None)
    return buf.getvalue()


def _ratio_bomb(mib: int = 64) -> bytes:
    """A gzip'd tar holding one task file of ``mib`` MiB of zeros (about a thousandfold compression)."""
    blob = tarfile.TarInfo("zeros/environment/blob")
    blob.size = mib << 20
    return gzip.compress(_task_tar("zeros", blob, bytes(mib << 20)), compresslevel=6)


def _linked(kind: bytes) -> bytes:
    link = tarfile.TarInfo("linky/tests/secret")
    link.type = kind
    link.linkname = "/etc/shadow" if kind == tarfile.SYMTYPE else "linky/../../etc/shadow"
    return gzip.compress(_task_tar("linky", link))


async def _upload(gateway, body: bytes):  # noqa: F811
    return await gateway.client.post("/v1/tasks", content=body, headers={"Content-Type": "application/gzip"})


@pytest.mark.parametrize(
    ("bomb", "words"),
    [
        (_pax_bomb, "header"),
        (_ratio_bomb, "times its compressed size"),
    ],
    ids=["pax-header", "ratio"],
)
async def test_archive_bomb_is_refused_fast_naming_its_limit(gateway, bomb, words):  # noqa: F811
    body = bomb()
    assert len(body) < 2 << 20  # a small upload...
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.process_time()
    error = assert_error(await _upload(gateway, body), 422, "task_format_error")
    spent = time.process_time() - started
    assert words in error["message"] and "limit" in error["message"], error
    # ...that never unpacks: far less CPU than unpacking it would take, and no big allocation.
    assert spent < 1.0, spent
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024  # KiB
    assert (await gateway.client.get("/healthz")).status_code == 200
    assert (await gateway.import_task("after-bomb"))["name"] == "after-bomb"


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE], ids=["symlink", "hardlink"])
async def test_links_in_a_task_archive_are_refused(gateway, kind):  # noqa: F811
    error = assert_error(await _upload(gateway, _linked(kind)), 422, "task_format_error")
    assert "links are not allowed" in error["message"] and "tests/secret" in error["message"]
    assert (await gateway.client.get("/v1/tasks")).json()["items"] == []


def test_member_count_is_bounded_while_streaming():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for i in range(50):
            info = tarfile.TarInfo(f"d{i}")
            info.type = tarfile.DIRTYPE
            archive.addfile(info)
    seen = 0
    with pytest.raises(TaskFormatError, match="more than 20 entries"):
        for _ in iter_members(buf.getvalue(), ArchiveLimits(max_members=20)):
            seen += 1
    assert seen == 20


def test_unpacked_size_is_bounded_while_streaming():
    body = tar_of({"big": {"blob": "x" * (3 << 20)}}, gz=False)
    with pytest.raises(TaskFormatError, match="unpacks to more than 2 MiB"):
        list(iter_members(body, ArchiveLimits(max_unpacked_bytes=2 << 20)))
    # Within the limits the same archive reads whole, in every compression.
    for packed in (body, gzip.compress(body), lzma.compress(body)):
        [(member, content)] = [m for m in iter_members(packed) if m[0].isfile()]
        assert member.name == "big/blob" and content == b"x" * (3 << 20)

"""The ``backend`` fixture: every sandbox backend with its own root dir and the base image.

Each test gets a fresh backend on a fresh node name and temp root, with the base
rootfs imported as ``forkyard/base:test``. Teardown destroys every sandbox the test
created, then checks by id that nothing is left (dirs, mounts, cgroups, processes,
containers), closes the backend and removes the temp root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from sandboxes.backends import create_backend
from sandboxes.base import ImageConfig
from sandboxes.oci import runtime_problem
from tests.conftest import derive_base_image

BACKENDS = [pytest.param("local", marks=pytest.mark.local), pytest.param("docker", marks=pytest.mark.docker)]
#: The local backend's gVisor tier (runsc), where this host can run it.
GVISOR = pytest.param(
    "local-gvisor",
    marks=[pytest.mark.local, pytest.mark.skipif(runtime_problem("gvisor") is not None, reason=str(runtime_problem("gvisor")))],
)
BASE_REF = "forkyard/base:test"
BASE_CONFIG = ImageConfig(env={"FORKYARD_TEST_IMAGE": "base"}, workdir="/", user="root")


def local_leftovers(root_dir: Path, ids: list[str]) -> list[str]:
    """Describe what the local backend left of sandboxes ``ids``: dirs, mounts, cgroups, processes."""
    from sandboxes.cgroups import SandboxCgroup

    found: list[str] = []
    with open("/proc/self/mountinfo") as fh:
        mountpoints = [line.split()[4] for line in fh]
    for sid in ids:
        sdir = root_dir / "sandboxes" / sid
        if sdir.exists():
            found.append(f"dir {sdir}")
        found += [f"mount {m}" for m in mountpoints if f"/sandboxes/{sid}/" in m + "/"]
        cgroup = SandboxCgroup(sid)
        found += [f"cgroup {p}" for p in cgroup.paths if p.exists()]
        found += [f"disk {p}" for p in Path("/run/forkyard/disk").glob(f"*/{sid}")]
    marks = [f"/forkyard/{sid}" for sid in ids]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup") as fh:
                groups = fh.read()
            root = os.readlink(f"/proc/{pid}/root")
        except OSError:
            continue
        for sid, mark in zip(ids, marks):
            if any(line.endswith(mark) for line in groups.splitlines()) or f"/sandboxes/{sid}/" in root + "/":
                found.append(f"process {pid} of sandbox {sid}")
    return found


def docker_leftovers(ids: list[str]) -> list[str]:
    """Describe the containers of ``ids`` that still exist."""
    import docker

    client = docker.from_env()
    try:
        found = []
        for sid in ids:
            found += [f"container {c.id[:12]}" for c in client.containers.list(all=True, filters={"id": sid})]
        return found
    finally:
        client.close()


def find_leftovers(backend, root_dir: Path, ids: list[str]) -> list[str]:
    """Describe whatever sandboxes ``ids`` of ``backend`` left behind (empty when clean)."""
    if backend.name == "local":
        return local_leftovers(root_dir, ids)
    return docker_leftovers(ids)


async def local_backend(backend_root: Path, base_rootfs: Path, node_name: str, **options):
    """Yield a LocalBackend (``options``: isolation, runtime, ...) with the base image as ``BASE_REF``.

    Afterwards its sandboxes and snapshots are destroyed and nothing of them may be left (checked by id).
    """
    from sandboxes.local import LocalBackend

    backend = LocalBackend(backend_root, f"{node_name}-{uuid.uuid4().hex[:6]}", **options)
    await backend.import_rootfs(str(base_rootfs), BASE_REF, BASE_CONFIG)
    try:
        yield backend
    finally:
        ids = [i.id for i in await backend.list()]
        for sid in ids:
            await backend.destroy(sid)
        for snap in await backend.list_snapshots():
            await backend.delete_snapshot(snap.id)
        await backend.aclose()
        assert local_leftovers(backend_root, ids) == []


@pytest.fixture
def created() -> list[str]:
    """Ids of every sandbox the current test created through the ``backend`` fixture."""
    return []


@pytest.fixture
def backend_root() -> Path:
    """A temp root dir for the backend, removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="forkyard-sbx-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
async def backend(request, created, backend_root, node_name):
    """Yield a ready backend of each kind with the base image imported as ``forkyard/base:test``."""
    async for ready in fresh_backend(request.param, created, backend_root, node_name):
        yield ready


async def fresh_backend(kind: str, created: list[str], backend_root: Path, node_name: str, **options):
    """Yield a backend of ``kind`` (``local``, ``local-gvisor``, ``docker``); check and clean up after.

    ``options`` go to :func:`create_backend` (``egress_ports``...).
    """
    kind, _, tier = kind.partition("-")
    backend = create_backend(
        kind, node=f"{node_name}-{uuid.uuid4().hex[:6]}", root_dir=backend_root, isolation=tier or "standard",
        **options,
    )
    real_create = backend.create

    async def tracking_create(spec):
        info = await real_create(spec)
        created.append(info.id)
        return info

    backend.create = tracking_create
    try:
        if not await backend.has_image(BASE_REF):
            await derive_base_image(backend, BASE_REF, BASE_CONFIG)
        yield backend
    finally:
        try:
            ids = list(dict.fromkeys(created + [i.id for i in await backend.list()]))
            for sid in ids:
                await backend.destroy(sid)
            left = find_leftovers(backend, backend_root, ids)
            await backend.remove_image(BASE_REF)
        finally:
            await backend.aclose()
        assert left == [], f"the {kind} backend left these behind: {left}"

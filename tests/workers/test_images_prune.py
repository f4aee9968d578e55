"""``forkyard images prune``: built task and stand-in images no sandbox uses go; the ones in use stay."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from tests.live import FORKYARD
from sandboxes.base import SandboxSpec
from tests.sandboxes.conftest import BASE_REF, backend_root, local_backend  # noqa: F401 - the fixture
from workers.dockerfile import ENV_IMAGE_NAME, build_task_image




@pytest.mark.local
async def test_prune_removes_the_unused_built_images_and_keeps_those_in_use(
    backend_root, base_rootfs, node_name  # noqa: F811
):
    root = backend_root / "sandboxes"
    async for backend in local_backend(root, base_rootfs, node_name):
        refs = [await build_task_image(backend, dockerfile=f"FROM base\nRUN echo {word} > /word\n", context={},
                                       base_image=BASE_REF, aliases={}) for word in (uuid.uuid4().hex, "unused")]
        used, unused = refs
        info = await backend.create(SandboxSpec(image=used))
        listed = {i.ref: i for i in await backend.list_images(ENV_IMAGE_NAME)}
        assert listed[used].in_use and not listed[unused].in_use and listed[unused].size_bytes > 0

        def prune(*extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([str(FORKYARD), "images", "prune", "--backend", "local", "--data-dir",
                                   str(backend_root), *extra], capture_output=True, text=True, timeout=120,
                                  env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "FORKYARD_NODE": "prune-test"})

        dry = prune("--dry-run")
        assert dry.returncode == 0 and f"would remove  {unused}" in dry.stdout and used not in dry.stdout, dry
        assert await backend.has_image(unused)
        done = prune()
        assert done.returncode == 0 and f"removed  {unused}" in done.stdout and "1 image(s) in use kept" in done.stderr
        assert not await backend.has_image(unused) and await backend.has_image(used)
        assert (await backend.exec(info.id, "cat /word")).exit_code == 0  # its sandbox runs on
        await backend.destroy(info.id)
        await backend.remove_image(used)


@pytest.mark.docker
async def test_docker_lists_built_images_with_their_use():
    """The docker side of prune: which built images a container uses (prune itself is not run on the shared engine)."""
    from sandboxes.docker import DockerBackend
    from tests.conftest import base_image

    backend = DockerBackend(f"test-images-{uuid.uuid4().hex[:6]}")
    try:
        base = await base_image(backend)
        ref = await build_task_image(backend, dockerfile=f"FROM base\nRUN echo {uuid.uuid4().hex} > /w\n",
                                     context={}, base_image=base, aliases={})
        info = await backend.create(SandboxSpec(image=ref))
        try:
            (mine,) = [i for i in await backend.list_images(ENV_IMAGE_NAME) if i.ref == ref]
            assert mine.in_use and mine.created_at > 0
        finally:
            await backend.destroy(info.id)
        (mine,) = [i for i in await backend.list_images(ENV_IMAGE_NAME) if i.ref == ref]
        assert not mine.in_use
        await backend.remove_image(ref)
        assert ref not in {i.ref for i in await backend.list_images(ENV_IMAGE_NAME)}
    finally:
        await backend.aclose()

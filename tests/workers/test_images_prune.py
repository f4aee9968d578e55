"""``forkyard images prune``: built task and stand-in images no sandbox uses go; the ones in use stay."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from sandboxes.base import SandboxSpec
from tests.live import FORKYARD
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


@pytest.mark.local
async def test_the_cap_removes_the_oldest_unused_images_until_the_rest_fit(
    backend_root, base_rootfs, node_name  # noqa: F811
):
    from workers.images import prune_images

    async for backend in local_backend(backend_root / "sandboxes", base_rootfs, node_name):
        # Three images of 1 MiB of their own each, oldest first; the oldest is in use, the newest kept.
        refs = [await build_task_image(backend, dockerfile=f"FROM base\nRUN head -c 1048576 /dev/urandom > /blob"
                                       f"\nRUN echo {uuid.uuid4().hex} > /id\n", context={}, base_image=BASE_REF,
                                       aliases={}) for _ in range(4)]
        in_use, oldest_free, middle, kept = refs
        info = await backend.create(SandboxSpec(image=in_use))
        sizes = {i.ref: i.size_bytes for i in await backend.list_images(ENV_IMAGE_NAME)}
        assert all(sizes[r] >= 1 << 20 for r in refs)
        total = sum(sizes.values())
        dry = await prune_images(backend, max_bytes=total - 1, keep={kept}, dry_run=True)
        assert [i.ref for i in dry.removed] == [oldest_free] and await backend.has_image(oldest_free)
        # A cap below what the images in use hold removes every other one and says what is left.
        report = await prune_images(backend, max_bytes=sizes[in_use], keep={kept})
        assert [i.ref for i in report.removed] == [oldest_free, middle]
        assert report.freed_bytes == sizes[oldest_free] + sizes[middle] and report.in_use == 2
        assert report.total_bytes == total - report.freed_bytes
        assert not await backend.has_image(oldest_free) and not await backend.has_image(middle)
        assert await backend.has_image(in_use) and await backend.has_image(kept)
        assert (await backend.exec(info.id, "test -s /blob && cat /id")).exit_code == 0
        await backend.destroy(info.id)
        for ref in (in_use, kept):
            await backend.remove_image(ref)


@pytest.mark.local
async def test_the_runtime_keeps_built_images_under_its_cap_but_never_the_one_it_hands_out(
    backend_root, base_rootfs, node_name  # noqa: F811
):
    from pathlib import Path

    from workers.envs.terminal.task import load_task_files
    from workers.runtime import WorkerRuntime

    async for backend in local_backend(backend_root / "sandboxes", base_rootfs, node_name):
        stale = await build_task_image(backend, dockerfile=f"FROM base\nRUN echo {uuid.uuid4().hex} > /stale\n",
                                       context={}, base_image=BASE_REF, aliases={})
        runtime = WorkerRuntime(backend, image_cache_dir=Path("/var/cache/forkyard/images"), base_image=BASE_REF,
                                image_max_bytes=1)
        task = load_task_files("capped", {
            "instruction.md": b"x\n", "task.toml": b"[environment]\n",
            "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
            "environment/Dockerfile": f"FROM base\nRUN echo {uuid.uuid4().hex} > /fresh\n".encode(),
        })
        fresh = await runtime.task_image(task)
        assert runtime._capping is not None
        await runtime._capping  # the cap runs behind the build
        assert not await backend.has_image(stale) and await backend.has_image(fresh)
        await backend.remove_image(fresh)

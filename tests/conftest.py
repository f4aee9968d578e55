"""Fixtures shared by every test package: the base image and this run's node name.

The base root filesystem is the production one (`forkyard images build base`, which
`.ci/bootstrap` runs): built once with debootstrap into the image cache, then reused.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sandboxes.base import ImageConfig, SandboxBackend, SandboxSpec
from sandboxes.images import DEFAULT_IMAGE_CACHE, build_base_rootfs, ensure_base_image
from tests.live import run_gateway


@pytest.fixture(scope="session")
def base_rootfs() -> Path:
    """Return the cached Debian base root filesystem (read-only; built on first use)."""
    return build_base_rootfs(DEFAULT_IMAGE_CACHE)


async def base_image(backend: SandboxBackend) -> str:
    """Return the production base image ref on ``backend``, importing it if needed (kept afterwards)."""
    return await ensure_base_image(backend, DEFAULT_IMAGE_CACHE)


async def derive_base_image(backend: SandboxBackend, ref: str, config: ImageConfig) -> None:
    """Register the base image again as ``ref`` with ``config``, cheaply.

    Local: a zero-copy import of the cached rootfs. Docker: a commit of an untouched
    sandbox of the base image, which shares the base's layers instead of importing
    400 MB again.
    """
    if backend.name == "local":
        await backend.import_rootfs(str(build_base_rootfs(DEFAULT_IMAGE_CACHE)), ref, config)
        return
    info = await backend.create(SandboxSpec(image=await base_image(backend)))
    try:
        await backend.commit(info.id, ref, config)
    finally:
        await backend.destroy(info.id)


@pytest.fixture(scope="session")
def node_name() -> str:
    """Return a node name unique to this test session, so runs never see each other's sandboxes."""
    return f"test-{uuid.uuid4().hex[:8]}"


def leftover_sandboxes(backend: str, node: str, data_dir) -> list[str]:
    """Return what a stopped gateway left behind on its node (should be nothing)."""
    if backend == "docker":
        import docker

        client = docker.from_env()
        try:
            return [c.id for c in client.containers.list(all=True, filters={"label": f"forkyard.node={node}"})]
        finally:
            client.close()
    root = data_dir / "sandboxes" / "sandboxes"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture(scope="module", params=["local", "docker"])
def live_gateway(request, tmp_path_factory):
    node = f"e2e-{request.param}-{uuid.uuid4().hex[:6]}"
    data_dir = tmp_path_factory.mktemp(f"gw-{request.param}")
    with run_gateway(request.param, data_dir, node=node) as gw:
        yield gw
    assert leftover_sandboxes(request.param, node, data_dir) == []

"""Fixtures shared by every test package: the base image and this run's node name.

The base root filesystem is the production one (`forkyard images build base`, which
`.ci/bootstrap` runs): built once with debootstrap into the image cache, then reused.
"""

from __future__ import annotations

import asyncio
import json
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


def leftover_storage(backend_kind: str, node: str, data_dir: Path) -> dict[str, list[str]]:
    """Empty a stopped gateway's setup cache, then return the snapshots and storage its node still holds.

    Everything else (trajectory-tree snapshots, lazy-fork snapshots, session snapshots
    nothing holds) must already be gone. Local: layer dirs no image uses, counted on disk;
    docker: this node's snapshot images, tagged or not.
    """
    from sandboxes.backends import create_backend
    from workers.setup_cache import SetupCache

    async def check() -> dict[str, list[str]]:
        backend = create_backend(backend_kind, node=node, root_dir=data_dir / "sandboxes")
        try:
            cache = SetupCache(backend, data_dir / "setup-cache")
            await cache.load()
            await cache.clear()
            left = {"snapshots": sorted(s.id for s in await backend.list_snapshots())}
            if backend_kind == "local":
                root = data_dir / "sandboxes"
                used = {layer for manifest in (root / "images").rglob("*.json")
                        for layer in json.loads(manifest.read_text()).get("layers", [])}
                layers = root / "layers"
                left["layers"] = sorted(str(p) for p in layers.iterdir()
                                        if not p.name.startswith(".") and str(p) not in used) if layers.exists() else []
            else:
                import docker

                client = docker.from_env()
                try:
                    left["images"] = [i.id for i in client.images.list(
                        all=True, filters={"label": f"forkyard.snapshot.node={node}"})]
                finally:
                    client.close()
            return left
        finally:
            await backend.aclose()

    return asyncio.run(check())


@pytest.fixture(scope="module", params=["local", "docker"])
def live_gateway(request, tmp_path_factory):
    node = f"e2e-{request.param}-{uuid.uuid4().hex[:6]}"
    data_dir = tmp_path_factory.mktemp(f"gw-{request.param}")
    with run_gateway(request.param, data_dir, node=node) as gw:
        yield gw
    assert leftover_sandboxes(request.param, node, data_dir) == []
    assert {k: v for k, v in leftover_storage(request.param, node, data_dir).items() if v} == {}

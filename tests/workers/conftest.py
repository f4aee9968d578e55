"""Fixtures for worker tests: real sandbox backends with the debootstrap'd base imported."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandboxes.backends import create_backend
from sandboxes.base import SandboxBackend
from tests.conftest import base_image


@dataclass
class BuildBackend:
    """A real backend plus the ref its base image was imported under."""

    backend: SandboxBackend
    base: str


@pytest.fixture(params=["local", "docker"])
async def build_backend(request) -> AsyncIterator[BuildBackend]:
    """Yield a local or docker backend with the production base image; destroy its sandboxes afterwards."""
    async for ready in backend_with_base(request.param):
        yield ready


async def backend_with_base(kind: str) -> AsyncIterator[BuildBackend]:
    """Yield a fresh ``kind`` backend with the production base image; destroy its sandboxes and root afterwards."""
    root_dir = Path(tempfile.mkdtemp(prefix="forkyard-workers-"))
    node = f"test-workers-{uuid.uuid4().hex[:8]}"
    backend = create_backend(kind, node=node, root_dir=root_dir)
    try:
        yield BuildBackend(backend, await base_image(backend))
    finally:
        try:
            for info in await backend.list():
                await backend.destroy(info.id)
        finally:
            await backend.aclose()
            shutil.rmtree(root_dir, ignore_errors=True)


#: The SWE example repositories and the instances written against them.
SWE_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "swe"


@pytest.fixture(scope="session")
def swe_store_built(tmp_path_factory: pytest.TempPathFactory):
    """Return a repository store of the example repositories and the shipped instances (built once)."""
    from workers.envs.swe.repos import RepoStore
    from workers.envs.swe.task import parse_jsonl

    store = RepoStore(tmp_path_factory.mktemp("swe-store"))
    for name in ("calc", "textkit"):
        store.add(SWE_EXAMPLES / "repos" / name, name=f"forkyard/{name}")
    return store, parse_jsonl((SWE_EXAMPLES / "instances.jsonl").read_bytes())


@pytest.fixture
def swe_store(swe_store_built):
    """Yield (store, instances) with the SWE family configured to use that store (as a gateway's startup does)."""
    from workers.envs.registry import get_family

    family = get_family("swe")
    store, tasks = swe_store_built
    before = family.repos
    family.configure(repo_store=store.root)
    try:
        yield store, tasks
    finally:
        family.repos = before

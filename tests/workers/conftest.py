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
    root_dir = Path(tempfile.mkdtemp(prefix="forkyard-workers-"))
    node = f"test-workers-{uuid.uuid4().hex[:8]}"
    backend = create_backend(request.param, node=node, root_dir=root_dir)
    try:
        yield BuildBackend(backend, await base_image(backend))
    finally:
        try:
            for info in await backend.list():
                await backend.destroy(info.id)
        finally:
            await backend.aclose()
            shutil.rmtree(root_dir, ignore_errors=True)

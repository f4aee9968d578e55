"""Fixtures of the escape suite: every sandbox backend (and tier) that can run here, fresh per test.

The ``backend`` fixture is the sandbox contract suite's (one fresh backend per test with
the base image, nothing left behind), with the local backend's gVisor tier added; ``still_serving`` checks afterwards that the
backend still starts and runs a fresh sandbox, i.e. the attempt hurt nobody else.
"""

from __future__ import annotations

import pytest

from sandboxes.base import SandboxSpec
from tests.sandboxes.conftest import (  # noqa: F401
    BACKENDS,
    BASE_REF,
    GVISOR,
    backend_root,
    created,
    fresh_backend,
)


@pytest.fixture(params=[*BACKENDS, GVISOR])
async def backend(request, created, backend_root, node_name):  # noqa: F811 - the imported fixtures
    """Yield a ready backend of each kind and isolation tier with the base image as ``forkyard/base:test``."""
    async for ready in fresh_backend(request.param, created, backend_root, node_name):
        yield ready


@pytest.fixture
def still_serving(backend):
    """Return a check that a fresh sandbox on ``backend`` starts and answers within seconds."""

    async def check() -> None:
        info = await backend.create(SandboxSpec(image=BASE_REF))
        try:
            result = await backend.exec(info.id, "echo alive", timeout_s=20)
            assert result.stdout == "alive\n", result
        finally:
            await backend.destroy(info.id)

    return check

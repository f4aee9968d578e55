"""Fixtures for policy tests: two tiny checkpoints and one real vLLM server per test session.

The server requires an API key (``--api-key``), as a production one would: every test
sends it (:attr:`VLLMServer.headers`, the policy clients' ``api_key``), and the API-key
test shares the server instead of starting a second (a vLLM start costs ~45 s here).

The server needs the virtualenv that `bash .ci/vllm` makes; without it these
fixtures fail (never skip), saying so.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.policy.vllm_server import VLLM_VENV, VLLMServer, VLLMServerError, start_vllm_server, stop_vllm_server
from workers.policy.tiny_model import build_tiny_model


@dataclass(frozen=True)
class TinyModels:
    """Two checkpoints of one tiny architecture and vocabulary: the served one and a reload target."""

    primary: Path
    second: Path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Iterator[TinyModels]:
    """Build the tiny model twice (seeds 0 and 1) into a temp dir; remove it afterwards."""
    root = tmp_path_factory.mktemp("tiny-models")
    try:
        yield TinyModels(
            primary=build_tiny_model(root / "seed-0", seed=0),
            second=build_tiny_model(root / "seed-1", seed=1),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def serve_tiny_model(tiny_models, tmp_path_factory, name: str, extra_args: tuple[str, ...] = (),
                     api_key: str | None = None) -> Iterator[VLLMServer]:
    """Yield a vLLM server on the primary tiny model (failing, never skipping, without the venv); stop it after."""
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"the policy tests need a real vLLM server but {VLLM_VENV} is missing: run `bash .ci/vllm`")
    log_path = tmp_path_factory.mktemp(name) / "server.log"
    try:
        server = start_vllm_server(tiny_models.primary, log_path=log_path, extra_args=extra_args, api_key=api_key)
    except VLLMServerError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        stop_vllm_server(server)


@pytest.fixture(scope="session")
def vllm_server(tiny_models, tmp_path_factory) -> Iterator[VLLMServer]:
    """Start one vLLM server on the primary tiny model, behind an API key, for the whole session; stop it at the end."""
    yield from serve_tiny_model(tiny_models, tmp_path_factory, "vllm", api_key="sk-test-" + secrets.token_hex(16))

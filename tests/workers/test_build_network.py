"""Builds reach the package registries; networked runs do too; both trust the host's CA bundle.

This machine reaches PyPI and the Debian mirror through a TLS-intercepting proxy whose CA
only the host trusts, as many corporate networks do: without the host's bundle an HTTPS
request from a sandbox fails certificate verification. The bundle is never kept in a
built image, and an offline task's sandbox gets none of it.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from sandboxes.backends import create_backend
from sandboxes.base import SandboxSpec
from tests.conftest import base_image
from workers.dockerfile import build_task_image
from workers.envs.base import Action
from workers.envs.terminal.env import TerminalEnv
from workers.envs.terminal.task import load_task_files
from workers.trust import CA_BUNDLE_PATH, SYSTEM_CA_BUNDLE, read_ca_bundle

HTTPS_PROBE = "python3 -c \"import urllib.request as u; print(u.urlopen('https://pypi.org/simple/six/', timeout=30).status)\""


@pytest.fixture(scope="module", params=[pytest.param("local", marks=pytest.mark.local),
                                        pytest.param("docker", marks=pytest.mark.docker)])
async def backend(request):
    root = Path(tempfile.mkdtemp(prefix="forkyard-build-net-"))
    backend = create_backend(request.param, node=f"test-buildnet-{uuid.uuid4().hex[:8]}", root_dir=root)
    try:
        yield backend
    finally:
        for sandbox in await backend.list():
            await backend.destroy(sandbox.id)
        await backend.aclose()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_dockerfile_that_apt_and_pip_installs_builds(backend):
    bundle = read_ca_bundle(SYSTEM_CA_BUNDLE)
    assert bundle is not None
    dockerfile = (
        f"# {uuid.uuid4()}: never a cached image\n"
        "FROM python:3.12-slim\n"
        "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends jq python3-pip >/dev/null\n"
        "RUN pip install --quiet --break-system-packages --no-deps six==1.16.0\n"
        f"RUN {HTTPS_PROBE} > /https-status\n"
    )
    image = await build_task_image(backend, dockerfile=dockerfile, context={}, base_image=await base_image(backend),
                                   ca_bundle=bundle)
    info = await backend.create(SandboxSpec(image=image))
    try:
        check = (f'jq -n 1 && python3 -c "import six; print(six.__version__)" && cat /https-status && '
                 f'test ! -e {CA_BUNDLE_PATH} && echo no-bundle-kept')
        result = await backend.exec(info.id, check)
        assert result.stdout.split() == ["1", "1.16.0", "200", "no-bundle-kept"], result
    finally:
        await backend.destroy(info.id)
        await backend.remove_image(image)


@pytest.mark.parametrize("internet", [True, False])
async def test_a_networked_task_trusts_the_hosts_bundle_and_an_offline_one_gets_none(backend, internet):
    task = load_task_files("trust", {
        "instruction.md": b"x\n",
        "task.toml": f"[environment]\nallow_internet = {'true' if internet else 'false'}\n".encode(),
        "environment/Dockerfile": b"FROM ubuntu:24.04\n",
        "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    })
    env = TerminalEnv(task, backend, image=await base_image(backend), ca_bundle=read_ca_bundle(SYSTEM_CA_BUNDLE))
    try:
        await env.reset()
        probe = await env.step(Action("bash", {"command": f"echo ${{PIP_CERT:-none}}; {HTTPS_PROBE} 2>&1 | tail -1",
                                        "timeout": 60}))
        first, second = probe.observation.splitlines()[:2]
        if internet:
            assert (first, second) == (CA_BUNDLE_PATH, "200"), probe.observation
        else:
            assert first == "none" and "200" not in second, probe.observation
    finally:
        await env.close()

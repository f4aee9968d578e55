"""Which image a task's sandboxes start from: docker_image, its stand-in, a real local image, or the Dockerfile.

Harbor's behaviour is the one to match: a ``docker_image`` this host does not have falls
back to building ``environment/Dockerfile`` (``--force-build``), and a real image present
locally wins over Forkyard's stand-in for the same name.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from sandboxes.backends import create_backend
from sandboxes.base import ImageConfig, SandboxSpec
from tests.conftest import base_image
from workers.envs.terminal.task import load_task_files
from workers.errors import ImageBuildError
from workers.runtime import WorkerRuntime
from workers.trust import SYSTEM_CA_BUNDLE, read_ca_bundle


@pytest.fixture(scope="module", params=[pytest.param("local", marks=pytest.mark.local),
                                        pytest.param("docker", marks=pytest.mark.docker)])
async def runtime(request):
    root = Path(tempfile.mkdtemp(prefix="forkyard-images-"))
    backend = create_backend(request.param, node=f"test-images-{uuid.uuid4().hex[:8]}", root_dir=root)
    # The host's CA bundle, as the gateway passes it: this machine reaches the registries through a TLS proxy.
    rt = WorkerRuntime(backend, image_cache_dir=Path("/var/cache/forkyard/images"), base_image=await base_image(backend),
                       ca_bundle=read_ca_bundle(SYSTEM_CA_BUNDLE))
    try:
        yield rt
    finally:
        await rt.aclose()
        shutil.rmtree(root, ignore_errors=True)


def task(environment: str, dockerfile: bytes | None) -> object:
    files = {
        "instruction.md": b"x\n",
        "task.toml": f"[environment]\n{environment}\n".encode(),
        "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    }
    if dockerfile is not None:
        files["environment/Dockerfile"] = dockerfile
    return load_task_files(f"images-{uuid.uuid4().hex[:6]}", files)


async def read(runtime: WorkerRuntime, image: str, command: str) -> str:
    info = await runtime.backend.create(SandboxSpec(image=image))
    try:
        return (await runtime.backend.exec(info.id, command)).stdout
    finally:
        await runtime.backend.destroy(info.id)


async def test_a_missing_docker_image_falls_back_to_the_dockerfile(runtime, caplog):
    built = task('docker_image = "registry.invalid/team/env:1.0"',
                 b"FROM ubuntu:24.04\nRUN echo from-dockerfile > /marker\n")
    image = await runtime.task_image(built)
    assert await read(runtime, image, "cat /marker") == "from-dockerfile\n"
    assert "registry.invalid/team/env:1.0 is not available locally" in caplog.text
    with pytest.raises(ImageBuildError, match="ships no environment/Dockerfile"):
        await runtime.task_image(task('docker_image = "registry.invalid/team/env:1.0"', None))


async def test_a_real_local_image_wins_over_its_stand_in(runtime):
    real = "debian:stable-slim"  # a stand-in name; the test makes a real image of it and removes it
    assert not await runtime.backend.has_image(real), "a real debian:stable-slim is on this host already"
    maker = await runtime.backend.create(SandboxSpec(image=runtime.base_image))
    try:
        await runtime.backend.exec(maker.id, "echo real > /marker-real")
        await runtime.backend.commit(maker.id, real, ImageConfig(workdir="/", user="root"))
    finally:
        await runtime.backend.destroy(maker.id)
    built = None
    try:
        assert await runtime.task_image(task(f'docker_image = "{real}"', None)) == real
        built = await runtime.task_image(task("", f"FROM {real}\nRUN cat /marker-real > /marker\n".encode()))
        assert await read(runtime, built, "cat /marker") == "real\n"
    finally:
        await runtime.backend.remove_image(real)
        if built:
            await runtime.backend.remove_image(built)
    stand_in = await runtime.task_image(task("", f"FROM {real}\nRUN ls /marker-real || echo none > /m\n".encode()))
    assert await read(runtime, stand_in, "cat /m") == "none\n"  # without the real one, the stand-in again


async def test_the_python_stand_in_behaves_like_the_official_image(runtime):
    """python:* has python, pip installing system-wide (PIP_BREAK_SYSTEM_PACKAGES) and venv, as the real image."""
    dockerfile = (b"FROM python:3.13-slim-bookworm\n"
                  b"RUN pip install --quiet --no-deps six==1.16.0 && python -m venv /opt/venv\n")
    image = await runtime.task_image(task("", dockerfile))
    out = await read(runtime, image, 'python -c "import six; print(six.__version__)"; /opt/venv/bin/python -V; '
                                     "echo $PIP_BREAK_SYSTEM_PACKAGES")
    lines = out.split("\n")
    assert lines[0] == "1.16.0" and lines[1].startswith("Python 3.") and lines[2] == "1", out


async def test_a_toolchain_stand_in_and_an_unmapped_image(runtime):
    image = await runtime.task_image(task("", b"FROM gcc:13\nRUN printf 'int main(){return 7;}' > /m.c && gcc -o /m /m.c\n"))
    assert await read(runtime, image, "/m; echo $?") == "7\n"
    with pytest.raises(ImageBuildError, match="no such local image"):
        await runtime.task_image(task("", b"FROM quay.io/someone/private:1\nRUN true\n"))
    runtime.ctx.stand_ins = {"quay.io/someone/*": "base"}  # the table is the operator's
    try:
        assert await runtime.task_image(task("", b"FROM quay.io/someone/private:1\nRUN true\n"))
    finally:
        runtime.ctx.stand_ins = None


@pytest.mark.local
async def test_the_java_stand_in_compiles_and_runs_java(runtime):
    """eclipse-temurin:* (18 of 116 tasks in two public TB2 suites) gets Debian's JDK and JAVA_HOME."""
    if runtime.backend.name != "local":
        pytest.skip("one backend is enough for a toolchain (the recipe is the same)")
    dockerfile = (b"FROM eclipse-temurin:17-jdk\n"
                  b"RUN mkdir /src && printf 'class M { public static void main(String[] a) { System.exit(5); } }' "
                  b"> /src/M.java && javac -d /src /src/M.java\n")
    image = await runtime.task_image(task("", dockerfile))
    assert await read(runtime, image, 'java -cp /src M; echo $? "$JAVA_HOME"; test -x "$JAVA_HOME/bin/java" && echo ok'
                      ) == "5 /usr/lib/jvm/default-java\nok\n"


def test_mirror_names_and_digests_of_official_images_find_their_stand_in():
    """TB2 tasks start FROM public.ecr.aws/docker/library/debian:bookworm-slim@sha256:..."""
    from workers.standins import stand_in_for

    digest = "@sha256:" + "0" * 64
    assert stand_in_for(f"public.ecr.aws/docker/library/debian:bookworm-slim{digest}") == "base"
    assert stand_in_for("mirror.gcr.io/library/python:3.12-slim") == "python"
    assert stand_in_for("ghcr.io/someone/python:3.12") is None  # not the official image


async def test_a_digest_reference_is_simply_not_a_local_image(runtime):
    assert await runtime.backend.has_image("public.ecr.aws/docker/library/debian:bookworm-slim@sha256:" + "0" * 64) \
        is False

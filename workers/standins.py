"""Stand-ins for the public images task Dockerfiles start ``FROM`` when no image registry answers.

A stand-in is the base image (Debian 12) plus a recipe that makes it behave like the
image it stands for: ``python:*`` gets ``python`` and ``pip`` (Debian's, with
``PIP_BREAK_SYSTEM_PACKAGES=1`` as in the official images, where pip installs system-wide)
and ``venv``; ``gcc:*``, ``golang:*``, ``node:*``, ``rust:*`` get the toolchain from Debian, and
``eclipse-temurin:*``, ``openjdk:*``, ``amazoncorretto:*`` its JDK (``JAVA_HOME`` set).
Each is built once per backend, like any task image, with the build's network. Which
names map to which stand-in is a setting (``FORKYARD_IMAGES__STAND_INS``: fnmatch
pattern to stand-in, first match wins); a real image this host has always wins.

The versions are Debian 12's (Python 3.11, GCC 12, Go 1.19, Node 18, Rust 1.63, Java 17), not the
tag's: a task pinned to a newer toolchain may need its real image imported.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping

from sandboxes.base import SandboxBackend

_APT = "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends {} >/dev/null && rm -rf /var/lib/apt/lists/*\n"

#: Stand-in name -> Dockerfile lines on top of the base image ("" is the base image itself).
RECIPES: Mapping[str, str] = {
    "base": "",
    "python": _APT.format("python3-pip python3-venv python-is-python3") + "ENV PIP_BREAK_SYSTEM_PACKAGES=1\n",
    "gcc": _APT.format("gcc g++ make libc6-dev"),
    "golang": _APT.format("golang-go gcc libc6-dev") + "ENV GOPATH=/go PATH=/go/bin:$PATH\n",
    "node": _APT.format("nodejs npm"),
    "rust": _APT.format("rustc cargo gcc libc6-dev"),
    "java": _APT.format("default-jdk-headless") + "ENV JAVA_HOME=/usr/lib/jvm/default-java\n",
}

#: Image name patterns (after ``docker.io/library/`` is dropped and ``:latest`` added) -> stand-in.
DEFAULT_STAND_INS: Mapping[str, str] = {
    "ubuntu:*": "base",
    "debian:*": "base",
    "python:*": "python",
    "gcc:*": "gcc",
    "buildpack-deps:*": "gcc",
    "golang:*": "golang",
    "node:*": "node",
    "rust:*": "rust",
    "eclipse-temurin:*": "java",
    "openjdk:*": "java",
    "amazoncorretto:*": "java",
}


def stand_in_for(image: str, table: Mapping[str, str] | None = None) -> str | None:
    """Return the stand-in (a :data:`RECIPES` name) for ``image``, or None if no pattern matches."""
    from workers.dockerfile import normalize_image_name

    name = normalize_image_name(image)
    for pattern, stand_in in (DEFAULT_STAND_INS if table is None else table).items():
        if fnmatch.fnmatchcase(name, normalize_image_name(pattern)) or fnmatch.fnmatchcase(name, pattern):
            return stand_in
    return None


def check_table(table: Mapping[str, str]) -> None:
    """Raise ValueError naming a pattern whose stand-in is not a known recipe."""
    for pattern, stand_in in table.items():
        if stand_in not in RECIPES:
            raise ValueError(f"stand-in {stand_in!r} of {pattern!r} is not one of {', '.join(RECIPES)}")


async def stand_in_image(
    backend: SandboxBackend,
    stand_in: str,
    *,
    base_image: str,
    ca_bundle: bytes | None = None,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Return the image of ``stand_in`` on ``backend``, building it from the base image once."""
    from workers.dockerfile import build_task_image

    recipe = RECIPES[stand_in]
    if not recipe:
        return base_image
    return await build_task_image(
        backend, dockerfile=f"# forkyard stand-in: {stand_in}\nFROM base\n{recipe}", context={},
        base_image=base_image, aliases={}, ca_bundle=ca_bundle, progress=progress,
    )


__all__ = ["DEFAULT_STAND_INS", "RECIPES", "check_table", "stand_in_for", "stand_in_image"]

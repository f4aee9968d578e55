"""The environment image of SWE instances: one per (repository, setup commit, install commands, base image).

The image is ``image`` (default the ``python:3.11`` stand-in) with the repository's tree
at ``environment_setup_commit`` (else ``base_commit``) in the workdir and the
``install`` commands run there, with the build's network (the package registries), so
every instance of one repository version shares it. Reset then writes each instance's
own base commit over the tree.
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
from collections.abc import Callable

from workers.envs.base import EnvContext
from workers.envs.swe.repos import RepoStore
from workers.envs.swe.task import SWETask
from workers.errors import TaskSetupError
from workers.standins import stand_in_for, stand_in_image

#: What an instance without ``image`` starts from.
DEFAULT_FROM = "python:3.11"
_INSTALL_SCRIPT = "forkyard-install.sh"


def environment_dockerfile(task: SWETask) -> str:
    """Return the Dockerfile of ``task``'s environment image (its context: the tree and the install script)."""
    workdir = task.workdir
    lines = [f"FROM {task.image or DEFAULT_FROM}", f"ADD repo.tar {workdir}/", f"WORKDIR {workdir}"]
    if task.install:
        lines += [f"COPY {_INSTALL_SCRIPT} /tmp/{_INSTALL_SCRIPT}",
                  f"RUN bash -e /tmp/{_INSTALL_SCRIPT} && rm -f /tmp/{_INSTALL_SCRIPT}"]
    return "\n".join(lines) + "\n"


def install_script(task: SWETask) -> bytes:
    """Return the install commands as one bash script (each must succeed)."""
    return ("set -e\ncd " + shlex.quote(task.workdir) + "\n" + "\n".join(task.install) + "\n").encode()


async def environment_image(task: SWETask, ctx: EnvContext, repos: RepoStore | None, *,
                            progress: Callable[[str], None] | None = None) -> str:
    """Return the image ``task``'s sandboxes start from, building it on first use.

    Raises:
        TaskSetupError: no repository store, or it lacks the repository or the commit.
        ImageBuildError: an install command failed.
    """
    from workers.dockerfile import build_task_image

    assert ctx.base_image is not None, "the runtime starts (and sets the base image) before it prepares images"
    if repos is None:
        raise TaskSetupError(f"instance {task.instance_id}: no repository store is configured (FORKYARD_SWE__REPO_STORE)")
    try:
        tree = await asyncio.to_thread(repos.archive, task.repo, task.setup_commit)
    except Exception as exc:
        raise TaskSetupError(f"instance {task.instance_id}: {exc}") from exc
    context = {"repo.tar": tree}
    if task.install:
        context[_INSTALL_SCRIPT] = install_script(task)
    dockerfile = environment_dockerfile(task)
    source = task.image or DEFAULT_FROM
    aliases: dict[str, str] = {}
    if not await ctx.backend.has_image(source):
        stand_in = stand_in_for(source, ctx.stand_ins)
        if stand_in is not None:
            aliases[source] = await stand_in_image(ctx.backend, stand_in, base_image=ctx.base_image,
                                                   ca_bundle=ctx.ca_bundle, progress=progress)
    key = hashlib.sha256(dockerfile.encode() + tree + context.get(_INSTALL_SCRIPT, b"")).hexdigest()
    async with ctx.lock(f"swe-image:{key}"):
        return await build_task_image(ctx.backend, dockerfile=dockerfile, context=context,
                                      base_image=ctx.base_image, aliases=aliases, progress=progress,
                                      ca_bundle=ctx.ca_bundle)

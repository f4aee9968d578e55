"""The image a terminal task's sandboxes start from, as Harbor picks it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from workers.envs.base import EnvContext
from workers.envs.terminal.task import DOCKERFILE, TerminalTask
from workers.errors import ImageBuildError
from workers.standins import stand_in_for, stand_in_image

logger = logging.getLogger(__name__)


async def task_image(task: TerminalTask, ctx: EnvContext, *, progress: Callable[[str], None] | None = None) -> str:
    """Return the image ``task``'s sandboxes start from, building it (and its FROM's stand-in) on first use.

    A real image this host has wins; else the image's stand-in (:mod:`workers.standins`);
    else, for a ``docker_image`` no stand-in covers, the task's own Dockerfile, as
    Harbor's ``--force-build`` does (every TB2 task names a prebuilt image).

    Raises:
        ImageBuildError: no image can be had, or the Dockerfile does not build.
    """
    assert ctx.base_image is not None, "the runtime starts (and sets the base image) before it prepares images"
    backend = ctx.backend
    dockerfile = task.files.get(DOCKERFILE)
    if task.docker_image:
        if await backend.has_image(task.docker_image):
            return task.docker_image
        stand_in = stand_in_for(task.docker_image, ctx.stand_ins)
        if stand_in is not None:
            return await _stand_in(ctx, stand_in, progress)
        if dockerfile is None:
            raise ImageBuildError(
                f"task {task.name!r}: docker_image {task.docker_image!r} is not available locally, no stand-in "
                "covers it (FORKYARD_IMAGES__STAND_INS) and the task ships no environment/Dockerfile to build"
            )
        logger.warning("task %s: docker_image %s is not available locally; building environment/Dockerfile "
                       "instead", task.name, task.docker_image)
    if dockerfile is None:
        raise ImageBuildError(f"task {task.name!r} has neither environment/Dockerfile nor docker_image")
    from workers.dockerfile import build_task_image, parse_dockerfile, parse_stage

    text = dockerfile.decode("utf-8", errors="replace")
    aliases: dict[str, str] = {}
    try:
        from_image = parse_stage(parse_dockerfile(text), {}).from_image
    except ImageBuildError:
        from_image = None  # build_task_image reports it with its line
    if from_image and not await backend.has_image(from_image):
        stand_in = stand_in_for(from_image, ctx.stand_ins)
        if stand_in is not None:
            aliases[from_image] = await _stand_in(ctx, stand_in, progress)
    # Concurrent sessions of one task share one build.
    async with ctx.lock(f"terminal-image:{task.content_hash}"):
        return await build_task_image(
            backend,
            dockerfile=text,
            context=task.environment_context,
            base_image=ctx.base_image,
            aliases=aliases,
            progress=progress,
            ca_bundle=ctx.ca_bundle,
        )


async def _stand_in(ctx: EnvContext, stand_in: str, progress: Callable[[str], None] | None) -> str:
    assert ctx.base_image is not None
    return await stand_in_image(ctx.backend, stand_in, base_image=ctx.base_image, ca_bundle=ctx.ca_bundle,
                                progress=progress)

"""The web family: headless Chromium in a sandbox, BrowserGym-style observations and actions.

- :mod:`~workers.envs.web.task`: the task directory format (a goal, a site, a checker);
- :mod:`~workers.envs.web.image`: the image (the base plus Debian's Chromium and Playwright);
- :mod:`~workers.envs.web.driver`: the browser driver that runs inside the sandbox;
- :mod:`~workers.envs.web.env`: the environment (its actions, scoring, crashes and forks).

Registered as ``web`` in :mod:`workers.envs.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sandboxes.base import SandboxInfo
from workers.envs.base import Action, EnvContext, ToolSpec
from workers.envs.terminal.task import task_dirs_from_tar, task_to_tar
from workers.envs.web.env import TOOLS, WEB_ENV_VERSION, WebEnv
from workers.envs.web.task import ORACLE_FILE, WebTask, load_task_files
from workers.errors import TaskFormatError

#: The system prompt an agent gets unless its rollout gives one.
SYSTEM_PROMPT = (
    "You are an agent using a web browser. Each observation shows the page's URL, title and accessibility "
    "tree, where every element is a line '[bid] role \"name\"'. Act on elements by their bid with the tools, "
    "one tool call per turn, and call submit once the goal is reached."
)


class WebFamily:
    """The ``web`` environment family."""

    name = "web"
    version = WEB_ENV_VERSION
    tools: tuple[ToolSpec, ...] = TOOLS

    def load_task(self, name: str, files: Mapping[str, bytes]) -> WebTask:
        """Validate a web task directory given as files."""
        return load_task_files(name, files)

    def parse_tasks(self, data: bytes) -> list[WebTask]:
        """Read the web task dirs of a tar archive (plain, gzip, bzip2 or xz)."""
        return task_dirs_from_tar(data, load_task_files)

    def encode_task(self, task: Any) -> bytes:
        """Return the task as a deterministic tar.gz of its directory."""
        return task_to_tar(_web(task))

    def decode_task(self, data: bytes) -> WebTask:
        """Return the task :meth:`encode_task` stored."""
        (task,) = task_dirs_from_tar(data, load_task_files)
        return task

    async def prepare_image(self, task: Any, ctx: EnvContext, *,
                            progress: Callable[[str], None] | None = None) -> str:
        """Return the web image, building it on first use (every web task shares it)."""
        from workers.envs.web.image import web_image

        assert ctx.base_image is not None, "the runtime starts (and sets the base image) before it prepares images"
        async with ctx.lock("web-image"):
            return await web_image(ctx.backend, base_image=ctx.base_image, ca_bundle=ctx.ca_bundle,
                                   progress=progress)

    def open(self, task: Any, ctx: EnvContext, *, image: str, labels: Mapping[str, str],
             env_version: str = "") -> WebEnv:
        """Return a (not yet reset) env for ``task``."""
        return WebEnv(_web(task), ctx.backend, image=image, labels=labels, counters=ctx.counters, pool=ctx.pool)

    def restore(self, task: Any, ctx: EnvContext, sandbox: SandboxInfo, state: Mapping[str, Any], *,
                labels: Mapping[str, str]) -> WebEnv:
        """Continue an episode on a sandbox restored from its snapshot (the browser restarts on the first step)."""
        return WebEnv.from_snapshot(_web(task), ctx.backend, sandbox, state, labels=labels, counters=ctx.counters)

    def system_prompt(self, task: Any) -> str:
        """Return the browser agent's system prompt."""
        return SYSTEM_PROMPT

    def oracle(self, task: Any) -> list[Action]:
        """Return ``solution/actions.json`` as actions, ending with ``submit``.

        Raises:
            TaskFormatError: the task ships no oracle.
        """
        actions = _web(task).oracle_actions
        if actions is None:
            raise TaskFormatError(f"task {task.name!r} has no oracle: {ORACLE_FILE} is missing", file=ORACLE_FILE)
        out = [Action(a["tool"], a.get("arguments") or {}) for a in actions]
        if out[-1].tool != "submit":
            out.append(Action("submit", {}))
        return out

    def deterministic(self, task: Any) -> bool:
        """Tell whether actions replay exactly: not for a browser (timers, layout, the server's clock)."""
        return False


def _web(task: Any) -> WebTask:
    if not isinstance(task, WebTask):
        raise TypeError(f"the web family runs WebTask, not {type(task).__name__}")
    return task


#: The family object the registry hands out.
FAMILY = WebFamily()

__all__ = ["FAMILY", "SYSTEM_PROMPT", "WebFamily"]

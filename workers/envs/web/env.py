"""The web environment: a headless Chromium in a sandbox, driven with BrowserGym-style actions.

A sandbox's browser driver (:mod:`workers.envs.web.driver`) starts before it knows its
task: a warm pool's fills start it (:data:`WARMUP`), so a reset that claims such a
sandbox finds Chromium running; a cold sandbox gets it at reset. The reset then writes
the task's site (one archive, one exec), starts the task's ``serve`` command if it has
one, and sends the driver the task's settings with its first request: open the start
page, run ``setup_js``. Each step is one exec of a bash ``/dev/tcp`` client that hands
the driver one JSON request (carrying the token only the worker knows) and prints its
JSON reply: the action, the next observation and the task's ``reward_js``/``done_js``
values, in one round trip.

The sandbox has no network but its own loopback, and the driver aborts every request
off the site's origin, so neither a page, a fetch nor ``goto`` reaches the host or
anything else. The episode ends when ``done_js`` turns true, the agent calls
``submit``, ``max_steps`` actions have run or the agent's time is up; it is then scored
with ``reward_js`` or, when the task has one, ``tests/check.py`` run in the sandbox.
With ``[observation] screenshots``, each step's result carries a PNG of the page in
``StepResult.artifacts`` (the gateway stores it and links it), never in the observation.

The final step says whose result it is in ``info["outcome"]``: ``reward`` for a verdict (0
included), ``verifier_error`` when the verifier gave none (``reward_js`` threw, gave no number
or read a value it cannot read without running page code; ``tests/check.py`` timed out or
printed no reward): then ``reward`` is None, never a 0, and ``info["verifier_error"]`` says why.
How the driver keeps page scripts from the values ``reward_js`` reads, and agent text from
running as script on a static site, is in :mod:`workers.envs.web.driver`; a ``serve`` app's
pages get no such policy.

A browser that crashes, is killed or stops answering ends the episode with
:class:`~sandboxes.errors.SandboxCrashedError` (an infrastructure failure, never scored)
and its sandbox is destroyed.

A fork (:meth:`WebEnv.snapshot`) keeps the sandbox's files (the site's server-side state
among them) and the browser's state: URL, cookies, local and session storage and the
actions since the page last loaded. A restored env starts its processes again on its
first step, loads that state, replays the actions and compares the accessibility tree
with the snapshot's: ``info["restore"]`` reports whether they match.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import json
import logging
import math
import secrets
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandboxes.base import Resources, SandboxBackend, SandboxInfo, SandboxSpec
from sandboxes.errors import SandboxCrashedError, SandboxError
from workers.archives import pack_files
from workers.envs.base import Action, EnvSnapshot, StepResult, ToolSpec
from workers.envs.sandboxed import SUBMIT_TOOL, SandboxedEnv, check_no_arguments, finite_number
from workers.envs.web.task import WebTask
from workers.errors import ActionError, SessionClosedError, TaskSetupError
from workers.pool import Warmup
from workers.protocol import EpisodeOutcome

if TYPE_CHECKING:
    from workers.pool import WarmPool

logger = logging.getLogger(__name__)

#: Version of what a reset leaves in the sandbox.
WEB_ENV_VERSION = "1"
DRIVER_DIR = "/opt/forkyard-web"
DRIVER_PORT = 7923
SITE_ROOT = "/srv/forkyard/site"
LOG_DIR = "/var/log/forkyard-web"
CHECK_DIR = "/forkyard-check"
#: Chromium runs ~80 threads and ~25 more per tab: the default 256 pids would crash a few tabs in.
WEB_PIDS = 2048
#: Milliseconds one browser action may wait for its element or its page.
ACTION_TIMEOUT_MS = 5000
#: Seconds the host waits for one driver reply before it calls the browser hung.
REPLY_TIMEOUT_S = 60.0
#: Seconds the driver (and Chromium) may take to start.
START_TIMEOUT_S = 60.0
_MAX_REPLY_BYTES = 32 * 1024 * 1024
_INLINE_REQUEST_BYTES = 32 * 1024
_CHECK_TIMEOUT_S = 120.0
_HOUSEKEEPING_TIMEOUT_S = 30.0
_DRIVER_SOURCE = Path(__file__).with_name("driver.py")

_BID = {"type": "string", "description": "The element's id: the [bid] of its line in the accessibility tree."}


def _tool(name: str, description: str, properties: Mapping[str, Any], required: tuple[str, ...] = ()) -> ToolSpec:
    return ToolSpec(name=name, description=description,
                    parameters={"type": "object", "properties": dict(properties), "required": list(required),
                                "additionalProperties": False})


TOOLS: tuple[ToolSpec, ...] = (
    _tool("click", "Click an element.", {"bid": _BID}, ("bid",)),
    _tool("fill", "Clear a text field and type text into it.", {"bid": _BID, "text": {"type": "string"}},
          ("bid", "text")),
    _tool("select_option", "Choose an option of a <select> by its value or its label.",
          {"bid": _BID, "value": {"type": "string"}}, ("bid", "value")),
    _tool("hover", "Move the mouse over an element.", {"bid": _BID}, ("bid",)),
    _tool("press", "Focus an element and press a key or a combination (Enter, Tab, Control+a).",
          {"bid": _BID, "key": {"type": "string"}}, ("bid", "key")),
    _tool("scroll", "Scroll the page by dx, dy pixels.", {"dx": {"type": "number"}, "dy": {"type": "number"}},
          ("dx", "dy")),
    _tool("goto", "Open a URL of the task's site (a path such as /cart, or the full URL).",
          {"url": {"type": "string"}}, ("url",)),
    _tool("go_back", "Go back one page in the tab's history.", {}),
    _tool("go_forward", "Go forward one page in the tab's history.", {}),
    _tool("noop", "Do nothing and look at the page again.", {}),
    _tool("send_msg_to_user", "Send a message to the user (an answer the task may check).",
          {"text": {"type": "string"}}, ("text",)),
    ToolSpec(name="submit", description="Finish the task: call this once the goal is reached; the result is then "
             "checked.", parameters=SUBMIT_TOOL.parameters, ends_episode=True),
)
_BROWSER_TOOLS = frozenset(t.name for t in TOOLS) - {"send_msg_to_user", "submit"}
_ARGUMENTS = {t.name: (set(t.parameters["properties"]), set(t.parameters.get("required", ()))) for t in TOOLS}


def check_arguments(tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Return a browser tool's arguments checked against its schema.

    Raises:
        ActionError: an unknown tool, a missing or unknown argument, or one of the wrong type.
    """
    if tool not in _ARGUMENTS:
        raise ActionError(f"unknown tool {tool!r}; the tools are: {', '.join(t.name for t in TOOLS)}")
    allowed, required = _ARGUMENTS[tool]
    unknown = sorted(set(arguments) - allowed)
    missing = sorted(required - set(arguments))
    if unknown or missing:
        wants = ", ".join(sorted(allowed)) or "no arguments"
        raise ActionError(f"{tool} takes {wants}; "
                          + (f"unknown: {', '.join(unknown)}" if unknown else f"missing: {', '.join(missing)}"))
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if key in ("dx", "dy"):
            number = finite_number(value)
            if number is None:
                raise ActionError(f"{tool} {key!r} must be a number of pixels, got {value!r}")
            out[key] = number
        elif key == "bid" and isinstance(value, int) and not isinstance(value, bool):
            out[key] = str(value)
        elif not isinstance(value, str):
            raise ActionError(f"{tool} {key!r} must be a string, got {value!r}")
        else:
            out[key] = value
    return out


def format_observation(obs: Mapping[str, Any], *, error: str | None = None, note: str | None = None) -> str:
    """Render the driver's observation as the text the agent sees."""
    lines = [f"URL: {obs.get('url', '')}", f"Title: {obs.get('title', '')}"]
    tabs = obs.get("tabs") or []
    if len(tabs) > 1:
        lines.append("Tabs:")
        lines += [f"  [{i}] {t.get('title') or '(untitled)'} {t.get('url')}{' (active)' if t.get('active') else ''}"
                  for i, t in enumerate(tabs)]
    lines += ["Accessibility tree:", obs.get("tree") or "(empty page)"]
    if error:
        lines.append(f"Last action error: {error}")
    if note:
        lines.append(note)
    return "\n".join(lines)


def _reward(value: Any) -> float | None:
    """Return what reward_js gave as a reward: a finite number, or a boolean as 1 or 0; else None."""
    return float(value) if isinstance(value, bool) else finite_number(value)


class WebEnv(SandboxedEnv):
    """One episode of a web task: a sandbox with the site, Chromium and the driver."""

    def __init__(self, task: WebTask, backend: SandboxBackend, *, image: str, labels: Mapping[str, str] | None = None,
                 counters: collections.Counter[str] | None = None, pool: WarmPool | None = None) -> None:
        super().__init__(backend, agent_timeout_s=task.agent_timeout_s, counters=counters, pool=pool)
        self.task = task
        self.image = image
        self.labels = dict(labels or {})
        self.messages: list[str] = []
        self._token = ""
        self._obs: dict[str, Any] = {}
        self._revive: Mapping[str, Any] | None = None
        """The snapshot state a restored env loads on its first step."""

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        """The browser actions, ``send_msg_to_user`` and ``submit``."""
        return TOOLS

    # ------------------------------------------------------------------ lifecycle

    async def reset(self) -> str:
        """Start a sandbox with the site and the browser on the start page; return the goal and the first observation.

        Raises:
            TaskSetupError: the task's server did not come up.
            SandboxError: the sandbox or the browser could not start.
        """
        async with self._lock:
            if self._closed:
                raise SessionClosedError("the environment is closed")
            await self._destroy_sandbox()
            self._count("resets")
            self.messages, self._revive = [], None
            self.sandbox = await self._create_sandbox(self._spec(), warmup=WARMUP)
            try:
                await self._browser(fresh=False)
                await self._install_site()
                await self._serve()
                reply = await self._call({"op": "start", "url": self.task.start_url, "setup_js": self.task.setup_js,
                                          "settings": self._settings(), "checks": self._checks()},
                                         timeout_s=START_TIMEOUT_S)
                if reply.get("failed"):
                    raise TaskSetupError(f"web task {self.task.name!r}: the start page {self.task.start_url} did not "
                                         f"open: {reply['failed']}")
            except BaseException:
                await self._destroy_sandbox()
                raise
            self._obs = reply["obs"]
            self._start_clock()
            logger.info("web task %s: sandbox %s ready at %s", self.task.name, self._sandbox_id(), self._obs.get("url"))
            return f"{self.task.goal}\n\n{format_observation(self._obs)}"

    def _spec(self) -> SandboxSpec:
        return SandboxSpec(image=self.image, network=False, labels=self.labels,
                           resources=Resources(cpus=self.task.cpus, memory_mb=self.task.memory_mb, pids=WEB_PIDS,
                                               disk_mb=self.task.disk_mb))

    def _settings(self) -> dict[str, Any]:
        """What the driver is told of the task with its first request (a warm pool's driver starts without it)."""
        return {"origin": self.task.origin, "seed": self.task.seed, "site_port": self.task.port,
                "site_dir": None if self.task.serve else SITE_ROOT, "action_timeout_ms": ACTION_TIMEOUT_MS,
                "max_tree_chars": self.task.max_tree_chars}

    async def _browser(self, *, fresh: bool) -> None:
        """Take the sandbox's running driver (a warm pool's), or start one; learn its token.

        ``fresh`` starts one whatever the sandbox holds (a restored sandbox has a config, not the processes).
        """
        sandbox_id = self._sandbox_id()
        if not fresh:
            # A subshell: the persistent shell must not keep a connection to the driver open.
            probe = await self.backend.exec(
                sandbox_id, f"(cat {DRIVER_DIR}/config.json 2>/dev/null && "
                f"{{ exec 3<>/dev/tcp/127.0.0.1/{DRIVER_PORT}; }} 2>/dev/null)", timeout_s=_HOUSEKEEPING_TIMEOUT_S)
            if probe.exit_code == 0:
                self._token = json.loads(probe.stdout)["token"]
                self._count("warm_browsers")
                return
        self._token = await start_browser(self.backend, sandbox_id)

    async def _install_site(self) -> None:
        """Put the task's site in the sandbox (one archive, one exec)."""
        files = {f"{SITE_ROOT.lstrip('/')}/{rel}": data for rel, data in self.task.site_files.items()}
        await _unpack(self.backend, self._sandbox_id(), files, what="install the site")

    async def _serve(self) -> None:
        """Start the task's own server, if it has one, and wait until it listens."""
        if not self.task.serve:
            return
        sandbox_id = self._sandbox_id()
        await _run(self.backend, sandbox_id,
                   f"mkdir -p {LOG_DIR} && cd {SITE_ROOT} && (setsid nohup bash -c {shlex.quote(self.task.serve)} "
                   f"> {LOG_DIR}/serve.log 2>&1 < /dev/null &)", what="start the task's server")
        if not await _wait_port(self.backend, sandbox_id, self.task.port, self.task.ready_timeout_s):
            log = await _log_tail(self.backend, sandbox_id, "serve.log")
            raise TaskSetupError(f"web task {self.task.name!r}: [site] serve did not listen on port "
                                 f"{self.task.port} within {self.task.ready_timeout_s:g}s; its output ended: {log}")

    # ------------------------------------------------------------------ the driver

    def _checks(self) -> dict[str, str]:
        return {k: v for k, v in (("reward", self.task.reward_js), ("done", self.task.done_js)) if v}

    async def _call(self, request: Mapping[str, Any], *, timeout_s: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        """Send the driver one request and return its reply.

        Raises:
            SandboxCrashedError: the driver is gone, the browser crashed, or no reply came in time.
        """
        sandbox_id = self._sandbox_id()
        line = f"{self._token} {json.dumps(request)}"
        if len(line) > _INLINE_REQUEST_BYTES:
            await self.backend.write_file(sandbox_id, f"{DRIVER_DIR}/request", line.encode() + b"\n", mode=0o600)
            send = f"cat {DRIVER_DIR}/request >&3"
        else:
            send = f"printf '%s\\n' {shlex.quote(line)} >&3"
        command = f"({{ exec 3<>/dev/tcp/127.0.0.1/{DRIVER_PORT}; }} 2>/dev/null || exit 97; {send}; cat <&3)"
        result = await self.backend.exec(sandbox_id, command, timeout_s=timeout_s, max_output_bytes=_MAX_REPLY_BYTES)
        if result.timed_out:
            raise await self._browser_failed(f"the browser did not answer within {timeout_s:g}s (hung)")
        if result.exit_code == 97:
            raise await self._browser_failed("the browser driver is not running (it crashed or was killed)")
        try:
            reply = json.loads(result.stdout)
        except ValueError:
            raise await self._browser_failed(
                f"the browser driver gave no reply (exit code {result.exit_code}; "
                f"{(result.stderr or result.stdout).strip()[-300:] or 'no output'})") from None
        if reply.get("fatal"):
            raise await self._browser_failed(f"the browser failed: {reply['fatal']}")
        return dict(reply)

    async def _browser_failed(self, reason: str) -> SandboxCrashedError:
        """End the episode as an infrastructure failure, destroy the sandbox and return the error to raise."""
        sandbox_id = self.sandbox.id if self.sandbox else "-"
        logger.warning("web task %s: %s in sandbox %s; destroying it", self.task.name, reason, sandbox_id)
        self._done = True
        self._count("browser_failures")
        try:
            await self._destroy_sandbox()
        except SandboxError:
            logger.exception("destroying sandbox %s after a browser failure failed", sandbox_id)
        return SandboxCrashedError(f"web task {self.task.name!r}: {reason}; sandbox {sandbox_id} was destroyed")

    # ------------------------------------------------------------------ steps

    async def step(self, action: Action, *, budget_s: float | None = None) -> StepResult:
        """Apply one action; ``done_js`` turning true, ``submit``, the step limit or the clock ends the episode.

        Raises:
            ActionError: unknown tool or invalid arguments (the episode goes on).
            SessionClosedError: the episode has ended or the env is closed.
            SandboxCrashedError: the browser crashed or hung (the sandbox is destroyed).
        """
        async with self._lock:
            self._check_open()
            tool, arguments = action.tool, action.arguments or {}
            if not isinstance(arguments, Mapping):
                raise ActionError(f"the arguments of {tool!r} must be an object, got {type(arguments).__name__}")
            if tool == SUBMIT_TOOL.name:
                check_no_arguments(tool, arguments)
                self._took_step()
                return await self._final_page(await self._finish(format_observation(self._obs), truncated=False,
                                                                 note="submitted"))
            args = check_arguments(tool, arguments)
            self._took_step()
            restore_info = await self._revive_if_restored()
            if self.time_left() <= 0:
                return await self._finish(format_observation(self._obs), truncated=True,
                                          note=f"agent time limit of {self.agent_timeout_s:g}s reached")
            error = None
            shot = self.task.screenshots
            if tool == "send_msg_to_user":
                self.messages.append(args["text"])
                reply = await self._call({"op": "observe", "checks": self._checks(), "screenshot": shot})
            else:
                timeout = REPLY_TIMEOUT_S if budget_s is None else max(5.0, min(REPLY_TIMEOUT_S, budget_s))
                reply = await self._call({"op": "act", "tool": tool, "args": args, "checks": self._checks(),
                                          "screenshot": shot}, timeout_s=timeout)
                error = reply.get("error") or reply.get("failed")
            obs = reply.get("obs") or {}
            png = screenshot_png(obs)
            obs.pop("screenshot", None)
            self._obs = obs or self._obs
            artifacts = {"screenshot.png": png} if png is not None else {}
            observation = format_observation(self._obs, error=error)
            info: dict[str, Any] = {"url": self._obs.get("url"), "title": self._obs.get("title"),
                                    "last_action_error": error, "driver_ms": reply.get("driver_ms"),
                                    "time_left_s": self.time_left()}
            if restore_info is not None:
                info["restore"] = restore_info
            values = reply.get("values") or {}
            ending = None
            if self.task.done_js and values.get("done"):
                ending = (False, "the task's page says it is done")
            elif self.steps >= self.task.max_steps:
                ending = (True, f"{self.task.max_steps} steps taken")
            elif self.time_left() <= 0:
                ending = (True, f"agent time limit of {self.agent_timeout_s:g}s reached")
            if ending is not None:
                final = await self._finish(observation, truncated=ending[0], note=ending[1], values=values, info=info)
                return dataclasses.replace(final, artifacts=artifacts)
            return StepResult(observation=observation, reward=None, terminated=False, truncated=False, info=info,
                              artifacts=artifacts)

    async def truncate(self, reason: str) -> StepResult:
        """End the episode early (max turns, a rollout's timeout) and score it as it stands."""
        async with self._lock:
            self._check_open()
            self._count("env_steps")
            return await self._final_page(await self._finish(format_observation(self._obs), truncated=True,
                                                             note=reason))

    async def _final_page(self, result: StepResult) -> StepResult:
        """Add the page's screenshot to an ending that took no browser action, when the task asks for them."""
        if not self.task.screenshots or self.sandbox is None or self._revive is not None:
            return result
        png = screenshot_png((await self._call({"op": "observe", "screenshot": True})).get("obs") or {})
        return dataclasses.replace(result, artifacts={"screenshot.png": png}) if png is not None else result

    async def _finish(self, observation: str, *, truncated: bool, note: str,
                      values: Mapping[str, Any] | None = None, info: dict[str, Any] | None = None) -> StepResult:
        """Score the episode (reward_js, or tests/check.py) and end it.

        A verifier that fails (reward_js throws or gives no number, check.py times out or
        prints no reward) leaves no reward: ``reward`` None, ``info["outcome"]``
        ``verifier_error`` with the message in ``info["verifier_error"]``; never a 0.
        """
        info = dict(info or {})
        reward, error = await self._score(values)
        self._done = True
        info["outcome"] = (EpisodeOutcome.REWARD if reward is not None else EpisodeOutcome.VERIFIER_ERROR).value
        if error:
            info["verifier_error"] = error
        info["messages"] = list(self.messages)
        lines = [observation, f"[episode ended: {note}]"]
        if error:
            lines.append(f"[verifier error: {error}]")
        shown = "none" if reward is None else f"{reward:g}"
        lines.append(f"[reward: {shown}]")
        logger.info("web task %s: episode ended in sandbox %s after %d steps (%s), reward %s",
                    self.task.name, self.sandbox.id if self.sandbox else "-", self.steps, note, shown)
        return StepResult(observation="\n".join(lines), reward=reward, terminated=not truncated, truncated=truncated,
                          info=info)

    async def _score(self, values: Mapping[str, Any] | None) -> tuple[float | None, str | None]:
        """Return the reward, or None and why the verifier gave none."""
        if self.task.check_script is not None:
            return await self._run_check()
        if values is None or ("reward" not in values and "reward_error" not in values):
            reply = await self._call({"op": "observe", "checks": self._checks()})
            values = reply.get("values") or {}
        if "reward_error" in values:
            return None, f"reward_js failed: {values['reward_error']}"
        reward = _reward(values.get("reward"))
        if reward is None:
            return None, f"reward_js gave {values.get('reward')!r}, not a number"
        return reward, None

    async def _run_check(self) -> tuple[float | None, str | None]:
        """Run ``tests/check.py`` in the sandbox (it is copied in only now) and read its last line."""
        sandbox_id = self._sandbox_id()
        assert self.task.check_script is not None
        await self.backend.write_file(sandbox_id, f"{CHECK_DIR}/check.py", self.task.check_script, mode=0o600)
        await self.backend.write_file(sandbox_id, f"{CHECK_DIR}/messages.json",
                                      json.dumps(self.messages).encode(), mode=0o600)
        result = await self.backend.exec(
            sandbox_id, f"cd {SITE_ROOT} && FORKYARD_MESSAGES={CHECK_DIR}/messages.json python3 {CHECK_DIR}/check.py",
            timeout_s=_CHECK_TIMEOUT_S, max_output_bytes=64 * 1024)
        if result.timed_out:
            return None, f"tests/check.py timed out after {_CHECK_TIMEOUT_S:g}s"
        last = (result.stdout.strip().splitlines() or [""])[-1]
        try:
            reward = float(last)
        except ValueError:
            reward = math.nan
        if result.exit_code != 0 or not math.isfinite(reward):
            detail = (result.stderr.strip() or last)[-300:]
            return None, f"tests/check.py exited {result.exit_code} without a reward as its last line: {detail}"
        return reward, None

    # ------------------------------------------------------------------ forks

    async def snapshot(self, *, metadata: Mapping[str, str] | None = None) -> EnvSnapshot:
        """Snapshot the sandbox with the browser's state (URL, storage, the actions since the page loaded).

        Raises:
            SessionClosedError: the episode has ended or the env is closed.
        """
        async with self._lock:
            self._check_open()
            await self._revive_if_restored()
            browser = (await self._call({"op": "state"}))["state"]
            snap = await self.backend.snapshot(self._sandbox_id(), metadata=metadata)
            state = {"image": self.image, "steps": self.steps, "time_left_s": self.time_left(),
                     "messages": list(self.messages), "browser": browser, "obs": self._obs}
            return EnvSnapshot(snap, state)

    @classmethod
    def from_snapshot(cls, task: WebTask, backend: SandboxBackend, sandbox: SandboxInfo, state: Mapping[str, Any], *,
                      labels: Mapping[str, str] | None = None,
                      counters: collections.Counter[str] | None = None) -> WebEnv:
        """Wrap a restored sandbox in an env that starts its browser again on its first step."""
        env = cls(task, backend, image=state.get("image") or sandbox.image, labels=labels, counters=counters)
        env.sandbox = sandbox
        env.steps = int(state.get("steps") or 0)
        env.messages = list(state.get("messages") or [])
        env._obs = dict(state.get("obs") or {})
        env._revive = state
        env._deadline = time.monotonic() + float(state.get("time_left_s", task.agent_timeout_s))
        return env

    async def _revive_if_restored(self) -> dict[str, Any] | None:
        """Start the processes of a restored sandbox and load the snapshot's page; return how it compares."""
        state, self._revive = self._revive, None
        if state is None:
            return None
        await self._browser(fresh=True)
        await self._serve()
        reply = await self._call({"op": "restore", "state": state["browser"], "setup_js": self.task.setup_js,
                                  "settings": self._settings(), "checks": self._checks()}, timeout_s=START_TIMEOUT_S)
        if reply.get("failed"):
            raise await self._browser_failed(f"the snapshot's page could not be restored: {reply['failed']}")
        before, after = (state.get("obs") or {}).get("tree", ""), reply["obs"].get("tree", "")
        self._obs = reply["obs"]
        info: dict[str, Any] = {"matches": before == after and state["browser"]["url"] == self._obs.get("url"),
                                "replayed": len(state["browser"].get("log") or []),
                                "replay_errors": reply.get("replay_errors") or []}
        if not info["matches"]:
            info["diff"] = _first_difference(before, after)
            logger.warning("web task %s: the restored page differs from the snapshot's: %s", self.task.name,
                           info["diff"])
        return info



async def start_browser(backend: SandboxBackend, sandbox_id: str) -> str:
    """Install the driver with a new token, start it (it launches Chromium) and wait until it answers; return the token.

    Raises:
        SandboxError: the browser did not start.
    """
    token = secrets.token_urlsafe(24)
    config = json.dumps({"token": token, "port": DRIVER_PORT}).encode()
    await _unpack(backend, sandbox_id, {f"{DRIVER_DIR.lstrip('/')}/driver.py": _DRIVER_SOURCE.read_bytes(),
                                        f"{DRIVER_DIR.lstrip('/')}/config.json": config}, what="install the driver")
    await _run(backend, sandbox_id,
               f"mkdir -p {LOG_DIR} && cd {DRIVER_DIR} && (setsid nohup python3 driver.py config.json "
               f"> {LOG_DIR}/driver.log 2>&1 < /dev/null &)", what="start the browser driver")
    if not await _wait_port(backend, sandbox_id, DRIVER_PORT, START_TIMEOUT_S):
        log = await _log_tail(backend, sandbox_id, "driver.log")
        raise SandboxError(f"the browser did not start in sandbox {sandbox_id} within {START_TIMEOUT_S:g}s: {log}")
    return token


async def _warm(backend: SandboxBackend, info: SandboxInfo) -> None:
    await start_browser(backend, info.id)


#: What a warm pool does to a web sandbox before a reset claims it: the driver and Chromium started.
WARMUP = Warmup("web-browser", _warm)


async def _unpack(backend: SandboxBackend, sandbox_id: str, files: Mapping[str, bytes], *, what: str) -> None:
    """Write ``files`` (paths from /) into the sandbox as one archive, unpacked with one exec."""
    data = pack_files(files, mode=lambda rel: 0o600 if rel.endswith("config.json") else 0o644)
    archive = f"/tmp/forkyard-web-{secrets.token_hex(4)}.tgz"
    await backend.write_file(sandbox_id, archive, data, mode=0o600)
    await _run(backend, sandbox_id, f"tar -xzf {archive} -C / --no-same-owner && rm -f {archive}", what=what)


async def _run(backend: SandboxBackend, sandbox_id: str, command: str, *, what: str) -> None:
    result = await backend.exec(sandbox_id, command, timeout_s=_HOUSEKEEPING_TIMEOUT_S)
    if result.exit_code != 0:
        detail = (result.stderr or result.stdout).strip()[-500:] or f"exit code {result.exit_code}"
        raise SandboxError(f"could not {what} in sandbox {sandbox_id}: {detail}")


async def _wait_port(backend: SandboxBackend, sandbox_id: str, port: int, timeout_s: float) -> bool:
    tries = max(1, int(timeout_s / 0.05))
    probe = (f"(for i in $(seq 1 {tries}); do if {{ exec 3<>/dev/tcp/127.0.0.1/{port}; }} 2>/dev/null; then "
             "exit 0; fi; sleep 0.05; done; exit 1)")
    result = await backend.exec(sandbox_id, probe, timeout_s=timeout_s + 10)
    return result.exit_code == 0


async def _log_tail(backend: SandboxBackend, sandbox_id: str, name: str) -> str:
    result = await backend.exec(sandbox_id, f"tail -c 1500 {LOG_DIR}/{name} 2>/dev/null",
                                timeout_s=_HOUSEKEEPING_TIMEOUT_S)
    return result.stdout.strip() or "(no output)"


def _first_difference(before: str, after: str) -> str:
    a, b = before.splitlines(), after.splitlines()
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"line {i + 1}: snapshot {x.strip()!r}, restored {y.strip()!r}"
    return f"the snapshot's tree has {len(a)} line(s), the restored one {len(b)}"


def screenshot_png(obs: Mapping[str, Any]) -> bytes | None:
    """Return the PNG an observation carries (asked for with ``screenshot``), or None."""
    data = obs.get("screenshot")
    return base64.b64decode(data) if isinstance(data, str) else None


__all__ = ["TOOLS", "WEB_ENV_VERSION", "WebEnv", "check_arguments", "format_observation"]

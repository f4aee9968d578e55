"""Web task directories: a goal, a site served inside the sandbox, and a checker.

A task is a directory::

    task.toml            the task (below)
    site/                the site: static files the driver serves, or the app [site] serve starts
    tests/check.py       optional: run in the sandbox at the end, prints the reward as its last line
    solution/actions.json  optional: the oracle, a JSON list of {"tool", "arguments"}

``task.toml``::

    [task]
    goal = "Click the button labelled Submit."   # required: the agent's instruction
    start_url = "/index.html"                    # required: a path on the site (or its full URL)
    max_steps = 30                               # actions before the episode is cut short
    seed = 0                                     # seeds Math.random on every page load, passed to setup_js
    setup_js = "start(seed)"                     # optional: run once after the first page load
    reward_js = "window.score"                   # the reward, a JS expression read in the page
    done_js = "window.finished === true"         # optional: ends the episode when true

    [site]
    serve = "python3 app.py"    # optional: the task's own server, run from site/; else site/ is served statically
    port = 8000                 # where the site listens on the sandbox's loopback
    ready_timeout_sec = 30

    [agent]
    timeout_sec = 600

    [observation]
    max_tree_chars = 16000      # the tree is cut here, with a visible note
    screenshots = false         # true: each step stores a PNG of the page as an artifact

    [environment]
    cpus = 1
    memory_mb = 2048

A task gives ``reward_js`` or ``tests/check.py`` (or both: the check then decides).
Pages of an existing suite (say MiniWoB's, started by a JS call and scored from JS
globals) fit unchanged: ``setup_js`` starts the episode, ``reward_js``/``done_js`` read
the globals. They run outside the page's scripts (see :mod:`workers.envs.web.driver`):
the page globals they read must be plain data the page stores with ``var``, a bare
assignment or ``window.X =`` (not a function to call, nor a top-level ``let``/``const``),
named in the expression (``window.score``, ``WOB_DONE_GLOBAL``); the DOM, storage and
builtins are theirs as before. An expression that throws or gives no number is a
verifier error, not a 0: guard it where the agent's input may reach it.

An element may carry its own ``bid`` attribute (a name such as ``"submit"``, not a
number): the driver keeps it, so an oracle can name elements.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from workers.envs.terminal.task import clean_task_files, content_hash
from workers.errors import TaskFormatError

CONFIG_FILE = "task.toml"
SITE_DIR = "site/"
CHECK_SCRIPT = "tests/check.py"
ORACLE_FILE = "solution/actions.json"

DEFAULT_MAX_STEPS = 30
DEFAULT_PORT = 8000
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_READY_TIMEOUT_S = 30.0
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 2048
DEFAULT_DISK_MB = 2048
#: Characters of accessibility tree an observation keeps (about 4 characters a token).
DEFAULT_MAX_TREE_CHARS = 16000
# Ports the driver itself takes on the sandbox's loopback.
RESERVED_PORTS = frozenset({7923})

_KNOWN = {
    "task": {"goal", "start_url", "max_steps", "seed", "setup_js", "reward_js", "done_js"},
    "site": {"serve", "port", "ready_timeout_sec"},
    "agent": {"timeout_sec"},
    "observation": {"max_tree_chars", "screenshots"},
    "environment": {"cpus", "memory_mb", "disk_mb"},
    "metadata": None,
}


@dataclass(frozen=True)
class WebTask:
    """One validated web task, held in memory."""

    family: ClassVar[str] = "web"
    name: str
    goal: str
    start_url: str
    max_steps: int
    seed: int
    setup_js: str | None
    reward_js: str | None
    done_js: str | None
    serve: str | None
    port: int
    ready_timeout_s: float
    agent_timeout_s: float
    max_tree_chars: int
    screenshots: bool
    """Each step stores a PNG of the page as an artifact (linked from the step, never in the observation)."""
    cpus: float
    memory_mb: int
    disk_mb: int
    files: Mapping[str, bytes]
    content_hash: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def __hash__(self) -> int:
        return hash((self.name, self.content_hash))

    @property
    def instruction(self) -> str:
        """The goal (the environment adds the first page's observation at reset)."""
        return self.goal

    @property
    def origin(self) -> str:
        """The site's origin inside the sandbox."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def site_files(self) -> dict[str, bytes]:
        """Return the files under ``site/`` by their path inside it."""
        return {p[len(SITE_DIR):]: d for p, d in self.files.items() if p.startswith(SITE_DIR)}

    @property
    def check_script(self) -> bytes | None:
        """Return ``tests/check.py``, or None."""
        return self.files.get(CHECK_SCRIPT)

    @property
    def oracle_actions(self) -> list[dict[str, Any]] | None:
        """Return ``solution/actions.json`` (validated at load), or None."""
        data = self.files.get(ORACLE_FILE)
        return None if data is None else json.loads(data)


def _fail(message: str, key: str) -> TaskFormatError:
    return TaskFormatError(f"{CONFIG_FILE}: {message}", file=CONFIG_FILE, field=key)


def _string(table: Mapping[str, Any], section: str, key: str, *, required: bool = False) -> str | None:
    value = table.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _fail(f"[{section}] {key} must be a non-empty string, got {value!r}", f"{section}.{key}")
    return value


def _number(table: Mapping[str, Any], section: str, key: str, default: float, *, whole: bool = False,
            low: float = 0.0, high: float = math.inf) -> float:
    value = table.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (whole and value != int(value)) or not low <= value <= high:
        kind = "a whole number" if whole else "a number"
        raise _fail(f"[{section}] {key} must be {kind} in [{low:g}, {high:g}], got {value!r}", f"{section}.{key}")
    return float(value)


def load_task_files(name: str, files: Mapping[str, bytes]) -> WebTask:
    """Validate a web task directory given as files (relative posix path -> bytes).

    Raises:
        TaskFormatError: names the file and the field.
    """
    clean = clean_task_files(name, files)
    if CONFIG_FILE not in clean:
        raise TaskFormatError(f"{CONFIG_FILE}: the file is missing", file=CONFIG_FILE)
    try:
        config = tomllib.loads(clean[CONFIG_FILE].decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TaskFormatError(f"{CONFIG_FILE}: invalid TOML: {exc}", file=CONFIG_FILE) from exc
    tables: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    for section, value in config.items():
        if section not in _KNOWN:
            warnings.append(f"[{section}] is not used by the web family")
            continue
        if not isinstance(value, dict):
            raise _fail(f"[{section}] must be a table", section)
        tables[section] = value
        known = _KNOWN[section]
        if known is not None:
            warnings += [f"[{section}] {k} is not used by the web family" for k in sorted(set(value) - known)]
    task, site = tables.get("task", {}), tables.get("site", {})
    agent, env = tables.get("agent", {}), tables.get("environment", {})
    goal = _string(task, "task", "goal", required=True)
    start_url = _string(task, "task", "start_url", required=True)
    assert goal is not None and start_url is not None
    setup_js, reward_js, done_js = (_string(task, "task", k) for k in ("setup_js", "reward_js", "done_js"))
    serve = _string(site, "site", "serve")
    port = int(_number(site, "site", "port", DEFAULT_PORT, whole=True, low=1024, high=65535))
    if port in RESERVED_PORTS:
        raise _fail(f"[site] port {port} is taken by the browser driver", "site.port")
    if reward_js is None and CHECK_SCRIPT not in clean:
        raise _fail(f"the task needs [task] reward_js or a {CHECK_SCRIPT} to score an episode", "task.reward_js")
    if not any(p.startswith(SITE_DIR) for p in clean):
        raise TaskFormatError(f"{SITE_DIR}: the site directory is missing or empty", file=SITE_DIR)
    if not start_url.startswith("/") and not start_url.startswith(f"http://127.0.0.1:{port}/"):
        raise _fail(f"[task] start_url must be a path on the site such as '/index.html', got {start_url!r}",
                    "task.start_url")
    if ORACLE_FILE in clean:
        _check_oracle(clean[ORACLE_FILE])
    screenshots = tables.get("observation", {}).get("screenshots", False)
    if not isinstance(screenshots, bool):
        raise _fail(f"[observation] screenshots must be true or false, got {screenshots!r}", "observation.screenshots")
    return WebTask(
        name=name, goal=goal, start_url=start_url,
        max_steps=int(_number(task, "task", "max_steps", DEFAULT_MAX_STEPS, whole=True, low=1, high=10000)),
        seed=int(_number(task, "task", "seed", 0, whole=True, low=0, high=2**32 - 1)),
        setup_js=setup_js, reward_js=reward_js, done_js=done_js, serve=serve, port=port,
        ready_timeout_s=_number(site, "site", "ready_timeout_sec", DEFAULT_READY_TIMEOUT_S, low=1, high=600),
        agent_timeout_s=_number(agent, "agent", "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, low=1),
        max_tree_chars=int(_number(tables.get("observation", {}), "observation", "max_tree_chars",
                                   DEFAULT_MAX_TREE_CHARS, whole=True, low=500, high=1_000_000)),
        screenshots=screenshots,
        cpus=_number(env, "environment", "cpus", DEFAULT_CPUS, low=0.1, high=64),
        memory_mb=int(_number(env, "environment", "memory_mb", DEFAULT_MEMORY_MB, whole=True, low=512)),
        disk_mb=int(_number(env, "environment", "disk_mb", DEFAULT_DISK_MB, whole=True, low=256)),
        files=MappingProxyType(dict(sorted(clean.items()))),
        content_hash=content_hash(name, clean),
        metadata=dict(tables.get("metadata", {})),
        warnings=tuple(warnings),
    )


def _check_oracle(data: bytes) -> None:
    try:
        actions = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskFormatError(f"{ORACLE_FILE}: not valid JSON: {exc}", file=ORACLE_FILE) from exc
    if not isinstance(actions, list) or not actions:
        raise TaskFormatError(f"{ORACLE_FILE}: must be a non-empty list of actions", file=ORACLE_FILE)
    for i, action in enumerate(actions):
        if (not isinstance(action, dict) or not isinstance(action.get("tool"), str)
                or not isinstance(action.get("arguments", {}), dict)):
            raise TaskFormatError(f"{ORACLE_FILE}: action {i} must be {{\"tool\": str, \"arguments\": object}}, "
                                  f"got {action!r}", file=ORACLE_FILE)


__all__ = ["CHECK_SCRIPT", "CONFIG_FILE", "ORACLE_FILE", "SITE_DIR", "WebTask", "load_task_files"]

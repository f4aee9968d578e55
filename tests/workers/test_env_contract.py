"""The environment-family contract, run against every registered family on both backends.

Each family is driven only through :mod:`workers.envs.base` and the runtime, as the
runner, the lazy-fork groups and the sessions API drive it: reset -> step -> snapshot
-> restore -> step -> verify. A family registered without a case here fails
:func:`test_every_registered_family_has_a_contract_case`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from sandboxes.base import LABEL_OWNER
from tests.conftest import DEFAULT_IMAGE_CACHE
from tests.workers.conftest import BuildBackend
from workers.envs.base import (
    Action,
    EnvFamily,
    Environment,
    EnvSnapshot,
    EnvTask,
    Forkable,
    ToolSpec,
    openai_tools,
    run_actions,
)
from workers.envs.registry import family_names, family_of, get_family
from workers.errors import ActionError, SessionClosedError, TaskFormatError
from workers.runtime import WorkerRuntime
from workers.trust import SYSTEM_CA_BUNDLE, read_ca_bundle


@dataclass(frozen=True)
class ContractCase:
    """One family's inputs to the contract: a task and the actions that probe it."""

    task: Callable[[], EnvTask]
    change: Action
    """Changes the sandbox's state (without ending the episode)."""
    observe: Action
    """Reads that state back: its observation holds ``marker`` once ``change`` ran."""
    marker: str
    invalid: Action
    """Arguments the family refuses with an ActionError (the episode goes on)."""


def _terminal_task() -> EnvTask:
    family = get_family("terminal")
    return family.load_task("contract-terminal", {
        "instruction.md": b"Create /app/done.\n",
        "task.toml": b"[environment]\nallow_internet = false\n[agent]\ntimeout_sec = 120\n",
        "environment/Dockerfile": b"FROM ubuntu:24.04\nRUN mkdir -p /app\nWORKDIR /app\n",
        "tests/test.sh": (b"#!/bin/bash\nmkdir -p /logs/verifier\n"
                          b"if [ -f /app/done ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"),
        "solution/solve.sh": b"#!/bin/bash\ntouch /app/done\n",
    })


def _swe_task() -> EnvTask:
    from tests.workers.conftest import SWE_EXAMPLES

    family = get_family("swe")
    line = next(line for line in (SWE_EXAMPLES / "instances.jsonl").read_bytes().splitlines() if b"clamp-upper" in line)
    (task,) = family.parse_tasks(line)
    return task


def _web_task() -> EnvTask:
    return get_family("web").load_task("contract-web", {
        "task.toml": b'[task]\ngoal = "Save."\nstart_url = "/index.html"\nreward_js = "window.saved === 1 ? 1 : 0"\n',
        "site/index.html": (b'<!doctype html><title>contract</title><body><label>Note <input bid="note"></label>'
                            b'<button bid="save" onclick="window.saved = 1">Save</button></body>'),
        "solution/actions.json": b'[{"tool": "click", "arguments": {"bid": "save"}}]',
    })


CASES: dict[str, ContractCase] = {
    "terminal": ContractCase(
        task=_terminal_task,
        change=Action("bash", {"command": "echo branch-point > /app/marker"}),
        observe=Action("bash", {"command": "cat /app/marker"}),
        marker="branch-point",
        invalid=Action("bash", {"command": ""}),
    ),
    "swe": ContractCase(
        task=_swe_task,
        change=Action("str_replace_editor", {"command": "create", "path": "/testbed/notes.txt", "file_text": "branch-point\n"}),
        observe=Action("str_replace_editor", {"command": "view", "path": "/testbed/notes.txt"}),
        marker="branch-point",
        invalid=Action("str_replace_editor", {"command": "view"}),
    ),
    "web": ContractCase(
        task=_web_task,
        change=Action("fill", {"bid": "note", "text": "branch-point"}),
        observe=Action("noop", {}),
        marker='value="branch-point"',
        invalid=Action("click", {}),
    ),
}


def test_every_registered_family_has_a_contract_case() -> None:
    assert set(family_names()) == set(CASES), "add a ContractCase for each family to this suite"


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_object_fits_the_protocol(name: str, swe_store) -> None:
    family = get_family(name)
    assert isinstance(family, EnvFamily) and family.name == name and family.version
    tools = list(family.tools)
    assert tools and all(isinstance(t, ToolSpec) for t in tools)
    assert len({t.name for t in tools}) == len(tools)
    assert any(t.ends_episode for t in tools), "some tool must end (and verify) the episode"
    for tool in openai_tools(tools):
        json.dumps(tool)  # the agent sees them as JSON
        assert tool["function"]["parameters"]["type"] == "object"
    task = CASES[name].task()
    assert task.family == name and family_of(task) is family
    assert family.system_prompt(task)
    # Stored and decoded by the gateway: the same task, the same hash.
    again = family.decode_task(family.encode_task(task))
    assert again.content_hash == task.content_hash and again.name == task.name
    assert family.encode_task(again) == family.encode_task(task)
    assert family.oracle(task)[-1].tool in {t.name for t in tools if t.ends_episode}
    assert isinstance(family.deterministic(task), bool)


def test_unknown_family_is_a_task_error() -> None:
    with pytest.raises(TaskFormatError, match="unknown environment family 'chess'") as info:
        get_family("chess")
    assert info.value.field == "family"


@pytest.mark.parametrize("name", sorted(CASES))
async def test_reset_step_snapshot_restore_step_verify(build_backend: BuildBackend, name: str, swe_store) -> None:
    case = CASES[name]
    task = case.task()
    family = family_of(task)
    runtime = WorkerRuntime(build_backend.backend, image_cache_dir=DEFAULT_IMAGE_CACHE,
                            base_image=build_backend.base, ca_bundle=read_ca_bundle(SYSTEM_CA_BUNDLE))
    owner = f"test-contract-{uuid.uuid4().hex[:8]}"
    labels = {LABEL_OWNER: owner}
    envs: list[Environment] = []
    snap: EnvSnapshot | None = None
    try:
        image = await runtime.task_image(task)
        env = runtime.new_env(task, image=image, labels=labels)
        envs.append(env)
        assert isinstance(env, Environment) and env.sandbox is None and not env.done
        assert (await env.reset()).startswith(task.instruction)  # the first observation may follow
        assert env.sandbox is not None and list(env.tools) == list(family.tools)

        with pytest.raises(ActionError):
            await env.step(case.invalid)
        with pytest.raises(ActionError):
            await env.step(Action("no-such-tool", {}))
        changed = await env.step(case.change, budget_s=30)
        assert not (changed.terminated or changed.truncated) and changed.reward is None

        assert isinstance(env, Forkable)
        snap = await env.snapshot(metadata={"forkyard.test": owner})
        snap = EnvSnapshot.from_json(json.loads(json.dumps(snap.to_json())))  # as the gateway stores it
        [fork] = await runtime.restore_envs(snap, task, [labels])
        envs.append(fork)
        assert fork.sandbox is not None and fork.sandbox.id != env.sandbox.id

        seen = await fork.step(case.observe)
        assert case.marker in seen.observation, seen.observation
        solved = await run_actions(fork, family.oracle(task))
        assert solved.terminated and solved.reward == 1.0, solved.info
        with pytest.raises(SessionClosedError):
            await fork.step(case.observe)

        # The source goes on untouched by its fork's oracle, and scores 0 unsolved.
        assert case.marker in (await env.step(case.observe)).observation
        ending = next(t for t in family.tools if t.ends_episode)
        unsolved = await env.step(Action(ending.name, {}))
        assert unsolved.terminated and unsolved.reward == 0.0, unsolved.info
    finally:
        for opened in envs:
            await opened.close()
        if snap is not None:
            await build_backend.backend.delete_snapshot(snap.id)
    assert not [s for s in await build_backend.backend.list() if s.labels.get(LABEL_OWNER) == owner]


def test_a_package_adds_a_family_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third-party family is one entry point: no line of Forkyard changes."""
    from importlib.metadata import EntryPoint

    from workers.envs import registry

    # This module stands in for the package; its family is terminal's under another name.
    class Renamed:
        def __getattr__(self, item: str):
            return getattr(get_family("terminal"), item)

    global PLUGIN_FAMILY
    PLUGIN_FAMILY = Renamed()
    PLUGIN_FAMILY.name = "plugin"  # type: ignore[attr-defined]
    points = [EntryPoint("plugin", f"{__name__}:PLUGIN_FAMILY", registry.ENTRY_POINT_GROUP),
              EntryPoint("terminal", "elsewhere:FAMILY", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: points if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_loaded", {})
    assert registry.family_names() == sorted(["plugin", *registry.BUILTIN])
    assert get_family("plugin") is PLUGIN_FAMILY
    assert get_family("terminal").name == "terminal"  # a built-in name is never taken over


PLUGIN_FAMILY: object = None


NOT_A_FAMILY = object()


def test_an_entry_point_that_is_not_a_family_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    from workers.envs import registry

    points = [EntryPoint("broken", f"{__name__}:NOT_A_FAMILY", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: points if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_loaded", {})
    with pytest.raises(TaskFormatError, match="does not implement the EnvFamily protocol"):
        get_family("broken")

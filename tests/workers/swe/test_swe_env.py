"""SWE episodes in real sandboxes, on both backends: reset, tools, grading, tamper, outcomes, the setup cache."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sandboxes.base import LABEL_OWNER
from sandboxes.errors import SandboxCrashedError
from tests.conftest import DEFAULT_IMAGE_CACHE
from tests.workers.conftest import BuildBackend, backend_with_base
from workers.envs.base import Action, EnvSnapshot, run_actions
from workers.envs.sandboxed import BASE_SNAPSHOT_KEY
from workers.envs.swe import FAMILY
from workers.envs.swe.env import GRADE_SNAPSHOT_KEY, SWEEnv, oracle_patch_command
from workers.envs.swe.task import SWETask, instance_from_json
from workers.errors import ActionError, SessionClosedError
from workers.runtime import WorkerRuntime
from workers.setup_cache import SetupCache


class Harness:
    def __init__(self, build: BuildBackend, tasks: list[SWETask], cache_dir: Path) -> None:
        self.backend = build.backend
        self.tasks = {t.instance_id: t for t in tasks}
        self.owner = f"test-swe-{uuid.uuid4().hex[:8]}"
        self.runtime = WorkerRuntime(build.backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=build.base,
                                     setup_cache=SetupCache(build.backend, cache_dir))

    @asynccontextmanager
    async def env(self, task: SWETask) -> AsyncIterator[SWEEnv]:
        env = self.runtime.new_env(task, image=await self.runtime.task_image(task), labels={LABEL_OWNER: self.owner})
        assert isinstance(env, SWEEnv)
        try:
            assert await env.reset() == task.instruction
            yield env
        finally:
            await env.close()


@pytest.fixture(scope="module", params=["local", "docker"])
async def module_backend(request) -> AsyncIterator[BuildBackend]:
    """A backend for the whole module: the instances' images are built once per backend, not once per test."""
    async for ready in backend_with_base(request.param):
        yield ready


@pytest.fixture
async def harness(module_backend: BuildBackend, swe_store, tmp_path: Path) -> AsyncIterator[Harness]:
    build_backend = module_backend
    _, tasks = swe_store
    ready = Harness(build_backend, tasks, tmp_path / "setup-cache")
    try:
        yield ready
    finally:
        assert ready.runtime.setup_cache is not None
        await ready.runtime.setup_cache.clear()
        left = [s.id for s in await build_backend.backend.list() if s.labels.get(LABEL_OWNER) == ready.owner]
        assert not left, f"sandboxes left behind: {left}"


async def _bash(env: SWEEnv, command: str) -> str:
    return (await env.step(Action("bash", {"command": command}))).observation


async def test_every_shipped_instance_is_resolved_by_its_gold_patch_and_not_by_nothing(harness: Harness) -> None:
    slots = asyncio.Semaphore(3)  # instances side by side; each one's two episodes in order (gold, then empty)

    async def check(task) -> None:
        async with slots:
            async with harness.env(task) as env:
                solved = await run_actions(env, FAMILY.oracle(task))
            assert solved.reward == 1.0 and solved.terminated, (task.instance_id, solved.info)
            grading = solved.info["grading"]
            assert grading["resolved"] and grading["fail_to_pass"] == 1.0 and grading["patch_applied"]
            async with harness.env(task) as env:
                empty = await env.step(Action("submit", {}))
            assert empty.reward == 0.0, (task.instance_id, empty.info)
            assert empty.info["grading"]["FAIL_TO_PASS"]["failure"], empty.info
            assert empty.info["grading"]["pass_to_pass"] == 1.0, empty.info  # the bug breaks only what it should

    await asyncio.gather(*(check(task) for task in harness.tasks.values()))
    # Every reset after the first of an instance restored the setup cache's snapshot.
    counters = harness.runtime.counters
    assert counters["setup_cache_hits"] >= len(harness.tasks) and counters["setup_runs"] == len(harness.tasks)


async def test_the_workdir_has_no_history_and_no_trace_of_the_fix(harness: Harness) -> None:
    task = harness.tasks["forkyard__calc-lcm"]
    async with harness.env(task) as env:
        out = await _bash(env, "cd /testbed && git rev-list --all | wc -l && git status --porcelain | wc -l && "
                               "git cat-file --batch-all-objects --batch | grep -c '// gcd(a, b)' || true")
        commits, dirty, fix_lines = out.split("[exit code")[0].split()
        assert (commits, dirty, fix_lines) == ("1", "0", "0"), out
        assert "gcd(a, a)" in await _bash(env, "grep -n 'gcd(a, a)' /testbed/calc/numbers.py")


async def test_the_editor_edits_and_grading_sees_it(harness: Harness) -> None:
    task = harness.tasks["forkyard__calc-median-even"]
    path = "/testbed/calc/stats.py"
    async with harness.env(task) as env:
        view = await env.step(Action("str_replace_editor", {"command": "view", "path": path, "view_range": [19, 22]}))
        assert view.observation.splitlines()[0].startswith("    19\t") and len(view.observation.splitlines()) == 4
        edit = await env.step(Action("str_replace_editor", {
            "command": "str_replace", "path": path,
            "old_str": "(ordered[middle] + ordered[middle + 1]) / 2", "new_str": "(ordered[middle - 1] + ordered[middle]) / 2"}))
        assert "ordered[middle - 1] + ordered[middle]" in edit.observation
        result = await env.step(Action("submit", {}))
    assert result.reward == 1.0, result.info


async def test_editor_edge_cases(harness: Harness) -> None:
    task = harness.tasks["forkyard__textkit-wrap-exact"]

    async def edit(**arguments: object) -> str:
        return (await env.step(Action("str_replace_editor", arguments))).observation

    async with harness.env(task) as env:
        listing = await edit(command="view", path="/testbed")
        assert "textkit/text.py" in listing and ".git" not in listing
        with pytest.raises(ActionError, match=r"occurs 2 times .*\(lines 24, 39\)"):
            await edit(command="str_replace", path="/testbed/textkit/text.py", old_str="    if width < ")
        with pytest.raises(ActionError, match="does not occur"):
            await edit(command="str_replace", path="/testbed/textkit/text.py", old_str="no such text")
        with pytest.raises(ActionError, match="does not exist"):
            await edit(command="view", path="/testbed/nope.py")
        with pytest.raises(ActionError, match="no edit of /testbed/textkit/case.py to undo"):
            await edit(command="undo_edit", path="/testbed/textkit/case.py")
        with pytest.raises(ActionError, match="outside the repository"):
            await edit(command="view", path="/etc/passwd")
        await _bash(env, "ln -s /etc /testbed/etc-link && head -c 64 /dev/urandom > /testbed/blob.bin && "
                         "printf 'a\\0b' >> /testbed/blob.bin")
        with pytest.raises(ActionError, match="outside the repository"):
            await edit(command="view", path="/testbed/etc-link/passwd")
        with pytest.raises(ActionError, match="binary file"):
            await edit(command="view", path="/testbed/blob.bin")
        with pytest.raises(ActionError, match="view_range"):
            await edit(command="view", path="/testbed/textkit/case.py", view_range=[50, 10])
        with pytest.raises(ActionError, match="already exists"):
            await edit(command="create", path="/testbed/textkit/case.py", file_text="x")
        with pytest.raises(ActionError, match="needs file_text"):
            await edit(command="create", path="/testbed/new.py")
        with pytest.raises(ActionError, match="command must be one of"):
            await edit(command="delete", path="/testbed/new.py")
        assert "File created" in await edit(command="create", path="/testbed/pkg/new.py", file_text="one\ntwo\n")
        assert "zero" in await edit(command="insert", path="/testbed/pkg/new.py", insert_line=0, new_str="zero")
        assert "1.5" in await edit(command="insert", path="/testbed/pkg/new.py", insert_line=2, new_str="1.5")
        assert await _bash(env, "cat /testbed/pkg/new.py") == "zero\none\n1.5\ntwo\n[exit code: 0]"
        with pytest.raises(ActionError, match="insert_line must be a line number from 0 to 4"):
            await edit(command="insert", path="/testbed/pkg/new.py", insert_line=9, new_str="x")
        # Undo survives a snapshot: a fork restored from it undoes the same edit.
        snap = await env.snapshot()
        assert isinstance(snap, EnvSnapshot) and snap.state["editor_history"]
        [fork] = await harness.runtime.restore_envs(snap, task, [{LABEL_OWNER: harness.owner}])
        try:
            await fork.step(Action("str_replace_editor", {"command": "undo_edit", "path": "/testbed/pkg/new.py"}))
            assert await _bash(fork, "cat /testbed/pkg/new.py") == "zero\none\ntwo\n[exit code: 0]"  # type: ignore[arg-type]
        finally:
            await fork.close()
            await harness.backend.delete_snapshot(snap.id)
        await edit(command="undo_edit", path="/testbed/pkg/new.py")
        await edit(command="undo_edit", path="/testbed/pkg/new.py")
        assert "removed" in await edit(command="undo_edit", path="/testbed/pkg/new.py")
        assert "No such file" in await _bash(env, "cat /testbed/pkg/new.py")


TAMPERING = ("cd /testbed && sed -i 's/== 10$/== 0/' tests/test_numbers.py && "
             "printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
             "    out = yield\\n    out.get_result().outcome = \"passed\"\\n' > conftest.py && "
             "echo 'import sys' > sitecustomize.py && "
             "{ (while true; do echo 1 > /testbed/tests/test_numbers.py; sleep 0.05; done) >/dev/null 2>&1 & }")
POISON_PYTEST = ("echo 'raise SystemExit(0)' >> "
                 "$(python3 -c 'import _pytest, os; print(os.path.dirname(_pytest.__file__))')/__init__.py")


def _variant(task: SWETask, **fields: object) -> SWETask:
    """Return ``task`` with some instance fields changed (another instance: another hash, another setup)."""
    return instance_from_json({**task.to_json(), **fields})


async def test_changes_to_tests_and_pytest_hooks_are_tamper(harness: Harness) -> None:
    """Rewriting the failing test, a conftest.py passing everything and a startup hook: reward 0, each listed."""
    task = harness.tasks["forkyard__calc-clamp-upper"]
    async with harness.env(task) as env:
        await _bash(env, TAMPERING)
        await _bash(env, POISON_PYTEST)  # outside the workdir: the grader never sees it, and it is no finding
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["outcome"] == "reward" and result.info["cause"] == "tamper", result.info
    assert {f["path"] for f in result.info["tamper"]} == {"conftest.py", "sitecustomize.py", "tests/test_numbers.py"}
    assert all(f["why"] and f["change"] in ("added", "modified") for f in result.info["tamper"])
    assert "FAIL_TO_PASS" not in result.info["grading"], "a refused verdict runs no tests"
    assert "[verdict refused" in result.observation and "[reward: 0]" in result.observation


async def test_reported_tamper_is_left_out_of_the_grade(harness: Harness) -> None:
    task = _variant(harness.tasks["forkyard__calc-clamp-upper"], tamper="report")
    async with harness.env(task) as env:
        await _bash(env, TAMPERING)
        await _bash(env, POISON_PYTEST)
        result = await env.step(Action("submit", {}))
    grading = result.info["grading"]
    assert result.reward == 0.0 and "cause" not in result.info, result.info
    assert set(grading["left_out_paths"]) == {"conftest.py", "sitecustomize.py", "tests/test_numbers.py"}
    assert {f["path"] for f in result.info["tamper"]} == set(grading["left_out_paths"])
    assert grading["FAIL_TO_PASS"]["failure"] == list(task.fail_to_pass) and grading["pass_to_pass"] == 1.0


async def test_honest_work_with_test_runs_and_a_dependency_is_no_tamper(harness: Harness) -> None:
    """Running the tests (bytecode, pytest's cache) and declaring a dependency are an honest agent's habits."""
    task = harness.tasks["forkyard__calc-clamp-upper"]
    async with harness.env(task) as env:
        await _bash(env, oracle_patch_command(task))
        await _bash(env, "cd /testbed && sed -i 's/^requires-python.*/&\\ndependencies = []/' pyproject.toml && "
                         "python -m pytest -q tests; python -m pytest -q -p no:cacheprovider tests")
        result = await env.step(Action("submit", {}))
    assert result.reward == 1.0, result.info
    assert "tamper" not in result.info and "cause" not in result.info and result.info["outcome"] == "reward"
    assert result.info["grading"]["bytecode_left_out"] > 0


async def test_a_gone_base_snapshot_gives_way_to_a_fresh_graders_files(harness: Harness) -> None:
    """The reset point's snapshot went (evicted from the cache): the agent's change is still measured right."""
    task = harness.tasks["forkyard__calc-median-even"]
    assert harness.runtime.setup_cache is not None
    async with harness.env(task) as env:
        await harness.runtime.setup_cache.clear()
        assert [s for s in await harness.backend.list_snapshots() if s.id == env.export_state()["base"]["id"]] == []
        solved = await run_actions(env, FAMILY.oracle(task))
    assert solved.reward == 1.0 and "tamper" not in solved.info, solved.info
    assert [s for s in await harness.backend.list_snapshots() if "forkyard.verifier" in s.metadata] == []


async def test_without_a_cache_the_env_keeps_its_own_base_until_it_closes(harness: Harness) -> None:
    task = harness.tasks["forkyard__calc-lcm"]
    env = SWEEnv(task, harness.backend, image=await harness.runtime.task_image(task), repos=FAMILY.repos,
                 labels={LABEL_OWNER: harness.owner})
    try:
        await env.reset()
        base = env.export_state()["base"]
        held = [s for s in await harness.backend.list_snapshots() if BASE_SNAPSHOT_KEY in s.metadata]
        assert [s.id for s in held] == [base["id"]]
        await env.reset()  # a new episode, a new base; the old one is freed
        held = [s.id for s in await harness.backend.list_snapshots() if BASE_SNAPSHOT_KEY in s.metadata]
        assert held == [env.export_state()["base"]["id"]] and held != [base["id"]]
        result = await run_actions(env, FAMILY.oracle(task))
        assert result.reward == 1.0, result.info
    finally:
        await env.close()
    assert [s for s in await harness.backend.list_snapshots()
            if BASE_SNAPSHOT_KEY in s.metadata or GRADE_SNAPSHOT_KEY in s.metadata] == []


async def test_a_change_too_large_to_grade_is_the_agents_zero(harness: Harness) -> None:
    task = harness.tasks["forkyard__calc-lcm"]
    async with harness.env(task) as env:
        await _bash(env, "head -c 5M /dev/urandom > /testbed/blob.bin")
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["cause"] == "patch_too_large", result.info


async def test_a_change_that_hangs_the_tests_is_the_agents_zero(harness: Harness) -> None:
    """Tests that run past the limit only with the agent's change are its doing, not a verifier error to drop."""
    task = _variant(harness.tasks["forkyard__calc-lcm"], verifier_timeout_sec=10)
    async with harness.env(task) as env:
        await _bash(env, "printf 'while True:\\n    pass\\n' >> /testbed/calc/__init__.py")
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["outcome"] == "reward", result.info
    assert result.info["cause"] == "tests_timed_out" and "ran past" in result.info["grading"]["error"]


async def test_tests_that_hang_without_any_change_are_a_verifier_error(harness: Harness) -> None:
    task = _variant(harness.tasks["forkyard__calc-lcm"], verifier_timeout_sec=3, test_cmd="sleep 30")
    async with harness.env(task) as env:
        result = await env.step(Action("submit", {}))
    assert result.reward is None and result.info["outcome"] == "verifier_error", result.info
    assert "ran past the 3s limit" in result.info["verifier_error"] and "cause" not in result.info
    assert "[reward: none]" in result.observation


async def test_a_sandbox_the_agent_took_down_is_graded_on_what_it_left(harness: Harness, monkeypatch) -> None:
    """A command that leaves the sandbox unable to run ends the episode with its cause; the files it left are
    graded host-side all the same (nothing of the broken sandbox has to run)."""
    task = harness.tasks["forkyard__calc-lcm"]
    real_exec = harness.backend.exec

    async def exec_(sandbox_id, command, **kwargs):
        if "crash-me" in command:
            raise SandboxCrashedError(f"the shell of sandbox {sandbox_id} did not start again")
        return await real_exec(sandbox_id, command, **kwargs)

    monkeypatch.setattr(harness.backend, "exec", exec_)
    async with harness.env(task) as env:
        await _bash(env, oracle_patch_command(task))
        result = await env.step(Action("bash", {"command": "crash-me"}))
    assert result.truncated and result.reward == 1.0, result.info
    assert result.info["cause"] == "sandbox_crashed" and result.info["outcome"] == "reward"


async def test_the_agents_own_commits_count_and_a_truncated_episode_is_graded(harness: Harness) -> None:
    task = harness.tasks["forkyard__textkit-truncate-exact"]
    async with harness.env(task) as env:
        await _bash(env, "cd /testbed && git rm -q -r textkit && git commit -qm gone")  # the agent's own commit counts
        result = await env.truncate("max turns (3) reached")
    assert result.truncated and not result.terminated and result.reward == 0.0
    assert result.info["grading"]["FAIL_TO_PASS"]["failure"], result.info
    with pytest.raises(SessionClosedError):
        await env.step(Action("bash", {"command": "true"}))

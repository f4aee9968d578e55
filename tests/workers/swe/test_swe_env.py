"""SWE episodes in real sandboxes, on both backends: reset, tools, grading, tampering, the setup cache."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sandboxes.base import LABEL_OWNER
from tests.conftest import DEFAULT_IMAGE_CACHE
from tests.workers.conftest import BuildBackend
from workers.envs.base import Action, EnvSnapshot, run_actions
from workers.envs.swe import FAMILY
from workers.envs.swe.env import SWEEnv
from workers.envs.swe.task import SWETask
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


@pytest.fixture
async def harness(build_backend: BuildBackend, swe_store, tmp_path: Path) -> AsyncIterator[Harness]:
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


async def test_changes_to_tests_and_pytest_hooks_do_not_reach_the_grade(harness: Harness) -> None:
    """An agent that rewrites the failing test, adds a conftest.py passing everything and poisons pytest still scores 0."""
    task = harness.tasks["forkyard__calc-clamp-upper"]
    async with harness.env(task) as env:
        await _bash(env, "cd /testbed && sed -i 's/== 10$/== 0/' tests/test_numbers.py && "
                         "printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
                         "    out = yield\\n    out.get_result().outcome = \"passed\"\\n' > conftest.py && "
                         "echo 'import sys' > sitecustomize.py && "
                         "(while true; do echo 1 > /testbed/tests/test_numbers.py; sleep 0.05; done) >/dev/null 2>&1 &")
        await _bash(env, "echo 'raise SystemExit(0)' >> $(python3 -c 'import _pytest, os; print(os.path.dirname(_pytest.__file__))')/__init__.py")
        result = await env.step(Action("submit", {}))
    grading = result.info["grading"]
    assert result.reward == 0.0, grading
    assert set(grading["ignored_test_paths"]) == {"conftest.py", "sitecustomize.py", "tests/test_numbers.py"}
    assert grading["FAIL_TO_PASS"]["failure"] == list(task.fail_to_pass) and grading["pass_to_pass"] == 1.0


async def test_the_agents_own_commits_count_and_a_truncated_episode_is_graded(harness: Harness) -> None:
    task = harness.tasks["forkyard__textkit-truncate-exact"]
    async with harness.env(task) as env:
        await _bash(env, "cd /testbed && git rm -q -r textkit && git commit -qm gone")  # the agent's own commit counts
        result = await env.truncate("max turns (3) reached")
    assert result.truncated and not result.terminated and result.reward == 0.0
    assert result.info["grading"]["FAIL_TO_PASS"]["failure"], result.info
    with pytest.raises(SessionClosedError):
        await env.step(Action("bash", {"command": "true"}))

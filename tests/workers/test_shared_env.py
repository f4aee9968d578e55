"""Tests of shared-prefix execution (SharedEnvGroup) on real sandbox backends.

The reference for every observation is the uncached run: the same action sequence
on its own plain TerminalEnv. The shared group must give each member exactly that,
while executing each distinct (node, call) once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from sandboxes.base import LABEL_OWNER
from sandboxes.errors import SandboxError
from workers.envs.base import Action, EnvContext
from workers.envs.terminal.env import TerminalEnv
from workers.envs.terminal.task import TerminalTask, load_task_files
from workers.errors import ActionError, SessionClosedError
from workers.shared_env import SharedEnvGroup, SharedMemberEnv, action_key, truncate_key

DOCKERFILE = b"FROM ubuntu:24.04\nRUN mkdir -p /app && echo seed > /app/seed.txt\nWORKDIR /app\n"
# Scores 1 when /app/answer says "right"; prints what it saw so observations differ by branch.
TEST_SH = b"""#!/bin/bash
mkdir -p /logs/verifier
if grep -qx right /app/answer 2>/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
echo "answer: $(cat /app/answer 2>/dev/null || echo none); files: $(ls /app | tr '\\n' ' ')"
"""
TASK: TerminalTask = load_task_files(
    "shared-probe",
    {
        "instruction.md": b"Write right to /app/answer.\n",
        "task.toml": b"[agent]\ntimeout_sec = 600\n[verifier]\ntimeout_sec = 60\n",
        "environment/Dockerfile": DOCKERFILE,
        "tests/test.sh": TEST_SH,
    },
)

Move = tuple[str, Any]  # ("bash", {...}) / ("submit", {}) / ("truncate", reason)


def bash(command: str) -> Move:
    return ("bash", {"command": command})


SUBMIT: Move = ("submit", {})


# ------------------------------------------------------------------ no backend needed


def test_action_keys_are_canonical() -> None:
    assert action_key("bash", {"command": "ls", "timeout": 5}) == action_key("bash", {"timeout": 5, "command": "ls"})
    assert action_key("submit", None) == action_key("submit", {})
    assert action_key("bash", {"command": "ls"}) != action_key("bash", {"command": "ls "})
    assert action_key("bash", {"command": "ls"}) != action_key("submit", {"command": "ls"})
    assert action_key("bash", {"timeout": float("nan")}) != action_key("bash", {"timeout": float("nan")})
    assert truncate_key("max turns") == truncate_key("max turns") != truncate_key("timeout")
    assert truncate_key("x") != action_key("truncate", "x")


def test_a_group_needs_members_and_a_positive_barrier() -> None:
    with pytest.raises(ValueError, match="at least one"):
        SharedEnvGroup(_unused_factory, size=0, ctx=None, task=TASK)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="barrier_timeout_s"):
        SharedEnvGroup(_unused_factory, size=2, ctx=None, task=TASK, barrier_timeout_s=0)  # type: ignore[arg-type]
    group = SharedEnvGroup(_unused_factory, size=2, ctx=None, task=TASK)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="member index"):
        group.member(2)


async def _unused_factory() -> TerminalEnv:
    raise AssertionError("not called")


# ------------------------------------------------------------------ real backends


def _mounts_under(path: Path) -> list[str]:
    prefix = os.path.realpath(path)
    with open("/proc/self/mountinfo") as handle:
        points = [line.split(" ")[4] for line in handle]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


class Harness:
    """One backend with the task image built on it; each test gets its own owner label."""

    def __init__(self, kind: str, backend, image: str) -> None:
        self.kind = kind
        self.backend = backend
        self.image = image

    def labels(self) -> dict[str, str]:
        return {LABEL_OWNER: f"test-shared-{uuid.uuid4().hex[:8]}"}

    def group(self, size: int, labels: dict[str, str], **kwargs: Any) -> SharedEnvGroup:
        async def new_env() -> TerminalEnv:
            return TerminalEnv(TASK, self.backend, image=self.image, labels=labels)

        ctx = EnvContext(self.backend, image_cache_dir=Path("/nonexistent"))
        return SharedEnvGroup(new_env, size=size, ctx=ctx, task=TASK, labels=labels, **kwargs)

    async def sandboxes(self, labels: dict[str, str]) -> list[str]:
        owner = labels[LABEL_OWNER]
        return [s.id for s in await self.backend.list() if s.labels.get(LABEL_OWNER) == owner]


@pytest.fixture(
    scope="module",
    params=[pytest.param("local", marks=pytest.mark.local), pytest.param("docker", marks=pytest.mark.docker)],
)
async def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    from sandboxes.backends import create_backend
    from tests.conftest import base_image
    from workers.dockerfile import build_task_image

    kind = request.param
    node = f"test-shared-{kind}-{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp(f"shared-{kind}")
    backend = create_backend(kind, node=node, root_dir=root)
    image = None
    try:
        image = await build_task_image(
            backend,
            dockerfile=TASK.dockerfile or "",
            context=TASK.environment_context,
            base_image=await base_image(backend),
            labels={LABEL_OWNER: node},
        )
        yield Harness(kind, backend, image)
    finally:
        try:
            for sandbox in await backend.list():
                await backend.destroy(sandbox.id)
            for snap in await backend.list_snapshots():
                await backend.delete_snapshot(snap.id)
            if image is not None:
                await backend.remove_image(image)
        finally:
            await backend.aclose()
    if not _mounts_under(root):
        shutil.rmtree(root, ignore_errors=True)


def _record(result) -> tuple:
    """Return what a member sees of a step (the clock-dependent time left left out)."""
    info = {k: v for k, v in result.info.items() if k != "time_left_s"}
    return (result.observation, result.reward, result.terminated, result.truncated, info)


async def _apply(env: TerminalEnv | SharedMemberEnv, action: Move) -> tuple:
    tool, arguments = action
    try:
        if tool == "truncate":
            return _record(await env.truncate(arguments))
        return _record(await env.step(Action(tool, arguments)))
    except ActionError as exc:
        return ("ActionError", str(exc))


async def _play(env: TerminalEnv | SharedMemberEnv, actions: Sequence[Move]) -> list[tuple]:
    """Reset, apply the actions in order and close; return what each action gave."""
    try:
        assert await env.reset() == TASK.instruction
        return [await _apply(env, action) for action in actions]
    finally:
        await env.close()


async def _reference(harness: Harness, scripts: Sequence[Sequence[Move]], labels: dict[str, str]) -> list[list]:
    """Run every script on its own plain TerminalEnv (the uncached reference)."""
    return list(
        await asyncio.gather(
            *(_play(TerminalEnv(TASK, harness.backend, image=harness.image, labels=labels), s) for s in scripts)
        )
    )


async def _assert_clean(harness: Harness, group: SharedEnvGroup, labels: dict[str, str]) -> None:
    await group.aclose()
    await group.aclose()
    assert await harness.sandboxes(labels) == []
    assert await harness.backend.list_snapshots() == []


async def test_shared_prefix_then_fork_matches_independent_envs(harness: Harness) -> None:
    common = [bash("echo hello > /app/a.txt && cat /app/a.txt"), bash("cd /app && export MARK=shared && ls")]
    left = [bash("touch only_a && echo right > answer && echo $MARK"), bash("ls /app; cat /app/answer"), SUBMIT]
    right = [bash("touch only_b && echo wrong > answer && echo $MARK"), bash("ls /app; cat /app/answer"), SUBMIT]
    scripts = [common + left, common + left, common + right, common + right]
    labels = harness.labels()
    group = harness.group(4, labels)
    try:
        shared = await asyncio.gather(*(_play(group.member(i), s) for i, s in enumerate(scripts)))
        assert all(group.member(i).done for i in range(4))
        assert await harness.sandboxes(labels) == [], "each node's sandbox goes with its last member"
    finally:
        await _assert_clean(harness, group, labels)
    reference = await _reference(harness, scripts, labels)
    assert shared == reference
    # Each branch saw only its own edits, after the shared shell state (cwd, exports).
    assert shared[0][2][0] == shared[2][2][0] == "shared\n[exit code: 0]"
    assert "only_a" in shared[0][3][0] and "only_b" not in shared[0][3][0]
    assert "only_b" in shared[2][3][0] and "only_a" not in shared[2][3][0]
    assert [s[-1][1] for s in shared] == [1.0, 1.0, 0.0, 0.0]
    # 2 shared steps + 2 x (2 branch steps + submit), each run once; 20 member-steps in all.
    assert group.stats == {"executed_steps": 8, "shared_steps": 12, "forks": 1, "sandboxes_created": 2}


async def test_reset_runs_once_and_only_once_per_member(harness: Harness) -> None:
    labels = harness.labels()
    group = harness.group(3, labels)
    try:
        instructions = await asyncio.gather(*(group.member(i).reset() for i in range(3)))
        assert instructions == [TASK.instruction] * 3
        assert len(await harness.sandboxes(labels)) == 1
        with pytest.raises(SessionClosedError, match="resets once"):
            await group.member(0).reset()
        assert group.stats["sandboxes_created"] == 1
    finally:
        await _assert_clean(harness, group, labels)
    with pytest.raises(SessionClosedError):
        await group.member(1).step(Action("bash", {"command": "true"}))


async def test_a_member_closing_early_does_not_block_the_others(harness: Harness) -> None:
    labels = harness.labels()
    # Far longer than the test's own bound: finishing at all shows nobody waited on the leaver.
    group = harness.group(3, labels, barrier_timeout_s=600)
    stayers = [bash("echo one > /app/answer"), bash("cat /app/answer"), ("truncate", "max turns (3) reached")]
    try:
        shared = await asyncio.wait_for(
            asyncio.gather(
                _play(group.member(0), stayers),
                _play(group.member(1), stayers),
                _play(group.member(2), stayers[:1]),  # one shared step, then it closes
            ),
            timeout=120,
        )
    finally:
        await _assert_clean(harness, group, labels)
    assert shared[0] == shared[1]
    assert shared[0][-1][3] is True and shared[0][-1][1] == 0.0, "truncate ends the episode and verifies"
    assert shared == await _reference(harness, [stayers, stayers, stayers[:1]], labels)
    assert group.stats == {"executed_steps": 3, "shared_steps": 4, "forks": 0, "sandboxes_created": 1}


async def test_a_cancelled_call_is_withdrawn(harness: Harness) -> None:
    labels = harness.labels()
    group = harness.group(2, labels, barrier_timeout_s=600)
    a, b = group.member(0), group.member(1)
    try:
        await asyncio.gather(a.reset(), b.reset())
        waiting = asyncio.ensure_future(b.step(Action("bash", {"command": "echo b > /app/x"})))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # b's call never ran: a alone decides the next turn once b leaves.
        step = asyncio.ensure_future(a.step(Action("bash", {"command": "cat /app/x 2>&1; echo a > /app/x; cat /app/x"})))
        await b.close()
        result = await asyncio.wait_for(step, timeout=60)
        assert "No such file" in result.observation and result.observation.endswith("a\n[exit code: 0]")
        assert group.stats == {"executed_steps": 1, "shared_steps": 0, "forks": 0, "sandboxes_created": 1}
    finally:
        await a.close()
        await _assert_clean(harness, group, labels)


async def test_a_stalled_member_is_split_off_at_the_barrier_timeout(harness: Harness) -> None:
    labels = harness.labels()
    group = harness.group(3, labels, barrier_timeout_s=1.0)
    fast = [bash("echo one > /app/x"), bash("cat /app/x"), SUBMIT]
    slow = [bash("cat /app/x"), bash("echo two > /app/x && cat /app/x"), SUBMIT]
    first_step_done = asyncio.Event()

    async def fast_member(i: int) -> list[tuple]:
        member = group.member(i)
        try:
            await member.reset()
            out = [await _apply(member, fast[0])]
            first_step_done.set()
            return out + [await _apply(member, a) for a in fast[1:]]
        finally:
            await member.close()

    async def slow_member() -> list[tuple]:
        member = group.member(2)
        try:
            await member.reset()
            await first_step_done.wait()  # sends nothing until the others went past the barrier
            return [await _apply(member, a) for a in slow]
        finally:
            await member.close()

    try:
        shared = await asyncio.wait_for(asyncio.gather(fast_member(0), fast_member(1), slow_member()), timeout=180)
    finally:
        await _assert_clean(harness, group, labels)
    assert shared == await _reference(harness, [fast, fast, slow], labels)
    assert shared[0][1][0] == "one\n[exit code: 0]"
    assert "No such file" in shared[2][0][0], "the stalled member continues from the state before the turn"
    assert group.stats["forks"] == 1 and group.stats["sandboxes_created"] == 2


async def test_action_errors_reach_every_member_of_their_key(harness: Harness) -> None:
    labels = harness.labels()
    group = harness.group(2, labels)
    a, b = group.member(0), group.member(1)
    reference = TerminalEnv(TASK, harness.backend, image=harness.image, labels=labels)
    try:
        await asyncio.gather(a.reset(), b.reset(), reference.reset())
        with pytest.raises(ActionError) as expected:
            await reference.step(Action("bash", {"command": 3}))
        errors = await asyncio.gather(
            a.step(Action("bash", {"command": 3})), b.step(Action("bash", {"command": 3})), return_exceptions=True
        )
        assert [type(e) for e in errors] == [ActionError, ActionError]
        assert [str(e) for e in errors] == [str(expected.value)] * 2
        assert errors[0] is not errors[1]
        assert group.stats["executed_steps"] == 1 and group.stats["shared_steps"] == 1
        # Diverging on a bad call: only its key gets the error, the episode goes on for both.
        outcomes = await asyncio.gather(
            a.step(Action("rm_rf", {})), b.step(Action("bash", {"command": "echo ok"})), return_exceptions=True
        )
        assert isinstance(outcomes[0], ActionError) and "unknown tool 'rm_rf'" in str(outcomes[0])
        assert outcomes[1].observation == "ok\n[exit code: 0]"
        assert (await a.step(Action("bash", {"command": "echo still here"}))).observation == "still here\n[exit code: 0]"
        assert group.stats["forks"] == 1
    finally:
        await reference.close()
        await a.close()
        await b.close()
        await _assert_clean(harness, group, labels)


async def test_other_errors_reach_every_member_too(harness: Harness) -> None:
    labels = harness.labels()
    group = harness.group(2, labels)
    try:
        await asyncio.gather(group.member(0).reset(), group.member(1).reset())
        (sandbox_id,) = await harness.sandboxes(labels)
        await harness.backend.destroy(sandbox_id)  # the sandbox dies under the group
        errors = await asyncio.gather(
            *(group.member(i).step(Action("bash", {"command": "true"})) for i in range(2)), return_exceptions=True
        )
        assert all(isinstance(e, SandboxError) for e in errors), errors
        assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
        assert errors[0] is not errors[1]
        assert group.stats["executed_steps"] == 1
    finally:
        await _assert_clean(harness, group, labels)


async def test_aclose_mid_episode_leaves_no_sandbox_and_no_snapshot(harness: Harness) -> None:
    labels = harness.labels()
    group = harness.group(4, labels)
    members = [group.member(i) for i in range(4)]
    try:
        await asyncio.gather(*(m.reset() for m in members))
        await asyncio.gather(*(m.step(Action("bash", {"command": f"echo {i % 3} > /app/x"})) for i, m in enumerate(members)))
        assert group.stats["forks"] == 1
        assert len(await harness.sandboxes(labels)) == 3
        # Member 0 waits at its node's barrier for member 3 (same branch), which never comes.
        waiting = asyncio.ensure_future(members[0].step(Action("bash", {"command": "cat /app/x"})))
        await asyncio.sleep(0.1)
        assert not waiting.done()
    finally:
        await _assert_clean(harness, group, labels)
    with pytest.raises(SessionClosedError):
        await asyncio.wait_for(waiting, timeout=30)
    with pytest.raises(SessionClosedError):
        await members[1].step(Action("bash", {"command": "true"}))


async def test_a_stalled_member_leaving_while_its_fork_restores_leaves_no_sandbox(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stalled member closes and the group shuts down while the sandbox split off for it is restoring."""
    labels = harness.labels()
    group = harness.group(3, labels, barrier_timeout_s=0.5)
    members = [group.member(i) for i in range(3)]
    restoring, release = asyncio.Event(), asyncio.Event()
    real_restore = harness.backend.restore

    async def slow_restore(snapshot, n=1, *, spec=None):
        restoring.set()
        await release.wait()
        return await real_restore(snapshot, n, spec=spec)

    monkeypatch.setattr(harness.backend, "restore", slow_restore)
    try:
        await asyncio.gather(*(m.reset() for m in members))
        steps = [asyncio.ensure_future(m.step(Action("bash", {"command": "echo hi > /app/x"}))) for m in members[:2]]
        await asyncio.wait_for(restoring.wait(), 30)  # member 2 sent nothing: it is being split off
        await members[2].close()
        closing = asyncio.ensure_future(group.aclose())
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.wait_for(closing, 60)
        await asyncio.gather(*steps, return_exceptions=True)
    finally:
        release.set()
        await _assert_clean(harness, group, labels)

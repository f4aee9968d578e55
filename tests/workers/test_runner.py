"""The episode runner on a real backend with scripted policies and a misbehaving server."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from sandboxes.backends import create_backend
from sandboxes.errors import BackendUnavailableError
from tests.conftest import base_image
from workers.branching import BranchingSpec, Tree
from workers.envs.base import StepResult
from workers.envs.registry import family_of
from workers.envs.terminal.task import load_task_dir
from workers.jobs import RolloutPlan, run_job
from workers.policy import create_policy_client
from workers.policy.base import Sampling
from workers.protocol import EpisodeJob, RolloutJob
from workers.reporting import MemoryReporter
from workers.runner import AgentSettings, StageLimits, run_episode
from workers.runtime import WorkerRuntime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "terminal"
TASK = load_task_dir(EXAMPLES / "count-log-errors")


@pytest.fixture(scope="module", params=["local", "docker"])
async def runtime(request):
    root = Path(tempfile.mkdtemp(prefix="forkyard-runner-"))
    backend = create_backend(request.param, node=f"test-runner-{uuid.uuid4().hex[:8]}", root_dir=root)
    rt = WorkerRuntime(backend, image_cache_dir=Path("/var/cache/forkyard/images"), base_image=await base_image(backend))
    try:
        yield rt
    finally:
        left = await backend.list()
        await rt.aclose()
        shutil.rmtree(root, ignore_errors=True)
        assert left == [], "the runner left sandboxes behind"


class AnnouncingReporter(MemoryReporter):
    """A trainer that announces a new weight version after every step."""

    async def record_step(self, episode_id, step):
        await super().record_step(episode_id, step)
        self.set_policy(version=(await self.policy_state()).version + 1)


async def run(runtime, policy_spec, *, max_turns=5, reporter=None, max_staleness=None, **kw):
    policy = create_policy_client(policy_spec, task=TASK)
    reporter = reporter or AnnouncingReporter()
    episode_id = f"ep_{uuid.uuid4().hex[:8]}"
    try:
        result = await run_episode(
            episode_id=episode_id, task=TASK, runtime=runtime, policy=policy,
            settings=AgentSettings(max_turns=max_turns, **kw), sampling=Sampling(), stages=StageLimits(),
            reporter=reporter, max_staleness=max_staleness,
        )
    finally:
        await policy.aclose()
    return result, reporter.steps.get(episode_id, [])


async def test_oracle_completes_with_reward_one(runtime):
    result, steps = await run(runtime, {"name": "test", "api": "scripted"})
    assert (result.status, result.termination, result.reward, result.error) == ("completed", "submitted", 1.0, None)
    assert [s.action["tool"] for s in steps] == ["bash", "submit"]
    assert steps == result.steps
    assert result.weight_versions == [0, 1]  # each turn stamped with the announced version
    assert {"setup_s", "agent_s", "verify_s", "total_s"} <= set(result.timings)
    assert result.messages[0]["role"] == "system" and result.messages[1]["content"] == TASK.instruction


async def test_wrong_answer_scores_zero_and_the_episode_says_what_the_verifier_printed(runtime):
    actions = [{"tool": "bash", "arguments": {"command": "echo 0 > /tmp/answer"}}, {"tool": "submit", "arguments": {}}]
    result, _ = await run(runtime, {"name": "test", "api": "scripted", "actions": actions})
    assert (result.status, result.reward) == ("completed", 0.0)
    verifier = result.info["verifier"]  # a 0 with no verifier error is explained without a rerun
    assert verifier["timed_out"] is False and isinstance(verifier["exit_code"], int)
    assert "FAIL: /app/report.txt does not hold the expected report" in verifier["stdout"], verifier
    assert len(verifier["stdout"]) <= 2048 and len(verifier["stderr"]) <= 2048


async def test_stage_limits_report_the_slots_in_use():
    stages = StageLimits.of(setup=2, agent=3, verify=1)
    assert stages.in_use() == {"setup": 0, "agent": 0, "verify": 0}
    async with stages.setup, stages.agent:
        async with stages.agent:
            assert stages.in_use() == {"setup": 1, "agent": 2, "verify": 0}
    assert stages.in_use() == {"setup": 0, "agent": 0, "verify": 0}


def test_the_verifier_summary_keeps_the_tails():
    from workers.runner import verifier_summary

    summary = verifier_summary({"exit_code": 1, "stdout": "x" * 5000 + "FAILED test_a", "stderr": "", "timed_out": 0})
    assert summary["stdout"].endswith("FAILED test_a") and len(summary["stdout"]) == 2048
    assert summary["stdout_truncated"] is True and "stderr_truncated" not in summary
    assert summary["exit_code"] == 1 and summary["timed_out"] is False


class VerdictEnv:
    """An environment without a sandbox whose submit answers a given final step (the family's verdict)."""

    def __init__(self, final: StepResult) -> None:
        self.final = final
        self.tools = family_of(TASK).tools
        self.closed = False

    async def reset(self) -> str:
        return TASK.instruction

    async def step(self, action, *, budget_s=None) -> StepResult:
        return self.final if action.tool == "submit" else StepResult("[exit code 0]", None, False, False)

    async def truncate(self, reason: str) -> StepResult:
        return self.final

    async def close(self) -> None:
        self.closed = True


async def run_verdict(final: StepResult, policy_spec: dict | None = None):
    env = VerdictEnv(final)
    spec = policy_spec or {"name": "test", "api": "scripted", "actions": [{"tool": "submit", "arguments": {}}]}
    policy = create_policy_client(spec, task=TASK)

    async def make_env():
        return env

    try:
        result = await run_episode(episode_id="ep_verdict", task=TASK, runtime=None, policy=policy,
                                   settings=AgentSettings(max_turns=3, step_timeout_s=10), sampling=Sampling(),
                                   env_factory=make_env)
    finally:
        await policy.aclose()
    assert env.closed
    return result


@pytest.mark.parametrize("info", [{"outcome": "verifier_error", "verifier_error": "the verifier timed out after 30s"},
                                  {"verifier_error": "the verifier timed out after 30s"}],
                         ids=["declared", "no-reward-no-outcome"])
async def test_a_verifier_error_fails_the_episode_and_is_never_a_reward(info):
    result = await run_verdict(StepResult("the verifier timed out", None, True, False, info))
    assert (result.status, result.termination, result.reward) == ("failed", "submitted", None)
    assert result.info["outcome"] == "verifier_error" and "infra" not in result.info
    assert result.error == "verifier_error: the verifier timed out after 30s"


async def test_a_zero_reward_stays_the_agents_outcome():
    result = await run_verdict(StepResult("reward: 0", 0.0, True, False, {"outcome": "reward", "cause": "tamper"}))
    assert (result.status, result.reward, result.info["outcome"], result.info["cause"]) == (
        "completed", 0.0, "reward", "tamper")


async def test_a_policy_failure_is_the_policy_error_outcome():
    spec = {"name": "test", "api": "chat", "base_urls": ["http://127.0.0.1:9"], "model": "m"}
    result = await run_verdict(StepResult("unused", 1.0, True, False), spec)
    assert (result.status, result.termination, result.reward) == ("failed", "error", None)
    assert result.info["outcome"] == "policy_error" and "infra" not in result.info
    assert "127.0.0.1:9" in result.error


async def test_max_turns_truncates_and_still_verifies(runtime):
    actions = [{"tool": "bash", "arguments": {"command": "true"}}] * 3
    result, steps = await run(runtime, {"name": "test", "api": "scripted", "actions": actions}, max_turns=2)
    assert (result.status, result.termination, len(steps)) == ("truncated", "max_turns", 2)
    assert result.reward == 0.0


async def test_unknown_tool_is_an_observation_not_a_crash(runtime):
    actions = [{"tool": "rm_rf", "arguments": {}}, {"tool": "submit", "arguments": {}}]
    result, steps = await run(runtime, {"name": "test", "api": "scripted", "actions": actions})
    assert "unknown tool" in steps[0].observation
    assert result.status == "completed"


async def test_unreachable_server_fails_the_episode_visibly(runtime):
    spec = {"name": "test", "api": "chat", "base_urls": ["http://127.0.0.1:9"], "model": "m"}
    result, _ = await run(runtime, spec)
    assert result.status == "failed" and result.termination == "error"
    assert "127.0.0.1:9" in result.error
    assert "infra" not in result.info  # the policy's own server: the policy's failure


async def test_a_sandbox_failure_is_marked_infra_not_the_policys(runtime, monkeypatch):
    async def engine_gone(spec):
        raise BackendUnavailableError("the engine stopped answering")

    monkeypatch.setattr(runtime.backend, "create", engine_gone)
    monkeypatch.setattr(runtime.backend, "restore", engine_gone)
    result, steps = await run(runtime, {"name": "test", "api": "scripted"})
    assert (result.status, result.termination, result.reward, steps) == ("failed", "error", None, [])
    assert result.info["infra"] is True and "engine stopped answering" in result.error
    assert result.info["outcome"] == "infra"


async def test_an_image_that_cannot_be_built_is_marked_infra(runtime, tmp_path):
    task_dir = tmp_path / "broken-image"
    shutil.copytree(EXAMPLES / "count-log-errors", task_dir)
    (task_dir / "environment" / "Dockerfile").write_text(f"FROM ubuntu:24.04\nRUN echo broken-{uuid.uuid4().hex[:8]} && exit 7\n")  # unique: no cached image of it
    task = load_task_dir(task_dir)
    policy = create_policy_client({"name": "test", "api": "scripted"}, task=task)
    try:
        result = await run_episode(episode_id="ep_img", task=task, runtime=runtime, policy=policy,
                                   settings=AgentSettings(max_turns=2), sampling=Sampling())
    finally:
        await policy.aclose()
    assert (result.status, result.info.get("infra")) == ("failed", True)
    assert "ImageBuildError" in result.error or "DockerfileError" in result.error


async def test_a_fork_cancelled_midway_leaves_no_sandbox_and_no_snapshot(runtime, monkeypatch):
    """Cancel the trunk while its branches are being restored: what was restored is destroyed, the snapshot freed."""
    reporter = MemoryReporter()
    tree = Tree(BranchingSpec(at_turns=(1,), fanout=4, max_episodes=4), root_episode_id="ep_trunk",
                reporter=reporter, delete_snapshot=runtime.delete_snapshot)
    real_restore = runtime.backend.restore
    restored = asyncio.Event()

    async def slow_restore(snapshot, n=1, *, spec=None):
        infos = await real_restore(snapshot, n, spec=spec)
        restored.set()
        await asyncio.sleep(0.3)  # a restore still under way when the cancel comes
        return infos

    monkeypatch.setattr(runtime.backend, "restore", slow_restore)
    actions = [{"tool": "bash", "arguments": {"command": f"echo {i} >> /tmp/log"}} for i in range(4)]
    policy = create_policy_client({"name": "test", "api": "scripted", "actions": actions}, task=TASK)
    trunk = asyncio.create_task(run_episode(
        episode_id="ep_trunk", task=TASK, runtime=runtime, policy=policy, settings=AgentSettings(max_turns=4),
        sampling=Sampling(), stages=StageLimits(), tree=tree,
    ))
    try:
        await asyncio.wait_for(restored.wait(), 120)
        trunk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await trunk
        await tree.cancel()
    finally:
        await policy.aclose()
    # The branches were made but never ran; the caller fails them (as cancelled).
    assert reporter.spawned == [("ep_trunk", 1, 3)] and not reporter.results
    assert await runtime.backend.list() == []
    assert [s for s in await runtime.backend.list_snapshots() if "forkyard.tree" in s.metadata] == []


async def test_a_paused_policy_holds_the_next_turn_until_resumed(runtime):
    reporter = MemoryReporter(version=4)
    reporter.set_policy(paused=True)
    episode = asyncio.create_task(run(runtime, {"name": "test", "api": "scripted"}, reporter=reporter))
    await asyncio.sleep(1.0)
    assert not episode.done() and not reporter.steps  # no policy call started while paused
    reporter.set_policy(paused=False)
    result, steps = await asyncio.wait_for(episode, 120)
    assert (result.status, result.reward) == ("completed", 1.0)
    assert result.weight_versions == [4, 4] and len(steps) == 2


async def test_an_episode_past_max_staleness_stops_at_dispatch(runtime):
    # The trainer moves 3 versions on after every step; 2 versions of lag are allowed.
    class FastTrainer(MemoryReporter):
        async def record_step(self, episode_id, step):
            await super().record_step(episode_id, step)
            self.set_policy(version=(await self.policy_state()).version + 3)

    actions = [{"tool": "bash", "arguments": {"command": f"echo {i}"}} for i in range(4)]
    result, steps = await run(runtime, {"name": "test", "api": "scripted", "actions": actions},
                              reporter=FastTrainer(), max_staleness=2)
    assert (result.status, result.termination, len(steps)) == ("stale", "stale", 1)
    assert "oldest turn at version 0, policy at 3 (max_staleness 2)" in result.error



async def test_a_wire_job_runs_without_a_gateway_and_reports_its_tree(runtime):
    """The data plane alone: a RolloutJob + EpisodeJob, a task and a reporter are all an episode needs."""
    actions = [{"tool": "bash", "arguments": {"command": f"echo {i} >> /tmp/log"}} for i in range(2)]
    actions.append({"tool": "submit", "arguments": {}})
    rollout = RolloutJob(rollout_id="ro_1", policy={"name": "test", "api": "scripted", "actions": actions},
                         agent={"max_turns": 4}, branching={"at_turns": [1], "fanout": 3})
    plan = await RolloutPlan.load(rollout)
    reporter = MemoryReporter()
    try:
        await run_job(EpisodeJob(episode_id="ep_trunk", task_id="t1"), plan=plan, task=TASK, runtime=runtime,
                      reporter=reporter, stages=StageLimits())
    finally:
        await plan.aclose()
    assert reporter.spawned == [("ep_trunk", 1, 2)]
    assert set(reporter.results) == {"ep_trunk", *(f"ep_trunk.1.{i}" for i in (1, 2))}
    trunk = reporter.results["ep_trunk"]
    assert trunk.info["tree"]["episodes"] == 3 and len(reporter.steps["ep_trunk"]) == 3
    # Every leaf ran the same actions from its copy of the sandbox: submitted, and scored by the verifier.
    assert {(r.status, r.termination, r.reward) for r in reporter.results.values()} == {("completed", "submitted", 0.0)}
    assert [s for s in await runtime.backend.list_snapshots() if "forkyard.tree" in s.metadata] == []

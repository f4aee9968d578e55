"""Tests of TerminalEnv on real sandbox backends (local namespaces and Docker).

Every example task is built from its Dockerfile on both backends; its oracle must
score 1.0 and submitting right away must score 0.0. The rest exercises the verifier
protocol, the agent time limit and the errors on small tasks made in memory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sandboxes.base import LABEL_OWNER, ExecResult
from sandboxes.errors import SandboxCrashedError, SandboxError, SandboxNotFoundError
from workers.envs.base import Action, openai_tools, run_actions
from workers.envs.terminal import FAMILY
from workers.envs.terminal.env import (
    BASH_TOOL,
    SUBMIT_TOOL,
    TOOLS,
    TerminalEnv,
    format_exec_result,
)
from workers.envs.terminal.task import TerminalTask, load_task_dir, load_task_files
from workers.envs.terminal.verifier import parse_reward_json, parse_reward_txt
from workers.errors import ActionError, SessionClosedError, TaskFormatError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "terminal"
EXAMPLE_TASKS = {p.name: load_task_dir(p) for p in sorted(EXAMPLES.iterdir()) if (p / "task.toml").is_file()}

PROBE_DOCKERFILE = b"FROM ubuntu:24.04\nRUN mkdir -p /app && echo seed > /app/seed.txt\nWORKDIR /app\n"
# Scores 1 only when run from /app (the image's WORKDIR) after the agent created /app/done.
PROBE_TEST = b"""#!/bin/bash
mkdir -p /logs/verifier
if [ "$(pwd)" = /app ] && [ -f /app/done ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
echo "verifier ran in $(pwd) with MARK=${MARK:-unset}"
"""


def probe_task(
    test_sh: bytes = PROBE_TEST, *, agent_timeout: float = 600, verifier_timeout: float = 60, environment: str = "",
    tamper: str | None = None,
) -> TerminalTask:
    """Return a small in-memory task on the probe image with the given verifier (and ``[environment]`` lines)."""
    toml = f"[agent]\ntimeout_sec = {agent_timeout}\n[verifier]\ntimeout_sec = {verifier_timeout}\n"
    toml += f'tamper = "{tamper}"\n' if tamper else ""
    toml += f"[environment]\n{environment}\n" if environment else ""
    return load_task_files(
        "probe",
        {
            "instruction.md": b"Create /app/done.\n",
            "task.toml": toml.encode(),
            "environment/Dockerfile": PROBE_DOCKERFILE,
            "tests/test.sh": test_sh,
            "solution/solve.sh": b"#!/bin/bash\ntouch /app/done\n",
        },
    )


# ------------------------------------------------------------------ no backend needed


def test_tools_are_openai_function_tools() -> None:
    assert TOOLS == (BASH_TOOL, SUBMIT_TOOL)
    for tool in openai_tools(TOOLS):
        assert tool["type"] == "function"
        assert set(tool["function"]) == {"name", "description", "parameters"}
        assert tool["function"]["parameters"]["type"] == "object"
    assert BASH_TOOL.parameters["required"] == ["command"]
    assert set(BASH_TOOL.parameters["properties"]) == {"command", "timeout"}
    assert SUBMIT_TOOL.parameters["properties"] == {}
    assert SUBMIT_TOOL.ends_episode and not BASH_TOOL.ends_episode


@pytest.mark.parametrize(
    ("result", "text"),
    [
        (ExecResult("hi\n", "", 0), "hi\n[exit code: 0]"),
        (ExecResult("", "", 0), "[exit code: 0]"),
        (ExecResult("out", "err", 3), "out\n[stderr]\nerr\n[exit code: 3]"),
        (ExecResult("", "boom\n", 1), "[stderr]\nboom\n[exit code: 1]"),
        (ExecResult("x\n", "", 137, timed_out=True), "x\n[timed out after 5s]\n[exit code: 137]"),
        (ExecResult("x\n", "", 0, truncated=True), "x\n[output truncated]\n[exit code: 0]"),
    ],
)
def test_observation_format(result: ExecResult, text: str) -> None:
    assert format_exec_result(result, timeout_s=5) == text


@pytest.mark.parametrize(("raw", "reward"), [(b"1\n", 1.0), (b" 0 ", 0.0), (b"0.25", 0.25), (b"-1", -1.0)])
def test_reward_txt_numbers(raw: bytes, reward: float) -> None:
    assert parse_reward_txt(raw) == (reward, {"reward": reward})


@pytest.mark.parametrize("raw", [b"", b"garbage", b"nan", b"inf", b"-Infinity", b"1 2", b"\xff\xfe"])
def test_reward_txt_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(Exception, match="reward.txt"):
        parse_reward_txt(raw)


@pytest.mark.parametrize(
    ("raw", "reward", "details"),
    [
        (b'{"a": 1, "b": 0}', 0.5, {"a": 1.0, "b": 0.0}),
        (b'{"reward": 0.25, "x": 1}', 0.25, {"reward": 0.25, "x": 1.0}),
        (b'{"only": 0.75}', 0.75, {"only": 0.75}),
    ],
)
def test_reward_json_numbers(raw: bytes, reward: float, details: dict) -> None:
    assert parse_reward_json(raw) == (reward, details)


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[1, 2]", b"{}", b'{"a": "1"}', b'{"a": true}', b'{"a": NaN}', b'{"a": Infinity}', b"0.5"]
)
def test_reward_json_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(Exception, match="reward.json"):
        parse_reward_json(raw)


async def test_step_before_reset_is_refused() -> None:
    env = TerminalEnv(probe_task(), backend=None, image="unused")  # type: ignore[arg-type]
    with pytest.raises(SessionClosedError, match="reset"):
        await env.step(Action("bash", {"command": "true"}))
    with pytest.raises(SessionClosedError):
        await run_actions(env, FAMILY.oracle(probe_task()))


# ------------------------------------------------------------------ real backends


def _mounts_under(path: Path) -> list[str]:
    prefix = os.path.realpath(path)
    with open("/proc/self/mountinfo") as handle:
        points = [line.split(" ")[4] for line in handle]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


class Harness:
    """One backend plus the images built on it for this module."""

    def __init__(self, backend, base: str) -> None:
        self.backend = backend
        self.base = base
        self.images: dict[tuple[str, str], str] = {}
        self.owner = f"test-terminal-{uuid.uuid4().hex[:8]}"
        self._lock = asyncio.Lock()

    async def image_for(self, task: TerminalTask) -> str:
        """Build (once) and return the task's image."""
        from workers.dockerfile import build_task_image

        key = (task.dockerfile or "", repr(sorted(task.environment_context.items())))
        async with self._lock:
            if key not in self.images:
                self.images[key] = await build_task_image(
                    self.backend,
                    dockerfile=task.dockerfile or "",
                    context=task.environment_context,
                    base_image=self.base,
                    labels={LABEL_OWNER: self.owner},
                )
            return self.images[key]

    @asynccontextmanager
    async def env(self, task: TerminalTask) -> AsyncIterator[TerminalEnv]:
        """Yield a reset TerminalEnv and close it (destroying its sandbox) afterwards."""
        env = TerminalEnv(task, self.backend, image=await self.image_for(task), labels={LABEL_OWNER: self.owner})
        try:
            observation = await env.reset()
            assert observation == task.instruction
            yield env
        finally:
            await env.close()


@pytest.fixture(
    scope="module",
    params=[pytest.param("local", marks=pytest.mark.local), pytest.param("docker", marks=pytest.mark.docker)],
)
async def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    async for ready in make_harness(request.param, tmp_path_factory):
        yield ready


async def make_harness(kind: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    """Yield a harness on a fresh backend of ``kind`` (``local``, ``local-gvisor``, ``docker``)."""
    from sandboxes.backends import create_backend
    from tests.conftest import base_image

    node = f"test-terminal-{kind}-{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp(f"terminal-{kind}")
    backend_kind, _, tier = kind.partition("-")
    backend = create_backend(backend_kind, node=node, root_dir=root, isolation=tier or "standard")
    harness = None
    try:
        harness = Harness(backend, await base_image(backend))
        yield harness
    finally:
        try:
            for sandbox in await backend.list():
                await backend.destroy(sandbox.id)
            for image in harness.images.values() if harness else ():
                await backend.remove_image(image)
        finally:
            await backend.aclose()
    if not _mounts_under(root):
        shutil.rmtree(root, ignore_errors=True)


async def test_task_storage_is_the_sandboxs_disk_quota(harness: Harness) -> None:
    if harness.backend.name == "docker" and harness.backend._disk_quota is None:
        pytest.skip("this Docker engine's storage cannot limit a container's disk (see test_docker_disk_quota)")
    async with harness.env(probe_task(environment='storage = "64M"')) as env:
        fill = "dd if=/dev/zero of=/app/fill bs=1M count=256 2>&1 | grep -io 'quota exceeded\\|no space left'; " \
               "du -sm /app/fill | cut -f1"
        observation = (await env.step(Action("bash", {"command": fill}))).observation
        refusal, used = observation.splitlines()[:2]
        assert refusal.lower() in ("quota exceeded", "no space left"), observation
        assert int(used) <= 64, observation


@pytest.mark.parametrize("name", sorted(EXAMPLE_TASKS))
async def test_example_oracle_scores_one(harness: Harness, name: str) -> None:
    task = EXAMPLE_TASKS[name]
    async with harness.env(task) as env:
        assert env.sandbox is not None and env.sandbox.labels.get(LABEL_OWNER) == harness.owner
        result = await run_actions(env, FAMILY.oracle(task))
        assert "verifier_error" not in result.info, result.info
        assert result.reward == 1.0, result.info
        assert result.terminated and not result.truncated
        assert result.observation.endswith("[reward: 1]")
        with pytest.raises(SessionClosedError):
            await env.step(Action("bash", {"command": "true"}))


@pytest.mark.parametrize("name", sorted(EXAMPLE_TASKS))
async def test_example_submit_right_away_scores_zero(harness: Harness, name: str) -> None:
    task = EXAMPLE_TASKS[name]
    async with harness.env(task) as env:
        result = await env.step(Action("submit", {}))
        assert "verifier_error" not in result.info, result.info
        assert result.reward == 0.0
        assert result.terminated and not result.truncated
        assert result.info["verifier"]["exit_code"] is not None
        with pytest.raises(SessionClosedError):
            await env.step(Action("submit", {}))
        with pytest.raises(SessionClosedError):
            await run_actions(env, FAMILY.oracle(task))


async def test_partial_credit_from_reward_json(harness: Harness) -> None:
    async with harness.env(EXAMPLE_TASKS["git-bugfix"]) as env:
        step = await env.step(Action("bash", {"command": "cd /app/stats && git checkout -q -b fix-mean && git branch"}))
        assert "* fix-mean" in step.observation and step.reward is None
        result = await env.step(Action("submit", {}))
    assert result.info["reward_details"] == {"branch": 1.0, "fix": 0.0, "commit": 0.0}
    assert result.reward == pytest.approx(1 / 3)


async def test_bash_steps_and_verifier_runs_from_the_workdir(harness: Harness) -> None:
    async with harness.env(probe_task()) as env:
        assert env.workdir == "/app"
        step = await env.step(Action("bash", {"command": "echo out; echo err >&2; (exit 3)"}))
        assert step.observation == "out\n[stderr]\nerr\n[exit code: 3]"
        assert (step.reward, step.terminated, step.truncated) == (None, False, False)
        assert step.info["exit_code"] == 3
        step = await env.step(Action("bash", {"command": "ls /tests"}))
        assert step.info["exit_code"] != 0, "the tests must not be visible before verification"
        # The agent moves away, exports variables (a broken PATH too) and forges a reward;
        # none of it may reach the verifier.
        await env.step(Action("bash", {"command": "cd /tmp && export MARK=1"}))
        step = await env.step(Action("bash", {"command": "pwd; echo $MARK"}))
        assert step.observation == "/tmp\n1\n[exit code: 0]"
        await env.step(Action("bash", {"command": "touch /app/done && echo 5 > /logs/verifier/reward.txt"}))
        await env.step(Action("bash", {"command": "export PATH=/nowhere"}))
        result = await env.step(Action("submit", {}))
        assert result.reward == 1.0, result.info
        assert result.info["verifier"]["exit_code"] == 0
        assert "verifier ran in /app with MARK=unset" in result.info["verifier"]["stdout"]
        assert result.info["reward_details"] == {"reward": 1.0}


async def test_forged_reward_without_a_verifier_reward_is_an_error(harness: Harness) -> None:
    silent = b"#!/bin/bash\necho 'no reward written'\n"
    forge = "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"
    async with harness.env(probe_task(silent)) as env:
        await env.step(Action("bash", {"command": forge}))
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["cause"] == "tamper"
    assert result.info["tamper"][0]["path"].startswith("/logs/verifier")
    # Only reported: the forged file is not there for the verifier, which wrote none.
    async with harness.env(probe_task(silent, tamper="report")) as env:
        await env.step(Action("bash", {"command": forge}))
        result = await env.step(Action("submit", {}))
    assert result.reward is None and result.info["outcome"] == "verifier_error"
    assert "neither" in result.info["verifier_error"]


@pytest.mark.parametrize(
    ("test_sh", "words"),
    [
        (b"#!/bin/bash\nmkdir -p /logs/verifier\necho garbage > /logs/verifier/reward.txt\n", "one number"),
        (b"#!/bin/bash\nmkdir -p /logs/verifier\necho nan > /logs/verifier/reward.txt\n", "finite"),
        (b'#!/bin/bash\nmkdir -p /logs/verifier\necho \'{"a": "x"}\' > /logs/verifier/reward.json\n', "finite number"),
        (b"#!/bin/bash\nmkdir -p /logs/verifier\necho '[1' > /logs/verifier/reward.json\n", "not valid JSON"),
        (b"#!/bin/bash\nexit 1\n", "neither"),
    ],
    ids=["text", "nan", "json-string", "json-broken", "nothing"],
)
async def test_verifier_writing_garbage_is_a_verifier_error(harness: Harness, test_sh: bytes, words: str) -> None:
    async with harness.env(probe_task(test_sh)) as env:
        result = await env.step(Action("submit", {}))
    assert result.reward is None and result.info["outcome"] == "verifier_error"  # never a 0
    assert result.terminated
    assert words in result.info["verifier_error"]
    assert "[verifier error:" in result.observation and "[reward: none]" in result.observation


async def test_a_wrecked_sandbox_is_the_agents_doing(harness: Harness) -> None:
    """What the agent does to its own sandbox is scored: a file where the verifier's logs go is tamper, a
    removed workdir fails the tests; neither is an error of the verifier."""
    async with harness.env(probe_task()) as env:
        await env.step(Action("bash", {"command": "touch /app/done && rm -rf /logs && touch /logs"}))
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["cause"] == "tamper", result.info
    async with harness.env(probe_task()) as env:
        await env.step(Action("bash", {"command": "cd / && rm -rf /app"}))
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["outcome"] == "reward" and "cause" not in result.info, result.info


async def test_a_sandbox_the_agent_took_down_is_scored_on_what_it_left(harness: Harness, monkeypatch) -> None:
    """A command that leaves the sandbox unable to run is the agent's doing (a fresh sandbox starts): the
    episode ends with a verdict on its files and the cause. When no fresh sandbox starts either, the host
    is at fault: the crash stays an infrastructure error, never a 0."""
    real_exec = harness.backend.exec

    async def exec_(sandbox_id, command, **kwargs):
        if "crash-me" in command:
            raise SandboxCrashedError(f"the shell of sandbox {sandbox_id} did not start again")
        return await real_exec(sandbox_id, command, **kwargs)

    monkeypatch.setattr(harness.backend, "exec", exec_)
    async with harness.env(probe_task()) as env:
        await env.step(Action("bash", {"command": "touch /app/done"}))
        result = await env.step(Action("bash", {"command": "crash-me"}))
        assert result.truncated and result.reward == 1.0, result.info
        assert result.info["cause"] == "sandbox_crashed" and result.info["outcome"] == "reward"
        assert "[the sandbox stopped working:" in result.observation
    async with harness.env(probe_task()) as env:
        async def no_create(spec):
            raise SandboxError("the engine is gone")

        monkeypatch.setattr(harness.backend, "create", no_create)
        with pytest.raises(SandboxCrashedError):
            await env.step(Action("bash", {"command": "crash-me"}))


async def test_tests_the_agents_work_makes_hang_are_its_zero(harness: Harness) -> None:
    """A verifier that hangs only on the agent's work (its program never returns) scores the agent 0: a
    control run on what the agent started from finishes, so a policy cannot drop its failures by hanging."""
    runs = b"#!/bin/bash\nmkdir -p /logs/verifier\nif [ -x /app/run.sh ]; then /app/run.sh; fi\necho 0 > /logs/verifier/reward.txt\n"
    async with harness.env(probe_task(runs, verifier_timeout=2)) as env:
        await env.step(Action("bash", {"command": "printf '#!/bin/bash\\nsleep 100\\n' > /app/run.sh && chmod +x /app/run.sh"}))
        result = await env.step(Action("submit", {}))
    assert result.reward == 0.0 and result.info["outcome"] == "reward", result.info
    assert result.info["cause"] == "tests_timed_out" and "timed out" in result.info["reason"]


async def test_verifier_timeout_is_a_verifier_error(harness: Harness) -> None:
    slow = b"#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\nsleep 60\n"
    async with harness.env(probe_task(slow, verifier_timeout=1)) as env:
        result = await env.step(Action("submit", {}))
    assert result.reward is None and result.info["outcome"] == "verifier_error"  # never a 0
    assert result.info["verifier"]["timed_out"] is True
    assert "timed out" in result.info["verifier_error"]


async def test_bad_actions_raise_and_the_session_goes_on(harness: Harness) -> None:
    async with harness.env(probe_task()) as env:
        with pytest.raises(ActionError, match="unknown tool 'rm_rf'"):
            await env.step(Action("rm_rf", {"command": "x"}))
        for arguments in (
            {},
            {"command": 3},
            {"command": "  "},
            {"command": "ls", "timeout": "abc"},
            {"command": "ls", "timeout": -1},
            {"command": "ls", "cwd": "/"},
        ):
            with pytest.raises(ActionError):
                await env.step(Action("bash", arguments))
        with pytest.raises(ActionError):
            await env.step(Action("submit", {"answer": 42}))
        with pytest.raises(ActionError):
            await env.step(Action("bash", ["ls"]))  # type: ignore[arg-type]
        step = await env.step(Action("bash", {"command": "echo still here"}))
        assert step.observation == "still here\n[exit code: 0]"
        assert env.steps == 1


async def test_command_timeout_keeps_the_episode_going(harness: Harness) -> None:
    async with harness.env(probe_task()) as env:
        step = await env.step(Action("bash", {"command": "echo started; sleep 30", "timeout": 1}))
        assert step.info["timed_out"] is True
        assert step.observation.startswith("started\n")
        assert "[timed out after 1s]" in step.observation
        assert not step.terminated and not step.truncated
        step = await env.step(Action("bash", {"command": "echo after"}))
        assert step.observation == "after\n[exit code: 0]"
        step = await env.step(Action("bash", {"command": "exit 7"}))
        assert step.info["exit_code"] == 7 and not step.terminated
        step = await env.step(Action("bash", {"command": "touch /app/done && echo back"}))
        assert step.observation.startswith("back\n")
        result = await env.step(Action("submit", {}))
        assert result.reward == 1.0, result.info


async def test_running_out_of_agent_time_runs_the_verifier(harness: Harness) -> None:
    async with harness.env(probe_task(agent_timeout=3)) as env:
        await env.step(Action("bash", {"command": "touch /app/done"}))
        step = await env.step(Action("bash", {"command": "echo waiting; sleep 60"}))
        assert step.truncated and not step.terminated
        assert step.reward == 1.0, step.info
        assert "agent time limit of 3s reached" in step.observation
        assert step.observation.startswith("waiting\n")
        with pytest.raises(SessionClosedError):
            await env.step(Action("bash", {"command": "true"}))


async def test_a_step_after_the_time_is_up_ends_the_episode_without_running(harness: Harness) -> None:
    async with harness.env(probe_task(agent_timeout=1)) as env:
        await asyncio.sleep(1.2)
        step = await env.step(Action("bash", {"command": "touch /app/done"}))
        assert step.truncated
        assert step.reward == 0.0, "the late command must not have run"


async def test_close_destroys_the_sandbox_and_ends_the_session(harness: Harness) -> None:
    env = TerminalEnv(
        probe_task(), harness.backend, image=await harness.image_for(probe_task()), labels={LABEL_OWNER: harness.owner}
    )
    try:
        await env.reset()
        assert env.sandbox is not None
        sandbox_id = env.sandbox.id
        assert sandbox_id in {s.id for s in await harness.backend.list()}
    finally:
        await env.close()
    await env.close()
    assert env.sandbox is None
    assert sandbox_id not in {s.id for s in await harness.backend.list()}
    with pytest.raises(SandboxNotFoundError):
        await harness.backend.status(sandbox_id)
    with pytest.raises(SessionClosedError):
        await env.step(Action("bash", {"command": "true"}))
    with pytest.raises(SessionClosedError):
        await env.reset()


async def test_reset_again_starts_a_fresh_sandbox(harness: Harness) -> None:
    async with harness.env(probe_task()) as env:
        assert env.sandbox is not None
        first = env.sandbox.id
        await env.step(Action("bash", {"command": "touch /app/done"}))
        await env.step(Action("submit", {}))
        assert await env.reset() == probe_task().instruction
        assert env.sandbox is not None and env.sandbox.id != first
        assert first not in {s.id for s in await harness.backend.list()}
        step = await env.step(Action("bash", {"command": "ls /app"}))
        assert step.observation == "seed.txt\n[exit code: 0]"


async def test_oracle_needs_a_solution(harness: Harness) -> None:
    files = dict(probe_task().files)
    del files["solution/solve.sh"]
    task = load_task_files("probe", files)
    async with harness.env(task) as env:
        with pytest.raises(TaskFormatError, match="solve.sh"):
            FAMILY.oracle(task)
        step = await env.step(Action("bash", {"command": "echo usable"}))
        assert step.observation.startswith("usable")


async def test_scripted_oracle_runs_solve_sh_from_solution_with_no_stdin(harness: Harness) -> None:
    """As Harbor does: solution/ is at /solution, and a command reading stdin cannot eat the script."""
    from workers.policy.scripted import oracle_actions

    solve = (
        b"#!/bin/bash\n"
        b"set -e\n"
        b"cat > /app/stdin.txt\n"  # under a heredoc this would swallow the lines below
        b"cp /solution/expected.txt /app/answer.txt\n"
        b"touch /app/done\n"
    )
    test_sh = (
        b"#!/bin/bash\n"
        b"mkdir -p /logs/verifier\n"
        b"if cmp -s /app/answer.txt /tests/expected.txt && [ ! -s /app/stdin.txt ] && [ -f /app/done ]; then\n"
        b"  echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
    )
    task = load_task_files("solution-dir", {
        "instruction.md": b"Put the expected answer in /app/answer.txt.\n",
        "task.toml": b"[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 60\n",
        "environment/Dockerfile": PROBE_DOCKERFILE,
        "tests/test.sh": test_sh,
        "tests/expected.txt": b"forty-two\n",
        "solution/solve.sh": solve,
        "solution/expected.txt": b"forty-two\n",
    })
    bash_call, submit = oracle_actions(task)
    async with harness.env(task) as env:
        ran = await env.step(Action(bash_call["tool"], bash_call["arguments"]))
        assert ran.info["exit_code"] == 0, ran.observation
        result = await env.step(Action(submit["tool"], submit["arguments"]))
        assert result.reward == 1.0, result.info


def env_tables_task() -> TerminalTask:
    """A task whose sandbox, oracle and verifier each see only their own ``env`` table of task.toml."""
    return load_task_files("env-tables", {
        "instruction.md": b"x\n",
        "task.toml": (b'[environment]\nallow_internet = false\nenv = { STAGE = "sandbox" }\n'
                      b'[solution]\nenv = { ANSWER = "it is 42" }\n[verifier]\nenv = { EXPECTED = "it is 42" }\n'),
        "environment/Dockerfile": PROBE_DOCKERFILE,
        "solution/solve.sh": b'#!/bin/bash\necho "$STAGE|$ANSWER|${EXPECTED:-unset}" > /app/seen\n',
        "tests/test.sh": (b'#!/bin/bash\nif [ "$(cat /app/seen)" = "sandbox|$EXPECTED|unset" ] && [ -z "$ANSWER" ]; '
                          b'then echo 1; else echo 0; fi > /logs/verifier/reward.txt\ncat /app/seen\n'),
    })


@pytest.mark.parametrize("oracle", ["scripted", "family"])
async def test_env_tables_reach_the_sandbox_the_oracle_and_the_verifier(harness: Harness, oracle: str) -> None:
    """Harbor's [environment] env, [solution] env and [verifier] env, each where Harbor sets it."""
    from workers.policy.scripted import oracle_actions

    task = env_tables_task()
    async with harness.env(task) as env:
        assert (await env.step(Action("bash", {"command": 'echo "$STAGE"'}))).observation.startswith("sandbox\n")
        if oracle == "family":
            result = await run_actions(env, FAMILY.oracle(task))
        else:
            bash_call, submit = oracle_actions(task)
            assert (await env.step(Action(bash_call["tool"], bash_call["arguments"]))).info["exit_code"] == 0
            result = await env.step(Action(submit["tool"], submit["arguments"]))
        assert result.reward == 1.0, result.info


@pytest.mark.parametrize(("environment", "networked"), [("", True), ("allow_internet = false", False)])
async def test_runs_get_harbors_internet_default_unless_the_task_says_otherwise(
    harness: Harness, environment: str, networked: bool
) -> None:
    async with harness.env(probe_task(environment=environment)) as env:
        counted = await env.step(Action("bash", {"command": "ls /sys/class/net | grep -cvx lo"}))
        assert (int(counted.observation.split()[0]) > 0) == networked, counted.observation  # a link beside lo


async def test_environment_setup_sh_is_only_the_dockerfiles_and_never_runs_at_reset(harness: Harness) -> None:
    """In Harbor environment/setup.sh is a build-context file; a task whose Dockerfile runs it once sees one run."""
    task = load_task_files("setup-once", {
        "instruction.md": b"x\n",
        "task.toml": b"[environment]\nallow_internet = false\n",
        "environment/Dockerfile": b"FROM ubuntu:24.04\nCOPY setup.sh /opt/setup.sh\nRUN bash /opt/setup.sh\nWORKDIR /app\n",
        "environment/setup.sh": b"#!/bin/bash\nmkdir -p /app && echo ran >> /app/runs.txt\n",
        "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    })
    assert task.setup_script is None
    async with harness.env(task) as env:
        assert (await env.step(Action("bash", {"command": "cat /app/runs.txt"}))).observation.startswith("ran\n[exit")


async def test_tests_dir_is_writable_by_the_verifier_under_the_images_user(harness: Harness) -> None:
    """pytest writes its cache and __pycache__ beside the tests: /tests is the verifier's to write, as in Harbor."""
    test_sh = (b"#!/bin/bash\nmkdir -p /logs/verifier\n"
               b"touch /tests/.pytest_cache_probe && mkdir /tests/__pycache__ && id -un > /tests/who && "
               b"echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    task = load_task_files("tests-writable", {
        "instruction.md": b"x\n",
        "task.toml": b"[environment]\nallow_internet = false\n",
        "environment/Dockerfile": b"FROM ubuntu:24.04\nRUN useradd -m player\nUSER player\nWORKDIR /home/player\n",
        "tests/test.sh": test_sh,
    })
    async with harness.env(task) as env:
        result = await env.step(Action("submit", {}))
        assert result.reward == 1.0, result.info

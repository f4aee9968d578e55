"""The multi-turn episode runner: prompt, policy call, tool calls, observation, verify.

Plain async code (no Celery, no database): the gateway's dispatcher calls
:func:`run_episode` and persists what it returns and reports step by step.

Token bookkeeping for the ``tokens`` policy follows DESIGN.md's fidelity rule: the
runner renders the chat template locally (:class:`ChatTokenizer`), appends the sampled
token ids exactly as the server returned them, and appends only the tokens of each
observation turn. Sampled text is decoded for parsing, never re-tokenized. Each
:class:`StepRecord` holds the tokens appended *before* its generation (``prompt_ids``,
loss 0) and the sampled ones (``completion_ids``, loss 1), so the training view of an
episode is the concatenation of its steps.

Setup (image build + sandbox start), the agent loop and verification take separate
:class:`StageLimits` semaphores so a burst of slow setups never idles the policy.

With a :class:`~workers.branching.Tree` the episode is the trunk of a trajectory tree:
at its branch points it snapshots the sandbox and starts branch episodes that continue
from there (each with a copy of the token context), see :mod:`workers.branching`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from sandboxes.base import LABEL_OWNER
from sandboxes.errors import SandboxError
from workers.envs.base import Action, EnvSnapshot, Forkable, openai_tools
from workers.envs.registry import family_of
from workers.errors import ActionError, ImageBuildError, WorkerError
from workers.policy.base import Generation, PolicyClient, PolicyError, Sampling
from workers.policy.toolcalls import ToolCallParseError, parse_tool_calls
from workers.protocol import (
    AgentSpec,
    EpisodeOutcome,
    EpisodeReporter,
    EpisodeResult,
    LimitsSpec,
    StepRecord,
    describe,
)

if TYPE_CHECKING:
    from workers.branching import Tree
    from workers.envs.base import EnvTask, StepResult
    from workers.policy.chat_template import ChatTokenizer
    from workers.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

@dataclass
class StageLimits:
    """Concurrency limits of the three stages of an episode."""

    setup: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(4))
    agent: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(32))
    verify: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(4))
    _sizes: dict[str, int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._sizes = {name: sem._value for name, sem in self._stages()}

    def _stages(self) -> tuple[tuple[str, asyncio.Semaphore], ...]:
        return ("setup", self.setup), ("agent", self.agent), ("verify", self.verify)

    @classmethod
    def of(cls, *, setup: int, agent: int, verify: int) -> StageLimits:
        """Build limits from three counts."""
        return cls(asyncio.Semaphore(setup), asyncio.Semaphore(agent), asyncio.Semaphore(verify))

    def in_use(self) -> dict[str, int]:
        """Return how many episodes hold each stage's slots now (a node's load by stage)."""
        return {name: self._sizes[name] - sem._value for name, sem in self._stages()}


@dataclass
class AgentSettings:
    """The rollout's ``agent`` and ``limits`` sections."""

    max_turns: int = 20
    system_prompt: str | None = None
    tool_call_format: str = "hermes"
    episode_timeout_s: float = 600.0
    step_timeout_s: float = 60.0

    @classmethod
    def from_spec(
        cls, agent: Mapping[str, Any] | AgentSpec | None, limits: Mapping[str, Any] | LimitsSpec | None
    ) -> AgentSettings:
        """Build settings from a rollout's ``agent`` and ``limits`` (their stored dicts, or the specs).

        Raises:
            WorkerError: a dict is not a valid :class:`~workers.protocol.AgentSpec` / ``LimitsSpec``.
        """
        try:
            a = agent if isinstance(agent, AgentSpec) else AgentSpec.from_stored(agent)
        except ValidationError as exc:
            raise WorkerError(describe(exc, "agent")) from exc
        try:
            lim = limits if isinstance(limits, LimitsSpec) else LimitsSpec.from_stored(limits)
        except ValidationError as exc:
            raise WorkerError(describe(exc, "limits")) from exc
        return cls(max_turns=a.max_turns, system_prompt=a.system_prompt, tool_call_format=a.tool_call_format,
                   episode_timeout_s=lim.episode_timeout_s, step_timeout_s=lim.step_timeout_s)


class _Episode:
    """Mutable state of one running episode (messages, token cursor, steps)."""

    def __init__(self, tokenizer: ChatTokenizer | None, tools: list[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.messages: list[dict[str, Any]] = []
        self.steps: list[StepRecord] = []
        self.pending_prompt: list[int] = []  # tokens to append before the next generation
        self.context_ids: list[int] = []  # every token so far (prompt + sampled + observations)
        self.versions: list[int] = []
        self.token_exact = True
        self.started = time.monotonic()
        """When the episode's root began: a branch's time limit and total count from there."""

    def branch(self) -> _Episode:
        """Return a copy to continue in a branch: same context and history, no steps of its own."""
        other = copy.copy(self)
        other.messages = list(self.messages)
        other.steps = []
        other.pending_prompt = list(self.pending_prompt)
        other.context_ids = list(self.context_ids)
        other.versions = list(self.versions)
        return other

    def start(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)
        if self.tokenizer is not None:
            self.pending_prompt = self.tokenizer.initial_prompt_ids(self.messages, self.tools)

    def prompt_for_call(self) -> list[int] | None:
        """Return the full token context to send (tokens API), or None (chat API)."""
        if self.tokenizer is None:
            return None
        return self.context_ids + self.pending_prompt

    def record_generation(self, gen: Generation) -> tuple[list[int], list[int], list[float]]:
        """Fold a generation into the token context; return (prompt_ids, completion_ids, logprobs)."""
        completion = list(gen.token_ids or [])
        logprobs = list(gen.logprobs or [])
        if self.tokenizer is not None:
            prompt = self.pending_prompt
        elif gen.prompt_token_ids is not None:
            # Chat API: the server rendered the prompt. Keep only what it added since the
            # last turn; if it re-rendered the past differently the episode is not token-exact.
            seen = gen.prompt_token_ids
            if seen[: len(self.context_ids)] == self.context_ids:
                prompt = list(seen[len(self.context_ids) :])
            else:
                self.token_exact = False
                prompt = list(seen)
                self.context_ids = []
        else:
            prompt = []
            self.token_exact = False
        self.context_ids += prompt + completion
        self.pending_prompt = []
        return prompt, completion, logprobs

    def add_observation(self, new_messages: list[dict[str, Any]], *, completion_ended: bool) -> None:
        history = self.messages
        self.messages = history + new_messages
        if self.tokenizer is not None:
            self.pending_prompt = self.tokenizer.observation_ids(
                history, new_messages, self.tools, completion_ended=completion_ended
            )


@dataclass
class _Run:
    """What every episode of one run (a trunk and its branches) shares."""

    task: EnvTask
    runtime: WorkerRuntime
    policy: PolicyClient
    settings: AgentSettings
    sampling: Sampling
    stages: StageLimits
    reporter: EpisodeReporter | None
    max_staleness: int | None
    labels: dict[str, str]
    tree: Tree | None

    def labels_for(self, episode_id: str) -> dict[str, str]:
        return {LABEL_OWNER: episode_id, "forkyard.task": self.task.name, **self.labels}


#: Keys of a step's info that describe the step, not the episode's verdict.
_STEP_ONLY_INFO = frozenset({"exit_code", "timed_out", "time_left_s"})
#: Characters of the verifier's stdout and stderr an episode keeps (the tail: where test runners summarize).
VERIFIER_TAIL_CHARS = 2048


def infra_failure(exc: BaseException) -> bool:
    """Tell whether ``exc`` is the infrastructure's failure (a sandbox, an image, a task's setup), not the policy's.

    Episodes it ends are marked ``info.infra``: failed, retried on a fresh sandbox while
    attempts remain, never delivered as training data (and never to be read as a reward of 0).
    """
    return isinstance(exc, SandboxError) or bool(getattr(exc, "infra", False))


def failure_info(outcome: EpisodeOutcome) -> dict[str, Any]:
    """Return the ``info`` of an episode that failed with ``outcome`` (``infra`` also keeps ``info.infra``)."""
    return {"outcome": outcome.value, **({"infra": True} if outcome is EpisodeOutcome.INFRA else {})}


def final_outcome(final: StepResult) -> EpisodeOutcome:
    """Return whose result an episode's final (verified) step is.

    The family's ``info["outcome"]`` when it names one; a family that names none gave a
    reward unless it left none (or a non-finite one), which is the verifier's failure.
    """
    declared = final.info.get("outcome")
    if declared in {o.value for o in EpisodeOutcome} and declared != EpisodeOutcome.REWARD.value:
        return EpisodeOutcome(declared)
    if final.reward is None or not math.isfinite(final.reward):
        return EpisodeOutcome.VERIFIER_ERROR
    return EpisodeOutcome.REWARD


def verifier_summary(verifier: dict[str, Any]) -> dict[str, Any]:
    """Return the verifier's exit code, timeout flag and the tails of its output, for an episode's info."""
    summary: dict[str, Any] = {"exit_code": verifier.get("exit_code"), "timed_out": bool(verifier.get("timed_out"))}
    for stream in ("stdout", "stderr"):
        text = str(verifier.get(stream) or "")
        summary[stream] = text[-VERIFIER_TAIL_CHARS:]
        if len(text) > VERIFIER_TAIL_CHARS:
            summary[f"{stream}_truncated"] = True
    return summary


async def run_episode(
    *,
    episode_id: str,
    task: EnvTask,
    runtime: WorkerRuntime,
    policy: PolicyClient,
    settings: AgentSettings,
    sampling: Sampling,
    tokenizer: ChatTokenizer | None = None,
    stages: StageLimits | None = None,
    reporter: EpisodeReporter | None = None,
    max_staleness: int | None = None,
    labels: dict[str, str] | None = None,
    env_version: str = "",
    tree: Tree | None = None,
    env_factory: Callable[[], Awaitable[Any]] | None = None,
) -> EpisodeResult:
    """Run one episode of ``task`` with ``policy`` to the end; never raises for episode failures.

    Args:
        reporter: where each step goes as soon as it is complete (live progress), and
            the policy's state before every turn: a pause blocks the next policy call,
            the announced version is stamped on turns whose server reports none. The
            tree's branches report through the tree's reporter.
        max_staleness: most versions the episode's oldest turn may lag the announced
            one before a further policy call; past it the episode stops as ``stale``
            (the rollout's max_staleness enforced at dispatch, not only at delivery).
        env_version: the environment's name and version (part of the setup cache key).
        tree: run the episode as the trunk of this trajectory tree; its branches report
            through the tree's callbacks and the caller awaits ``tree.join()``.
        env_factory: makes the (not yet reset) environment instead of the runtime, e.g. a
            member of a :class:`~workers.shared_env.SharedEnvGroup`.
    """
    family = family_of(task)
    run = _Run(task=task, runtime=runtime, policy=policy, settings=settings, sampling=sampling,
               stages=stages or StageLimits(), reporter=reporter, max_staleness=max_staleness,
               labels=dict(labels or {}), tree=tree)
    state = _Episode(tokenizer, openai_tools(family.tools))

    async def open_env(timings: dict[str, float]) -> Any:
        t = time.monotonic()
        async with run.stages.setup:
            if env_factory is not None:
                env = await env_factory()
            else:
                image = await runtime.task_image(task)
                env = runtime.new_env(task, image=image, labels=run.labels_for(episode_id), env_version=env_version)
            try:
                instruction = await env.reset()
            except BaseException:
                await _close_quietly(env, episode_id)
                raise
        timings["setup_s"] = time.monotonic() - t
        state.start([{"role": "system", "content": settings.system_prompt or family.system_prompt(task)},
                     {"role": "user", "content": instruction}])
        return env

    on_step = None if reporter is None else functools.partial(reporter.record_step, episode_id)
    return await _drive(run, episode_id, state, open_env, start_turn=0, forked_at=None, on_step=on_step,
                        started=state.started)


async def _close_quietly(env: Any, episode_id: str) -> None:
    try:
        await env.close()
    except Exception:
        logger.exception("episode %s: closing its sandbox failed", episode_id)


async def _drive(
    run: _Run,
    episode_id: str,
    state: _Episode,
    open_env: Callable[[dict[str, float]], Awaitable[Any]],
    *,
    start_turn: int,
    forked_at: int | None,
    on_step: Callable[[StepRecord], Awaitable[None]] | None,
    started: float,
) -> EpisodeResult:
    """Open the env, run the agent loop from ``start_turn``, verify; turn every failure into a result."""
    timings: dict[str, float] = {}
    env: Any = None
    extra: dict[str, Any] = {} if forked_at is None else {"forked_at": forked_at}

    def result(status: str, termination: str, *, reward: float | None = None, error: str | None = None,
               info: dict[str, Any] | None = None, artifacts: Mapping[str, bytes] | None = None) -> EpisodeResult:
        timings["total_s"] = time.monotonic() - started
        return EpisodeResult(
            status=status,
            termination=termination,
            reward=reward,
            error=error,
            steps=state.steps,
            messages=state.messages,
            timings=dict(timings),
            weight_versions=list(state.versions),
            info={"token_exact": state.token_exact, **extra, **(info or {})},
            artifacts=dict(artifacts or {}),
        )

    try:
        env = await open_env(timings)
        if run.tree is not None and not isinstance(env, Forkable):
            raise WorkerError(f"the {run.task.family} environment of task {run.task.name!r} cannot be snapshotted, "
                              "so its episodes cannot branch")
        t = time.monotonic()
        deadline = started + run.settings.episode_timeout_s
        async with run.stages.agent:
            outcome = await _agent_loop(run, episode_id=episode_id, env=env, state=state, deadline=deadline,
                                        on_step=on_step, start_turn=start_turn, forked_at=forked_at)
        timings["agent_s"] = time.monotonic() - t - outcome.verify_s
        timings["verify_s"] = outcome.verify_s
        final = outcome.final
        # What the family says of the verdict (terminal: reward_details, verifier_error; swe: grading),
        # less the last step's own bookkeeping.
        info = {k: v for k, v in final.info.items() if k not in _STEP_ONLY_INFO}
        if isinstance(final.info.get("verifier"), dict):  # why a reward is what it is, without a rerun
            info["verifier"] = verifier_summary(final.info["verifier"])
        verdict = final_outcome(final)
        if verdict is not EpisodeOutcome.REWARD:  # never a 0: the episode failed, and is retried
            reason = next((text for text in (final.info.get(verdict.value), final.info.get("error"))
                           if isinstance(text, str) and text), "the verifier left no reward")
            return result("failed", outcome.termination, error=f"{verdict.value}: {reason}",
                          info={**info, **failure_info(verdict)}, artifacts=final.artifacts)
        info["outcome"] = verdict.value
        return result("completed" if final.terminated else "truncated", outcome.termination, reward=final.reward,
                      info=info, artifacts=final.artifacts)
    except _Stale as exc:
        return result("stale", "stale", error=str(exc))
    except PolicyError as exc:
        return result("failed", "error", error=f"policy: {exc}", info=failure_info(EpisodeOutcome.POLICY_ERROR))
    except (ImageBuildError, SandboxError, WorkerError) as exc:
        # Not infra_failure() alone: a worker error the runner did not expect is still nothing the agent did.
        return result("failed", "error", error=f"{type(exc).__name__}: {exc}",
                      info=failure_info(EpisodeOutcome.INFRA))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # an episode never takes the rollout down with it
        logger.exception("episode %s failed unexpectedly", episode_id)
        return result("failed", "error", error=f"internal error: {type(exc).__name__}: {exc}",
                      info=failure_info(EpisodeOutcome.INFRA))
    finally:
        release = getattr(run.policy, "release", None)
        if release is not None:
            release(episode_id)
        if env is not None:
            await _close_quietly(env, episode_id)


async def _fork(run: _Run, parent_id: str, env: Any, state: _Episode, turn: int, *, why: dict[str, Any]) -> None:
    """Start the branches of one branch point: snapshot ``env`` and continue ``state`` in copies of it.

    A fork that fails (the sandbox could not be snapshotted or restored) costs the tree
    those branches, never the parent episode.
    """
    tree = run.tree
    assert tree is not None
    n = tree.grant()
    if n == 0:
        return
    t = time.monotonic()
    ids: list[str] = []
    try:
        snap = await _snapshot_for(tree, env, turn)
        ids = await tree.reporter.spawn_branches(parent_id, turn, n)
        envs = await run.runtime.restore_envs(snap, run.task, [run.labels_for(i) for i in ids])
    except Exception as exc:
        logger.warning("episode %s: fork at turn %d failed: %s", parent_id, turn, exc)
        tree.refund(n - len(ids))
        for branch_id in ids:
            await tree.reporter.finish(branch_id, _failed_branch(state, f"the fork at turn {turn} failed: {exc}"))
        return
    fork_s = time.monotonic() - t
    tree.branch_points.append({"episode_id": parent_id, "turn": turn, "branches": ids, "fork_s": fork_s, **why})
    logger.info("episode %s: forked %d branch(es) at turn %d in %.1f ms", parent_id, n, turn, fork_s * 1000)
    tree.unopened.update(zip(ids, envs, strict=True))
    for branch_id in ids:
        branch_state = state.branch()  # now: the parent changes ``state`` as soon as this returns

        async def opened(timings: dict[str, float], branch_id: str = branch_id) -> Any:
            timings["setup_s"] = fork_s
            return tree.unopened.pop(branch_id)

        async def branch(branch_id: str = branch_id, opener: Any = opened, branch_state: _Episode = branch_state) -> None:
            result = await _drive(run, branch_id, branch_state, opener, start_turn=turn, forked_at=turn,
                                  on_step=functools.partial(tree.reporter.record_step, branch_id),
                                  started=branch_state.started)
            await tree.reporter.finish(branch_id, result)

        tree.start(branch(), name=f"branch {branch_id}")


async def _snapshot_for(tree: Any, env: Forkable, turn: int) -> EnvSnapshot:
    """Snapshot ``env`` for a branch point of ``tree``, which holds the snapshot even if this is cancelled."""
    taking = asyncio.ensure_future(env.snapshot(metadata={"forkyard.tree": tree.root_episode_id,
                                                          "forkyard.turn": str(turn)}))

    def hold(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            tree.snapshots.append(done.result().id)

    taking.add_done_callback(hold)
    try:
        return await asyncio.shield(taking)
    except asyncio.CancelledError:
        await asyncio.wait([taking])  # a snapshot half taken is held (and freed) by the tree, not lost
        raise


def _failed_branch(state: _Episode, error: str) -> EpisodeResult:
    return EpisodeResult(status="failed", termination="error", reward=None, error=error, steps=[],
                         messages=list(state.messages), timings={}, weight_versions=list(state.versions),
                         info=failure_info(EpisodeOutcome.INFRA))


class _Stale(Exception):
    """The episode's oldest turn fell too far behind the policy: stop spending compute on it."""


@dataclass
class _Outcome:
    final: StepResult
    termination: str
    verify_s: float


async def _agent_loop(
    run: _Run,
    *,
    episode_id: str,
    env: Any,
    state: _Episode,
    deadline: float,
    on_step: Callable[[StepRecord], Awaitable[None]] | None,
    start_turn: int,
    forked_at: int | None,
) -> _Outcome:
    settings, stages, tree = run.settings, run.stages, run.tree
    verify_s = 0.0
    tools = {tool.name: tool for tool in env.tools}
    example = next(iter(tools), "tool")

    async def finish(termination: str, reason: str) -> _Outcome:
        nonlocal verify_s
        t = time.monotonic()
        async with stages.verify:
            final = await env.truncate(reason)
        verify_s += time.monotonic() - t
        return _Outcome(final, termination, verify_s)

    for turn in range(start_turn, settings.max_turns):
        if time.monotonic() >= deadline:
            return await finish("timeout", f"episode timeout of {settings.episode_timeout_s:g}s reached")
        if run.reporter is not None:
            await run.reporter.wait_until_unpaused()
            if run.max_staleness is not None and state.versions:
                current = (await run.reporter.policy_state()).version
                if current - min(state.versions) > run.max_staleness:
                    raise _Stale(f"stopped at dispatch: oldest turn at version {min(state.versions)}, policy at "
                                 f"{current} (max_staleness {run.max_staleness})")
        # After the pause gate and the stale check: a stale episode does not fork, and no
        # branch sandbox waits out a pause.
        if tree is not None and tree.wants_fork(turn, forked_at=forked_at):
            await _fork(run, episode_id, env, state, turn, why={"reason": "at_turns"})
        t = time.monotonic()
        budget = max(0.1, min(settings.step_timeout_s, deadline - t))
        try:
            gen = await asyncio.wait_for(
                run.policy.generate(
                    episode_id=episode_id, prompt_ids=state.prompt_for_call(), messages=state.messages,
                    tools=state.tools, sampling=run.sampling,
                ),
                budget,
            )
        except TimeoutError:
            raise PolicyError(f"no answer from the policy within {budget:.3g}s (turn {turn})") from None
        policy_s = time.monotonic() - t
        if tree is not None:
            uncertainty = tree.wants_resample(turn, gen.logprobs, forked_at=forked_at)
            if uncertainty is not None:  # re-sample this turn from before its action runs
                await _fork(run, episode_id, env, state, turn, why={"reason": "adaptive", "uncertainty": uncertainty})
        version = gen.weight_version
        if version is None and run.reporter is not None:
            version = (await run.reporter.policy_state()).version
        if version is not None:
            state.versions.append(version)
        prompt_ids, completion_ids, logprobs = state.record_generation(gen)
        if completion_ids and logprobs and len(completion_ids) != len(logprobs):
            raise PolicyError(
                f"{gen.server} returned {len(completion_ids)} token ids but {len(logprobs)} logprobs"
            )

        t = time.monotonic()
        action: dict[str, Any] | None = None
        parse_error: str | None = None
        step_result: StepResult | None = None
        try:
            calls = parse_tool_calls(gen.text, fmt=settings.tool_call_format)
            if not calls:
                raise ToolCallParseError(
                    "no tool call found; answer with exactly one tool call such as "
                    f'<tool_call>{{"name": "{example}", "arguments": {{...}}}}</tool_call>'
                )
            action = {"tool": calls[0]["name"], "arguments": calls[0]["arguments"]}
        except ToolCallParseError as exc:
            parse_error = str(exc)
        if action is not None:
            arguments = dict(action["arguments"] or {}) if isinstance(action["arguments"], dict) else action["arguments"]
            call = Action(action["tool"], arguments)
            budget = min(settings.step_timeout_s, deadline - time.monotonic())
            try:
                spec = tools.get(call.tool)
                if spec is not None and spec.ends_episode:
                    tv = time.monotonic()
                    async with stages.verify:
                        step_result = await env.step(call, budget_s=budget)
                    verify_s += time.monotonic() - tv
                else:
                    step_result = await env.step(call, budget_s=budget)
                observation = step_result.observation
            except ActionError as exc:
                observation = f"[error: {exc}]"
        else:
            observation = f"[error: could not parse a tool call: {parse_error}]"
        env_s = time.monotonic() - t

        completion_ended = bool(completion_ids) and gen.finish_reason == "stop"
        state.messages.append({"role": "assistant", "content": gen.text})
        tool_name = action["tool"] if action else "error"
        step = StepRecord(
            index=turn,
            parent_index=turn - 1 if turn else None,
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            weight_version=version,
            finish_reason=gen.finish_reason,
            text=gen.text,
            action=action,
            parse_error=parse_error,
            observation=observation,
            reward=step_result.reward if step_result is not None else None,
            timings={"policy_s": policy_s, "env_s": env_s},
            server=gen.server,
            artifacts=dict(step_result.artifacts) if step_result is not None else {},
        )
        state.steps.append(step)
        if on_step is not None:
            await on_step(step)
        if step_result is not None and (step_result.terminated or step_result.truncated):
            return _Outcome(step_result, "submitted" if step_result.terminated else "timeout", verify_s)
        state.add_observation(
            [{"role": "tool", "name": tool_name, "content": observation}], completion_ended=completion_ended
        )
    return await finish("max_turns", f"max turns ({settings.max_turns}) reached")

"""A policy with no model: replay a fixed list of tool calls (tests, demos, SFT data).

The actions come from a rollout's ``policy.actions`` (``[{"tool": ..., "arguments":
{...}}, ...]``) or from a task's oracle (its family's :meth:`~workers.envs.base.EnvFamily.oracle`;
for a terminal task, one ``bash`` call putting ``solution/`` at ``/solution`` and running
``/solution/solve.sh``, then ``submit``). Each action is
emitted as assistant text in the agent's tool-call format, so the runner parses it
with the same parser it uses for a model.

The position in the list is the episode's turn (the assistant messages so far), so an
episode forked mid-way (a branch of a trajectory tree) continues where its parent was.
An action may also be ``{"one_of": [action, ...]}``: each episode picks one at random,
seeded by the sampling seed, the episode id and the turn, so branches of one tree and the
samples of one group diverge the way sampled policies do while staying reproducible.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.policy.base import Generation, PolicyError, Sampling
from workers.policy.toolcalls import TOOL_CALL_FORMATS, format_tool_call

if TYPE_CHECKING:
    from workers.envs.base import EnvTask
    from workers.policy.chat_template import ChatTokenizer

SCRIPTED_SERVER = "scripted"


def oracle_actions(task: EnvTask) -> list[dict[str, Any]]:
    """Return the actions of ``task``'s oracle, as its family gives them.

    Raises:
        PolicyError: the task has no reference solution.
    """
    from workers.envs.registry import family_of
    from workers.errors import TaskFormatError

    try:
        actions = family_of(task).oracle(task)
    except TaskFormatError as exc:
        raise PolicyError(f"no oracle for the scripted policy to replay: {exc}") from exc
    return [action.to_json() for action in actions]


def _check_action(action: Any, where: str) -> dict[str, Any]:
    if not isinstance(action, Mapping) or not isinstance(action.get("tool"), str) or not action["tool"]:
        raise PolicyError(f"scripted action {where} must be an object with a \"tool\" name, got {action!r}")
    arguments = action.get("arguments") or {}
    if not isinstance(arguments, Mapping):
        raise PolicyError(f"scripted action {where} ({action['tool']!r}) has arguments that are not an object")
    return {"tool": action["tool"], "arguments": dict(arguments)}


def _check_actions(actions: Any) -> list[list[dict[str, Any]]]:
    """Return each turn's alternatives (one for a plain action, several for ``one_of``)."""
    if not isinstance(actions, Sequence) or isinstance(actions, (str, bytes)) or not actions:
        raise PolicyError("the scripted policy needs a non-empty list of actions [{\"tool\", \"arguments\"}, ...]")
    checked = []
    for i, action in enumerate(actions):
        if isinstance(action, Mapping) and "one_of" in action:
            choices = action["one_of"]
            if not isinstance(choices, Sequence) or isinstance(choices, (str, bytes)) or not choices:
                raise PolicyError(f"scripted action {i}: one_of must be a non-empty list of actions")
            checked.append([_check_action(c, f"{i}.one_of[{j}]") for j, c in enumerate(choices)])
        else:
            checked.append([_check_action(action, str(i))])
    return checked


class ScriptedPolicy:
    """Replay fixed tool calls, one per turn (the episode's turn picks the action)."""

    api = "scripted"

    def __init__(
        self,
        actions: Sequence[Mapping[str, Any]],
        *,
        tool_call_format: str = "hermes",
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        """Replay ``actions``; with a ``tokenizer`` each turn also carries token ids (for SFT data).

        Raises:
            PolicyError: the actions are not a non-empty list of ``{"tool", "arguments"}``.
        """
        if tool_call_format not in TOOL_CALL_FORMATS:
            raise PolicyError(f"unknown tool_call_format {tool_call_format!r}")
        self.actions = _check_actions(actions)
        self.tool_call_format = tool_call_format
        self.tokenizer = tokenizer

    @classmethod
    def from_task(
        cls, task: EnvTask, *, tool_call_format: str = "hermes", tokenizer: ChatTokenizer | None = None
    ) -> ScriptedPolicy:
        """Replay ``task``'s oracle."""
        return cls(oracle_actions(task), tool_call_format=tool_call_format, tokenizer=tokenizer)

    async def generate(
        self,
        *,
        episode_id: str,
        prompt_ids: list[int] | None,
        messages: list[dict],
        tools: list[dict],
        sampling: Sampling,
    ) -> Generation:
        """Return the episode's next action as assistant text.

        Raises:
            PolicyError: the episode has used every action.
        """
        started = time.monotonic()
        index = sum(1 for m in messages if m.get("role") == "assistant")
        if index >= len(self.actions):
            raise PolicyError(
                f"the scripted policy has no action left for episode {episode_id} after {len(self.actions)}",
                server=SCRIPTED_SERVER,
            )
        choices = self.actions[index]
        action = choices[0] if len(choices) == 1 else random.Random(
            f"{sampling.seed}:{episode_id}:{index}").choice(choices)
        text = format_tool_call(action["tool"], action["arguments"], self.tool_call_format)
        token_ids = logprobs = None
        if self.tokenizer is not None:
            # Scripted text is not sampled, so tokenizing it is the only way to get ids; a
            # deterministic policy gives each of its tokens probability 1 (logprob 0).
            token_ids = [*self.tokenizer.encode(text), self.tokenizer.end_of_turn_id]
            logprobs = [0.0] * len(token_ids)
        return Generation(
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_token_ids=list(prompt_ids) if prompt_ids is not None else None,
            finish_reason="stop",
            weight_version=None,
            server=SCRIPTED_SERVER,
            latency_s=time.monotonic() - started,
        )

    def release(self, episode_id: str) -> None:
        """Nothing to forget: the position is the episode's turn."""

    async def aclose(self) -> None:
        """Nothing to close."""


__all__ = ["ScriptedPolicy", "oracle_actions"]

"""Policy clients: how an episode asks the trainer's model for its next turn.

- ``tokens``: token-in/token-out against vLLM's ``/inference/v1/generate``
  (:class:`~workers.policy.tokens.TokensPolicy`); the runner owns the token ids.
- ``chat``: any OpenAI-compatible ``/v1/chat/completions``
  (:class:`~workers.policy.chat.ChatPolicy`).
- ``scripted``: replays a task's oracle or a given action list, no server
  (:class:`~workers.policy.scripted.ScriptedPolicy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from workers.policy.base import (
    DEFAULT_TIMEOUT_S,
    Generation,
    PolicyClient,
    PolicyError,
    Sampling,
)
from workers.protocol import PolicySpec, describe

if TYPE_CHECKING:
    from workers.envs.base import EnvTask
    from workers.policy.chat_template import ChatTokenizer

#: The policy apis, as the wire type names them.
POLICY_APIS: tuple[str, ...] = get_args(PolicySpec.model_fields["api"].annotation)


def create_policy_client(
    spec: PolicySpec | Mapping[str, Any],
    *,
    task: EnvTask | None = None,
    tokenizer: ChatTokenizer | None = None,
    tool_call_format: str = "hermes",
    timeout_s: float | None = None,
    api_key: str | None = None,
) -> PolicyClient:
    """Build the client a rollout's ``policy`` asks for.

    Args:
        spec: the rollout's :class:`~workers.protocol.PolicySpec`, or its stored dict.
        task: the task whose oracle a scripted policy without ``actions`` replays.
        tokenizer: the episode's chat tokenizer (tokens api: decodes sampled ids;
            scripted: gives its turns token ids). The tokens api loads
            ``spec.tokenizer`` (default ``spec.model``) when none is given.
        tool_call_format: the agent's format, which scripted turns are written in.
        timeout_s: seconds one request may take (default 120).
        api_key: the servers' bearer token, when the spec does not carry it (a stored
            spec never does: the gateway keeps the key apart).

    Raises:
        PolicyError: the spec is invalid, or the tokenizer cannot be loaded.
    """
    if not isinstance(spec, PolicySpec):
        if not isinstance(spec, Mapping):
            raise PolicyError(f"policy spec must be an object, got {type(spec).__name__}")
        try:
            spec = PolicySpec.from_stored(spec)
        except ValidationError as exc:
            raise PolicyError(describe(exc, "policy")) from exc
    if spec.api == "scripted":
        from workers.policy.scripted import ScriptedPolicy

        if spec.actions:
            return ScriptedPolicy(spec.actions, tool_call_format=tool_call_format, tokenizer=tokenizer)
        if task is None:
            raise PolicyError("the scripted policy needs policy.actions or a task whose oracle it replays")
        return ScriptedPolicy.from_task(task, tool_call_format=tool_call_format, tokenizer=tokenizer)

    base_urls = [str(u).rstrip("/") for u in spec.base_urls]
    common: dict[str, Any] = {
        "model": spec.model or None,
        "api_key": spec.secret_api_key() or api_key or None,
        "timeout_s": float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S,
    }
    if spec.api == "chat":
        from workers.policy.chat import ChatPolicy

        return ChatPolicy(base_urls, tool_choice=spec.tool_choice, **common)

    from workers.policy.chat_template import ChatTemplateError, load_chat_tokenizer
    from workers.policy.tokens import TokensPolicy

    if tokenizer is None:
        source = spec.tokenizer or spec.model
        try:
            tokenizer = load_chat_tokenizer(str(source))
        except ChatTemplateError as exc:
            raise PolicyError(str(exc)) from exc
    return TokensPolicy(base_urls, tokenizer=tokenizer, **common)


__all__ = ["POLICY_APIS", "Generation", "PolicyClient", "PolicyError", "Sampling", "create_policy_client"]

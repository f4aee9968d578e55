"""Policy clients: how an episode asks the trainer's model for its next turn.

- ``tokens``: token-in/token-out against vLLM's ``/inference/v1/generate``
  (:class:`~workers.policy.tokens.TokensPolicy`); the runner owns the token ids.
- ``chat``: any OpenAI-compatible ``/v1/chat/completions``
  (:class:`~workers.policy.chat.ChatPolicy`).
- ``scripted``: replays a task's oracle or a given action list, no server
  (:class:`~workers.policy.scripted.ScriptedPolicy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.policy.base import (
    DEFAULT_TIMEOUT_S,
    Generation,
    PolicyClient,
    PolicyError,
    Sampling,
)

if TYPE_CHECKING:
    from workers.envs.base import EnvTask
    from workers.policy.chat_template import ChatTokenizer

POLICY_APIS = ("tokens", "chat", "scripted")


def create_policy_client(
    spec: dict[str, Any],
    *,
    task: EnvTask | None = None,
    tokenizer: ChatTokenizer | None = None,
    tool_call_format: str = "hermes",
    timeout_s: float | None = None,
) -> PolicyClient:
    """Build the client a rollout's ``policy`` dict asks for.

    Args:
        spec: ``{"api", "base_urls", "model", "tokenizer"?, "actions"?, "api_key"?, ...}``.
        task: the task whose oracle a scripted policy without ``actions`` replays.
        tokenizer: the episode's chat tokenizer (tokens api: decodes sampled ids;
            scripted: gives its turns token ids). The tokens api loads
            ``spec["tokenizer"]`` (default ``spec["model"]``) when none is given.
        tool_call_format: the agent's format, which scripted turns are written in.
        timeout_s: seconds one request may take (default 120).

    Raises:
        PolicyError: the spec is incomplete or invalid, or the tokenizer cannot be loaded.
    """
    if not isinstance(spec, dict):
        raise PolicyError(f"policy spec must be an object, got {type(spec).__name__}")
    api = spec.get("api", "chat")
    if api == "scripted":
        from workers.policy.scripted import ScriptedPolicy

        if spec.get("actions"):
            return ScriptedPolicy(spec["actions"], tool_call_format=tool_call_format, tokenizer=tokenizer)
        if task is None:
            raise PolicyError("the scripted policy needs policy.actions or a task whose oracle it replays")
        return ScriptedPolicy.from_task(task, tool_call_format=tool_call_format, tokenizer=tokenizer)
    if api not in POLICY_APIS:
        raise PolicyError(f"unknown policy api {api!r}; expected one of {', '.join(POLICY_APIS)}")

    base_urls = spec.get("base_urls")
    if isinstance(base_urls, str):
        base_urls = [base_urls]
    if not base_urls or not isinstance(base_urls, list):
        raise PolicyError(f"the {api} api needs policy.base_urls (a non-empty list of URLs)")
    model = spec.get("model") or None
    common: dict[str, Any] = {
        "model": model,
        "api_key": spec.get("api_key") or None,
        "timeout_s": float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S,
    }
    if api == "chat":
        from workers.policy.chat import ChatPolicy

        return ChatPolicy(base_urls, tool_choice=spec.get("tool_choice") or None, **common)

    from workers.policy.chat_template import ChatTemplateError, load_chat_tokenizer
    from workers.policy.tokens import TokensPolicy

    if tokenizer is None:
        source = spec.get("tokenizer") or model
        if not source:
            raise PolicyError("the tokens api needs policy.tokenizer (a local tokenizer path) or policy.model")
        try:
            tokenizer = load_chat_tokenizer(str(source))
        except ChatTemplateError as exc:
            raise PolicyError(str(exc)) from exc
    return TokensPolicy(base_urls, tokenizer=tokenizer, **common)


__all__ = ["POLICY_APIS", "Generation", "PolicyClient", "PolicyError", "Sampling", "create_policy_client"]

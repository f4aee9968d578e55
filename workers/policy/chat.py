"""Generation through any OpenAI-compatible ``POST /v1/chat/completions``.

Request::

    {"model", "messages", "tools" (when any), "tool_choice", "temperature", "top_p", "max_tokens",
     "stop", "seed", "n": 1, "logprobs": true, "top_logprobs": 0,
     "return_token_ids": true, "skip_special_tokens": true}

``return_token_ids`` and ``skip_special_tokens`` are vLLM extensions (other
servers ignore unknown fields). Answer (vLLM)::

    {"choices": [{"message": {"role": "assistant", "content": "...", "tool_calls": [...]},
                  "finish_reason": "stop", "token_ids": [...],
                  "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}}],
     "prompt_token_ids": [...], "usage": {...}}

Token ids and logprobs are recorded when the server returns them. The runner parses
tool calls out of the text itself, so the client asks for ``tool_choice: "auto"``
(the OpenAI default) and, on a vLLM server without a tool parser (which refuses
``auto`` with HTTP 400), switches to ``"none"``: the tools stay in the prompt and
the model's ``<tool_call>`` text comes back verbatim. When a server does parse the
calls into ``message.tool_calls``, they are written back into the text in the
hermes format, so the same parser reads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from workers.policy.base import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_TIMEOUT_S,
    Generation,
    HTTPPolicy,
    PolicyError,
    Sampling,
    check_logprob,
    check_token_ids,
    first_choice,
    parse_weight_version,
    weight_version_of_spans,
)
from workers.policy.toolcalls import format_tool_call

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
# What vLLM says when "auto" tool choice is asked of a server without a tool parser.
_NO_AUTO_TOOLS_HINTS = ("enable-auto-tool-choice", "tool choice requires", "tool_choice")


class ChatPolicy(HTTPPolicy):
    """Sample from an OpenAI-compatible chat completions endpoint."""

    api = "chat"

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        model: str,
        tool_choice: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not model:
            raise PolicyError("the chat api needs the served model name (policy.model)")
        super().__init__(
            base_urls,
            model=model,
            api_key=api_key,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_attempts=max_attempts,
            transport=transport,
        )
        self._tool_choice_fixed = tool_choice is not None
        self.tool_choice = tool_choice or "auto"

    def _body(self, episode_id: str, messages: list[dict], tools: list[dict], sampling: Sampling) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "n": 1,
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if tools:
            body["tools"] = tools
            body["tool_choice"] = self.tool_choice
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        seed = sampling.seed_for(episode_id, messages)
        if seed is not None:
            body["seed"] = seed
        return body

    async def generate(
        self,
        *,
        episode_id: str,
        prompt_ids: list[int] | None,
        messages: list[dict],
        tools: list[dict],
        sampling: Sampling,
    ) -> Generation:
        """Sample the assistant's next message for ``messages``; ``prompt_ids`` is not sent.

        Raises:
            PolicyError: no usable answer from the server.
        """
        if not messages:
            raise PolicyError("the chat api needs at least one message")
        try:
            server, payload, latency = await self._post(
                episode_id=episode_id, path=CHAT_PATH, body=self._body(episode_id, messages, tools, sampling)
            )
        except PolicyError as exc:
            if not (tools and self._refuses_auto_tools(exc)):
                raise
            logger.warning("policy server %s has no tool parser; asking with tool_choice 'none' from now on", exc.server)
            self.tool_choice = "none"
            server, payload, latency = await self._post(
                episode_id=episode_id, path=CHAT_PATH, body=self._body(episode_id, messages, tools, sampling)
            )
        return self._generation(payload, server=server, latency=latency)

    def _refuses_auto_tools(self, exc: PolicyError) -> bool:
        detail = exc.detail or ""
        return (
            not self._tool_choice_fixed
            and self.tool_choice == "auto"
            and "HTTP 400" in str(exc)
            and any(hint in detail for hint in _NO_AUTO_TOOLS_HINTS)
        )

    @staticmethod
    def _generation(payload: dict[str, Any], *, server: str, latency: float) -> Generation:
        choice = first_choice(payload, server=server, path=CHAT_PATH)
        message = choice.get("message")
        if not isinstance(message, dict):
            raise PolicyError(f"policy server {server} answered without choices[0].message", server=server)
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise PolicyError(
                f"policy server {server} returned message content of type {type(content).__name__}, not a string",
                server=server,
            )
        calls = _tool_calls_as_text(message.get("tool_calls"), server=server)
        text = content + ("\n" if content and calls else "") + calls
        finish_reason = choice.get("finish_reason") or "stop"
        if not isinstance(finish_reason, str):
            raise PolicyError(f"policy server {server} returned finish_reason {finish_reason!r}", server=server)

        token_ids = choice.get("token_ids")
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, what="choices[0].token_ids", server=server)
        logprobs = _logprobs(choice.get("logprobs"), server=server)
        if token_ids is not None and logprobs is not None and len(logprobs) != len(token_ids):
            raise PolicyError(
                f"policy server {server} returned {len(logprobs)} logprobs for {len(token_ids)} sampled tokens",
                server=server,
            )
        prompt_ids = payload.get("prompt_token_ids")
        if prompt_ids is not None:
            prompt_ids = check_token_ids(prompt_ids, what="prompt_token_ids", server=server)

        version = weight_version_of_spans(choice.get("weight_versions"), server=server)
        if version is None:
            version = parse_weight_version(payload.get("weight_version"))
        return Generation(
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_token_ids=prompt_ids,
            finish_reason=finish_reason,
            weight_version=version,
            server=server,
            latency_s=latency,
        )


def _logprobs(block: Any, *, server: str) -> list[float] | None:
    if block is None:
        return None
    content = block.get("content") if isinstance(block, dict) else None
    if content is None and isinstance(block, dict):
        return None
    if not isinstance(content, list):
        raise PolicyError(f"policy server {server} returned malformed choices[0].logprobs", server=server)
    values = []
    for i, entry in enumerate(content):
        if not isinstance(entry, dict):
            raise PolicyError(f"policy server {server} returned logprob entry {i} that is not an object", server=server)
        values.append(check_logprob(entry.get("logprob"), index=i, server=server))
    return values


def _tool_calls_as_text(tool_calls: Any, *, server: str) -> str:
    """Write server-parsed tool calls back as hermes text, so the runner's parser reads them."""
    if not tool_calls:
        return ""
    if not isinstance(tool_calls, list):
        raise PolicyError(f"policy server {server} returned message.tool_calls that is not a list", server=server)
    parts = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise PolicyError(f"policy server {server} returned tool call {i} without function.name", server=server)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the raw string: the runner's parser reports it to the model
        parts.append(format_tool_call(function["name"], arguments if arguments is not None else {}))
    return "\n".join(parts)


__all__ = ["CHAT_PATH", "ChatPolicy"]

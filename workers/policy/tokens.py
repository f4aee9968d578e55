"""Token-in/token-out generation against vLLM's ``POST /inference/v1/generate``.

The server (vLLM >= 0.32, started with ``--enable-scale-out``) takes the prompt as
token ids and returns the sampled token ids, one logprob per sampled token, and
the weight version(s) that sampled them. Request, non-streaming::

    {"request_id": "...", "token_ids": [...], "model": "...", "output_mode": "tokens" | "text",
     "sampling_params": {"temperature", "top_p", "max_tokens", "stop", "seed",
                         "logprobs": 0, "skip_special_tokens": true, "include_stop_str_in_output": true}}

Answer::

    {"request_id", "model", "choices": [{"index": 0, "finish_reason": "stop" | "length" | "abort",
      "stop_reason", "token_ids": [...], "text": "..." (output_mode "text" only),
      "logprobs": {"content": [{"token_id", "logprob", ...}, ...]}     (tokens mode)
                | {"content": [{"token", "logprob", "bytes", ...}, ...]} (text mode),
      "weight_versions": [{"version": "7", "start": 0, "end": n}, ...] | null}], "usage", ...}

With a local tokenizer the client asks for ``output_mode="tokens"`` and decodes the
ids itself; without one it asks the server for the text (``output_mode="text"``;
the server must load a tokenizer, i.e. not ``--tokens-only``).
"""

from __future__ import annotations

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
    weight_version_of_spans,
)

if TYPE_CHECKING:
    import httpx

    from workers.policy.chat_template import ChatTokenizer

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"


def sampling_params(sampling: Sampling, seed: int | None = None) -> dict[str, Any]:
    """Return vLLM ``SamplingParams`` fields for ``sampling`` (``seed``: this call's), asking for logprobs."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        # 0 top candidates: only the sampled token's own logprob.
        "logprobs": 0,
        "skip_special_tokens": True,
        # The text must cover every sampled id, a matched stop string included.
        "include_stop_str_in_output": True,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if seed is not None:
        params["seed"] = seed
    return params


class TokensPolicy(HTTPPolicy):
    """Sample from vLLM's token-in/token-out endpoint; the caller owns the token sequence."""

    api = "tokens"

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        model: str | None = None,
        tokenizer: ChatTokenizer | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_urls,
            model=model,
            api_key=api_key,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_attempts=max_attempts,
            transport=transport,
        )
        self.tokenizer = tokenizer
        self._requests = 0

    async def generate(
        self,
        *,
        episode_id: str,
        prompt_ids: list[int] | None,
        messages: list[dict],
        tools: list[dict],
        sampling: Sampling,
    ) -> Generation:
        """Sample one completion of ``prompt_ids``; ``messages`` and ``tools`` are not sent.

        Raises:
            PolicyError: no prompt ids, or no usable answer from the server.
        """
        if not prompt_ids:
            raise PolicyError("the tokens api needs the episode's prompt token ids (prompt_ids is empty)")
        self._requests += 1
        text_mode = self.tokenizer is None
        body: dict[str, Any] = {
            "request_id": f"{episode_id}-{self._requests}",
            "token_ids": list(prompt_ids),
            "sampling_params": sampling_params(sampling, sampling.seed_for(episode_id, messages)),
            "output_mode": "text" if text_mode else "tokens",
        }
        if self.model:
            body["model"] = self.model
        server, payload, latency = await self._post(episode_id=episode_id, path=GENERATE_PATH, body=body)
        choice = first_choice(payload, server=server, path=GENERATE_PATH)
        finish_reason = choice.get("finish_reason") or "stop"
        if not isinstance(finish_reason, str):
            raise PolicyError(f"policy server {server} returned finish_reason {finish_reason!r}", server=server)
        if finish_reason == "abort":
            raise PolicyError(
                f"policy server {server} aborted the generation (paused for a weight update, or shutting down)",
                server=server,
            )
        token_ids = check_token_ids(choice.get("token_ids"), what="choices[0].token_ids", server=server)
        logprobs = self._logprobs(choice, token_ids, server=server, text_mode=text_mode)
        if text_mode:
            text = choice.get("text")
            if not isinstance(text, str):
                raise PolicyError(
                    f"policy server {server} answered output_mode 'text' without a choices[0].text string",
                    server=server,
                )
        else:
            assert self.tokenizer is not None
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Generation(
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_token_ids=list(prompt_ids),
            finish_reason=finish_reason,
            weight_version=weight_version_of_spans(choice.get("weight_versions"), server=server),
            server=server,
            latency_s=latency,
        )

    @staticmethod
    def _logprobs(choice: dict[str, Any], token_ids: list[int], *, server: str, text_mode: bool) -> list[float]:
        block = choice.get("logprobs")
        content = block.get("content") if isinstance(block, dict) else None
        if not isinstance(content, list):
            raise PolicyError(
                f"policy server {server} returned no per-token logprobs (choices[0].logprobs.content)", server=server
            )
        if len(content) != len(token_ids):
            raise PolicyError(
                f"policy server {server} returned {len(content)} logprobs for {len(token_ids)} sampled tokens",
                server=server,
            )
        logprobs: list[float] = []
        for i, entry in enumerate(content):
            if not isinstance(entry, dict):
                raise PolicyError(f"policy server {server} returned logprob entry {i} that is not an object", server=server)
            # Tokens mode names each entry's token; a mismatch means misaligned logprobs.
            if (not text_mode or "token_id" in entry) and entry.get("token_id") != token_ids[i]:
                raise PolicyError(
                    f"policy server {server} returned a logprob for token {entry.get('token_id')!r} at position {i}, "
                    f"but the sampled token there is {token_ids[i]}",
                    server=server,
                )
            logprobs.append(check_logprob(entry.get("logprob"), index=i, server=server))
        return logprobs


__all__ = ["GENERATE_PATH", "TokensPolicy", "sampling_params"]

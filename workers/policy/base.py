"""The policy-client contract and the HTTP plumbing the server-backed clients share.

A policy client turns an episode's prompt (token ids for the ``tokens`` api, chat
messages for ``chat``) into one :class:`Generation`. Every failure to get a usable
answer (server unreachable, HTTP error, a body that is not what the api promises)
is a :class:`PolicyError` whose message names the server and what went wrong;
requests have bounded timeouts, and only connection errors and 503 answers are
retried, a few times, with a short backoff.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx
from pydantic import ValidationError

from workers.errors import WorkerError
from workers.policy.router import ServerPool
from workers.protocol import SamplingSpec, describe

logger = logging.getLogger(__name__)

#: Seconds one request to an inference server may take, end to end.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds to open a TCP connection to an inference server.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
#: Tries per generation (the first plus retries on connection errors and 503).
DEFAULT_MAX_ATTEMPTS = 3
#: First retry delay; doubles on each further retry, plus up to 50% jitter.
RETRY_BACKOFF_S = 0.25
# Characters of a bad body quoted back in an error message.
_SNIPPET_CHARS = 200
_VERSION_RE = re.compile(r"\s*v?(\d+)\s*")


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one rollout, sent with every generation."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | SamplingSpec | None) -> Sampling:
        """Build from a rollout's ``policy.sampling`` (its stored dict, or the spec itself).

        Raises:
            PolicyError: the dict is not a valid :class:`~workers.protocol.SamplingSpec`.
        """
        try:
            spec = data if isinstance(data, SamplingSpec) else SamplingSpec.from_stored(data)
        except ValidationError as exc:
            raise PolicyError(describe(exc, "policy.sampling")) from exc
        return cls(temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens, stop=list(spec.stop),
                   seed=spec.seed)

    def seed_for(self, episode_id: str, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """Return the seed of one call: derived from the rollout's seed, the episode and its turn.

        The same seed on every call would make every sample of a group, and every branch of
        a trajectory tree, repeat the same tokens from the same context.
        """
        if self.seed is None:
            return None
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        digest = hashlib.sha256(f"{self.seed}:{episode_id}:{turn}".encode()).digest()
        return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class Generation:
    """One LLM call's result, exactly as the server produced it."""

    text: str
    """Sampled text (decoded from the token ids by the server or tokenizer; never re-tokenized)."""
    token_ids: list[int] | None
    """Sampled token ids exactly as returned (None if the server does not return them)."""
    logprobs: list[float] | None
    """One logprob per sampled token."""
    prompt_token_ids: list[int] | None
    """The prompt the server saw, when known."""
    finish_reason: str
    """``stop`` | ``length`` | ``tool_calls`` | ..."""
    weight_version: int | None
    """Weight version the server reports for this sample, if any (the oldest, if it changed mid-sample)."""
    server: str
    """base_url that served it (``scripted`` for the scripted policy)."""
    latency_s: float


class PolicyError(WorkerError):
    """The policy could not produce a generation: unreachable server, HTTP error, garbage body."""

    def __init__(self, message: str, *, server: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.server = server
        self.detail = detail
        """The server's own error text, for the client's logic and logs; never part of the message."""


@runtime_checkable
class PolicyClient(Protocol):
    """What the episode runner needs from a policy."""

    api: str

    async def generate(
        self,
        *,
        episode_id: str,
        prompt_ids: list[int] | None,
        messages: list[dict],
        tools: list[dict],
        sampling: Sampling,
    ) -> Generation:
        """Sample one assistant turn for ``episode_id``."""
        ...

    def release(self, episode_id: str) -> None:
        """Forget ``episode_id`` (its server affinity, its script position); idempotent."""
        ...

    async def aclose(self) -> None:
        """Close connections; idempotent."""
        ...


def parse_weight_version(value: Any) -> int | None:
    """Return a server-reported weight version as an int (``7``, ``"7"``, ``"v7"``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str):
        match = _VERSION_RE.fullmatch(value)
        if match:
            return int(match.group(1))
    return None


def weight_version_of_spans(spans: Any, *, server: str) -> int | None:
    """Return the oldest version of vLLM ``weight_versions`` spans, or None if any label is not a number.

    Raises:
        PolicyError: ``spans`` is not a list of ``{"version", "start", "end"}`` objects.
    """
    if spans is None:
        return None
    if not isinstance(spans, list) or not all(isinstance(s, dict) and "version" in s for s in spans):
        raise PolicyError(
            f"policy server {server} returned malformed weight_versions {_snippet(spans)}", server=server
        )
    versions = [parse_weight_version(s["version"]) for s in spans]
    if not versions or any(v is None for v in versions):
        return None
    if len(set(versions)) > 1:
        logger.info("policy server %s changed weights during one sample: versions %s", server, versions)
    return min(v for v in versions if v is not None)


def check_token_ids(value: Any, *, what: str, server: str) -> list[int]:
    """Return ``value`` if it is a list of non-negative ints, else raise PolicyError naming ``what``."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise PolicyError(
            f"policy server {server} returned {what} that is not a list of token ids: {_snippet(value)}",
            server=server,
        )
    return value


def check_logprob(value: Any, *, index: int, server: str) -> float:
    """Return ``value`` as a float if it is a finite number <= 0 (a log probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > 1e-6:
        raise PolicyError(
            f"policy server {server} returned logprob {value!r} for sampled token {index}, not a log probability",
            server=server,
        )
    return float(value)


def _snippet(value: Any) -> str:
    """Describe ``value`` by its shape, never its content: error reasons reach API clients.

    Echoing a reply would let any key holder read what an arbitrary URL answers (the
    policy's ``base_urls`` are the caller's); the content goes to the gateway's log.
    """
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    logger.warning("policy server reply (not echoed to the client): %s", text[:_SNIPPET_CHARS])
    kind = "text" if isinstance(value, str) else type(value).__name__
    return f"<{kind} of {len(text)} characters, logged by the gateway>"


def _error_detail(response: httpx.Response) -> str:
    """Describe an error body without echoing it (its content is logged)."""
    return _snippet(response.text) if response.text else "(empty body)"


class _Retry(Exception):
    """One attempt failed in a way worth another try; carries the error to raise if none is left."""

    def __init__(self, error: PolicyError, *, server_down: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.server_down = server_down


class HTTPPolicy:
    """Shared base of the server-backed clients: one httpx.AsyncClient, a ServerPool, bounded retries."""

    api = "http"

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise PolicyError(f"policy timeouts must be positive, got {timeout_s!r} and {connect_timeout_s!r}")
        if max_attempts < 1:
            raise PolicyError(f"max_attempts must be at least 1, got {max_attempts!r}")
        try:
            self.pool = ServerPool(base_urls)
        except (TypeError, ValueError) as exc:
            raise PolicyError(str(exc)) from exc
        self.model = model
        self.timeout_s = float(timeout_s)
        self.max_attempts = max_attempts
        self._has_key = bool(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=min(connect_timeout_s, self.timeout_s)),
            headers=headers,
            transport=transport,
            # Inference servers are local infrastructure; a proxy from the environment is never wanted.
            trust_env=False,
        )
        self._closed = False

    def release(self, episode_id: str) -> None:
        """Forget the episode's server affinity; idempotent."""
        self.pool.release(episode_id)

    async def aclose(self) -> None:
        """Close the HTTP connections; idempotent."""
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    async def _post(self, *, episode_id: str, path: str, body: dict[str, Any]) -> tuple[str, Any, float]:
        """POST ``body`` as JSON to ``path`` on the episode's server; return (server, JSON answer, latency).

        Retries connection errors (on another server when the pool has one up) and
        503 answers, at most ``max_attempts`` tries in all.

        Raises:
            PolicyError: no usable answer (unreachable, timeout, HTTP error, non-JSON body).
        """
        if self._closed:
            raise PolicyError("policy client is closed")
        last: PolicyError | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                delay = RETRY_BACKOFF_S * (2 ** (attempt - 1))
                await asyncio.sleep(delay * (1 + random.random() / 2))
            server = self.pool.acquire(episode_id)
            # A retried request gets its own id: the first may still be running on the server.
            sent = body
            if attempt and "request_id" in body:
                sent = {**body, "request_id": f"{body['request_id']}-retry{attempt}"}
            try:
                return await self._attempt(server, path, sent)
            except _Retry as retry:
                last = retry.error
                if retry.server_down:
                    self.pool.mark_down(server)
                logger.warning(
                    "episode %s: attempt %d/%d failed: %s", episode_id, attempt + 1, self.max_attempts, retry.error
                )
            finally:
                self.pool.done(server)
        assert last is not None
        raise PolicyError(
            f"{last} (gave up after {self.max_attempts} tries)", server=last.server, detail=last.detail
        )

    async def _attempt(self, server: str, path: str, body: dict[str, Any]) -> tuple[str, Any, float]:
        url = server + path
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self._client.post(url, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
            error = PolicyError(f"policy server {server} is unreachable: {type(exc).__name__}: {exc}", server=server)
            raise _Retry(error, server_down=True) from exc
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise PolicyError(
                f"policy server {server} did not answer POST {path} within {self.timeout_s:g}s", server=server
            ) from exc
        except httpx.HTTPError as exc:
            raise PolicyError(
                f"policy server {server} failed on POST {path}: {type(exc).__name__}: {exc}", server=server
            ) from exc
        latency = time.monotonic() - started
        if response.status_code == 503:
            error = PolicyError(
                f"policy server {server} is unavailable (HTTP 503 on POST {path}): {_error_detail(response)}",
                server=server,
                detail=response.text[:_SNIPPET_CHARS],
            )
            raise _Retry(error, server_down=False)
        if response.status_code >= 400:
            hint = ""
            if response.status_code in (401, 403):
                hint = " (policy.api_key is wrong)" if self._has_key else " (the server wants policy.api_key)"
            raise PolicyError(
                f"policy server {server} answered HTTP {response.status_code} to POST {path}{hint}: "
                f"{_error_detail(response)}",
                server=server,
                detail=response.text[:_SNIPPET_CHARS],
            )
        try:
            payload = response.json()
        except ValueError as exc:
            raise PolicyError(
                f"policy server {server} returned a non-JSON body to POST {path} "
                f"(HTTP {response.status_code}): {_snippet(response.text) if response.text else '(empty body)'}",
                server=server,
            ) from exc
        if not isinstance(payload, dict):
            raise PolicyError(
                f"policy server {server} returned {type(payload).__name__} instead of a JSON object to POST {path}",
                server=server,
            )
        return server, payload, latency


def first_choice(payload: dict[str, Any], *, server: str, path: str) -> dict[str, Any]:
    """Return ``payload["choices"][0]`` or raise PolicyError saying what is missing."""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyError(
            f"policy server {server} answered POST {path} without a 'choices' list: {_snippet(payload)}",
            server=server,
        )
    return choices[0]


__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_TIMEOUT_S",
    "Generation",
    "HTTPPolicy",
    "PolicyClient",
    "PolicyError",
    "Sampling",
    "check_logprob",
    "check_token_ids",
    "first_choice",
    "parse_weight_version",
    "weight_version_of_spans",
]

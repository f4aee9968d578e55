"""``GET /metrics``: the worker runtime's counters and the setup cache in Prometheus text format.

Open like ``/healthz`` (outside ``/v1``, no API key): scrapers carry none, and the
numbers say nothing about tasks or episodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from gateway.dependencies import Runtime

#: Content type of the Prometheus text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter(tags=["metrics"])


@dataclass(frozen=True)
class Metric:
    """One metric family with a single unlabelled sample."""

    name: str
    kind: str
    """``counter`` or ``gauge``."""
    help: str
    value: int | float


#: (name, kind, help, key): the metrics read from one stats mapping, zero where a key is missing.
_Table = list[tuple[str, str, str, str]]

_ENV: _Table = [
    ("forkyard_env_resets_total", "counter", "Environment resets.", "resets"),
    ("forkyard_env_steps_total", "counter", "Environment steps executed (tool calls and truncations).", "env_steps"),
    ("forkyard_env_setup_runs_total", "counter", "Runs of a task's forkyard/reset.sh.", "setup_runs"),
    ("forkyard_env_setup_uncacheable_total", "counter",
     "Setup cache keys whose reset.sh left processes running (never cached).", "setup_uncacheable"),
]
_SETUP_CACHE: _Table = [
    ("forkyard_setup_cache_hits_total", "counter", "Resets restored from the setup cache.", "hits"),
    ("forkyard_setup_cache_misses_total", "counter", "Resets that ran setup and filled the setup cache.", "misses"),
    ("forkyard_setup_cache_evictions_total", "counter", "Setup cache entries evicted to stay under the cap.",
     "evictions"),
    ("forkyard_setup_cache_entries", "gauge", "Entries in the setup cache.", "entries"),
    ("forkyard_setup_cache_bytes", "gauge", "Bytes the setup cache's snapshots hold.", "bytes"),
]
_POOL: _Table = [
    ("forkyard_pool_hits_total", "counter", "Sandbox starts served from the warm pool.", "hits"),
    ("forkyard_pool_misses_total", "counter", "Sandbox starts the warm pool had none idle for (cold).", "misses"),
    ("forkyard_pool_fills_total", "counter", "Sandboxes the warm pool started.", "fills"),
    ("forkyard_pool_fill_failures_total", "counter", "Warm pool fills that failed.", "fill_failures"),
    ("forkyard_pool_breaker_trips_total", "counter", "Times a pool key stopped filling after failures.",
     "breaker_trips"),
    ("forkyard_pool_claim_seconds_total", "counter", "Seconds spent handing out pooled sandboxes (hits).",
     "claim_seconds"),
    ("forkyard_pool_fill_seconds_total", "counter", "Seconds the successful fills took.", "fill_seconds"),
    ("forkyard_pool_idle", "gauge", "Sandboxes idle in the warm pool.", "idle"),
    ("forkyard_pool_keys", "gauge", "Keys the warm pool tracks.", "keys"),
]


def _read(table: _Table, stats: Mapping[str, Any]) -> list[Metric]:
    return [Metric(name, kind, help_text, stats.get(key, 0)) for name, kind, help_text, key in table]


def runtime_metrics(runtime: Any) -> list[Metric]:
    """Return the metrics of a worker runtime: env counters, setup cache and warm pool stats (zeros without).

    A distributed-mode gateway's runtime (its client of the nodes) has none of them: its
    metrics are zeros, and each node's load is in ``GET /v1/nodes``.
    """
    cache = getattr(runtime, "setup_cache", None)
    pool = getattr(runtime, "pool", None)
    return [
        *_read(_ENV, getattr(runtime, "counters", None) or {}),
        *_read(_SETUP_CACHE, cache.stats() if cache is not None else {}),
        *_read(_POOL, pool.stats() if pool is not None else {}),
    ]


def render(metrics: Iterable[Metric]) -> str:
    """Return metrics in the Prometheus text exposition format (version 0.0.4)."""
    lines = []
    for metric in metrics:
        help_text = metric.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [
            f"# HELP {metric.name} {help_text}",
            f"# TYPE {metric.name} {metric.kind}",
            f"{metric.name} {metric.value}",
        ]
    return "\n".join(lines) + "\n"


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(runtime: Runtime) -> PlainTextResponse:
    """Answer this node's metrics in the Prometheus text format."""
    return PlainTextResponse(render(runtime_metrics(runtime)), media_type=CONTENT_TYPE)

"""``GET /metrics``: the worker runtime's counters and the setup cache in Prometheus text format.

Open like ``/healthz`` (outside ``/v1``, no API key): scrapers carry none, and the
numbers say nothing about tasks or episodes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
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


def runtime_metrics(runtime: Any) -> list[Metric]:
    """Return the metrics of a worker runtime: env counters and setup cache stats (zeros without a cache).

    A distributed-mode gateway's runtime (its client of the nodes) has neither: its metrics are
    zeros, and each node's load is in ``GET /v1/nodes``.
    """
    counters = getattr(runtime, "counters", None) or collections.Counter()
    cache = getattr(runtime, "setup_cache", None)
    stats = cache.stats() if cache is not None else {}
    return [
        Metric("forkyard_env_resets_total", "counter", "Environment resets.", counters["resets"]),
        Metric("forkyard_env_steps_total", "counter", "Environment steps executed (tool calls and truncations).",
               counters["env_steps"]),
        Metric("forkyard_env_setup_runs_total", "counter", "Runs of a task's forkyard/reset.sh.",
               counters["setup_runs"]),
        Metric("forkyard_env_setup_uncacheable_total", "counter",
               "Setup cache keys whose reset.sh left processes running (never cached).",
               counters["setup_uncacheable"]),
        Metric("forkyard_setup_cache_hits_total", "counter", "Resets restored from the setup cache.",
               stats.get("hits", 0)),
        Metric("forkyard_setup_cache_misses_total", "counter", "Resets that ran setup and filled the setup cache.",
               stats.get("misses", 0)),
        Metric("forkyard_setup_cache_evictions_total", "counter", "Setup cache entries evicted to stay under the cap.",
               stats.get("evictions", 0)),
        Metric("forkyard_setup_cache_entries", "gauge", "Entries in the setup cache.", stats.get("entries", 0)),
        Metric("forkyard_setup_cache_bytes", "gauge", "Bytes the setup cache's snapshots hold.",
               stats.get("bytes", 0)),
        *pool_metrics(runtime),
    ]


def pool_metrics(runtime: Any) -> list[Metric]:
    """Return the warm pool's metrics (zeros when the node pools nothing)."""
    pool = getattr(runtime, "pool", None)
    stats = pool.stats() if pool is not None else {}
    return [
        Metric("forkyard_pool_hits_total", "counter", "Sandbox starts served from the warm pool.", stats.get("hits", 0)),
        Metric("forkyard_pool_misses_total", "counter", "Sandbox starts the warm pool had none idle for (cold).",
               stats.get("misses", 0)),
        Metric("forkyard_pool_fills_total", "counter", "Sandboxes the warm pool started.", stats.get("fills", 0)),
        Metric("forkyard_pool_fill_failures_total", "counter", "Warm pool fills that failed.",
               stats.get("fill_failures", 0)),
        Metric("forkyard_pool_breaker_trips_total", "counter", "Times a pool key stopped filling after failures.",
               stats.get("breaker_trips", 0)),
        Metric("forkyard_pool_claim_seconds_total", "counter", "Seconds spent handing out pooled sandboxes (hits).",
               stats.get("claim_seconds", 0.0)),
        Metric("forkyard_pool_fill_seconds_total", "counter", "Seconds the successful fills took.",
               stats.get("fill_seconds", 0.0)),
        Metric("forkyard_pool_idle", "gauge", "Sandboxes idle in the warm pool.", stats.get("idle", 0)),
        Metric("forkyard_pool_keys", "gauge", "Keys the warm pool tracks.", stats.get("keys", 0)),
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

"""What the console's pages show, read from the database (every gateway shows the same fleet).

Each function returns plain data for one page or fragment. Lists are paged by offset
(:class:`Page`); counts and series are computed in SQL where the rows would be many.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.models import AuditEntry
from gateway.db import utcnow
from gateway.environments.models import Environment
from gateway.episodes.models import Episode, EpisodeStep
from gateway.nodes import service as nodes_service
from gateway.nodes.models import NodeCommand
from gateway.nodes.schemas import NodeRead
from gateway.rollouts.models import DeliveryConsumer, Rollout, RolloutStatus
from gateway.sandboxes.models import Sandbox
from gateway.sessions.models import SessionStep
from gateway.snapshots.models import SnapshotRecord
from gateway.tasks.models import Task
from workers.protocol import EpisodeStatus, SandboxStatus

T = TypeVar("T")

#: Rows on one page of a list.
PAGE_SIZE = 50
#: Minutes the overview's time series cover.
WINDOW_MINUTES = 60


@dataclass
class Page(Generic[T]):
    """One page of a list: its rows, the page number (from 1), and the total row count."""

    items: list[T]
    page: int
    total: int
    size: int = PAGE_SIZE

    @property
    def pages(self) -> int:
        return max(1, math.ceil(self.total / self.size))

    @property
    def has_prev(self) -> bool:
        return self.page > 1

    @property
    def has_next(self) -> bool:
        return self.page < self.pages


async def _page(db: AsyncSession, stmt: Select[Any], page: int, *, scalars: bool = True) -> Page[Any]:
    page = max(1, page)
    total = int(await db.scalar(select(func.count()).select_from(stmt.order_by(None).subquery())) or 0)
    paged = stmt.limit(PAGE_SIZE).offset((page - 1) * PAGE_SIZE)
    rows = list((await db.scalars(paged)).all()) if scalars else list((await db.execute(paged)).all())
    return Page(items=rows, page=page, total=total)


def page_list(items: Sequence[T], page: int) -> Page[T]:
    """Return one page of a list already in memory (the nodes, and what their heartbeats report)."""
    page = max(1, page)
    return Page(items=list(items[(page - 1) * PAGE_SIZE:page * PAGE_SIZE]), page=page, total=len(items))


def _minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


# ---------------------------------------------------------------------------- overview


async def overview(db: AsyncSession) -> dict[str, Any]:
    """Return the overview: nodes by state, live sandboxes by state, rollouts running, episodes per
    minute and failure reasons over the last hour, and the delivery lag of each consumer."""
    now = utcnow()
    since = now - timedelta(minutes=WINDOW_MINUTES)
    nodes = await nodes_service.list_nodes(db_session=db)
    node_states = Counter(n.state for n in nodes)
    sandboxes = dict((await db.execute(
        select(Sandbox.state, func.count()).where(Sandbox.gone_at.is_(None)).group_by(Sandbox.state))).all())
    rollouts = dict((await db.execute(
        select(Rollout.status, func.count()).group_by(Rollout.status))).all())
    finished = (await db.execute(
        select(Episode.finished_at, Episode.status, Episode.error)
        .where(Episode.finished_at.is_not(None), Episode.finished_at >= since))).all()
    per_minute: Counter[datetime] = Counter()
    failed_per_minute: Counter[datetime] = Counter()
    reasons: Counter[str] = Counter()
    for at, status, error in finished:
        minute = _minute(at)
        per_minute[minute] += 1
        if status == EpisodeStatus.FAILED:
            failed_per_minute[minute] += 1
            reasons[failure_reason(error)] += 1
    minutes = [_minute(since) + timedelta(minutes=i + 1) for i in range(WINDOW_MINUTES)]
    eps = [(m.strftime("%H:%M"), float(per_minute[m])) for m in minutes]
    fail_rate = [(m.strftime("%H:%M"), failed_per_minute[m] / per_minute[m] if per_minute[m] else None)
                 for m in minutes]
    lag = (await db.execute(
        select(DeliveryConsumer.name, DeliveryConsumer.rollout_id, Rollout.last_seq,
               DeliveryConsumer.last_delivered_seq, DeliveryConsumer.updated_at)
        .join(Rollout, Rollout.id == DeliveryConsumer.rollout_id)
        .where(Rollout.status.in_([RolloutStatus.QUEUED, RolloutStatus.RUNNING]))
        .order_by((Rollout.last_seq - DeliveryConsumer.last_delivered_seq).desc()).limit(20))).all()
    return {
        "nodes": {state: node_states.get(state, 0) for state in ("up", "draining", "down")},
        "sandboxes": {s.value: int(sandboxes.get(s, 0)) for s in SandboxStatus if s != SandboxStatus.GONE},
        "rollouts": {s.value: int(rollouts.get(s, 0)) for s in RolloutStatus},
        "episodes_last_hour": len(finished),
        "episodes_per_minute": eps,
        "failure_rate": fail_rate,
        "failures": reasons.most_common(10),
        "failed_last_hour": sum(reasons.values()),
        "lag": [{"consumer": name, "rollout_id": rid, "behind": max(0, (last or 0) - (done or 0)),
                 "updated_at": updated} for name, rid, last, done, updated in lag],
    }


def failure_reason(error: str | None) -> str:
    """Return a failed episode's reason as a short class: the error's first clause, ids dropped."""
    if not error:
        return "unknown"
    head = error.split(":", 1)[0].split(" (", 1)[0].strip()
    return " ".join(w for w in head.split() if not any(c.isdigit() for c in w))[:80] or "unknown"


# ---------------------------------------------------------------------------- nodes


async def nodes(db: AsyncSession) -> list[NodeRead]:
    """Return every node (state, capacity, load, heartbeat)."""
    return await nodes_service.list_nodes(db_session=db)


async def commands(db: AsyncSession, page: int) -> Page[NodeCommand]:
    """Return one page of the commands queued for nodes, newest first."""
    return await _page(db, select(NodeCommand).order_by(NodeCommand.created_at.desc(), NodeCommand.id.desc()), page)


# ---------------------------------------------------------------------------- sandboxes


@dataclass(frozen=True)
class SandboxFilter:
    """The sandboxes page's filters (empty: any); ``state`` ``live`` is every state but gone."""

    node: str = ""
    state: str = "live"
    task: str = ""
    owner: str = ""

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        if self.node:
            stmt = stmt.where(Sandbox.node == self.node)
        if self.state == "live":
            stmt = stmt.where(Sandbox.gone_at.is_(None))
        elif self.state:
            stmt = stmt.where(Sandbox.state == SandboxStatus(self.state))
        if self.task:
            stmt = stmt.where((Sandbox.task_id == self.task) | Sandbox.task_id.in_(
                select(Task.id).where(Task.name == self.task)))
        if self.owner:
            stmt = stmt.where((Sandbox.owner_id == self.owner) | (Sandbox.owner_kind == self.owner)
                              | (Sandbox.session_id == self.owner) | (Sandbox.rollout_id == self.owner))
        return stmt

    def query(self) -> dict[str, str]:
        return {k: v for k, v in (("node", self.node), ("state", self.state), ("task", self.task),
                                  ("owner", self.owner)) if v}


async def sandboxes(db: AsyncSession, flt: SandboxFilter, page: int) -> Page[Sandbox]:
    """Return one page of the sandboxes matching ``flt``, newest first."""
    stmt = flt.apply(select(Sandbox)).order_by(Sandbox.created_at.desc(), Sandbox.id)
    return await _page(db, stmt, page)


async def matching_sandboxes(db: AsyncSession, flt: SandboxFilter, *, limit: int = 1000) -> list[Sandbox]:
    """Return the live sandboxes matching ``flt`` (a bulk kill's preview and targets), at most ``limit``."""
    stmt = flt.apply(select(Sandbox)).where(Sandbox.gone_at.is_(None)).order_by(Sandbox.created_at).limit(limit)
    return list((await db.scalars(stmt)).all())


async def sandbox_detail(db: AsyncSession, sandbox_id: str) -> dict[str, Any] | None:
    """Return a sandbox with its recent commands and outputs (its session's or its episode's last steps)."""
    row = await db.get(Sandbox, sandbox_id)
    if row is None:
        return None
    steps: list[dict[str, Any]] = []
    if row.session_id is not None:
        for step in (await db.scalars(select(SessionStep).where(SessionStep.session_id == row.session_id)
                                      .order_by(SessionStep.seq.desc()).limit(20))).all():
            steps.append({"seq": step.seq, "tool": step.tool, "arguments": step.arguments,
                          "output": step.observation, "reward": step.reward, "at": step.created_at})
    elif row.owner_kind == "episode" and row.owner_id:
        for step in (await db.scalars(select(EpisodeStep).where(EpisodeStep.episode_id == row.owner_id)
                                      .order_by(EpisodeStep.index.desc()).limit(20))).all():
            action = step.action or {}
            steps.append({"seq": step.index, "tool": action.get("tool", "(unparsed)"),
                          "arguments": action.get("arguments", {}), "output": step.observation,
                          "reward": step.reward, "at": step.created_at})
    return {"sandbox": row, "steps": list(reversed(steps))}


# ---------------------------------------------------------------------------- warm pools and caches


def pools(node_rows: Sequence[NodeRead]) -> list[dict[str, Any]]:
    """Return every node's warm pool keys (target vs idle, hits and misses) from their last heartbeats."""
    found = []
    for node in node_rows:
        pool = node.load.get("pool")
        if not isinstance(pool, dict):
            continue
        found.append({"node": node.name, "state": node.state, "hits": pool.get("hits", 0),
                      "misses": pool.get("misses", 0), "idle": pool.get("idle", 0),
                      "max_idle": pool.get("max_idle", 0), "keys": pool.get("by_key") or []})
    return found


def setup_caches(node_rows: Sequence[NodeRead]) -> list[dict[str, Any]]:
    """Return every node's setup cache (entries, bytes, hits) from their last heartbeats."""
    return [{"node": node.name, **node.load["setup_cache"]} for node in node_rows
            if isinstance(node.load.get("setup_cache"), dict)]


async def snapshots(db: AsyncSession, page: int) -> Page[SnapshotRecord]:
    """Return one page of the snapshots not deleted, newest first."""
    stmt = (select(SnapshotRecord).where(SnapshotRecord.deleted_at.is_(None))
            .order_by(SnapshotRecord.created_at.desc(), SnapshotRecord.id))
    return await _page(db, stmt, page)


# ---------------------------------------------------------------------------- rollouts and episodes


async def rollouts(db: AsyncSession, page: int, status: str = "") -> Page[Rollout]:
    """Return one page of rollouts, newest first (``status``: only those)."""
    stmt = select(Rollout).order_by(Rollout.created_at.desc(), Rollout.id)
    if status:
        stmt = stmt.where(Rollout.status == RolloutStatus(status))
    return await _page(db, stmt, page)


def _histogram(values: Sequence[float], bins: int = 10) -> list[tuple[str, float]]:
    lo, hi = min(values), max(values)
    if hi == lo:
        return [(f"{lo:g}", float(len(values)))]
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    return [(f"{lo + i * width:.2g}–{lo + (i + 1) * width:.2g}", float(c)) for i, c in enumerate(counts)]


async def rollout_rewards(db: AsyncSession, rollout_id: str) -> dict[str, Any]:
    """Return a rollout's reward distribution, mean reward over time (by finishing order, in 20 buckets),
    and per-group statistics (the first 50 groups)."""
    rows = (await db.execute(
        select(Episode.group_id, Episode.reward, Episode.finished_at)
        .where(Episode.rollout_id == rollout_id, Episode.reward.is_not(None), Episode.finished_at.is_not(None))
        .order_by(Episode.finished_at))).all()
    rewards = [float(r) for _, r, _ in rows if math.isfinite(r)]
    over_time: list[tuple[str, float | None]] = []
    if rewards:
        buckets = min(20, len(rows))
        for b in range(buckets):
            chunk = rows[b * len(rows) // buckets:(b + 1) * len(rows) // buckets]
            if chunk:
                over_time.append((chunk[-1][2].strftime("%H:%M:%S"),
                                  statistics.fmean(float(r) for _, r, _ in chunk)))
    groups: dict[str, list[float]] = {}
    for group_id, reward, _ in rows:
        groups.setdefault(group_id, []).append(float(reward))
    group_stats = [{"group_id": g, "n": len(v), "mean": statistics.fmean(v), "std": statistics.pstdev(v),
                    "min": min(v), "max": max(v)} for g, v in list(groups.items())[:50]]
    return {"n": len(rewards), "mean": statistics.fmean(rewards) if rewards else None,
            "histogram": _histogram(rewards) if rewards else [], "over_time": over_time,
            "groups": group_stats, "group_count": len(groups)}


async def dead_letters(db: AsyncSession, rollout_id: str, page: int) -> Page[Episode]:
    """Return one page of a rollout's dead letters (never to be delivered), with their reasons."""
    stmt = (select(Episode).where(Episode.rollout_id == rollout_id, Episode.dead_letter_reason.is_not(None))
            .order_by(Episode.created_at, Episode.id))
    return await _page(db, stmt, page)


async def episodes(db: AsyncSession, rollout_id: str, page: int, status: str = "") -> Page[Episode]:
    """Return one page of a rollout's episodes, in creation order."""
    stmt = select(Episode).where(Episode.rollout_id == rollout_id).order_by(Episode.created_at, Episode.id)
    if status:
        stmt = stmt.where(Episode.status == EpisodeStatus(status))
    return await _page(db, stmt, page)


def token_view(training: dict[str, Any], *, limit: int = 4000) -> list[dict[str, Any]]:
    """Return the first ``limit`` tokens of a training view: id, whether the loss counts it, logprob and shade."""
    tokens = []
    logprobs = iter(training["logprobs"])
    for token, mask in zip(training["input_ids"][:limit], training["loss_mask"][:limit]):
        lp = next(logprobs, None) if mask else None
        # Shade 0 (certain) .. 1 (logprob -5 or less): where the policy hesitated.
        shade = None if lp is None else round(min(1.0, max(0.0, -lp / 5.0)), 2)
        tokens.append({"id": token, "loss": bool(mask), "logprob": lp, "shade": shade})
    return tokens


# ---------------------------------------------------------------------------- tasks, environments and audit


async def environments(db: AsyncSession, page: int) -> Page[Environment]:
    """Return one page of environments, oldest first."""
    return await _page(db, select(Environment).order_by(Environment.created_at, Environment.id), page)


async def tasks(db: AsyncSession, page: int, environment: str = "") -> Page[Task]:
    """Return one page of tasks, newest first."""
    stmt = select(Task).order_by(Task.created_at.desc(), Task.id)
    if environment:
        stmt = stmt.where(Task.environment.has(name=environment))
    return await _page(db, stmt, page)


async def audit_log(db: AsyncSession, page: int) -> Page[AuditEntry]:
    """Return one page of the audit log, newest first."""
    return await _page(db, select(AuditEntry).order_by(AuditEntry.at.desc(), AuditEntry.id.desc()), page)

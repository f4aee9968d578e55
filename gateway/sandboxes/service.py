"""The sandboxes of the nodes: live listings joined with the sessions and tasks they serve, and their rows."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import utcnow
from gateway.sandboxes.models import Sandbox
from gateway.sandboxes.schemas import SandboxRead
from gateway.sessions.service import LABEL_TASK_ID
from gateway.tasks.models import Task
from workers.protocol import LABEL_OWNER, SandboxStatus, owner_kind

#: Label the runtime sets to the task's name.
LABEL_TASK_NAME = "forkyard.task"
#: Label a rollout's sandboxes carry: the rollout's id.
LABEL_ROLLOUT = "forkyard.rollout"
#: Owner kinds whose owner label is an id worth showing.
_OWNED_BY_ID = {"session", "episode", "group"}

if TYPE_CHECKING:
    from workers.protocol import SandboxView, WorkerClient


async def list_sandboxes(*, db_session: AsyncSession, runtime: WorkerClient) -> list[SandboxRead]:
    """Return this node's live sandboxes (orphans included), oldest first."""
    live = sorted(await runtime.list_sandboxes(), key=lambda info: (info.created_at, info.id))
    if not live:
        return []
    records = {
        row.id: row
        for row in (await db_session.scalars(select(Sandbox).where(Sandbox.id.in_([i.id for i in live])))).all()
    }
    links: dict[str, tuple[str | None, str | None]] = {}
    for info in live:
        record = records.get(info.id)
        owner = info.labels.get(LABEL_OWNER)
        session_id = record.session_id if record else owner if owner_kind(owner) == "session" else None
        task_id = record.task_id if record else info.labels.get(LABEL_TASK_ID)
        links[info.id] = (session_id, task_id)
    task_ids = {task_id for _, task_id in links.values() if task_id}
    names: dict[str, str] = {}
    if task_ids:
        rows = await db_session.execute(select(Task.id, Task.name).where(Task.id.in_(task_ids)))
        names = {task_id: name for task_id, name in rows}
    now = time.time()
    return [
        SandboxRead(
            id=info.id, node=info.node, backend=info.backend, state=SandboxStatus(info.state), image=info.image,
            session_id=links[info.id][0], task_id=links[info.id][1], **_owner(info.labels),
            task_name=names.get(links[info.id][1] or "") or info.labels.get(LABEL_TASK_NAME),
            age_s=round(max(0.0, now - info.created_at), 3),
            created_at=datetime.fromtimestamp(info.created_at, UTC),
        )
        for info in live
    ]


def _owner(labels: Mapping[str, str]) -> dict[str, str | None]:
    owner = labels.get(LABEL_OWNER)
    kind = owner_kind(owner)
    return {"owner_kind": kind, "owner_id": owner if kind in _OWNED_BY_ID else None,
            "rollout_id": labels.get(LABEL_ROLLOUT)}


async def record_sandboxes(
    *, db_session: AsyncSession, node: str, live: Sequence[SandboxView], listed_at: datetime,
    made: Sequence[SandboxView] = (),
) -> int:
    """Bring ``node``'s sandbox rows in line with its live sandboxes; return how many rows changed.

    Every live sandbox gets a row with its owner (:func:`workers.protocol.owner_kind`), and
    a row whose owner changed is updated: a pooled sandbox becomes an episode's when it is
    claimed. A session's row is left to the sessions service, which writes it when the
    session opens. A row still open whose sandbox is no longer live is marked gone. That
    applies only to rows created before ``listed_at``, when ``live`` was listed, so a
    sandbox made since is never marked gone by mistake. A sandbox of ``made`` (those the node
    made since its last listing) that is not live any more and has no row gets one, already gone.
    """
    open_rows = {row.id: row for row in (await db_session.scalars(
        select(Sandbox).where(Sandbox.node == node, Sandbox.gone_at.is_(None)))).all()}
    live_by_id = {info.id: info for info in live}
    gone = {info.id: info for info in made if info.id not in live_by_id}
    asked = [*live_by_id, *gone]
    recorded = set((await db_session.scalars(select(Sandbox.id).where(Sandbox.id.in_(asked)))).all()) if asked else set()
    changed = 0
    for info in live:
        owner = _owner(info.labels)
        row = open_rows.get(info.id)
        if row is None and info.id not in recorded and owner["owner_kind"] != "session":
            db_session.add(Sandbox(id=info.id, node=node, backend=info.backend, state=SandboxStatus(info.state),
                                   created_at=datetime.fromtimestamp(info.created_at, UTC), **owner))
            changed += 1
        elif row is not None and row.session_id is None and (row.owner_kind, row.owner_id) != (
                owner["owner_kind"], owner["owner_id"]):
            row.owner_kind, row.owner_id, row.rollout_id = owner["owner_kind"], owner["owner_id"], owner["rollout_id"]
            changed += 1
    now = utcnow()
    for info in gone.values():
        owner = _owner(info.labels)
        if info.id not in recorded and owner["owner_kind"] != "session":
            db_session.add(Sandbox(id=info.id, node=node, backend=info.backend, state=SandboxStatus.GONE,
                                   created_at=datetime.fromtimestamp(info.created_at, UTC), gone_at=now, **owner))
            changed += 1
    for row in open_rows.values():
        created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
        if row.id not in live_by_id and created < listed_at:
            row.gone_at, row.state = now, SandboxStatus.GONE
            changed += 1
    await db_session.commit()
    return changed

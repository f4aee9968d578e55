"""List the live sandboxes of this node, joined with the sessions and tasks they serve."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.sandboxes.models import Sandbox
from gateway.sandboxes.schemas import SandboxRead
from gateway.sessions.service import LABEL_TASK_ID
from gateway.tasks.models import Task
from sandboxes.base import LABEL_OWNER

#: Label the runtime sets to the task's name.
LABEL_TASK_NAME = "forkyard.task"

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime


async def list_sandboxes(*, db_session: AsyncSession, runtime: WorkerRuntime) -> list[SandboxRead]:
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
        session_id = record.session_id if record else info.labels.get(LABEL_OWNER)
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
            id=info.id, node=info.node, backend=info.backend, state=info.state, image=info.image,
            session_id=links[info.id][0], task_id=links[info.id][1],
            task_name=names.get(links[info.id][1] or "") or info.labels.get(LABEL_TASK_NAME),
            age_s=round(max(0.0, now - info.created_at), 3),
            created_at=datetime.fromtimestamp(info.created_at, UTC),
        )
        for info in live
    ]

"""Freeing the snapshots nothing holds any more: run when a session ends, a snapshot is deleted, a node starts.

It stands apart from :mod:`gateway.snapshots.service`, which forks sessions and so builds on
the sessions service: the sessions service calls this module when a session ends, and no
cycle ties the two services together.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, exists, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from gateway.db import utcnow
from gateway.sessions.models import EnvSession, SessionState
from gateway.snapshots.models import SnapshotRecord

if TYPE_CHECKING:
    from workers.protocol import WorkerClient

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KnownSnapshot:
    """The part of a snapshot row that never changes: enough to start restoring its forks."""

    task_id: str
    session_id: str
    state: dict[str, Any]


class KnownSnapshots:
    """Snapshot rows this process wrote or read and has not deleted since, by id, the oldest dropped past ``max_entries``.

    A fork of a known snapshot starts restoring at once. Whatever this process deletes
    (DELETE, a collection) it drops from here first, so a sole gateway may take a
    snapshot it knows for a live one without reading its row.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._known: OrderedDict[str, KnownSnapshot] = OrderedDict()

    def get(self, snapshot_id: str) -> KnownSnapshot | None:
        """Return what is known of the snapshot, or None."""
        return self._known.get(snapshot_id)

    def drop(self, snapshot_id: str) -> None:
        """Forget a snapshot (its row was never written, or it is being deleted)."""
        self._known.pop(snapshot_id, None)

    def put(self, record: SnapshotRecord) -> KnownSnapshot:
        """Remember a snapshot row's unchanging part; return it."""
        known = KnownSnapshot(task_id=record.task_id, session_id=record.session_id, state=record.state)
        self._known[record.id] = known
        self._known.move_to_end(record.id)
        while len(self._known) > self.max_entries:
            self._known.popitem(last=False)
        return known


#: The process's known snapshots (ids are random: two databases never share one).
known_snapshots = KnownSnapshots()


class ForkHolds:
    """Snapshots this process is forking whose forks' rows are not written yet.

    A fork's rows hold its snapshot once written; until then (a sole gateway writes them
    behind the answer) this does. A collection notes :meth:`mark` before it reads which
    snapshots nothing holds, and spares those :meth:`holds` names: a fork under way, or one
    whose rows went in after the mark (the read may have missed them).
    """

    def __init__(self, max_touched: int = 4096) -> None:
        self._pending: Counter[str] = Counter()
        self._clock = 0
        self._touched: OrderedDict[str, int] = OrderedDict()  # the clock at each snapshot's last begin or end
        self._max_touched = max_touched

    def _touch(self, snapshot_id: str) -> None:
        self._clock += 1
        self._touched[snapshot_id] = self._clock
        self._touched.move_to_end(snapshot_id)
        while len(self._touched) > self._max_touched:
            self._touched.popitem(last=False)

    def begin(self, snapshot_id: str, n: int = 1) -> None:
        """Hold ``snapshot_id`` for ``n`` forks whose rows are not written yet."""
        self._pending[snapshot_id] += n
        self._touch(snapshot_id)

    def end(self, snapshot_id: str, n: int = 1) -> None:
        """Let go of ``n`` of them (their rows are written, or they failed)."""
        self._pending[snapshot_id] -= n
        if self._pending[snapshot_id] <= 0:
            del self._pending[snapshot_id]
        self._touch(snapshot_id)

    def mark(self) -> int:
        """Return the clock now, for :meth:`holds`."""
        return self._clock

    def holds(self, snapshot_id: str, since: int) -> bool:
        """Tell whether a fork holds ``snapshot_id`` now or let go of it after ``since`` (a :meth:`mark`)."""
        return snapshot_id in self._pending or self._touched.get(snapshot_id, -1) > since


#: The process's forks under way.
fork_holds = ForkHolds()


def backend_snapshot_id(record: SnapshotRecord) -> str:
    """Return the id of the backend snapshot behind a record."""
    return record.state["session"]["sandbox"]["id"]


# The backend snapshot's id as the database reads it out of the row's state (as backend_snapshot_id does).
_BACKEND_ID = SnapshotRecord.state[("session", "sandbox", "id")].as_string()
_NOT_FREED = (SnapshotRecord.node == bindparam("node"), SnapshotRecord.freed_at.is_(None))
_LIVE_BACKEND_IDS = select(_BACKEND_ID).where(*_NOT_FREED)
# The snapshots nothing holds: no open fork, no pin and, unless deleted, no open source session.
_FORK, _SOURCE = aliased(EnvSession), aliased(EnvSession)
_UNHELD = select(SnapshotRecord).where(
    *_NOT_FREED, SnapshotRecord.pinned.is_(False),
    ~exists().where(_FORK.snapshot_id == SnapshotRecord.id, _FORK.state == SessionState.OPEN),
    or_(SnapshotRecord.deleted_at.is_not(None),
        ~exists().where(_SOURCE.id == SnapshotRecord.session_id, _SOURCE.state == SessionState.OPEN)),
)
# The rows not yet freed that reference any of some backend snapshots (content-addressed: rows may share one).
_SHARING = select(SnapshotRecord.id, _BACKEND_ID).where(*_NOT_FREED, _BACKEND_ID.in_(bindparam("refs", expanding=True)))


async def live_backend_snapshot_ids(*, db_session: AsyncSession, node: str) -> set[str]:
    """Return the backend snapshots the not yet freed snapshot rows of ``node`` reference."""
    return set((await db_session.scalars(_LIVE_BACKEND_IDS, {"node": node})).all())


async def collect_garbage(*, db_session: AsyncSession, runtime: WorkerClient, node: str) -> list[str]:
    """Delete the snapshots of ``node`` that nothing holds and free their backend storage; return their ids.

    Holders: an open fork, the pin, (unless the snapshot was deleted) its open source session,
    and a fork of this process whose rows are not written yet (:data:`fork_holds`).
    """
    since = fork_holds.mark()
    await db_session.commit()  # the read below sees every fork row written before the mark
    doomed = [r for r in (await db_session.scalars(_UNHELD, {"node": node})).all()
              if not fork_holds.holds(r.id, since)]
    if not doomed:
        return []
    for record in doomed:  # no fork of this process starts from it from now on
        known_snapshots.drop(record.id)
    now = utcnow()
    for record in doomed:
        if record.deleted_at is None:  # its session ended with nothing else holding it
            record.deleted_at = now
    # Only the rows sharing a doomed row's backend snapshot, and only two columns: not every live state.
    refs = sorted({backend_snapshot_id(r) for r in doomed})
    sharing = (await db_session.execute(_SHARING, {"node": node, "refs": refs})).all()
    await db_session.commit()
    doomed_ids = {r.id for r in doomed}
    still_used = {ref for row_id, ref in sharing if row_id not in doomed_ids}
    freed = []
    for record in doomed:
        ref = backend_snapshot_id(record)
        if ref not in still_used:  # content-addressed: another record may share the backend snapshot
            try:
                await runtime.delete_snapshot(ref, node=node)
            except Exception:
                logger.exception("snapshot %s: freeing backend snapshot %s failed; will retry", record.id, ref)
                continue
            still_used.add(ref)  # freed once is enough
        record.freed_at = utcnow()
        freed.append(record.id)
    await db_session.commit()
    if freed:
        logger.info("freed %d snapshot(s): %s", len(freed), ", ".join(freed))
    return freed

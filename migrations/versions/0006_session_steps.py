"""Session steps as rows: the session_step table replaces session.history; forks point at their parent.

A step used to rewrite the session's whole history (a JSON column), so its cost grew
with every step. Each step is now one row. A fork no longer copies the history up to its
snapshot: ``parent_session_id`` and ``parent_steps`` say where those steps are, and a
snapshot's state keeps their count (``steps``) instead of a copy.

Existing histories are moved into rows (a fork's inherited prefix stays its source's),
and snapshots keep their step count; the downgrade writes the JSON back.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 500

session = sa.table(
    'session', sa.column('id', sa.String), sa.column('steps', sa.Integer), sa.column('history', sa.JSON),
    sa.column('snapshot_id', sa.String), sa.column('parent_session_id', sa.String),
    sa.column('parent_steps', sa.Integer), sa.column('created_at', sa.DateTime(timezone=True)),
)
snapshot = sa.table('snapshot', sa.column('id', sa.String), sa.column('session_id', sa.String),
                    sa.column('state', sa.JSON))
step = sa.table(
    'session_step', sa.column('session_id', sa.String), sa.column('seq', sa.Integer), sa.column('tool', sa.String),
    sa.column('arguments', sa.JSON), sa.column('observation', sa.Text), sa.column('reward', sa.Float),
    sa.column('terminated', sa.Boolean), sa.column('truncated', sa.Boolean),
    sa.column('created_at', sa.DateTime(timezone=True)),
)


def _pages(conn, stmt, key):
    """Yield rows of ``stmt`` in pages of BATCH ordered by ``key`` (no page stays in memory)."""
    last = None
    while True:
        query = stmt.order_by(key).limit(BATCH)
        if last is not None:
            query = query.where(key > last)
        rows = conn.execute(query).all()
        if not rows:
            return
        yield from rows
        last = rows[-1][0]


def upgrade() -> None:
    op.create_table('session_step',
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('tool', sa.String(length=200), nullable=False),
    sa.Column('arguments', sa.JSON(), nullable=False),
    sa.Column('observation', sa.Text(), nullable=False),
    sa.Column('reward', sa.Double(), nullable=True),
    sa.Column('terminated', sa.Boolean(), nullable=False),
    sa.Column('truncated', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['session.id'], name=op.f('fk_session_step_session_id_session')),
    sa.PrimaryKeyConstraint('session_id', 'seq', name=op.f('pk_session_step'))
    )
    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.add_column(sa.Column('parent_session_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('parent_steps', sa.Integer(), server_default='0', nullable=False))

    conn = op.get_bind()
    inherited: dict[str, tuple[str, int]] = {}  # snapshot id -> (source session, steps)
    for snap_id, source, state in _pages(conn, sa.select(snapshot.c.id, snapshot.c.session_id, snapshot.c.state),
                                         snapshot.c.id):
        state = dict(state or {})
        count = len(state.pop('history', None) or [])
        state.setdefault('steps', count)
        inherited[snap_id] = (source, int(state['steps']))
        conn.execute(snapshot.update().where(snapshot.c.id == snap_id).values(state=state))
    columns = (session.c.id, session.c.history, session.c.snapshot_id, session.c.created_at)
    for sid, history, snap_id, created in _pages(conn, sa.select(*columns).where(session.c.history.isnot(None)),
                                                 session.c.id):
        history = list(history or [])
        parent, start = inherited.get(snap_id, (None, 0)) if snap_id else (None, 0)
        if parent is None or start > len(history):
            parent, start = None, 0
        when = created or datetime.now(UTC)
        rows = [
            {'session_id': sid, 'seq': seq, 'tool': str((h.get('action') or {}).get('tool') or ''),
             'arguments': (h.get('action') or {}).get('arguments') or {}, 'observation': str(h.get('observation') or ''),
             'reward': h.get('reward'), 'terminated': bool(h.get('terminated')), 'truncated': bool(h.get('truncated')),
             'created_at': when}
            for seq, h in enumerate(history) if seq >= start
        ]
        if rows:
            conn.execute(step.insert(), rows)
        if parent is not None:
            conn.execute(session.update().where(session.c.id == sid)
                         .values(parent_session_id=parent, parent_steps=start))

    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.drop_column('history')


def _history(conn, sid: str, cache: dict[str, list]) -> list:
    """Rebuild a session's whole history (inherited steps first) as the old JSON entries."""
    if sid in cache:
        return cache[sid]
    parent, start = conn.execute(
        sa.select(session.c.parent_session_id, session.c.parent_steps).where(session.c.id == sid)).one()
    entries = list(_history(conn, parent, cache)[:start]) if parent else []
    for r in conn.execute(sa.select(step).where(step.c.session_id == sid).order_by(step.c.seq)):
        entries.append({'action': {'tool': r.tool, 'arguments': r.arguments}, 'observation': r.observation,
                        'reward': r.reward, 'terminated': r.terminated, 'truncated': r.truncated})
    cache[sid] = entries
    return entries


def downgrade() -> None:
    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.add_column(sa.Column('history', sa.JSON(), nullable=True))
    conn = op.get_bind()
    cache: dict[str, list] = {}
    stepped = sa.select(session.c.id).where(sa.or_(
        session.c.parent_session_id.isnot(None),
        sa.exists().where(step.c.session_id == session.c.id)))
    for (sid,) in _pages(conn, stepped, session.c.id):
        conn.execute(session.update().where(session.c.id == sid).values(history=_history(conn, sid, cache)))
    for snap_id, source, state in _pages(conn, sa.select(snapshot.c.id, snapshot.c.session_id, snapshot.c.state),
                                         snapshot.c.id):
        state = dict(state or {})
        state['history'] = _history(conn, source, cache)[:int(state.pop('steps', 0) or 0)]
        conn.execute(snapshot.update().where(snapshot.c.id == snap_id).values(state=state))
    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.drop_column('parent_steps')
        batch_op.drop_column('parent_session_id')
    op.drop_table('session_step')

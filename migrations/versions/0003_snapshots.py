"""Snapshots: the snapshot table; session.history and session.snapshot_id.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('snapshot',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('node', sa.String(length=255), nullable=False),
    sa.Column('backend', sa.String(length=32), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('pinned', sa.Boolean(), nullable=False),
    sa.Column('state', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('freed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_snapshot'))
    )
    with op.batch_alter_table('snapshot', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_snapshot_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_snapshot_session_id'), ['session_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_snapshot_task_id'), ['task_id'], unique=False)

    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.add_column(sa.Column('history', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('snapshot_id', sa.String(length=40), nullable=True))
        batch_op.create_index(batch_op.f('ix_session_snapshot_id'), ['snapshot_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_session_snapshot_id'))
        batch_op.drop_column('snapshot_id')
        batch_op.drop_column('history')

    with op.batch_alter_table('snapshot', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_snapshot_task_id'))
        batch_op.drop_index(batch_op.f('ix_snapshot_session_id'))
        batch_op.drop_index(batch_op.f('ix_snapshot_created_at'))

    op.drop_table('snapshot')

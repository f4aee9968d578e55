"""Distributed mode: an episode's dispatch time and the fencing token of the attempt running it;
a node's address (its gRPC channel for the sessions of its sandboxes).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('episode') as batch:
        batch.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('lease', sa.String(length=40), nullable=True))
    with op.batch_alter_table('node') as batch:
        batch.add_column(sa.Column('address', sa.String(length=255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('node') as batch:
        batch.drop_column('address')
    with op.batch_alter_table('episode') as batch:
        batch.drop_column('lease')
        batch.drop_column('dispatched_at')

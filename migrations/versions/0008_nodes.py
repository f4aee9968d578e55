"""Nodes: one row per host that owns sandboxes, with its heartbeat, capacity, load and drain switch.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'node',
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('backend', sa.String(length=32), nullable=False),
        sa.Column('capacity', sa.Integer(), nullable=False),
        sa.Column('load', sa.JSON(), nullable=False),
        sa.Column('heartbeat_s', sa.Double(), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('draining', sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_node')),
    )


def downgrade() -> None:
    op.drop_table('node')

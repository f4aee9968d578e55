"""Sandbox rows for every owner: what a sandbox served (session, episode, group, pool, ...) and for which rollout.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sandbox') as batch:
        batch.add_column(sa.Column('owner_kind', sa.String(length=16), nullable=True))
        batch.add_column(sa.Column('owner_id', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('rollout_id', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sandbox') as batch:
        batch.drop_column('rollout_id')
        batch.drop_column('owner_id')
        batch.drop_column('owner_kind')

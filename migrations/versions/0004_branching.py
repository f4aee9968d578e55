"""Branching: trajectory trees (episode parent, branch turn, root) and the rollout's branching settings.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('rollout', schema=None) as batch_op:
        batch_op.add_column(sa.Column('branching', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('lazy_fork', sa.Boolean(), nullable=False, server_default=sa.true()))

    with op.batch_alter_table('episode', schema=None) as batch_op:
        batch_op.add_column(sa.Column('parent_episode_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('branch_turn', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('root_episode_id', sa.String(length=40), nullable=True))
        batch_op.create_index(batch_op.f('ix_episode_parent_episode_id'), ['parent_episode_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_episode_root_episode_id'), ['root_episode_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('episode', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_episode_root_episode_id'))
        batch_op.drop_index(batch_op.f('ix_episode_parent_episode_id'))
        batch_op.drop_column('root_episode_id')
        batch_op.drop_column('branch_turn')
        batch_op.drop_column('parent_episode_id')

    with op.batch_alter_table('rollout', schema=None) as batch_op:
        batch_op.drop_column('lazy_fork')
        batch_op.drop_column('branching')

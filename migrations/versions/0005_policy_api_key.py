"""Policy credentials: the inference servers' API key of a rollout, kept apart from its policy.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('rollout', schema=None) as batch_op:
        batch_op.add_column(sa.Column('policy_api_key', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('rollout', schema=None) as batch_op:
        batch_op.drop_column('policy_api_key')

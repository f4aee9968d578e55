"""Artifacts: files steps made (screenshots), stored by content; episode steps link theirs.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'artifact',
        sa.Column('id', sa.String(length=48), nullable=False),
        sa.Column('media_type', sa.String(length=100), nullable=False),
        sa.Column('size', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('episode_step') as batch:
        batch.add_column(sa.Column('artifacts', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('episode_step') as batch:
        batch.drop_column('artifacts')
    op.drop_table('artifact')

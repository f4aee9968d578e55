"""Node channel token: the secret a gateway presents on a worker node's channel, written with the node's address.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('node') as batch:
        batch.add_column(sa.Column('channel_token', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('node') as batch:
        batch.drop_column('channel_token')

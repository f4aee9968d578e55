"""Console: key scopes, admin sessions, the audit log and commands queued for nodes.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_key') as batch:
        batch.add_column(sa.Column('scope', sa.String(length=16), nullable=False, server_default='trainer'))
    op.create_table(
        'admin_session',
        sa.Column('id_hash', sa.String(length=64), nullable=False),
        sa.Column('key_id', sa.String(length=40), nullable=False),
        sa.Column('csrf_token', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id_hash'),
    )
    op.create_table(
        'audit_log',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('key_id', sa.String(length=40), nullable=False),
        sa.Column('key_prefix', sa.String(length=16), nullable=False),
        sa.Column('action', sa.String(length=64), nullable=False),
        sa.Column('target', sa.String(length=300), nullable=False),
        sa.Column('detail', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_audit_log_at', 'audit_log', ['at'])
    op.create_table(
        'node_command',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('node', sa.String(length=200), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('args', sa.JSON(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('result', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('done_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_node_command_node_state', 'node_command', ['node', 'state'])
    op.create_index('ix_episode_finished_at', 'episode', ['finished_at'])
    op.create_index('ix_sandbox_state', 'sandbox', ['state'])


def downgrade() -> None:
    op.drop_index('ix_sandbox_state', 'sandbox')
    op.drop_index('ix_episode_finished_at', 'episode')
    op.drop_index('ix_node_command_node_state', 'node_command')
    op.drop_table('node_command')
    op.drop_index('ix_audit_log_at', 'audit_log')
    op.drop_table('audit_log')
    op.drop_table('admin_session')
    with op.batch_alter_table('api_key') as batch:
        batch.drop_column('scope')

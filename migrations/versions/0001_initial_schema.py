"""Initial schema: api_key, environment, task, session, sandbox.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('api_key',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_key')),
    sa.UniqueConstraint('hash', name=op.f('uq_api_key_hash'))
    )
    op.create_table('environment',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('family', sa.Enum('terminal', name='environmentfamily', native_enum=False, length=32), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_environment')),
    sa.UniqueConstraint('name', name=op.f('uq_environment_name'))
    )
    with op.batch_alter_table('environment', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_environment_created_at'), ['created_at'], unique=False)

    op.create_table('task',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('environment_id', sa.String(length=40), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('instruction', sa.Text(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('archive', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['environment_id'], ['environment.id'], name=op.f('fk_task_environment_id_environment')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_task')),
    sa.UniqueConstraint('environment_id', 'name', 'content_hash', name='uq_task_environment_name_hash')
    )
    with op.batch_alter_table('task', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_task_created_at'), ['created_at'], unique=False)
        batch_op.create_index('ix_task_environment_id_name', ['environment_id', 'name'], unique=False)

    op.create_table('session',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('state', sa.Enum('open', 'terminated', 'closed', 'failed', name='sessionstate',
                               native_enum=False, length=16), nullable=False),
    sa.Column('node', sa.String(length=255), nullable=False),
    sa.Column('sandbox_id', sa.String(length=128), nullable=True),
    sa.Column('backend', sa.String(length=32), nullable=True),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('reward', sa.Double(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['task_id'], ['task.id'], name=op.f('fk_session_task_id_task')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_session'))
    )
    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_session_created_at'), ['created_at'], unique=False)
        batch_op.create_index('ix_session_node_state', ['node', 'state'], unique=False)
        batch_op.create_index(batch_op.f('ix_session_task_id'), ['task_id'], unique=False)

    op.create_table('sandbox',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('node', sa.String(length=255), nullable=False),
    sa.Column('backend', sa.String(length=32), nullable=False),
    sa.Column('state', sa.Enum('starting', 'ready', 'busy', 'stopping', 'gone', 'failed', name='sandboxstate',
                               native_enum=False, length=16), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=True),
    sa.Column('task_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('gone_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['session_id'], ['session.id'], name=op.f('fk_sandbox_session_id_session')),
    sa.ForeignKeyConstraint(['task_id'], ['task.id'], name=op.f('fk_sandbox_task_id_task')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sandbox'))
    )
    with op.batch_alter_table('sandbox', schema=None) as batch_op:
        batch_op.create_index('ix_sandbox_node_gone_at', ['node', 'gone_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_sandbox_session_id'), ['session_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('sandbox', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sandbox_session_id'))
        batch_op.drop_index('ix_sandbox_node_gone_at')

    op.drop_table('sandbox')
    with op.batch_alter_table('session', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_session_task_id'))
        batch_op.drop_index('ix_session_node_state')
        batch_op.drop_index(batch_op.f('ix_session_created_at'))

    op.drop_table('session')
    with op.batch_alter_table('task', schema=None) as batch_op:
        batch_op.drop_index('ix_task_environment_id_name')
        batch_op.drop_index(batch_op.f('ix_task_created_at'))

    op.drop_table('task')
    with op.batch_alter_table('environment', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_environment_created_at'))

    op.drop_table('environment')
    op.drop_table('api_key')

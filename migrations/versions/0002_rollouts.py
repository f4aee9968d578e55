"""Rollouts: policy, rollout, episode_group, episode, episode_step, delivery_consumer, delivery_lease.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('policy',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('paused', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_policy'))
    )
    op.create_table('rollout',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('status', sa.Enum('queued', 'running', 'completed', 'cancelled', 'failed',
                        name='rolloutstatus', native_enum=False, length=16), nullable=False),
    sa.Column('policy_name', sa.String(length=200), nullable=False),
    sa.Column('group_size', sa.Integer(), nullable=False),
    sa.Column('task_ids', sa.JSON(), nullable=False),
    sa.Column('policy', sa.JSON(), nullable=False),
    sa.Column('agent', sa.JSON(), nullable=False),
    sa.Column('limits', sa.JSON(), nullable=False),
    sa.Column('max_staleness', sa.Integer(), nullable=True),
    sa.Column('staleness_action', sa.Enum('rerun', 'dead_letter',
                                  name='stalenessaction', native_enum=False, length=16), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('group_mode', sa.Enum('complete', 'early',
                            name='groupmode', native_enum=False, length=16), nullable=False),
    sa.Column('min_group_size', sa.Integer(), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('concurrency', sa.Integer(), nullable=False),
    sa.Column('last_seq', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rollout'))
    )
    with op.batch_alter_table('rollout', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rollout_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_rollout_policy_name'), ['policy_name'], unique=False)
        batch_op.create_index('ix_rollout_status_priority', ['status', 'priority'], unique=False)

    op.create_table('delivery_consumer',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('last_delivered_seq', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollout.id'], name=op.f('fk_delivery_consumer_rollout_id_rollout')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_delivery_consumer')),
    sa.UniqueConstraint('rollout_id', 'name', name='uq_delivery_consumer_rollout_name')
    )
    op.create_table('episode_group',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollout.id'], name=op.f('fk_episode_group_rollout_id_rollout')),
    sa.ForeignKeyConstraint(['task_id'], ['task.id'], name=op.f('fk_episode_group_task_id_task')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_episode_group'))
    )
    with op.batch_alter_table('episode_group', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_episode_group_rollout_id'), ['rollout_id'], unique=False)

    op.create_table('episode',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=40), nullable=False),
    sa.Column('group_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('task_index', sa.Integer(), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('queued', 'running', 'completed', 'truncated', 'failed', 'stale',
                        name='episodestatus', native_enum=False, length=16), nullable=False),
    sa.Column('termination', sa.Enum('submitted', 'max_turns', 'timeout', 'error', 'stale', 'cancelled',
                             name='termination', native_enum=False, length=16), nullable=True),
    sa.Column('reward', sa.Double(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('messages', sa.JSON(), nullable=False),
    sa.Column('timings', sa.JSON(), nullable=False),
    sa.Column('weight_versions', sa.JSON(), nullable=False),
    sa.Column('info', sa.JSON(), nullable=False),
    sa.Column('num_turns', sa.Integer(), nullable=False),
    sa.Column('node', sa.String(length=255), nullable=True),
    sa.Column('seq', sa.Integer(), nullable=True),
    sa.Column('dead_letter_reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['group_id'], ['episode_group.id'], name=op.f('fk_episode_group_id_episode_group')),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollout.id'], name=op.f('fk_episode_rollout_id_rollout')),
    sa.ForeignKeyConstraint(['task_id'], ['task.id'], name=op.f('fk_episode_task_id_task')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_episode')),
    sa.UniqueConstraint('rollout_id', 'seq', name='uq_episode_rollout_seq')
    )
    with op.batch_alter_table('episode', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_episode_created_at'), ['created_at'], unique=False)
        batch_op.create_index('ix_episode_group_sample', ['group_id', 'sample_index'], unique=False)
        batch_op.create_index('ix_episode_rollout_status', ['rollout_id', 'status'], unique=False)

    op.create_table('delivery_lease',
    sa.Column('consumer_id', sa.String(length=40), nullable=False),
    sa.Column('episode_id', sa.String(length=40), nullable=False),
    sa.Column('rollout_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('state', sa.Enum('pending', 'acked', 'dropped',
                       name='deliverystate', native_enum=False, length=16), nullable=False),
    sa.Column('delivery_count', sa.Integer(), nullable=False),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('first_delivered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_delivered_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('acked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['consumer_id'], ['delivery_consumer.id'],
                            name=op.f('fk_delivery_lease_consumer_id_delivery_consumer')),
    sa.ForeignKeyConstraint(['episode_id'], ['episode.id'], name=op.f('fk_delivery_lease_episode_id_episode')),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollout.id'], name=op.f('fk_delivery_lease_rollout_id_rollout')),
    sa.PrimaryKeyConstraint('consumer_id', 'episode_id', name=op.f('pk_delivery_lease'))
    )
    with op.batch_alter_table('delivery_lease', schema=None) as batch_op:
        batch_op.create_index('ix_delivery_lease_consumer_state_expiry',
                              ['consumer_id', 'state', 'lease_expires_at'], unique=False)
        batch_op.create_index('ix_delivery_lease_rollout_state', ['rollout_id', 'state'], unique=False)

    op.create_table('episode_step',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('episode_id', sa.String(length=40), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('parent_index', sa.Integer(), nullable=True),
    sa.Column('prompt_ids', sa.JSON(), nullable=False),
    sa.Column('completion_ids', sa.JSON(), nullable=False),
    sa.Column('logprobs', sa.JSON(), nullable=True),
    sa.Column('weight_version', sa.Integer(), nullable=True),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('action', sa.JSON(), nullable=True),
    sa.Column('parse_error', sa.Text(), nullable=True),
    sa.Column('observation', sa.Text(), nullable=False),
    sa.Column('reward', sa.Double(), nullable=True),
    sa.Column('timings', sa.JSON(), nullable=False),
    sa.Column('server', sa.String(length=500), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['episode_id'], ['episode.id'], name=op.f('fk_episode_step_episode_id_episode')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_episode_step')),
    sa.UniqueConstraint('episode_id', 'step_index', name='uq_episode_step_episode_index')
    )


def downgrade() -> None:
    op.drop_table('episode_step')
    with op.batch_alter_table('delivery_lease', schema=None) as batch_op:
        batch_op.drop_index('ix_delivery_lease_rollout_state')
        batch_op.drop_index('ix_delivery_lease_consumer_state_expiry')

    op.drop_table('delivery_lease')
    with op.batch_alter_table('episode', schema=None) as batch_op:
        batch_op.drop_index('ix_episode_rollout_status')
        batch_op.drop_index('ix_episode_group_sample')
        batch_op.drop_index(batch_op.f('ix_episode_created_at'))

    op.drop_table('episode')
    with op.batch_alter_table('episode_group', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_episode_group_rollout_id'))

    op.drop_table('episode_group')
    op.drop_table('delivery_consumer')
    with op.batch_alter_table('rollout', schema=None) as batch_op:
        batch_op.drop_index('ix_rollout_status_priority')
        batch_op.drop_index(batch_op.f('ix_rollout_policy_name'))
        batch_op.drop_index(batch_op.f('ix_rollout_created_at'))

    op.drop_table('rollout')
    op.drop_table('policy')

"""Typed outcomes: an episode's outcome, partial groups and their reason, a rollout's group_spare.

Existing rows get the outcome their status and info say: completed and truncated episodes ``reward``,
failed ones marked ``info.infra`` ``infra``; other failures keep none (they were never retried).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-08
"""

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OUTCOMES = ('reward', 'verifier_error', 'policy_error', 'infra')


def upgrade() -> None:
    with op.batch_alter_table('episode') as batch:
        batch.add_column(sa.Column('outcome', sa.Enum(*OUTCOMES, name='episodeoutcome', native_enum=False, length=16),
                                   nullable=True))
    with op.batch_alter_table('episode_group') as batch:
        batch.add_column(sa.Column('partial', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column('partial_reason', sa.Text(), nullable=True))
    with op.batch_alter_table('rollout') as batch:
        batch.add_column(sa.Column('group_spare', sa.Integer(), nullable=False, server_default='0'))
    episode = sa.table('episode', sa.column('id', sa.String), sa.column('status', sa.String),
                       sa.column('info', sa.JSON), sa.column('outcome', sa.String))
    op.execute(episode.update().where(episode.c.status.in_(['completed', 'truncated'])).values(outcome='reward'))
    connection = op.get_bind()
    failed = connection.execute(sa.select(episode.c.id, episode.c.info).where(episode.c.status == 'failed')).all()
    infra = [episode_id for episode_id, info in failed
             if (json.loads(info) if isinstance(info, str) else info or {}).get('infra') is True]
    for start in range(0, len(infra), 1000):
        op.execute(episode.update().where(episode.c.id.in_(infra[start:start + 1000])).values(outcome='infra'))


def downgrade() -> None:
    with op.batch_alter_table('rollout') as batch:
        batch.drop_column('group_spare')
    with op.batch_alter_table('episode_group') as batch:
        batch.drop_column('partial_reason')
        batch.drop_column('partial')
    with op.batch_alter_table('episode') as batch:
        batch.drop_column('outcome')

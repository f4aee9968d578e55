"""Environment families become plugins: the family is a registry name, and each task row carries it.

``environment.family`` was an enum of the built-in families; it is now a plain string
checked against the worker's family registry when an environment is created, so a
family from a third-party package needs no migration. ``task.family`` lets a worker
decode a stored task without reading its environment; existing rows take their
environment's family.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('environment') as batch:
        batch.alter_column('family', existing_type=sa.Enum('terminal', name='environmentfamily', native_enum=False,
                                                           length=32),
                           type_=sa.String(length=32), existing_nullable=False)
    with op.batch_alter_table('task') as batch:
        batch.add_column(sa.Column('family', sa.String(length=32), nullable=True))
    environment = sa.table('environment', sa.column('id', sa.String), sa.column('family', sa.String))
    task = sa.table('task', sa.column('environment_id', sa.String), sa.column('family', sa.String))
    op.execute(task.update().values(family=sa.select(environment.c.family)
                                    .where(environment.c.id == task.c.environment_id).scalar_subquery()))
    with op.batch_alter_table('task') as batch:
        batch.alter_column('family', existing_type=sa.String(length=32), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table('task') as batch:
        batch.drop_column('family')
    with op.batch_alter_table('environment') as batch:
        batch.alter_column('family', existing_type=sa.String(length=32),
                           type_=sa.Enum('terminal', name='environmentfamily', native_enum=False, length=32),
                           existing_nullable=False)

"""Alembic environment for the gateway database (sync drivers; batch mode so SQLite can ALTER)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

import gateway.models  # noqa: F401  (fills Base.metadata)
from gateway.db import Base, sync_database_url

config = context.config

if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name)

target_metadata = Base.metadata


def database_url() -> str:
    """Return the URL to migrate: set by the caller, else alembic.ini, else the gateway settings."""
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from gateway.settings import Settings

        url = Settings().database_url
    return sync_database_url(url)


def run_migrations_offline() -> None:
    """Emit the SQL of the migrations without a database connection."""
    context.configure(
        url=database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on a live connection."""
    url = database_url()
    from gateway.db import ensure_sqlite_dir

    ensure_sqlite_dir(url)
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

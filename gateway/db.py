"""Database plumbing: the declarative base, the async engine, IDs, timestamps and migrations.

The gateway talks to the database through SQLAlchemy's asyncio layer (aiosqlite for
SQLite, psycopg 3 for PostgreSQL); Alembic runs on the matching sync driver, and so does
the :class:`RecordWriter` (the records written behind answers, in a thread of its own).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from sqlalchemy import JSON, DateTime, MetaData, event
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.types import TypeDecorator

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The Alembic script directory (``migrations/`` beside the ``gateway`` package).
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def utcnow() -> datetime:
    """Return the current time as an aware UTC datetime."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """Return a fresh random ID such as ``task_3f2a9c1d0b4e5f6a7b8c9d0e``."""
    return f"{prefix}_{secrets.token_hex(12)}"


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        # SQLite has no timezone-aware type: keep naive UTC so string comparison orders correctly.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


#: Constraint names fixed by convention, so later (batch) migrations can name what they alter.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of every gateway table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


def async_database_url(url: str) -> str:
    """Return ``url`` with the asyncio driver the gateway uses (aiosqlite / psycopg)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False)
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise ValueError(f"unsupported database URL scheme {parsed.drivername!r}; use sqlite:// or postgresql://")


def sync_database_url(url: str) -> str:
    """Return ``url`` with the sync driver Alembic uses (pysqlite / psycopg)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return parsed.set(drivername="sqlite").render_as_string(hide_password=False)
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise ValueError(f"unsupported database URL scheme {parsed.drivername!r}; use sqlite:// or postgresql://")


def redact_database_url(url: str) -> str:
    """Return ``url`` with any password hidden, for logs."""
    return make_url(url).render_as_string(hide_password=True)


def ensure_sqlite_dir(url: str) -> None:
    """Create the directory of a file-backed SQLite database if it is missing."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the one writer; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    # WAL with synchronous=NORMAL never corrupts the database; a power loss (not a crash of
    # the process) may lose the last commits. FULL cost a step ~0.3 ms per commit here.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def create_engine(url: str) -> AsyncEngine:
    """Build the async engine for ``url`` (SQLite gets WAL, foreign keys and a busy timeout)."""
    ensure_sqlite_dir(url)
    aurl = async_database_url(url)
    if make_url(aurl).get_backend_name() == "sqlite":
        engine = create_async_engine(aurl, connect_args={"timeout": 30})
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    return create_async_engine(aurl, pool_pre_ping=True)


class RecordWriter:
    """Runs the records written behind answers (steps, snapshots, forks) on a sync engine, in one thread of its own.

    Through the asyncio layer, each statement on SQLite hops to aiosqlite's thread and back
    (a cursor, the statement, the commit, the pool's reset: 4 to 6 hops), and the ORM's and
    driver's work runs on the event loop: one snapshot row cost ~0.7 ms of CPU here, most
    of it beside the next request. Here a record is one hop and ~0.25 ms, off the loop.
    The thread runs one record at a time, in the order they come (the gate orders each
    session's); a fork reads its node's drain flag here too, beside its restore. Its
    engine is the database's own: readers of the async engine see a record once
    :meth:`run` has returned.
    """

    def __init__(self, url: str) -> None:
        from sqlalchemy import create_engine as create_sync_engine

        ensure_sqlite_dir(url)
        sqlite = make_url(url).get_backend_name() == "sqlite"
        if sqlite and make_url(url).database in (None, "", ":memory:"):
            raise ValueError("the gateway's SQLite database must be a file (an in-memory one is not shared)")
        self._engine = create_sync_engine(sync_database_url(url), **({} if sqlite else {"pool_pre_ping": True}))
        if sqlite:
            event.listen(self._engine, "connect", _sqlite_pragmas)
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="forkyard-records")

    async def run(self, work: Callable[[Session], T]) -> T:
        """Run ``work`` in one transaction of the writer's thread (committed if it returns); return its result.

        Cancelling the caller does not stop a record that started: it is written all the same.
        """
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._in_transaction, work)

    def _in_transaction(self, work: Callable[[Session], T]) -> T:
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            return work(session)

    def close(self) -> None:
        """Wait for the records under way, then close the engine's connections (blocking)."""
        self._thread.shutdown(wait=True)
        self._engine.dispose()


async def write_records(db: AsyncSession | RecordWriter, work: Callable[[Session], T]) -> T:
    """Run the sync record function ``work`` in one transaction: the gate's writer's, or the request's ``db``.

    The records written behind an answer go to the writer; written before it (no writer: a
    gate outside the app, or the app shutting down), they use the request's session.
    """
    if isinstance(db, RecordWriter):
        return await db.run(work)
    result = await db.run_sync(work)
    await db.commit()
    return result


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Return the session factory the request dependency uses."""
    return async_sessionmaker(engine, expire_on_commit=False)


#: The key of a request's database session in its ASGI scope's state (closed by RequestIdMiddleware).
REQUEST_DB_SESSION = "forkyard_db_session"


async def get_db_session(request: Request) -> AsyncSession:
    """Return the request's database session (FastAPI dependency); the middleware closes it after the response.

    Not a ``yield`` dependency: FastAPI's exit stack for one cost about a quarter of the
    gateway's own time on a session step.
    """
    state = request.scope.setdefault("state", {})
    db_session = state.get(REQUEST_DB_SESSION)
    if db_session is None:
        db_session = state[REQUEST_DB_SESSION] = request.app.state.sessionmaker()
    return db_session


async def close_request_db_session(state: dict) -> None:
    """Close the database session a request opened, if any (its connection goes back to the pool)."""
    db_session = state.pop(REQUEST_DB_SESSION, None)
    if db_session is not None:
        await asyncio.shield(db_session.close())


# --- migrations -------------------------------------------------------------------


def alembic_config(url: str):  # -> alembic.config.Config
    """Return an Alembic config for ``url`` that does not touch logging."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = sync_database_url(url)
    cfg.attributes["configure_logging"] = False
    return cfg


def upgrade_database(url: str) -> None:
    """Run ``alembic upgrade head`` on ``url`` (blocking)."""
    from alembic import command

    ensure_sqlite_dir(url)
    logger.info("migrating database %s to head", redact_database_url(url))
    command.upgrade(alembic_config(url), "head")


def database_revisions(url: str) -> tuple[set[str], set[str]]:
    """Return (the revisions the database is at, the head revisions of the scripts) (blocking)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine as create_sync_engine

    heads = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    engine = create_sync_engine(sync_database_url(url))
    try:
        with engine.connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
    return current, heads


def check_database(url: str) -> None:
    """Raise RuntimeError unless the database at ``url`` is migrated to head (blocking)."""
    current, heads = database_revisions(url)
    if current != heads:
        raise RuntimeError(
            f"database {redact_database_url(url)} is at revision {sorted(current) or 'none'}, not at head "
            f"{sorted(heads)}; run `alembic upgrade head` or enable FORKYARD_AUTO_MIGRATE"
        )

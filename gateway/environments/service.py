"""Create, find and list environments."""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import new_id, utcnow
from gateway.environments.models import Environment
from gateway.environments.schemas import EnvironmentCreate, EnvironmentRead
from gateway.errors import ConflictError, InvalidRequestError, NotFoundError
from gateway.pagination import page_of, paginate
from workers.envs.base import openai_tools
from workers.envs.registry import family_names, get_family

logger = logging.getLogger(__name__)

#: The environments every gateway has, one per built-in family; tasks land in ``terminal`` unless told otherwise.
DEFAULT_ENVIRONMENTS = (
    EnvironmentCreate(
        name="terminal", family="terminal", version="1",
        description="Terminal tasks (Harbor/Terminal-Bench style task directories) driven through bash and submit.",
    ),
    EnvironmentCreate(
        name="swe", family="swe", version="1",
        description="SWE-bench-style instances (JSONL) on repositories of the repository store, graded by their tests.",
    ),
    EnvironmentCreate(
        name="web", family="web", version="1",
        description="Web tasks (a site served in the sandbox) in headless Chromium, driven by BrowserGym-style actions.",
    ),
)


async def create_environment(*, db_session: AsyncSession, spec: EnvironmentCreate) -> Environment:
    """Create an environment; raise ConflictError if the name is taken, InvalidRequestError if the family is unknown."""
    if spec.family not in family_names():
        raise InvalidRequestError(
            f"Unknown environment family {spec.family!r}; the families this gateway's workers run are: "
            f"{', '.join(family_names())}.", code="unknown_family",
        )
    row = Environment(
        id=new_id("env"), name=spec.name, family=spec.family, version=spec.version,
        description=spec.description, created_at=utcnow(),
    )
    db_session.add(row)
    try:
        await db_session.commit()
    except IntegrityError as exc:
        await db_session.rollback()
        raise ConflictError(f"An environment named {spec.name!r} already exists.") from exc
    return row


async def ensure_default_environments(*, db_session: AsyncSession) -> None:
    """Create the default environments (``terminal``, ``swe``, ``web``) that are missing."""
    for spec in DEFAULT_ENVIRONMENTS:
        if await get_environment_by_name(db_session=db_session, name=spec.name) is None:
            try:
                await create_environment(db_session=db_session, spec=spec)
            except ConflictError:
                pass  # another gateway created it at the same time


async def get_environment(*, db_session: AsyncSession, environment_id: str) -> Environment:
    """Return the environment with this id; raise NotFoundError if there is none."""
    row = await db_session.get(Environment, environment_id)
    if row is None:
        raise NotFoundError(f"Environment {environment_id!r} does not exist.")
    return row


async def get_environment_by_name(*, db_session: AsyncSession, name: str) -> Environment | None:
    """Return the environment named ``name`` or None."""
    return await db_session.scalar(select(Environment).where(Environment.name == name))


async def list_environments(
    *, db_session: AsyncSession, limit: int, cursor: str | None = None
) -> tuple[list[Environment], str | None]:
    """Return one page of environments, oldest first, and the next cursor."""
    stmt = paginate(select(Environment), created_at=Environment.created_at, id_=Environment.id,
                    cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).all())
    return page_of(rows, limit=limit)


def environment_read(row: Environment) -> EnvironmentRead:
    """Return the API view of an environment, with its family's tools (none if no worker here knows it)."""
    read = EnvironmentRead.model_validate(row)
    if row.family in family_names():
        read.tools = openai_tools(get_family(row.family).tools)
    return read

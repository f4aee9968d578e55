"""Import, find and list tasks; decode a stored task for the workers."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import new_id, utcnow
from gateway.environments.models import Environment
from gateway.environments.service import get_environment_by_name
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.pagination import page_of, paginate
from gateway.tasks.models import Task
from workers.envs.base import EnvFamily, EnvTask
from workers.envs.registry import family_names, family_of, get_family

logger = logging.getLogger(__name__)


async def _resolve_environment(db_session: AsyncSession, name: str) -> Environment:
    env = await get_environment_by_name(db_session=db_session, name=name)
    if env is None:
        raise InvalidRequestError(f"Environment {name!r} does not exist; create it with POST /v1/environments first.")
    return env


def _family(name: str) -> EnvFamily:
    if name not in family_names():
        raise InvalidRequestError(
            f"Environment family {name!r} is not installed beside this gateway (it has: {', '.join(family_names())}).",
            code="unknown_family",
        )
    return get_family(name)


async def environment_family(*, db_session: AsyncSession, name: str) -> EnvFamily:
    """Return the family of the environment named ``name``, which reads tasks imported into it.

    Raises:
        InvalidRequestError: no such environment, or its family is not installed here.
    """
    return _family((await _resolve_environment(db_session, name)).family)


def check_task_resources(
    tasks: Sequence[tuple[str, EnvTask]], *, max_cpus: float, max_memory_mb: int, max_disk_mb: int | None = None
) -> None:
    """Refuse a task whose sandbox would ask for more than one sandbox may have here.

    Raises:
        InvalidRequestError: names the task, the field and the limit (code ``resources_exceeded``).
    """
    for _, task in tasks:
        for field, wanted, limit, unit in (
            ("environment.cpus", task.cpus, max_cpus, " CPUs"),
            ("environment.memory_mb", task.memory_mb, max_memory_mb, " MiB"),
            ("environment.storage_mb", task.disk_mb, max_disk_mb if max_disk_mb is not None else math.inf, " MiB"),
        ):
            if wanted > limit:
                raise InvalidRequestError(
                    f"Task {task.name!r}: task.toml {field} asks for {wanted:g}{unit}, more than the "
                    f"{limit:g}{unit} one sandbox may have on this gateway (FORKYARD_SANDBOX_LIMITS).",
                    code="resources_exceeded",
                )


async def import_tasks(*, db_session: AsyncSession, tasks: Sequence[tuple[str, EnvTask]]) -> list[Task]:
    """Store each (environment name, task), reusing an identical task already stored; return them in order.

    Raises:
        InvalidRequestError: an environment does not exist, or is of another family than its task.
    """
    archives = await asyncio.to_thread(lambda: [family_of(task).encode_task(task) for _, task in tasks])
    for attempt in range(2):
        try:
            return await _import_once(db_session, tasks, archives)
        except IntegrityError:
            # A concurrent import stored the same task first; the retry finds it.
            await db_session.rollback()
            if attempt:
                raise
    raise AssertionError("unreachable")


async def _import_once(
    db_session: AsyncSession, tasks: Sequence[tuple[str, EnvTask]], archives: list[bytes]
) -> list[Task]:
    envs: dict[str, Environment] = {}
    result: list[Task] = []
    seen: dict[tuple[str, str, str], Task] = {}
    created = 0
    for (env_name, task), archive in zip(tasks, archives, strict=True):
        if env_name not in envs:
            envs[env_name] = await _resolve_environment(db_session, env_name)
        env = envs[env_name]
        if task.family != env.family:
            raise InvalidRequestError(
                f"Task {task.name!r} is a {task.family} task; environment {env_name!r} is of family {env.family!r}."
            )
        key = (env.id, task.name, task.content_hash)
        row = seen.get(key)
        if row is None:
            row = await db_session.scalar(
                select(Task).where(
                    Task.environment_id == env.id, Task.name == task.name, Task.content_hash == task.content_hash
                )
            )
        if row is None:
            row = Task(
                id=new_id("task"), name=task.name, environment_id=env.id, family=task.family,
                content_hash=task.content_hash,
                instruction=task.instruction, meta=dict(task.metadata), archive=archive, created_at=utcnow(),
            )
            row.environment = env
            db_session.add(row)
            created += 1
        seen[key] = row
        result.append(row)
    await db_session.commit()
    logger.info("imported %d task(s) (%d new)", len(result), created)
    return result


async def get_task(*, db_session: AsyncSession, task_id: str) -> Task:
    """Return the task with this id; raise NotFoundError if there is none."""
    row = await db_session.get(Task, task_id)
    if row is None:
        raise NotFoundError(f"Task {task_id!r} does not exist.")
    return row


async def list_tasks(
    *, db_session: AsyncSession, environment: str | None = None, name: str | None = None,
    limit: int, cursor: str | None = None,
) -> tuple[list[Task], str | None]:
    """Return one page of tasks (oldest first), filtered by environment name and task name."""
    stmt = select(Task)
    if environment is not None:
        stmt = stmt.join(Environment, Task.environment_id == Environment.id).where(Environment.name == environment)
    if name is not None:
        stmt = stmt.where(Task.name == name)
    stmt = paginate(stmt, created_at=Task.created_at, id_=Task.id, cursor=cursor, limit=limit)
    rows = list((await db_session.scalars(stmt)).unique().all())
    return page_of(rows, limit=limit)


class DecodedTasks:
    """Decoded tasks by id, the least recently used dropped past a budget of archive bytes.

    A task row never changes (it is content-hashed), so a decoded task stays right for
    as long as it is kept: opening, forking or dispatching one again neither reads its
    archive from the database nor unpacks it.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._tasks: OrderedDict[str, tuple[EnvTask, int]] = OrderedDict()
        self._bytes = 0

    def get(self, task_id: str) -> EnvTask | None:
        """Return the decoded task, or None if it is not kept."""
        found = self._tasks.get(task_id)
        if found is None:
            return None
        self._tasks.move_to_end(task_id)
        return found[0]

    def put(self, task_id: str, task: EnvTask, size: int) -> None:
        """Keep ``task`` (its archive ``size`` bytes), dropping the least recently used past the budget."""
        if size > self.max_bytes or task_id in self._tasks:
            return
        self._tasks[task_id] = (task, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, dropped) = self._tasks.popitem(last=False)
            self._bytes -= dropped


#: The process's decoded tasks (their ids are random, so databases never share one).
decoded_tasks = DecodedTasks()


async def load_task(*, db_session: AsyncSession, task_id: str) -> EnvTask:
    """Return the task the workers run for a stored task, decoded by its family once per process.

    Raises:
        NotFoundError: no such task.
        InvalidRequestError: its family is not installed here.
    """
    task = decoded_tasks.get(task_id)
    if task is not None:
        return task
    found = (await db_session.execute(select(Task.family, Task.archive).where(Task.id == task_id))).first()
    if found is None:
        raise NotFoundError(f"Task {task_id!r} does not exist.")
    family_name, archive = found
    task = await asyncio.to_thread(_family(family_name).decode_task, archive)
    decoded_tasks.put(task_id, task, len(archive))
    return task

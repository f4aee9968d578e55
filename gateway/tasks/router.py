"""``/v1/tasks`` routes: import (tar, multipart or JSON), list, get."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from gateway.dependencies import CurrentSettings, DbSession
from gateway.errors import BadRequestError, UnsupportedMediaTypeError
from gateway.pagination import DEFAULT_LIMIT, MAX_LIMIT
from gateway.tasks import service
from gateway.tasks.schemas import TaskImport, TaskList, TaskPage, TaskRead
from workers.envs.base import EnvFamily, EnvTask

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/tasks", tags=["tasks"])

#: Content types read in the environment family's import format: a (possibly compressed) tar
#: of task directories for terminal, JSONL instances for swe.
UPLOAD_TYPES = frozenset({
    "application/x-tar", "application/tar", "application/gzip", "application/x-gzip", "application/x-gtar",
    "application/x-compressed-tar", "application/octet-stream",
    "application/x-ndjson", "application/jsonl", "application/json-lines", "application/x-jsonlines",
})

def _inline_schema(model: type) -> dict:
    """Return the model's JSON schema with its ``$defs`` inlined (OpenAPI has no room for them)."""
    schema = model.model_json_schema()  # type: ignore[attr-defined]
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


_IMPORT_BODY = {
    "requestBody": {
        "required": True,
        "description": "Tasks in their environment's format (terminal: a tar(.gz) of one or more task dirs; "
                       "swe: JSONL instances), a multipart upload of such files, or a JSON list of specs.",
        "content": {
            "application/json": {"schema": _inline_schema(TaskImport)},
            "application/gzip": {"schema": {"type": "string", "format": "binary"}},
            "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
            "application/x-ndjson": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}}}
            },
        },
    }
}


async def _tasks_from_upload(family: EnvFamily, data: bytes) -> list[EnvTask]:
    return await asyncio.to_thread(family.parse_tasks, data)


async def _parse_import(request: Request, db_session: DbSession, environment: str) -> list[tuple[str, EnvTask]]:
    """Read the upload in whichever of the three forms it came, each task by its environment's family."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "application/json":
        try:
            spec = TaskImport.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc
        families: dict[str, EnvFamily] = {}
        for item in spec.tasks:
            if item.environment not in families:
                families[item.environment] = await service.environment_family(
                    db_session=db_session, name=item.environment)
        return [
            (item.environment, families[item.environment].load_task(
                item.name, {path: text.encode() for path, text in item.files.items()}))
            for item in spec.tasks
        ]
    if content_type in UPLOAD_TYPES:
        body = await request.body()
        if not body:
            raise BadRequestError("The request body is empty; send the tasks in their environment's import format "
                                  "(a tar or tar.gz of task directories for terminal environments).")
        family = await service.environment_family(db_session=db_session, name=environment)
        return [(environment, task) for task in await _tasks_from_upload(family, body)]
    if content_type == "multipart/form-data":
        family = await service.environment_family(db_session=db_session, name=environment)
        async with request.form() as form:
            uploads = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
            if not uploads:
                raise BadRequestError("The multipart upload holds no file; attach a tar or tar.gz as a file field.")
            found: list[tuple[str, EnvTask]] = []
            for upload in uploads:
                found.extend((environment, task) for task in await _tasks_from_upload(family, await upload.read()))
        return found
    raise UnsupportedMediaTypeError(
        f"Content-Type {content_type or '(none)'!r} is not accepted; send application/json, "
        "application/gzip, application/x-tar, application/x-ndjson (JSONL) or multipart/form-data."
    )


@router.post("", status_code=201, response_model=TaskList, openapi_extra=_IMPORT_BODY)
async def import_tasks(
    request: Request,
    db_session: DbSession,
    settings: CurrentSettings,
    environment: str = Query("terminal", description="Environment of tasks uploaded as archives."),
):
    """Import tasks; an identical task already stored is returned rather than duplicated."""
    tasks = await _parse_import(request, db_session, environment)
    limits = settings.sandbox_limits
    service.check_task_resources(
        tasks, max_cpus=limits.max_cpus, max_memory_mb=limits.max_memory_mb, max_disk_mb=limits.max_disk_mb
    )
    rows = await service.import_tasks(db_session=db_session, tasks=tasks)
    items = []
    for row, (_, task) in zip(rows, tasks, strict=True):
        if task.warnings:
            logger.info("task %s (%s): %s", task.name, row.id, "; ".join(task.warnings))
        items.append(TaskRead.from_row(row).model_copy(update={"warnings": list(task.warnings)}))
    return TaskList(items=items)


@router.get("", response_model=TaskPage)
async def list_tasks(
    db_session: DbSession,
    environment: str | None = None,
    name: str | None = None,
    limit: int = Query(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT),
    cursor: str | None = None,
):
    """List tasks, oldest first, optionally of one environment or name."""
    rows, next_cursor = await service.list_tasks(
        db_session=db_session, environment=environment or None, name=name or None, limit=limit,
        cursor=cursor or None,
    )
    return TaskPage(items=[TaskRead.from_row(r) for r in rows], next=next_cursor)


@router.get("/{task_id}", response_model=TaskRead)
async def get_task(task_id: str, db_session: DbSession):
    """Return one task."""
    return TaskRead.from_row(await service.get_task(db_session=db_session, task_id=task_id))

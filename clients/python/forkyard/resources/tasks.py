"""client.tasks: import and look up tasks."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._archive import find_task_dirs, pack_task_dirs
from .._base_client import RequestOptions
from .._models import Page, Task
from .._pagination import DEFAULT_PAGE_SIZE, AsyncPager, Pager, PageRequest
from ._resource import Resource, items_of, path_id

if TYPE_CHECKING:
    from .._base_client import AsyncRequester, SyncRequester

__all__ = ["Tasks", "AsyncTasks"]

DEFAULT_ENVIRONMENT = "terminal"
SWE_ENVIRONMENT = "swe"
JSONL_TYPE = "application/x-ndjson"


def _import_jsonl_request(
    source: str | os.PathLike[str] | bytes, environment: str
) -> RequestOptions[list[Task]]:
    data = bytes(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb").read()  # noqa: SIM115
    if not data.strip():
        raise ValueError("import_jsonl needs at least one instance (one JSON object per line).")
    return RequestOptions(
        "POST",
        "/v1/tasks",
        params={"environment": environment},
        content=data,
        headers={"Content-Type": JSONL_TYPE},
        cast_to=Page[Task],
        transform=items_of,
        idempotent=True,  # an identical re-import returns the stored tasks
    )


def _import_dir_request(path: str | os.PathLike[str], environment: str) -> RequestOptions[list[Task]]:
    archive = pack_task_dirs(find_task_dirs(path))
    return RequestOptions(
        "POST",
        "/v1/tasks",
        params={"environment": environment},
        content=archive,
        headers={"Content-Type": "application/gzip"},
        cast_to=Page[Task],
        transform=items_of,
        # The gateway returns the existing task for an identical re-import, so resending is safe.
        idempotent=True,
    )


def _file_text(task: str, path: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (bytes, bytearray)):
        try:
            return bytes(content).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"Task {task!r}: file {path!r} is not UTF-8 text; upload binary files with import_dir."
            ) from None
    raise TypeError(f"Task {task!r}: file {path!r} must be str or bytes, got {type(content).__name__}.")


def _import_specs_request(specs: Iterable[Mapping[str, Any]], environment: str) -> RequestOptions[list[Task]]:
    tasks = []
    for index, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec.get("name"):
            raise ValueError(f"Task spec #{index} needs a non-empty string 'name'.")
        name = spec["name"]
        files = spec.get("files")
        if not isinstance(files, Mapping) or not files:
            raise ValueError(f"Task spec {name!r} needs a non-empty 'files' mapping of path -> text.")
        task = dict(spec)
        task.setdefault("environment", environment)
        task["files"] = {str(path): _file_text(name, str(path), content) for path, content in files.items()}
        tasks.append(task)
    if not tasks:
        raise ValueError("import_specs needs at least one task spec.")
    return RequestOptions(
        "POST", "/v1/tasks", json={"tasks": tasks}, cast_to=Page[Task], transform=items_of, idempotent=True
    )


def _list_request(environment: str | None, name: str | None, limit: int) -> PageRequest[Task]:
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}.")

    def page(cursor: str | None) -> RequestOptions[Page[Task]]:
        params = {"environment": environment, "name": name, "limit": limit, "cursor": cursor}
        return RequestOptions("GET", "/v1/tasks", params=params, cast_to=Page[Task])

    return page


def _get_request(task_id: str) -> RequestOptions[Task]:
    return RequestOptions("GET", f"/v1/tasks/{path_id(task_id, 'task_id')}", cast_to=Task)


class Tasks(Resource):
    """Import, list and fetch tasks."""
    _client: SyncRequester

    def import_dir(self, path: str | os.PathLike[str], *, environment: str = DEFAULT_ENVIRONMENT) -> list[Task]:
        """Upload a task directory, or a directory of task directories, and return the tasks.

        Raises:
            FileNotFoundError, NotADirectoryError, ValueError: path holds no task directory.
            UnprocessableEntityError: the gateway found a task malformed (the message names the file).
        """
        return self._client._request(_import_dir_request(path, environment))

    def import_specs(
        self, specs: Iterable[Mapping[str, Any]], *, environment: str = DEFAULT_ENVIRONMENT
    ) -> list[Task]:
        """Import tasks given in memory as {"name", "files": {path: text}, "environment"?} dicts."""
        return self._client._request(_import_specs_request(specs, environment))

    def import_jsonl(
        self, source: str | os.PathLike[str] | bytes, *, environment: str = SWE_ENVIRONMENT
    ) -> list[Task]:
        """Import SWE-bench-style instances from a JSONL file (or its bytes); all or nothing.

        Raises:
            UnprocessableEntityError: a bad line (the message names each by number and field),
                or a repository or commit the gateway's repository store lacks.
        """
        return self._client._request(_import_jsonl_request(source, environment))

    def get(self, task_id: str) -> Task:
        """Fetch one task by id."""
        return self._client._request(_get_request(task_id))

    def list(
        self,
        *,
        environment: str | None = None,
        name: str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> Pager[Task]:
        """Iterate over the tasks matching the filters; `limit` is the page size."""
        return Pager(self._client, _list_request(environment, name, limit), cursor)


class AsyncTasks(Resource):
    """Import, list and fetch tasks."""
    _client: AsyncRequester

    async def import_dir(
        self, path: str | os.PathLike[str], *, environment: str = DEFAULT_ENVIRONMENT
    ) -> list[Task]:
        """Upload a task directory, or a directory of task directories, and return the tasks.

        Raises:
            FileNotFoundError, NotADirectoryError, ValueError: path holds no task directory.
            UnprocessableEntityError: the gateway found a task malformed (the message names the file).
        """
        # Reading and compressing files would block the event loop.
        request = await asyncio.to_thread(_import_dir_request, path, environment)
        return await self._client._request(request)

    async def import_specs(
        self, specs: Iterable[Mapping[str, Any]], *, environment: str = DEFAULT_ENVIRONMENT
    ) -> list[Task]:
        """Import tasks given in memory as {"name", "files": {path: text}, "environment"?} dicts."""
        return await self._client._request(_import_specs_request(specs, environment))

    async def import_jsonl(
        self, source: str | os.PathLike[str] | bytes, *, environment: str = SWE_ENVIRONMENT
    ) -> list[Task]:
        """Import SWE-bench-style instances from a JSONL file (or its bytes); all or nothing."""
        request = await asyncio.to_thread(_import_jsonl_request, source, environment)
        return await self._client._request(request)

    async def get(self, task_id: str) -> Task:
        """Fetch one task by id."""
        return await self._client._request(_get_request(task_id))

    def list(
        self,
        *,
        environment: str | None = None,
        name: str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> AsyncPager[Task]:
        """Iterate (`async for`) over the tasks matching the filters; `limit` is the page size."""
        return AsyncPager(self._client, _list_request(environment, name, limit), cursor)

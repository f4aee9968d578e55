"""Worker errors carry their edge meaning as class attributes and survive the wire unchanged."""

from __future__ import annotations

import json

import pytest

from gateway.errors import map_foreign_error
from workers import errors
from workers.dockerfile import DockerfileError
from workers.errors import SessionClosedError, TaskFormatError, WorkerError, from_wire


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def test_every_error_class_has_a_code_and_a_client_or_server_status():
    classes = [WorkerError, *_all_subclasses(WorkerError)]
    assert {errors.ActionError, errors.SessionNotFoundError, DockerfileError} <= set(classes)
    for cls in classes:
        assert cls.code and cls.code == cls.code.lower() and " " not in cls.code, cls
        assert 400 <= cls.status < 600, cls


@pytest.mark.parametrize("exc", [
    TaskFormatError("'name' is missing", file="task.toml", field="name"),
    SessionClosedError("session sess_1 has ended"),
    errors.ActionError("unknown tool 'rm'"),
    errors.TaskSetupError("reset.sh exited 3"),
])
def test_an_error_round_trips_through_json_as_the_same_class(exc):
    back = from_wire(json.loads(json.dumps(exc.to_wire())))
    assert type(back) is type(exc)
    assert (str(back), back.code, back.status, back.message) == (str(exc), exc.code, exc.status, exc.message)
    if isinstance(exc, TaskFormatError):
        assert (back.file, back.field) == ("task.toml", "name")


def test_an_unknown_code_from_a_newer_worker_is_a_plain_internal_error():
    back = from_wire({"code": "quantum_flux", "message": "no", "extra": 1})
    assert type(back) is WorkerError and back.status == 500


def test_a_taken_code_is_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match="session_closed"):
        type("Clash", (WorkerError,), {"code": "session_closed", "status": 409})


def test_the_gateway_maps_by_attribute_so_a_new_error_needs_no_edge_change():
    teapot = type("TeapotError", (WorkerError,), {"code": "teapot_for_tests", "status": 418})
    mapped = map_foreign_error(teapot("short and stout"))
    assert (mapped.status, mapped.code, mapped.message) == (418, "teapot_for_tests", "short and stout.")
    # The file a format error names leads its message once.
    mapped = map_foreign_error(TaskFormatError("'name' is missing", file="task.toml"))
    assert (mapped.status, mapped.code, mapped.message) == (422, "task_format_error", "task.toml: 'name' is missing.")


def test_a_server_side_worker_error_shows_no_internals():
    mapped = map_foreign_error(WorkerError("task task_9 vanished from /var/lib/forkyard"))
    assert (mapped.status, mapped.code) == (500, "internal_error")
    assert "/var/lib" not in mapped.message

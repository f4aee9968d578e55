"""Mapping of gateway error answers to the SDK's exception tree."""

from __future__ import annotations

import httpx
import pytest

import forkyard

STATUS_ERRORS = [
    (400, "bad_request", forkyard.BadRequestError),
    (401, "unauthorized", forkyard.AuthenticationError),
    (403, "forbidden", forkyard.PermissionDeniedError),
    (404, "not_found", forkyard.NotFoundError),
    (409, "session_closed", forkyard.ConflictError),
    (413, "payload_too_large", forkyard.PayloadTooLargeError),
    (422, "task_format_error", forkyard.UnprocessableEntityError),
    (429, "rate_limited", forkyard.RateLimitError),
    (500, "internal_error", forkyard.InternalServerError),
    (502, "bad_gateway", forkyard.InternalServerError),
    (503, "unavailable", forkyard.InternalServerError),
    (418, "teapot", forkyard.APIStatusError),
]


@pytest.mark.parametrize(("status", "code", "error_cls"), STATUS_ERRORS)
async def test_status_maps_to_error_class(make_twin, kind, status, code, error_cls):
    twin = make_twin(kind, max_retries=0)
    message = f"Something specific went wrong ({status})."
    twin.respond(twin.error(status, code, message, request_id=f"req-{status}"))
    with pytest.raises(forkyard.APIStatusError) as info:
        await twin.call(twin.client.sessions.step, "s1", "bash", command="ls")
    err = info.value
    assert type(err) is error_cls
    assert isinstance(err, forkyard.ForkyardError)
    assert (err.status_code, err.code, err.message, err.request_id) == (status, code, message, f"req-{status}")
    assert err.body == {"error": {"code": code, "message": message, "request_id": f"req-{status}"}}
    assert err.response.status_code == status
    assert err.request is not None and err.request.url.path == "/v1/sessions/s1/step"
    assert str(err) == f"{status} {code}: {message} (request id: req-{status})"


async def test_request_id_falls_back_to_header(twin):
    twin.respond(
        httpx.Response(404, json={"error": {"code": "not_found", "message": "No such task."}},
                       headers={"X-Request-ID": "hdr-7"})
    )
    with pytest.raises(forkyard.NotFoundError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert info.value.request_id == "hdr-7"
    assert "hdr-7" in str(info.value)


async def test_non_json_error_body_keeps_its_text(make_twin, kind):
    twin = make_twin(kind, max_retries=0)
    twin.respond(httpx.Response(502, text="upstream connect error", headers={"content-type": "text/plain"}))
    with pytest.raises(forkyard.InternalServerError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    err = info.value
    assert (err.code, err.message, err.request_id) == (None, "upstream connect error", None)
    assert err.body == "upstream connect error"
    assert str(err) == "502 error: upstream connect error"


async def test_fastapi_validation_detail_becomes_the_message(twin):
    detail = [{"loc": ["body", "task_id"], "msg": "Field required", "type": "missing"}]
    twin.respond(httpx.Response(422, json={"detail": detail}))
    with pytest.raises(forkyard.UnprocessableEntityError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert info.value.message == "body.task_id: Field required"


async def test_empty_error_body_uses_reason_phrase(twin):
    twin.respond(httpx.Response(401))
    with pytest.raises(forkyard.AuthenticationError) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert info.value.message == "Unauthorized"


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (lambda: httpx.Response(200, text="<html>proxy</html>"), "is not JSON"),
        (lambda: httpx.Response(200, json={"id": "t1"}), r"is not a valid Task: name: Field required"),
    ],
)
async def test_malformed_success_body_raises_validation_error(twin, answer, match):
    twin.respond(answer())
    with pytest.raises(forkyard.APIResponseValidationError, match=match) as info:
        await twin.call(twin.client.tasks.get, "t1")
    assert info.value.status_code == 200

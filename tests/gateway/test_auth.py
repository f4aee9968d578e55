"""API-key auth: every /v1 route needs a valid bearer key; keys are stored only as hashes."""

from __future__ import annotations

import hashlib
import logging

from sqlalchemy import select, text

from gateway.auth import service
from gateway.auth.models import ApiKey
from gateway.logs import RedactingFormatter, redact_api_keys
from tests.gateway.conftest import API_KEY, asgi_client, assert_error

V1_ROUTES = [
    ("GET", "/v1/tasks"), ("POST", "/v1/tasks"), ("GET", "/v1/tasks/task_x"), ("GET", "/v1/environments"),
    ("POST", "/v1/environments"), ("POST", "/v1/sessions"), ("GET", "/v1/sessions/sess_x"),
    ("POST", "/v1/sessions/sess_x/step"), ("DELETE", "/v1/sessions/sess_x"), ("GET", "/v1/sandboxes"),
]


async def test_missing_or_bad_key_is_401_on_every_route(gateway):
    async with asgi_client(gateway.app, api_key=None) as anonymous, \
            asgi_client(gateway.app, api_key="fy_wrong") as wrong, \
            asgi_client(gateway.app, api_key="not-even-a-key") as garbage:
        for method, path in V1_ROUTES:
            error = assert_error(await anonymous.request(method, path), 401, "unauthorized")
            assert "Authorization: Bearer" in error["message"]
            missing = await anonymous.request(method, path)
            assert missing.headers["www-authenticate"] == "Bearer"
            assert_error(await wrong.request(method, path), 401, "unauthorized")
            assert_error(await garbage.request(method, path), 401, "unauthorized")
        basic = await anonymous.get("/v1/tasks", headers={"Authorization": "Basic dXNlcjpwYXNz"})
        assert_error(basic, 401, "unauthorized")
    assert (await gateway.client.get("/v1/tasks")).status_code == 200


async def test_keys_are_hashed_at_rest_and_revocable(gateway):
    async with gateway.app.state.sessionmaker() as db:
        created = await service.create_api_key(db_session=db, name="trainer")
        assert created.key.startswith("fy_") and len(created.key) >= 40
        rows = (await db.scalars(select(ApiKey))).all()
        # Nothing in the table holds a secret: only sha256 hashes and short prefixes.
        dump = " ".join(str(v) for row in (await db.execute(text("SELECT * FROM api_key"))).all() for v in row)
        for secret in (created.key, API_KEY):
            assert secret not in dump
            assert hashlib.sha256(secret.encode()).hexdigest() in dump
        mine = next(r for r in rows if r.id == created.id)
        assert mine.name == "trainer" and created.key.startswith(mine.prefix) and len(mine.prefix) < 12
    async with asgi_client(gateway.app, api_key=created.key) as client:
        assert (await client.get("/v1/environments")).status_code == 200
        async with gateway.app.state.sessionmaker() as db:
            assert await service.revoke_api_key(db_session=db, key_id=created.id)
            assert not await service.revoke_api_key(db_session=db, key_id="key_unknown")
        error = assert_error(await client.get("/v1/environments"), 401, "unauthorized")
        assert "revoked" in error["message"]


def test_log_redaction_hides_keys():
    key = "fy_" + "A1b2C3d4" * 5
    assert redact_api_keys(f"Authorization: Bearer {key} done") == "Authorization: Bearer fy_*** done"
    formatter = RedactingFormatter("%(message)s")
    try:
        raise ValueError(f"bad key {key}")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "using %s", (key,), sys.exc_info())
    out = formatter.format(record)
    assert key not in out and out.count("fy_***") == 2

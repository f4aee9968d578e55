"""``alembic upgrade head`` on SQLite and PostgreSQL, and an API flow on PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect, text

import gateway.models  # noqa: F401
from gateway.app import create_app
from gateway.db import (
    Base,
    alembic_config,
    check_database,
    sync_database_url,
    upgrade_database,
)
from tests.fleet import postgres_database
from tests.gateway.conftest import FakeRuntime, asgi_client, make_settings, task_files

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"api_key", "environment", "task", "session", "sandbox", "alembic_version", "policy", "rollout",
          "episode_group", "episode", "episode_step", "delivery_consumer", "delivery_lease", "snapshot"}


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this module, dropped afterwards."""
    with postgres_database() as url:
        yield url


def assert_schema_matches_models(url: str) -> None:
    engine = create_engine(sync_database_url(url))
    try:
        with engine.connect() as conn:
            assert TABLES <= set(inspect(conn).get_table_names())
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            assert diff == [], diff
    finally:
        engine.dispose()


def database_at(revision: str, backend: str, tmp_path: Path, request: pytest.FixtureRequest
                ) -> tuple[str, Config, Engine]:
    """Return the URL, Alembic config and engine of a database of ``backend`` migrated from empty to ``revision``."""
    url = f"sqlite:///{tmp_path / 'r.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    cfg = alembic_config(url)
    if backend == "postgresql":
        command.downgrade(cfg, "base")  # the module's database may be at head already
    command.upgrade(cfg, revision)
    return url, cfg, create_engine(sync_database_url(url))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_upgrade_head_matches_models_and_downgrades(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    with pytest.raises(RuntimeError, match="not at head"):
        check_database(url)
    upgrade_database(url)
    check_database(url)
    assert_schema_matches_models(url)
    upgrade_database(url)  # idempotent
    command.downgrade(alembic_config(url), "base")
    engine = create_engine(sync_database_url(url))
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade_database(url)
    assert_schema_matches_models(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_rollouts_revision_upgrades_a_0001_database_with_data_and_downgrades(backend, tmp_path, request):
    url, cfg, engine = database_at("0001", backend, tmp_path, request)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO environment (id, name, family, version, description, created_at) "
                "VALUES ('env_1', 'terminal-m', 'terminal', '1', '', CURRENT_TIMESTAMP)")
        command.upgrade(cfg, "0002")
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
            assert {"rollout", "episode", "episode_step", "delivery_lease", "policy"} <= names
            assert conn.exec_driver_sql("SELECT name FROM environment").scalars().all() == ["terminal-m"]
        command.upgrade(cfg, "head")
        assert_schema_matches_models(url)
        command.downgrade(cfg, "0001")
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
            assert not names & {"rollout", "episode_group", "episode", "episode_step", "delivery_consumer",
                                "delivery_lease", "policy"}
            assert conn.exec_driver_sql("SELECT name FROM environment").scalars().all() == ["terminal-m"]
        command.downgrade(cfg, "base")
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_snapshots_revision_keeps_sessions_and_downgrades(backend, tmp_path, request):
    url, cfg, engine = database_at("0002", backend, tmp_path, request)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO environment (id, name, family, version, description, created_at) "
                "VALUES ('env_1', 'terminal-s', 'terminal', '1', '', CURRENT_TIMESTAMP)")
            conn.exec_driver_sql(
                "INSERT INTO task (id, name, environment_id, content_hash, instruction, metadata, archive, created_at) "
                "VALUES ('task_1', 't', 'env_1', 'h', 'do it', '{}', '', CURRENT_TIMESTAMP)")
            conn.exec_driver_sql(
                "INSERT INTO session (id, task_id, state, node, steps, created_at) "
                "VALUES ('sess_1', 'task_1', 'open', 'n', 3, CURRENT_TIMESTAMP)")
        command.upgrade(cfg, "0003")
        with engine.connect() as conn:
            assert "snapshot" in set(inspect(conn).get_table_names())
            rows = conn.exec_driver_sql("SELECT id, steps, history, snapshot_id FROM session").all()
            assert [tuple(r) for r in rows] == [("sess_1", 3, None, None)]
        command.upgrade(cfg, "head")  # 0004 (branching) adds columns to rollout and episode only
        assert_schema_matches_models(url)
        command.downgrade(cfg, "0003")
        with engine.connect() as conn:
            assert {c["name"] for c in inspect(conn).get_columns("episode")}.isdisjoint(
                {"parent_episode_id", "branch_turn", "root_episode_id"})
            assert {c["name"] for c in inspect(conn).get_columns("rollout")}.isdisjoint({"branching", "lazy_fork"})
        command.downgrade(cfg, "0002")
        with engine.connect() as conn:
            assert "snapshot" not in set(inspect(conn).get_table_names())
            assert {c["name"] for c in inspect(conn).get_columns("session")}.isdisjoint({"history", "snapshot_id"})
            assert conn.exec_driver_sql("SELECT id FROM session").scalars().all() == ["sess_1"]
        command.downgrade(cfg, "base")
    finally:
        engine.dispose()


def _entry(command: str, observation: str) -> dict:
    return {"action": {"tool": "bash", "arguments": {"command": command}}, "observation": observation,
            "reward": None, "terminated": False, "truncated": False}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_session_steps_revision_moves_histories_into_rows_and_back(backend, tmp_path, request):
    """0006: JSON histories become rows; a fork keeps only its own steps and points at its source."""
    url, cfg, engine = database_at("0005", backend, tmp_path, request)
    source = [_entry("echo a", "a"), _entry("echo b", "b"), _entry("echo c", "c")]
    fork = [*source[:2], _entry("echo f", "f")]
    snap_state = {"session": {"sandbox": {"id": "bsnap"}}, "history": source[:2], "observation": "b"}
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO environment (id, name, family, version, description, created_at) "
                "VALUES ('env_1', 'terminal-h', 'terminal', '1', '', CURRENT_TIMESTAMP)")
            conn.exec_driver_sql(
                "INSERT INTO task (id, name, environment_id, content_hash, instruction, metadata, archive, created_at) "
                "VALUES ('task_1', 't', 'env_1', 'h', 'do it', '{}', '', CURRENT_TIMESTAMP)")
            for sid, history, snap in (("sess_src", source, None), ("sess_fork", fork, "snap_1"),
                                       ("sess_new", None, None)):
                conn.exec_driver_sql(
                    "INSERT INTO session (id, task_id, state, node, steps, created_at, history, snapshot_id) "
                    "VALUES (%(id)s, 'task_1', 'closed', 'n', %(steps)s, CURRENT_TIMESTAMP, %(history)s, %(snap)s)"
                    if backend == "postgresql" else
                    "INSERT INTO session (id, task_id, state, node, steps, created_at, history, snapshot_id) "
                    "VALUES (:id, 'task_1', 'closed', 'n', :steps, CURRENT_TIMESTAMP, :history, :snap)",
                    {"id": sid, "steps": len(history or []), "history": json.dumps(history) if history else None,
                     "snap": snap},
                )
            conn.exec_driver_sql(
                "INSERT INTO snapshot (id, node, backend, session_id, task_id, kind, pinned, state, created_at) "
                + ("VALUES ('snap_1', 'n', 'local', 'sess_src', 'task_1', 'manual', false, %(state)s, CURRENT_TIMESTAMP)"
                   if backend == "postgresql" else
                   "VALUES ('snap_1', 'n', 'local', 'sess_src', 'task_1', 'manual', 0, :state, CURRENT_TIMESTAMP)"),
                {"state": json.dumps(snap_state)},
            )
        command.upgrade(cfg, "head")
        assert_schema_matches_models(url)
        with engine.connect() as conn:
            steps = conn.exec_driver_sql(
                "SELECT session_id, seq, observation FROM session_step ORDER BY session_id, seq").all()
            assert [tuple(r) for r in steps] == [("sess_fork", 2, "f"), ("sess_src", 0, "a"), ("sess_src", 1, "b"),
                                                 ("sess_src", 2, "c")]
            lineage = conn.exec_driver_sql(
                "SELECT id, parent_session_id, parent_steps, steps FROM session ORDER BY id").all()
            assert [tuple(r) for r in lineage] == [("sess_fork", "sess_src", 2, 3), ("sess_new", None, 0, 0),
                                                   ("sess_src", None, 0, 3)]
            (state,) = conn.exec_driver_sql("SELECT state FROM snapshot").scalars().all()
            state = json.loads(state) if isinstance(state, str) else state
            assert state == {"session": {"sandbox": {"id": "bsnap"}}, "steps": 2, "observation": "b"}
        command.downgrade(cfg, "0005")
        with engine.connect() as conn:
            rows = dict(conn.exec_driver_sql("SELECT id, history FROM session").all())
            rows = {k: json.loads(v) if isinstance(v, str) else v for k, v in rows.items()}
            assert rows == {"sess_src": source, "sess_fork": fork, "sess_new": None}
            (state,) = conn.exec_driver_sql("SELECT state FROM snapshot").scalars().all()
            assert (json.loads(state) if isinstance(state, str) else state) == snap_state
        command.downgrade(cfg, "base")
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_outcomes_revision_derives_the_outcome_of_finished_episodes_and_downgrades(backend, tmp_path, request):
    """0014: usable episodes were the agent's reward, failures marked info.infra the infrastructure's."""
    url, cfg, engine = database_at("0013", backend, tmp_path, request)
    rows = {"ep_ok": ("completed", {}), "ep_cut": ("truncated", {}), "ep_node": ("failed", {"infra": True}),
            "ep_cancel": ("failed", {}), "ep_wait": ("queued", {})}
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO environment (id, name, family, version, description, created_at) "
                              "VALUES ('env_1', 'terminal-o', 'terminal', '1', '', CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO task (id, name, environment_id, content_hash, instruction, metadata, "
                              "archive, created_at, family) VALUES ('task_1', 't', 'env_1', 'h', 'do it', '{}', '', "
                              "CURRENT_TIMESTAMP, 'terminal')"))
            conn.execute(text(
                "INSERT INTO rollout (id, status, policy_name, group_size, task_ids, policy, agent, limits, "
                "staleness_action, max_attempts, group_mode, priority, concurrency, last_seq, created_at, updated_at) "
                "VALUES ('ro_1', 'running', 'p', 5, '[\"task_1\"]', '{}', '{}', '{}', 'dead_letter', 2, 'complete', "
                "0, 8, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO episode_group (id, rollout_id, task_id, created_at, updated_at) "
                              "VALUES ('grp_1', 'ro_1', 'task_1', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
            for index, (episode_id, (status, info)) in enumerate(rows.items()):
                conn.execute(text(
                    "INSERT INTO episode (id, rollout_id, group_id, task_id, task_index, sample_index, attempt, status, "
                    "messages, timings, weight_versions, info, num_turns, created_at) VALUES (:id, 'ro_1', 'grp_1', "
                    "'task_1', 0, :index, 1, :status, '[]', '{}', '[]', :info, 0, CURRENT_TIMESTAMP)"),
                    {"id": episode_id, "index": index, "status": status, "info": json.dumps(info)})
        command.upgrade(cfg, "head")
        assert_schema_matches_models(url)
        with engine.connect() as conn:
            outcomes = dict(conn.execute(text("SELECT id, outcome FROM episode")).all())
            assert outcomes == {"ep_ok": "reward", "ep_cut": "reward", "ep_node": "infra", "ep_cancel": None,
                                "ep_wait": None}
            assert conn.execute(text("SELECT group_spare FROM rollout")).scalar_one() == 0
            assert tuple(conn.execute(text("SELECT partial, partial_reason FROM episode_group")).one()) in (
                (False, None), (0, None))
        command.downgrade(cfg, "0013")
        with engine.connect() as conn:
            assert "outcome" not in {c["name"] for c in inspect(conn).get_columns("episode")}
            assert {c["name"] for c in inspect(conn).get_columns("episode_group")}.isdisjoint(
                {"partial", "partial_reason"})
            assert len(conn.execute(text("SELECT id FROM episode")).all()) == len(rows)
        command.downgrade(cfg, "base")
    finally:
        engine.dispose()


def test_alembic_cli_uses_forkyard_database_url(tmp_path):
    db = tmp_path / "cli.db"
    out = subprocess.run([str(Path(sys.executable).parent / "alembic"), "upgrade", "head"], cwd=ROOT,
                         env={"FORKYARD_DATABASE_URL": f"sqlite:///{db}", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    check_database(f"sqlite:///{db}")


async def test_api_flow_on_postgresql(pg_url, tmp_path):
    runtime = FakeRuntime()
    app = create_app(make_settings(tmp_path, database_url=pg_url), runtime=runtime)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        names = ["pg-a", "pg-b", "pg-c"]
        created = await client.post("/v1/tasks", json={"tasks": [{"name": n, "files": task_files(n)} for n in names]})
        assert created.status_code == 201, created.text
        again = await client.post("/v1/tasks", json={"tasks": [{"name": "pg-a", "files": task_files("pg-a")}]})
        assert again.json()["items"][0]["id"] == created.json()["items"][0]["id"]
        first = (await client.get("/v1/tasks", params={"limit": 2})).json()
        second = (await client.get("/v1/tasks", params={"limit": 2, "cursor": first["next"]})).json()
        assert [t["name"] for t in first["items"] + second["items"]] == names and second["next"] is None
        sid = (await client.post("/v1/sessions", json={"task_id": first["items"][0]["id"]})).json()["id"]
        solve = {"action": {"tool": "bash", "arguments": {"command": "solve"}}}
        await client.post(f"/v1/sessions/{sid}/step", json=solve)
        done = (await client.post(f"/v1/sessions/{sid}/step", json={"action": {"tool": "submit"}})).json()
        assert done["reward"] == 1.0
        info = (await client.get(f"/v1/sessions/{sid}")).json()
        assert info["state"] == "terminated" and info["steps"] == 2
        assert datetime.fromisoformat(info["created_at"]) < datetime.fromisoformat(info["closed_at"])
        assert (await client.delete(f"/v1/sessions/{sid}")).status_code == 204

"""Every example terminal task, solved through the SDK against a live gateway, on both backends."""

from __future__ import annotations

import subprocess

import pytest

import forkyard
from tests.live import FORKYARD, ROOT

TASKS_DIR = ROOT / "examples" / "tasks" / "terminal"
TASK_NAMES = sorted(p.name for p in TASKS_DIR.iterdir() if (p / "task.toml").is_file())


def oracle_command(name: str) -> str:
    script = (TASKS_DIR / name / "solution" / "solve.sh").read_text()
    return f"bash <<'FORKYARD_ORACLE'\n{script}\nFORKYARD_ORACLE"


@pytest.fixture(scope="module")
def imported(live_gateway):
    """Import the example tasks with the CLI; return {name: task id}."""
    out = subprocess.run(
        [str(FORKYARD), "tasks", "import", str(TASKS_DIR)],
        env=live_gateway.env(), capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    ids = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("task_"):
            ids[parts[1]] = parts[0]
    assert sorted(ids) == TASK_NAMES
    return ids


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=300) as c:
        yield c


def test_there_are_at_least_six_example_tasks():
    assert len(TASK_NAMES) >= 6


@pytest.mark.parametrize("name", TASK_NAMES)
def test_oracle_scores_one(client, imported, name):
    with client.sessions.create(imported[name]) as s:
        assert s.observation.strip()
        assert {t["function"]["name"] for t in s.tools} == {"bash", "submit"}
        step = s.step("bash", command=oracle_command(name), timeout=120)
        assert not step.terminated
        result = s.submit()
    assert result.terminated
    assert result.reward == 1.0, result.info


@pytest.mark.parametrize("name", TASK_NAMES)
def test_wrong_action_scores_zero(client, imported, name):
    with client.sessions.create(imported[name]) as s:
        s.step("bash", command="echo not solving this")
        result = s.submit()
    assert result.reward == 0.0, result.info


def test_bad_input_gets_clear_4xx_and_gateway_keeps_working(client, imported, live_gateway):
    name = TASK_NAMES[0]
    with client.sessions.create(imported[name]) as other:
        with pytest.raises(forkyard.NotFoundError) as e:
            client.sessions.create("task_does_not_exist")
        assert e.value.request_id and "task" in e.value.message.lower()
        with client.sessions.create(imported[name]) as s:
            with pytest.raises(forkyard.UnprocessableEntityError, match="(?i)tool"):
                s.step("rm_rf", command="x")
            with pytest.raises(forkyard.UnprocessableEntityError):
                s.step("bash", nonsense=1)
            assert s.step("bash", command="echo fine").observation.startswith("fine")
            session_id = s.id
        with pytest.raises(forkyard.ConflictError):
            client.sessions.step(session_id, "bash", command="echo closed")
        with forkyard.Client(base_url=live_gateway.url, api_key="fy_wrong", max_retries=0) as bad:
            with pytest.raises(forkyard.AuthenticationError):
                bad.tasks.list().first_page()
        assert "alive" in other.step("bash", command="echo alive").observation


def test_sandboxes_listing_shows_live_sessions(client, imported):
    with client.sessions.create(imported[TASK_NAMES[0]]) as s:
        rows = [r for r in client.sandboxes.list() if r.session_id == s.id]
        assert len(rows) == 1
        assert rows[0].state in ("ready", "busy") and rows[0].task_name == TASK_NAMES[0]


def _over_grpc(live_gateway, session_id: str, requests: list) -> list:
    """Send ``requests`` one at a time over one ``Sessions.Attach`` stream of the session; return the replies."""
    import asyncio

    import grpc

    from gateway.grpc.codegen import modules

    _, pb2_grpc = modules()

    async def run() -> list:
        async with grpc.aio.insecure_channel(live_gateway.grpc) as channel:
            call = pb2_grpc.SessionsStub(channel).Attach(
                metadata=(("authorization", f"Bearer {live_gateway.api_key}"), ("x-forkyard-session", session_id)))
            replies = []
            for request in requests:
                await call.write(request)
                replies.append(await call.read())
            await call.done_writing()
            return replies

    return asyncio.run(run())


def _grpc_step(seq: int, tool: str, **arguments) -> object:
    import json

    from gateway.grpc.codegen import modules

    pb2, _ = modules()
    return pb2.StepRequest(seq=seq, tool=tool, arguments_json=json.dumps(arguments))


def test_the_oracle_over_the_grpc_step_channel_scores_one(client, imported, live_gateway):
    """A real sandbox stepped through Sessions.Attach: the same observations, records and reward as REST."""
    name = TASK_NAMES[0]
    session = client.sessions.create(imported[name])
    replies = _over_grpc(live_gateway, session.id, [
        _grpc_step(0, "bash", command="cd /tmp && export MARK=1"),
        _grpc_step(1, "bash", command="echo $MARK; pwd"),
        _grpc_step(2, "bash", command=oracle_command(name), timeout=120),
        _grpc_step(3, "submit"),
    ])
    assert not any(r.HasField("error") for r in replies), replies
    assert replies[1].observation.split()[:2] == ["1", "/tmp"]  # one persistent shell, as through REST
    assert replies[3].terminated and replies[3].reward == 1.0
    assert client.sessions.get(session.id).state == "terminated"
    assert [s.action["tool"] for s in client.sessions.steps(session.id)] == ["bash", "bash", "bash", "submit"]


def test_a_snapshot_and_a_fork_over_the_grpc_stream_carry_the_sandbox(client, imported, live_gateway):
    """Snapshot a real sandbox in order with its steps and fork it, all over Sessions.Attach."""
    import json

    from gateway.grpc.codegen import modules

    pb2, _ = modules()
    session = client.sessions.create(imported[TASK_NAMES[0]])
    forks: list[dict] = []
    try:
        replies = _over_grpc(live_gateway, session.id, [
            _grpc_step(0, "bash", command="cd /tmp && echo before > mark && export MARK=1"),
            pb2.StepRequest(seq=1, snapshot=pb2.Snapshot()),
            _grpc_step(2, "bash", command="echo after > /tmp/mark && export MARK=2"),
        ])
        assert not any(r.HasField("error") for r in replies), replies
        snap = json.loads(replies[1].result_json)
        assert snap["session_id"] == session.id and snap["steps"] == 1
        assert client.snapshots.get(snap["id"]).id == snap["id"]
        (forked,) = _over_grpc(live_gateway, session.id, [
            pb2.StepRequest(seq=3, fork=pb2.Fork(snapshot_id=snap["id"], n=2))])
        forks = json.loads(forked.result_json)["items"]
        assert len(forks) == 2 and all(f["steps"] == 1 and f["snapshot_id"] == snap["id"] for f in forks)
        for fork in forks:  # the sandbox as it was at the snapshot: its file, cwd and exports
            (seen,) = _over_grpc(live_gateway, fork["id"], [_grpc_step(0, "bash", command="cat mark; echo $MARK; pwd")])
            assert seen.observation.split()[:3] == ["before", "1", "/tmp"], seen
        (source,) = _over_grpc(live_gateway, session.id, [_grpc_step(4, "bash", command="cat mark; echo $MARK")])
        assert source.observation.split()[:2] == ["after", "2"]
    finally:
        for fork in forks:
            client.sessions.close(fork["id"])
        client.sessions.close(session.id)

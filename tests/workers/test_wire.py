"""The sessions seam: the runtimes are WorkerClients, and what crosses it survives the wire.

The gateway reads sandboxes, steps and opened sessions through the views and wire types
of :mod:`workers.protocol` only. These tests hold the two runtimes (in-process and the
distributed mode's client of the nodes) to that protocol, check that the wire mirrors of
the sandboxes layer's enum and owner label agree with it, and prove on a real backend
that a session whose sandbox vanished fails with the wire's ``SandboxLostError``.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from sandboxes.base import LABEL_OWNER, SandboxInfo, SandboxState
from tests.conftest import DEFAULT_IMAGE_CACHE
from workers.envs.base import StepResult
from workers.envs.registry import get_family
from workers.errors import SandboxLostError, from_wire
from workers.protocol import (
    LABEL_OWNER as WIRE_LABEL_OWNER,
)
from workers.protocol import (
    OpenedWire,
    SandboxStatus,
    SandboxWire,
    SnapshotWire,
    StepWire,
    WorkerClient,
)
from workers.runtime import SessionOpened, WorkerRuntime


def test_the_wire_mirrors_agree_with_the_sandboxes_layer() -> None:
    assert [s.value for s in SandboxStatus] == [s.value for s in SandboxState]
    assert WIRE_LABEL_OWNER == LABEL_OWNER


def test_both_runtimes_are_worker_clients(tmp_path) -> None:
    from gateway.fleet.sessions import FleetRuntime
    from tests.gateway.conftest import FakeRuntime

    class NoBackend:
        name = "none"

    assert isinstance(WorkerRuntime(NoBackend(), image_cache_dir=tmp_path), WorkerClient)  # type: ignore[arg-type]
    assert isinstance(FleetRuntime(sessionmaker=None), WorkerClient)  # type: ignore[arg-type]
    assert isinstance(FakeRuntime(), WorkerClient), "the gateway tests' fake keeps to the protocol too"
    assert WorkerRuntime.loads_tasks is False and FleetRuntime.loads_tasks is True
    assert WorkerRuntime.sole_gateway is True and FleetRuntime.sole_gateway is False


def _through_the_wire(data: dict) -> dict:
    return json.loads(json.dumps(data, default=str))


def test_opened_sessions_and_steps_cross_the_wire_unchanged() -> None:
    info = SandboxInfo(id="sbx1", backend="local", node="n1", state=SandboxState.READY, image="img:1",
                       created_at=1234.5, labels={LABEL_OWNER: "sess_1"})
    opened = SessionOpened("sess_1", info, "do it", [{"type": "function", "function": {"name": "bash"}}])
    back = OpenedWire.model_validate(_through_the_wire(OpenedWire.of(opened).model_dump()))
    assert back.session_id == "sess_1" and back.observation == "do it" and back.tools == opened.tools
    assert back.sandbox.state is SandboxStatus.READY and back.sandbox.state == info.state
    assert back.sandbox == SandboxWire.of(info) and back.sandbox.labels == {LABEL_OWNER: "sess_1"}

    step = StepResult("ok", 1.0, True, False, {"exit_code": 0})
    assert StepWire.model_validate(_through_the_wire(StepWire.of(step).model_dump())) == StepWire(
        observation="ok", reward=1.0, terminated=True, truncated=False, info={"exit_code": 0})

    snap = SnapshotWire({"sandbox": {"id": "snapX", "backend": "docker", "node": "n2"}, "env": {"steps": 3}})
    assert (snap.id, snap.sandbox.backend, snap.sandbox.node) == ("snapX", "docker", "n2")
    assert SnapshotWire(_through_the_wire(snap.to_json())).to_json() == snap.to_json()


def test_a_lost_sandbox_crosses_the_wire_by_code() -> None:
    again = from_wire(SandboxLostError("gone").to_wire())
    assert isinstance(again, SandboxLostError) and str(again) == "gone"


def test_runtime_errors_map_to_wire_errors_in_one_place() -> None:
    from sandboxes.errors import SandboxCrashedError, SandboxError, SandboxNotFoundError
    from workers.errors import ActionError, SandboxBackendError, WorkerError
    from workers.runtime import worker_error

    assert type(worker_error(SandboxCrashedError("shell died"))) is SandboxLostError
    assert type(worker_error(SandboxNotFoundError("no sbx"))) is SandboxLostError
    backend = worker_error(SandboxError("engine said no"))
    assert type(backend) is SandboxBackendError and "engine said no" in str(backend)
    action = ActionError("bad args")
    assert worker_error(action) is action
    internal = worker_error(KeyError("secret-detail"))
    assert type(internal) is WorkerError and "secret-detail" not in str(internal)


@pytest.mark.parametrize("build_backend", ["local"], indirect=True)
async def test_a_step_on_a_vanished_sandbox_is_a_lost_sandbox(build_backend) -> None:
    task = get_family("terminal").load_task("wire-lost", {
        "instruction.md": b"Do nothing.\n",
        "task.toml": b"[environment]\nallow_internet = false\n",
        "environment/Dockerfile": b"FROM ubuntu:24.04\n",
        "tests/test.sh": b"#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n",
    })
    runtime = WorkerRuntime(build_backend.backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=build_backend.base)
    session_id = f"sess_wire{uuid.uuid4().hex[:8]}"
    opened = await runtime.open_session(session_id, task, labels={LABEL_OWNER: session_id})
    try:
        assert (await runtime.step(session_id, "bash", {"command": "echo alive"})).observation.startswith("alive")
        await build_backend.backend.destroy(opened.sandbox.id)  # the host lost it (OOM kill, a node's cleanup)
        started = time.monotonic()
        with pytest.raises(SandboxLostError):
            await runtime.step(session_id, "bash", {"command": "echo alive"})
        assert time.monotonic() - started < 60
    finally:
        await runtime.close_session(session_id)
    assert not [s for s in await build_backend.backend.list() if s.labels.get(LABEL_OWNER) == session_id]

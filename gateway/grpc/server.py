"""The gRPC server of the sessions' step channel: ``Sessions.Attach``, one stream per session.

A step through it is the same call as ``POST /v1/sessions/{id}/step`` (the same service
function, step gate and records) without HTTP's per-request parsing, routing and
response building; likewise a snapshot of the attached session and a fork of a snapshot
(REST's bodies, as JSON). Errors come back in-band, as the REST API's code and message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI
from pydantic import ValidationError

from gateway.auth import service as auth_service
from gateway.dependencies import drain_flag_of, fork_node_of, step_gate_of
from gateway.errors import GatewayError, as_gateway_error
from gateway.grpc.codegen import modules
from gateway.sessions import service as sessions_service
from gateway.sessions.gate import HeldRecords, holding
from gateway.snapshots import service as snapshots_service
from gateway.snapshots.schemas import SnapshotFork

logger = logging.getLogger(__name__)

pb2, pb2_grpc = modules()

#: Metadata key naming the session a stream steps.
SESSION_KEY = "x-forkyard-session"


class SessionsServicer(pb2_grpc.SessionsServicer):  # type: ignore[misc,name-defined]
    """Steps, snapshots and forks the sessions of the app's runtime; reads what the lifespan built from ``app.state``."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app

    async def Attach(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        state = self._app.state
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        key = metadata.get("authorization", "").removeprefix("Bearer ").strip()
        async with state.sessionmaker() as db:
            if not key or await auth_service.authenticated_key_id(db_session=db, key=key) is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "Missing or invalid API key: send metadata `authorization: Bearer <key>`.")
            session_id = metadata.get(SESSION_KEY, "")
            if not session_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Send metadata `{SESSION_KEY}: <session id>`.")
            try:
                await step_gate_of(self._app).settle(session_id)  # a fork's row may still be being written
                await sessions_service.get_session(db_session=db, session_id=session_id)
            except GatewayError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, exc.message)
        async for request in request_iterator:
            call = request.WhichOneof("call")
            held = HeldRecords()
            try:
                # The records the call makes are written once its reply is sent (gateway.sessions.gate).
                with holding(held):
                    async with state.sessionmaker() as db:
                        if call == "snapshot":
                            reply = await self._snapshot(db, request.seq, session_id)
                        elif call == "fork":
                            reply = await self._fork(db, request.seq, request.fork)
                        else:
                            reply = await self._step(db, request, session_id)
            except json.JSONDecodeError as exc:
                reply = _error(request.seq, GatewayError(422, "validation_error",
                                                         f"arguments_json is not JSON: {exc}."))
            except Exception as exc:
                mapped = as_gateway_error(exc)
                if mapped.status >= 500:
                    logger.warning("gRPC %s of session %s failed with %s: %s", call or "step", session_id,
                                   mapped.code, exc, exc_info=exc)
                reply = _error(request.seq, mapped)
            try:
                yield reply
            finally:
                held.release()

    async def _step(self, db: Any, request: Any, session_id: str) -> Any:
        arguments = json.loads(request.arguments_json or "{}")
        if not isinstance(arguments, dict):
            raise GatewayError(422, "validation_error", "arguments_json must be a JSON object.")
        result = await sessions_service.step_session(
            db_session=db, runtime=self._app.state.runtime, session_id=session_id, tool=request.tool,
            arguments=arguments, gate=step_gate_of(self._app),
        )
        reply = pb2.StepReply(seq=request.seq, observation=result.observation, terminated=result.terminated,
                              truncated=result.truncated, info_json=json.dumps(result.info, default=str))
        if result.reward is not None:
            reply.reward = float(result.reward)
        return reply

    async def _snapshot(self, db: Any, seq: int, session_id: str) -> Any:
        record = await snapshots_service.snapshot_session(
            db_session=db, runtime=self._app.state.runtime, session_id=session_id, gate=step_gate_of(self._app))
        return pb2.StepReply(seq=seq, result_json=snapshots_service.snapshot_read(record).model_dump_json())

    async def _fork(self, db: Any, seq: int, fork: Any) -> Any:
        try:  # REST's body, so the same rules (1 <= n <= MAX_FORK)
            body = SnapshotFork(n=fork.n or 1)
        except ValidationError as exc:
            raise GatewayError(422, "validation_error", f"Fork n = {fork.n}: {exc.errors()[0]['msg']}.") from exc
        if not fork.snapshot_id:
            raise GatewayError(422, "validation_error", "A fork names its snapshot_id.")
        forks = await snapshots_service.fork_snapshot(
            db_session=db, runtime=self._app.state.runtime, snapshot_id=fork.snapshot_id, n=body.n,
            node=fork_node_of(self._app), max_open=self._app.state.settings.sessions.max_open,
            gate=step_gate_of(self._app), drain=drain_flag_of(self._app),
        )
        forked = snapshots_service.forked_sessions(fork.snapshot_id, forks)
        return pb2.StepReply(seq=seq, result_json=forked.model_dump_json())


def _error(seq: int, error: GatewayError) -> Any:
    return pb2.StepReply(seq=seq, error=pb2.Error(code=error.code, message=error.message, status=error.status))


async def start_server(app: FastAPI, host: str, port: int, *, max_message_bytes: int) -> tuple[grpc.aio.Server, int]:
    """Serve ``Sessions`` for ``app`` on ``host:port`` (0: any free port); return the server and its port."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes)])
    pb2_grpc.add_SessionsServicer_to_server(SessionsServicer(app), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    logger.info("gRPC sessions channel on %s:%d", host, bound)
    return server, bound

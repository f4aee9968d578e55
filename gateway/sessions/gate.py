"""One step at a time per session, closes that win over the step they interrupt, and records written behind.

A step's row is written right after its answer, not before it: the write (a short
transaction) cost more than the rest of the gateway's work on a step. Writes of one
session run in order; whatever reads a session's steps (its record, its steps, a
snapshot of it, its close, a terminal step) first waits for that session's pending ones,
so this process always reads its own writes. A crash can lose the records of the steps
answered in the last milliseconds, of sessions the restart then marks failed. The app's
gate writes them with a :class:`~gateway.db.RecordWriter` (a sync engine in a thread of its
own): through the asyncio layer a record cost ~0.7 ms of CPU, most of it on the event
loop beside the next request; there it costs ~0.25 ms, off the loop.

A snapshot's row is written behind its answer too, in its session's order: whatever reads
snapshot rows (a fork, GET, list, pin, delete) settles it first. A crash that loses one
loses a snapshot of a session the restart marks failed; the restart's sweep frees its storage.

"Behind the answer" means after it is sent: a request (REST, through the request-id
middleware; a gRPC call, per reply) holds the records it makes (:func:`holding`) until
its answer has left, or at most :data:`MAX_HOLD_S`. Started at once, a write ran its first
~0.7 ms (session, statement, the hop to the database thread) on the event loop before the
answer was sent, at every await the answer still had to pass.

When the runtime holds its sessions in this process alone (``WorkerClient.sole_gateway``),
the gate also keeps what a snapshot records of each open session (:class:`SessionFacts`),
so taking one reads nothing from the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from gateway.errors import ConflictError

if TYPE_CHECKING:
    from gateway.db import RecordWriter

logger = logging.getLogger(__name__)

#: Most sessions whose facts are kept (the oldest go first; a snapshot of one then reads its row).
MAX_FACTS = 65_536


#: Longest a record waits for its request's answer to leave (then it is written anyway).
MAX_HOLD_S = 1.0


class HeldRecords:
    """The records one request made, started when :meth:`release` says its answer has left."""

    def __init__(self) -> None:
        self.released = False
        self._waiting: list[asyncio.Future[None]] = []

    def hold(self) -> asyncio.Future[None] | None:
        """Return a future the next record waits for, or None once released (it then starts at once)."""
        if self.released:
            return None
        go: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(go)
        return go

    def release(self) -> None:
        """Let the held records start (idempotent); records made from now on start at once."""
        self.released = True
        waiting, self._waiting = self._waiting, []
        for go in waiting:
            if not go.done():
                go.set_result(None)


_held: contextvars.ContextVar[HeldRecords | None] = contextvars.ContextVar("forkyard_held_records", default=None)


@contextlib.contextmanager
def holding(held: HeldRecords) -> Iterator[HeldRecords]:
    """Have the records made in the block (and in the tasks it starts) wait for ``held.release()``.

    The caller releases once the answer is sent, and in any case when the request ends;
    a record waits :data:`MAX_HOLD_S` at most.
    """
    token = _held.set(held)
    try:
        yield held
    finally:
        _held.reset(token)


@dataclasses.dataclass
class SessionFacts:
    """What a snapshot records of an open session, as its answered steps left it."""

    task_id: str
    node: str
    steps: int
    """Steps answered (inherited ones included): the count its records reach once written."""
    observation: str | None
    """The latest step's observation (own or inherited); None before any step."""


class StepGate:
    """Who is stepping or closing which session in this gateway process.

    A session takes one step at a time: a step that arrives while another runs is
    refused with 409 ``session_busy`` (nothing queues, nothing is lost; the client
    retries or waits). A close is never refused: the step it interrupts answers 409
    ``session_closed`` and the session ends ``closed``, not ``failed``.
    """

    def __init__(self, *, writer: RecordWriter | None = None) -> None:
        self._stepping: set[str] = set()
        self._closing: set[str] = set()
        self.writer = writer
        """Writes the records behind the answers (the app's gate, while the app runs); None: before them."""
        self._writes: dict[str, asyncio.Task[None]] = {}  # the latest pending write of each session
        self._facts: dict[str, SessionFacts] = {}

    def know(self, session_id: str, facts: SessionFacts) -> None:
        """Keep ``facts`` of an open session this process alone steps (see the module's note)."""
        self._facts.pop(session_id, None)
        self._facts[session_id] = facts
        while len(self._facts) > MAX_FACTS:
            self._facts.pop(next(iter(self._facts)))

    def facts(self, session_id: str) -> SessionFacts | None:
        """Return the kept facts of ``session_id``, or None (then its row tells)."""
        return self._facts.get(session_id)

    def stepped(self, session_id: str, observation: str) -> None:
        """Count an answered step of ``session_id`` in its facts, if any are kept."""
        facts = self._facts.get(session_id)
        if facts is not None:
            facts.steps += 1
            facts.observation = observation

    def forget(self, session_id: str) -> None:
        """Drop the facts of a session that ended."""
        self._facts.pop(session_id, None)

    def record(self, session_id: str, write: Callable[[], Awaitable[None]]) -> None:
        """Run ``write`` (a record of the session: a step, a snapshot) after its earlier ones, in the background."""
        earlier = self._writes.get(session_id)
        held = _held.get()
        go = held.hold() if held is not None else None

        async def in_order() -> None:
            if go is not None:  # after the answer is sent (see the module's note)
                await asyncio.wait([go], timeout=MAX_HOLD_S)
            if earlier is not None:
                await asyncio.wait([earlier])
            try:
                await write()
            except Exception:
                logger.exception("session %s: writing a record failed", session_id)

        task = asyncio.ensure_future(in_order())
        self._writes[session_id] = task
        task.add_done_callback(lambda done: self._writes.pop(session_id, None) if self._writes.get(session_id) is done
                               else None)

    async def settle(self, session_id: str | None = None) -> None:
        """Wait until the records of ``session_id`` (every session's, if None) are written.

        A request that settles lets its own held records start first: it would wait for itself.
        """
        held = _held.get()
        if held is not None:
            held.release()
        pending = [self._writes[session_id]] if session_id in self._writes else []
        if session_id is None:
            pending = list(self._writes.values())
        if pending:
            await asyncio.wait(pending)

    @contextlib.contextmanager
    def stepping(self, session_id: str) -> Iterator[None]:
        """Hold ``session_id`` for one step; raise ConflictError(session_busy) if a step holds it."""
        if session_id in self._stepping:
            raise ConflictError(
                f"Session {session_id!r} is running another step; send the next one when it has answered.",
                code="session_busy",
            )
        self._stepping.add(session_id)
        try:
            yield
        finally:
            self._stepping.discard(session_id)

    @contextlib.contextmanager
    def closing(self, session_id: str) -> Iterator[None]:
        """Mark ``session_id`` as being closed while the block runs."""
        self._closing.add(session_id)
        try:
            yield
        finally:
            self._closing.discard(session_id)

    def is_closing(self, session_id: str) -> bool:
        """Tell whether a close of ``session_id`` is under way."""
        return session_id in self._closing


__all__ = ["HeldRecords", "SessionFacts", "StepGate", "holding"]

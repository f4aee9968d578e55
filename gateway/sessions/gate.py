"""One step at a time per session, and closes that win over the step they interrupt."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from gateway.errors import ConflictError


class StepGate:
    """Who is stepping or closing which session in this gateway process.

    A session takes one step at a time: a step that arrives while another runs is
    refused with 409 ``session_busy`` (nothing queues, nothing is lost; the client
    retries or waits). A close is never refused: the step it interrupts answers 409
    ``session_closed`` and the session ends ``closed``, not ``failed``.
    """

    def __init__(self) -> None:
        self._stepping: set[str] = set()
        self._closing: set[str] = set()

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


__all__ = ["StepGate"]

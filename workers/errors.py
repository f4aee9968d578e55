"""Exceptions of the data plane, each carried by a stable code.

Every class says at class level what it is at the edge: ``code`` (stable snake_case, the
``error.code`` of the gateway's JSON error body) and ``status`` (the HTTP status). The
gateway maps an error by these attributes, never by an ``isinstance`` ladder, and a worker
on another host sends an error across the wire as :meth:`WorkerError.to_wire` and the
gateway raises it again with :func:`from_wire`, the same class with the same fields.
A new error is one subclass here; nothing at the edge changes.
"""

from __future__ import annotations

from typing import Any, ClassVar

#: Every concrete error class by its code (filled by ``__init_subclass__``).
_BY_CODE: dict[str, type[WorkerError]] = {}


class WorkerError(Exception):
    """Root of every error the workers raise on purpose: an internal failure (500) unless a subclass says."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    infra: ClassVar[bool] = False
    """Whether an episode this ends failed for the infrastructure's sake (never the policy's)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            other = _BY_CODE.get(cls.code)
            if other is not None and other.__qualname__ != cls.__qualname__:
                raise TypeError(f"error code {cls.code!r} is taken by {other.__qualname__}")
            _BY_CODE[cls.code] = cls

    @property
    def message(self) -> str:
        """The one sentence shown to the client."""
        return str(self)

    def to_wire(self) -> dict[str, Any]:
        """Return the error as plain data (JSON, a gRPC status detail) for :func:`from_wire`."""
        return {"code": self.code, "message": str(self), **self._wire_fields()}

    def _wire_fields(self) -> dict[str, Any]:
        return {}


def from_wire(data: dict[str, Any]) -> WorkerError:
    """Rebuild the error :meth:`WorkerError.to_wire` sent; an unknown code becomes a plain WorkerError."""
    cls = _BY_CODE.get(str(data.get("code")), WorkerError)
    fields = {k: v for k, v in data.items() if k not in ("code", "message")}
    try:
        return cls(str(data.get("message", "")), **fields)
    except TypeError:
        return cls(str(data.get("message", "")))


class TaskFormatError(WorkerError):
    """A task directory or task spec is malformed; the message names the file and field."""

    code = "task_format_error"
    status = 422

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.field = field

    @property
    def message(self) -> str:
        text = str(self)
        return f"{self.file}: {text}" if self.file and self.file not in text else text

    def _wire_fields(self) -> dict[str, Any]:
        return {"file": self.file, "field": self.field}


class ImageBuildError(WorkerError):
    """An environment's Dockerfile cannot be built (unsupported instruction, failing RUN...)."""

    code = "image_build_error"
    status = 422
    infra = True


class TaskSetupError(WorkerError):
    """The task's own reset hook (``forkyard/reset.sh``) failed or ran past its time: the task's fault."""

    code = "task_setup_failed"
    status = 422
    infra = True


class ActionError(WorkerError):
    """An action names an unknown tool or carries invalid arguments."""

    code = "invalid_action"
    status = 422


class SessionNotFoundError(WorkerError):
    """No open session has this id on this worker."""

    code = "not_found"
    status = 404


class SessionClosedError(WorkerError):
    """The session has ended (submitted, timed out or closed) and takes no more steps."""

    code = "session_closed"
    status = 409


class SandboxLostError(WorkerError):
    """A session's sandbox crashed or vanished on its node: the session cannot go on."""

    code = "sandbox_lost"
    status = 503
    infra = True


class SandboxBackendError(WorkerError):
    """A node's sandbox backend failed a call (the session may still go on), or the node was unreachable."""

    code = "sandbox_error"
    status = 503
    infra = True


class NotSupportedError(WorkerError):
    """The call is not available in this deployment mode."""

    code = "not_supported"
    status = 501

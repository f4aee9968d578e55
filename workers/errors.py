"""Exceptions of the data plane; each maps to one 4xx at the gateway edge."""


class WorkerError(Exception):
    """Root of every error the workers raise on purpose."""


class TaskFormatError(WorkerError):
    """A task directory or task spec is malformed; the message names the file and field."""

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.field = field


class ImageBuildError(WorkerError):
    """An environment's Dockerfile cannot be built (unsupported instruction, failing RUN...)."""


class TaskSetupError(WorkerError):
    """The task's own reset hook (``forkyard/reset.sh``) failed or ran past its time: the task's fault."""


class ActionError(WorkerError):
    """An action names an unknown tool or carries invalid arguments."""


class SessionNotFoundError(WorkerError):
    """No open session has this id on this worker."""


class SessionClosedError(WorkerError):
    """The session has ended (submitted, timed out or closed) and takes no more steps."""

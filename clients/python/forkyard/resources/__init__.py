"""Resource namespaces hung on Client and AsyncClient (client.tasks, client.sessions, ...)."""

from .environments import AsyncEnvironments, Environments
from .sandboxes import AsyncSandboxes, Sandboxes
from .sessions import AsyncSession, AsyncSessionOpener, AsyncSessions, Session, Sessions
from .tasks import AsyncTasks, Tasks

__all__ = [
    "Environments",
    "AsyncEnvironments",
    "Tasks",
    "AsyncTasks",
    "Sessions",
    "AsyncSessions",
    "Session",
    "AsyncSession",
    "AsyncSessionOpener",
    "Sandboxes",
    "AsyncSandboxes",
]

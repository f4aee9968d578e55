"""Resource namespaces hung on Client and AsyncClient (client.tasks, client.sessions, ...)."""

from .environments import AsyncEnvironments, Environments
from .episodes import AsyncEpisodes, Episodes
from .policies import AsyncPolicies, Policies
from .rollouts import AsyncEpisodeBatch, AsyncRollouts, EpisodeBatch, Rollouts
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
    "Rollouts",
    "AsyncRollouts",
    "EpisodeBatch",
    "AsyncEpisodeBatch",
    "Policies",
    "AsyncPolicies",
    "Episodes",
    "AsyncEpisodes",
]

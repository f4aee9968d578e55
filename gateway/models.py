"""Every gateway table, imported in one place so ``Base.metadata`` is complete (Alembic uses it)."""

from gateway.auth.models import ApiKey
from gateway.db import Base
from gateway.environments.models import Environment, EnvironmentFamily
from gateway.sandboxes.models import Sandbox
from gateway.sessions.models import EnvSession, SessionState
from gateway.tasks.models import Task

__all__ = ["ApiKey", "Base", "EnvSession", "Environment", "EnvironmentFamily", "Sandbox", "SessionState", "Task"]

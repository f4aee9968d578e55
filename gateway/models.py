"""Every gateway table, imported in one place so ``Base.metadata`` is complete (Alembic uses it)."""

from gateway.artifacts.models import Artifact
from gateway.auth.models import ApiKey
from gateway.console.models import AdminSession, AuditEntry
from gateway.db import Base
from gateway.environments.models import Environment
from gateway.episodes.models import Episode, EpisodeStep
from gateway.nodes.models import Node, NodeCommand
from gateway.policies.models import Policy
from gateway.rollouts.models import (
    DeliveryConsumer,
    DeliveryLease,
    EpisodeGroup,
    Rollout,
)
from gateway.sandboxes.models import Sandbox
from gateway.sessions.models import EnvSession, SessionState, SessionStep
from gateway.snapshots.models import SnapshotRecord
from gateway.tasks.models import Task

__all__ = [
    "AdminSession", "ApiKey", "Artifact", "AuditEntry", "Base", "DeliveryConsumer", "DeliveryLease", "EnvSession", "Environment", "Episode",
    "EpisodeGroup", "EpisodeStep", "Node", "NodeCommand", "Policy", "Rollout", "Sandbox", "SessionState", "SessionStep",
    "SnapshotRecord", "Task",
]

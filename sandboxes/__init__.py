"""Isolated sandboxes behind one small async contract; knows nothing about RL.

Backends are imported lazily by :func:`sandboxes.backends.create_backend` so that a host
without a Docker SDK or without namespaces can still use the other one.
"""

from sandboxes.base import (
    ExecResult,
    ImageConfig,
    Resources,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)
from sandboxes.errors import (
    BackendUnavailableError,
    ImageNotFoundError,
    PathEscapeError,
    SandboxError,
    SandboxNotFoundError,
)

__all__ = [
    "BackendUnavailableError",
    "ExecResult",
    "ImageConfig",
    "ImageNotFoundError",
    "PathEscapeError",
    "Resources",
    "SandboxBackend",
    "SandboxError",
    "SandboxInfo",
    "SandboxNotFoundError",
    "SandboxSpec",
    "SandboxState",
]

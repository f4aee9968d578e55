"""Python SDK for the Forkyard rollout gateway."""

from ._base_client import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from ._client import AsyncClient, Client
from ._exceptions import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ForkyardError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    UnprocessableEntityError,
)
from ._models import (
    DeadLetter,
    Environment,
    Episode,
    EpisodeDetail,
    EpisodeInfo,
    EpisodeOutcome,
    EpisodeStatus,
    EpisodeStep,
    EpisodeTree,
    Node,
    Page,
    Policy,
    Rollout,
    RolloutProgress,
    RolloutStatus,
    Sandbox,
    SandboxState,
    SessionInfo,
    SessionState,
    SessionStepRecord,
    Snapshot,
    StepResult,
    Task,
)
from ._pagination import AsyncPager, Pager
from ._streaming import AsyncStream, Stream
from ._training import group_advantages
from ._version import __version__
from .resources.rollouts import AsyncEpisodeBatch, EpisodeBatch
from .resources.sessions import AsyncSession, AsyncSessionOpener, Session
from .resources.snapshots import AsyncSessionList, SessionList
from .trees import render_tree_svg, render_tree_text

__all__ = [
    "__version__",
    "Client",
    "AsyncClient",
    "DEFAULT_TIMEOUT",
    "DEFAULT_MAX_RETRIES",
    # sessions
    "Session",
    "AsyncSession",
    "AsyncSessionOpener",
    "SessionList",
    "AsyncSessionList",
    # rollouts
    "EpisodeBatch",
    "AsyncEpisodeBatch",
    "Stream",
    "AsyncStream",
    "group_advantages",
    "render_tree_text",
    "render_tree_svg",
    # models
    "Environment",
    "Task",
    "SessionInfo",
    "SessionStepRecord",
    "SessionState",
    "Snapshot",
    "StepResult",
    "Sandbox",
    "SandboxState",
    "Rollout",
    "RolloutStatus",
    "RolloutProgress",
    "Node",
    "Policy",
    "Episode",
    "EpisodeStatus",
    "EpisodeOutcome",
    "EpisodeInfo",
    "EpisodeDetail",
    "EpisodeStep",
    "EpisodeTree",
    "DeadLetter",
    "Page",
    "Pager",
    "AsyncPager",
    # errors
    "ForkyardError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseValidationError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "PayloadTooLargeError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
]

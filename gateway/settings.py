"""Gateway configuration, read from ``FORKYARD_*`` environment variables when built."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Where base root filesystems are built and cached unless configured otherwise.
DEFAULT_IMAGE_CACHE_DIR = Path("/var/cache/forkyard/images")
#: Every API key starts with this; it also lets the log filter find keys to redact.
API_KEY_PREFIX = "fy_"
#: What a key opens: ``trainer`` the ``/v1`` API, ``admin`` that and the console at ``/admin``.
KEY_SCOPES = ("trainer", "admin")


class SessionLimits(BaseModel):
    """Limits on the sessions one gateway node runs at once."""

    max_open: int = Field(default=64, ge=1)
    """Most sessions open at the same time on this node; more are refused with 429."""


class NodeSettings(BaseModel):
    """This node's heartbeat (``FORKYARD_NODES__HEARTBEAT_S``)."""

    heartbeat_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds between heartbeats; a node is down after 2.5 intervals without one."""


class FleetSettings(BaseModel):
    """The distributed mode: episode jobs over Celery + Redis (``FORKYARD_FLEET__*``)."""

    capacity: int = Field(default=8, ge=1, le=4096)
    """Episodes one worker node runs at once (``forkyard worker --capacity``); the schedulers never
    send a node more than this."""
    schedule_s: float = Field(default=0.2, gt=0, le=60)
    """Seconds between a gateway scheduler's passes over the active rollouts (a new rollout wakes it at once)."""
    redispatch_s: float = Field(default=120.0, gt=0)
    """A job sent to a node that has not taken it within this is sent again (a message lost with a Redis
    restart); a copy that arrives after all is a duplicate and exits without touching a sandbox."""
    visibility_timeout_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    """Seconds Redis waits for an unacknowledged job before delivering it again: longer than the longest
    episode (a node found down hands its work on long before)."""


class PoolSettings(BaseModel):
    """Warm pools of started sandboxes per node (``FORKYARD_POOL__*``; :mod:`workers.pool`)."""

    max_idle: int | None = Field(default=None, ge=0, le=4096)
    """Idle pooled sandboxes on one node, all keys together; 0 turns pools off. Default: off in the
    embedded mode (``forkyard up``), the node's capacity on ``forkyard worker``."""
    window_s: float = Field(default=120.0, gt=0)
    """A key's demand is its claims in this many seconds."""
    headroom: float = Field(default=1.2, gt=0, le=10)
    """A key's target is its demand times this, rounded up."""
    sizes: dict[str, int] = Field(default_factory=dict)
    """Operator-set targets by pool key id or a prefix of it (JSON object); they replace demand."""
    fill_concurrency: int = Field(default=1, ge=1, le=64)
    """Fills run at once on one node (each is a cold start: keep it below the node's spare cores)."""
    breaker_failures: int = Field(default=3, ge=1)
    """Failed fills in a row that open a key's circuit breaker (its claims go cold meanwhile)."""
    breaker_cooldown_s: float = Field(default=30.0, ge=0)
    """The first trip's pause; each further trip doubles it, up to 300 s."""


class StageLimitsSettings(BaseModel):
    """How many episodes of all rollouts may be in each stage at once on this node."""

    setup: int = Field(default=4, ge=1)
    """Image build + sandbox start (``FORKYARD_STAGES__SETUP``): slow setups never idle the policy."""
    agent: int = Field(default=32, ge=1)
    """Episodes in their agent loop, calling the policy and stepping the environment."""
    verify: int = Field(default=4, ge=1)
    """Verifiers running at once."""


class SetupCacheSettings(BaseModel):
    """The setup cache: a snapshot of each task's sandbox right after its forkyard/reset.sh ran."""

    max_bytes: int = Field(default=20 * 1024**3, ge=0)
    """Cap on the bytes the cached snapshots hold (``FORKYARD_SETUP_CACHE__MAX_BYTES``); 0 turns the cache off."""
    dir: Path | None = None
    """Where the cache keeps its index (``FORKYARD_SETUP_CACHE__DIR``); default: ``data_dir/setup-cache``."""


class SWESettings(BaseModel):
    """The ``swe`` environment family (:mod:`workers.envs.swe`)."""

    repo_store: Path | None = None
    """Directory of the repositories SWE instances name (``FORKYARD_SWE__REPO_STORE``); default ``data_dir/repos``.
    ``forkyard repos add PATH --name owner/repo`` puts one there; nothing is fetched from a network."""


class ImageSettings(BaseModel):
    """How task images are found when no image registry answers (:mod:`workers.standins`)."""

    stand_ins: dict[str, str] = Field(default_factory=lambda: dict(_default_stand_ins()))
    """Image name pattern (fnmatch) -> stand-in (base, python, gcc, golang, node, rust, java), first match wins
    (``FORKYARD_IMAGES__STAND_INS``, JSON); a real image this host has always wins."""
    max_bytes: int = Field(default=30 * 1024**3, ge=0)
    """Cap on the bytes of built task and stand-in images (``FORKYARD_IMAGES__MAX_BYTES``): past it the oldest
    that no sandbox uses are removed (they rebuild on demand); 0: no cap."""

    @model_validator(mode="after")
    def _known(self) -> ImageSettings:
        from workers.standins import check_table

        check_table(self.stand_ins)
        return self


def _default_stand_ins() -> dict[str, str]:
    from workers.standins import DEFAULT_STAND_INS

    return dict(DEFAULT_STAND_INS)


def _host_cpus() -> float:
    return float(os.cpu_count() or 1)


def _host_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024))


class SandboxLimitSettings(BaseModel):
    """The most one sandbox may ask for; a task asking for more is refused at import (422)."""

    max_cpus: float = Field(default_factory=_host_cpus, gt=0)
    """CPUs (``FORKYARD_SANDBOX_LIMITS__MAX_CPUS``); default: this host's CPU count."""
    max_memory_mb: int = Field(default_factory=_host_memory_mb, gt=0)
    """Memory in MiB (``FORKYARD_SANDBOX_LIMITS__MAX_MEMORY_MB``); default: this host's memory."""
    max_disk_mb: int = Field(default=100 * 1024, gt=0)
    """Disk quota in MiB (``FORKYARD_SANDBOX_LIMITS__MAX_DISK_MB``); default 100 GiB."""


class EgressSettings(BaseModel):
    """What local sandboxes with network may reach (docker sandboxes use the engine's bridge)."""

    tcp_ports: list[int] = Field(default_factory=lambda: [80, 443])
    """Destination TCP ports allowed to public addresses (``FORKYARD_EGRESS__TCP_PORTS``, JSON list)."""
    allow_networks: list[str] = Field(default_factory=list)
    """Private networks (CIDR) allowed on those ports too (``FORKYARD_EGRESS__ALLOW_NETWORKS``); loopback never."""


#: The file in the data dir that holds the node's name.
NODE_FILE = "node"


def node_identity(data_dir: Path) -> str:
    """Return this data dir's node name, making one (``<host>-<6 hex>``) and keeping it on first use.

    A data dir that already holds a database from before node files existed keeps the
    host name it was running under, so its sandboxes are still its own after an upgrade.
    """
    path = data_dir / NODE_FILE
    try:
        name = path.read_text().strip()
        if name:
            return name
    except FileNotFoundError:
        pass
    legacy = (data_dir / "forkyard.db").exists()
    name = socket.gethostname() if legacy else f"{socket.gethostname()}-{secrets.token_hex(3)}"
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{NODE_FILE}.{secrets.token_hex(4)}")
    tmp.write_text(name + "\n")
    try:
        os.link(tmp, path)  # first writer wins when two processes start at once
    except FileExistsError:
        name = path.read_text().strip() or name
    finally:
        tmp.unlink(missing_ok=True)
    return name


class Settings(BaseSettings):
    """Everything the gateway and ``forkyard up`` need; built by the caller, never at import."""

    model_config = SettingsConfigDict(
        env_prefix="FORKYARD_",
        env_nested_delimiter="__",
        extra="ignore",
        populate_by_name=True,
    )

    data_dir: Path = Path(".forkyard")
    """Directory for the SQLite database, the API key file and local sandboxes."""

    database_url: str | None = None
    """SQLAlchemy URL (sqlite:///... or postgresql://...); default: SQLite at ``data_dir/forkyard.db``."""

    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the sessions' gRPC step channel (``FORKYARD_GRPC_PORT``; 0: any free port; None: off).
    On ``forkyard worker``, the port of its node channel, which the gateways call (None or 0: any free port)."""

    grpc_host: str = "127.0.0.1"
    """Address the gRPC step channel (or, on ``forkyard worker``, the node channel) listens on (``FORKYARD_GRPC_HOST``)."""

    redis_url: str | None = None
    """``redis://host:port/db`` shared by the gateways of a fleet (``FORKYARD_REDIS_URL``): finished
    episodes wake the streams and long-polls of every gateway at once. None (embedded): in-process only."""

    auto_migrate: bool = True
    """Run ``alembic upgrade head`` at startup; when false, refuse to start unless the DB is at head."""

    backend: Literal["auto", "docker", "local"] = "auto"
    """Sandbox backend: ``docker``, ``local`` (an OCI runtime over overlayfs) or ``auto`` (docker if an engine answers)."""

    isolation: Literal["standard", "gvisor"] = "standard"
    """Local sandboxes' tier: ``standard`` (crun or runc: namespaces, seccomp, a user namespace) or
    ``gvisor`` (runsc: a user-space kernel between the agent and the host's)."""

    runtime: Literal["crun", "runc", "runsc"] | None = None
    """Insist on this OCI runtime for local sandboxes; default: the tier's first one installed."""

    node: str = Field(default="", max_length=200)
    """Name of this node; sandboxes and sessions are stamped with it, and a start reaps only its own
    (``FORKYARD_NODE``). Default: a name made once per data dir (the host name and a random suffix) and
    kept in ``data_dir/node``, so two gateways sharing a Docker engine never reap each other's sandboxes."""

    ca_bundle: Path | None = Field(
        default=Path("/etc/ssl/certs/ca-certificates.crt"),
        description="PEM CA bundle trusted in image builds and networked sandboxes (FORKYARD_CA_BUNDLE; "
                    "empty: none), for registries reached through a TLS-intercepting proxy.",
    )  # fmt: skip
    image_cache_dir: Path = Field(
        default=DEFAULT_IMAGE_CACHE_DIR,
        validation_alias=AliasChoices("FORKYARD_IMAGE_CACHE_DIR", "FORKYARD_IMAGE_CACHE"),
    )
    """Cache of base root filesystems (``FORKYARD_IMAGE_CACHE_DIR`` or ``FORKYARD_IMAGE_CACHE``)."""

    docker_url: str | None = None
    """Docker Engine URL (e.g. unix:///var/run/docker.sock); default: DOCKER_HOST or the default socket."""

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Largest request body accepted (task archives included); bigger ones get 413."""

    dev_mode: bool = False
    """Relax safety checks for local development (e.g. allow a short bootstrap API key)."""

    bootstrap_api_key: SecretStr | None = None
    """An API key (``fy_...``) to make valid at startup, for deployments that configure the key up front."""

    sessions: SessionLimits = Field(default_factory=SessionLimits)
    """Session limits (``FORKYARD_SESSIONS__MAX_OPEN``)."""

    stages: StageLimitsSettings = Field(default_factory=StageLimitsSettings)
    nodes: NodeSettings = Field(default_factory=NodeSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    """Warm pools (``FORKYARD_POOL__MAX_IDLE``, ``__WINDOW_S``, ``__SIZES``, ...)."""
    """Per-stage concurrency of rollout episodes (``FORKYARD_STAGES__SETUP`` / ``__AGENT`` / ``__VERIFY``)."""

    setup_cache: SetupCacheSettings = Field(default_factory=SetupCacheSettings)
    images: ImageSettings = Field(default_factory=ImageSettings)
    """Setup cache size and place (``FORKYARD_SETUP_CACHE__MAX_BYTES`` / ``__DIR``)."""

    policy_hosts: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.0/8", "::1"])
    """Inference servers a rollout may name (``FORKYARD_POLICY_HOSTS``, JSON list): host names, ``*.domain``,
    networks (``10.0.0.0/8``) or ``*`` for any; default: this machine only."""

    sandbox_limits: SandboxLimitSettings = Field(default_factory=SandboxLimitSettings)
    """Per-sandbox maximum resources (``FORKYARD_SANDBOX_LIMITS__MAX_CPUS`` / ``__MAX_MEMORY_MB``)."""

    egress: EgressSettings = Field(default_factory=EgressSettings)
    """Outbound network of local sandboxes that ask for one (``FORKYARD_EGRESS__TCP_PORTS`` / ``__ALLOW_NETWORKS``)."""

    swe: SWESettings = Field(default_factory=SWESettings)
    """The SWE family's repository store (``FORKYARD_SWE__REPO_STORE``)."""

    @field_validator("ca_bundle", mode="before")
    @classmethod
    def _no_bundle(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        # Fix relative paths now: the local backend mounts under data_dir, where cwd no longer counts.
        self.data_dir = self.data_dir.expanduser().absolute()
        self.image_cache_dir = self.image_cache_dir.expanduser().absolute()
        if self.setup_cache.dir is None:
            self.setup_cache.dir = self.data_dir / "setup-cache"
        self.setup_cache.dir = self.setup_cache.dir.expanduser().absolute()
        self.swe.repo_store = (self.swe.repo_store or self.data_dir / "repos").expanduser().absolute()
        if not self.node:
            self.node = node_identity(self.data_dir)
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.data_dir / 'forkyard.db'}"
        if self.bootstrap_api_key is not None:
            key = self.bootstrap_api_key.get_secret_value()
            if not key.startswith(API_KEY_PREFIX):
                raise ValueError(f"bootstrap_api_key must start with {API_KEY_PREFIX!r}")
            if len(key) < 32 and not self.dev_mode:
                raise ValueError("bootstrap_api_key is too short (under 32 characters); use `forkyard keys create` "
                                 "or set dev_mode for a throwaway key")
        return self

    def family_options(self) -> dict[str, dict[str, Any]]:
        """Return each environment family's options, by family name (what its ``configure`` takes)."""
        return {"swe": {"repo_store": self.swe.repo_store}}

    @property
    def sandboxes_dir(self) -> Path:
        """Return the root directory of the local backend's sandboxes."""
        return self.data_dir / "sandboxes"

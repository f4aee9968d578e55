"""The sandbox backend contract: value types and the :class:`SandboxBackend` protocol."""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import contextvars
import enum
import posixpath
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sandboxes.errors import PathEscapeError

if TYPE_CHECKING:
    from sandboxes.layers import LayerStack

#: Default cap on the bytes of stdout (and, separately, stderr) kept per command.
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
#: Label keys every backend stamps on its sandboxes.
LABEL_NODE = "forkyard.node"
LABEL_OWNER = "forkyard.owner"


class SandboxState(str, enum.Enum):
    """Lifecycle of one sandbox: starting -> ready -> busy -> stopping -> gone (+ failed)."""

    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    GONE = "gone"
    FAILED = "failed"


@dataclass(frozen=True)
class Resources:
    """CPU, memory, process-count and disk limits of one sandbox."""

    cpus: float = 1.0
    memory_mb: int = 1024
    pids: int = 256
    disk_mb: int = 10240
    """Bytes the sandbox may write (its writable layer), in MiB; where the backend can enforce it."""


@dataclass(frozen=True)
class ImageConfig:
    """Runtime defaults an image carries (what Dockerfile ENV/WORKDIR/USER set)."""

    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"


@dataclass(frozen=True)
class SandboxSpec:
    """What to create: an image known to the backend plus limits and overrides."""

    image: str
    resources: Resources = field(default_factory=Resources)
    network: bool = False
    """Give the sandbox outbound network (never the host's loopback; local: what its egress policy allows);
    off means a private namespace with only a loopback."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to (and overriding) the image's ENV for the persistent shell."""
    workdir: str | None = None
    """Working directory of the shell; None keeps the image's WORKDIR."""
    labels: Mapping[str, str] = field(default_factory=dict)
    network_of: str | None = None
    """Join this live sandbox's network namespace (its loopback, its services) instead of ``network``:
    how a verifier runs beside the agent's sandbox without sharing its processes or files."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command in a sandbox's persistent shell."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    cwd: str | None = None


@dataclass(frozen=True)
class SandboxInfo:
    """What a backend knows of one sandbox."""

    id: str
    backend: str
    node: str
    state: SandboxState
    image: str
    created_at: float
    """Seconds since the epoch."""
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageInfo:
    """One image a backend holds: its ref, its bytes of its own (not shared with other images), its use."""

    ref: str
    size_bytes: int
    created_at: float
    in_use: bool
    """A sandbox (live or stopped) of this backend starts from it."""


@dataclass(frozen=True)
class Snapshot:
    """An immutable, content-addressed capture of a sandbox's filesystem and shell state (see :mod:`sandboxes.snapshots`)."""

    id: str
    backend: str
    node: str
    image: str
    """The image the snapshotted sandbox was created from."""
    ref: str
    """docker: the snapshot image reference; local: empty (see ``layers``)."""
    layers: tuple[str, ...] = ()
    """local: overlay layer dirs, bottom to top; docker: empty."""
    cwd: str = "/"
    env: Mapping[str, str] = field(default_factory=dict)
    """Exported variables of the persistent shell."""
    workdir: str = "/"
    """The snapshotted sandbox's working directory (relative file paths start there)."""
    config: ImageConfig = field(default_factory=ImageConfig)
    resources: Resources = field(default_factory=Resources)
    network: bool = False
    digest: str = ""
    """sha256 of the filesystem part (new layer's tree listing, or the image id)."""
    created_at: float = 0.0
    metadata: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return the snapshot as plain JSON data."""
        return {
            "id": self.id,
            "backend": self.backend,
            "node": self.node,
            "image": self.image,
            "ref": self.ref,
            "layers": list(self.layers),
            "cwd": self.cwd,
            "env": dict(self.env),
            "workdir": self.workdir,
            "config": {
                "env": dict(self.config.env),
                "workdir": self.config.workdir,
                "user": self.config.user,
            },
            "resources": {
                "cpus": self.resources.cpus,
                "memory_mb": self.resources.memory_mb,
                "pids": self.resources.pids,
                "disk_mb": self.resources.disk_mb,
            },
            "network": self.network,
            "digest": self.digest,
            "created_at": self.created_at,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        """Build a snapshot from :meth:`to_json` data."""
        config = data.get("config") or {}
        res = data.get("resources") or {}
        return cls(
            id=data["id"],
            backend=data["backend"],
            node=data.get("node", ""),
            image=data.get("image", ""),
            ref=data.get("ref", ""),
            layers=tuple(data.get("layers") or ()),
            cwd=data.get("cwd") or "/",
            env=dict(data.get("env") or {}),
            workdir=data.get("workdir") or "/",
            config=ImageConfig(
                env=dict(config.get("env") or {}),
                workdir=config.get("workdir") or "/",
                user=config.get("user") or "root",
            ),
            resources=Resources(**res) if res else Resources(),
            network=bool(data.get("network", False)),
            digest=data.get("digest", ""),
            created_at=float(data.get("created_at") or 0.0),
            metadata=dict(data.get("metadata") or {}),
        )


@dataclass(frozen=True)
class Revert:
    """Paths a restored sandbox shows as ``base`` has them, not as the snapshot does.

    ``base`` is what the snapshotted sandbox started from (an image ref, or the snapshot it
    was restored from): a path ``base`` lacks is hidden, a directory comes back whole. How a
    verifier gets the task image's own tools whatever the agent did to them.
    """

    paths: tuple[str, ...]
    base: Snapshot | str


@runtime_checkable
class SandboxBackend(Protocol):
    """A handful of async methods every backend implements.

    ``snapshot``/``restore`` branch a sandbox (see :mod:`sandboxes.snapshots`);
    ``commit`` freezes a sandbox's filesystem into an image (the Dockerfile builder uses it).
    """

    name: str
    node: str

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Start a sandbox and return once its shell answers."""

    async def exec(
        self,
        sandbox_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    ) -> ExecResult:
        """Run ``command`` in the sandbox's persistent shell (cwd and exports persist)."""

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        """Return the bytes of ``path`` inside the sandbox.

        Raises:
            FileTooLargeError: ``max_bytes`` is set and the file is bigger (nothing is read past it).
        """

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644, owner: tuple[int, int] | None = None
    ) -> None:
        """Write ``data`` to ``path`` inside the sandbox, creating parent directories.

        The file (and the directories made for it) belong to ``owner`` (uid, gid inside the
        sandbox), by default root.
        """

    async def status(self, sandbox_id: str) -> SandboxInfo:
        """Return the sandbox's current info; raise SandboxNotFoundError if unknown."""

    async def list(self) -> list[SandboxInfo]:
        """Return every sandbox this backend created on this node, live or orphaned."""

    def made_after(self, mark: int) -> tuple[builtins.list[SandboxInfo], int]:
        """Return the sandboxes this process made after ``mark`` (0: all it recalls), live or since
        destroyed, as they were made, and the mark to pass next time (see :class:`SandboxLedger`)."""

    async def destroy(self, sandbox_id: str) -> None:
        """Stop and remove the sandbox; a second call (or an unknown id) is a no-op."""

    async def commit(self, sandbox_id: str, image: str, config: ImageConfig) -> None:
        """Freeze the sandbox's filesystem into a new image named ``image``."""

    async def import_rootfs(self, rootfs: str, image: str, config: ImageConfig) -> None:
        """Make a root filesystem directory available as image ``image``."""

    async def has_image(self, image: str) -> bool:
        """Tell whether ``image`` is known to this backend."""

    async def remove_image(self, image: str) -> None:
        """Forget ``image`` (idempotent)."""

    async def list_images(self, repository: str) -> builtins.list[ImageInfo]:
        """Return the images of ``repository`` (e.g. ``forkyard/env``), oldest first."""

    async def image_digest(self, image: str) -> str:
        """Return a digest that changes whenever the content behind ``image`` does.

        Raises:
            ImageNotFoundError: the image is not known to this backend.
        """

    async def snapshot(
        self, sandbox_id: str, *, metadata: Mapping[str, str] | None = None, shell_state: bool = True
    ) -> Snapshot:
        """Capture the sandbox's filesystem, cwd and exports (not its background processes).

        With ``shell_state=False`` only the files are captured, without a word to the
        sandbox's shell: it works whatever its programs became (a deleted shell, a stopped
        sandbox), and the snapshot restores with the image's environment and workdir.
        """

    async def restore(
        self,
        snapshot: Snapshot,
        n: int = 1,
        *,
        spec: SandboxSpec | None = None,
        revert: Revert | None = None,
        shell_state: bool = True,
    ) -> builtins.list[SandboxInfo]:
        """Start ``n`` independent sandboxes from ``snapshot``.

        ``revert`` shows its paths as its base has them in every branch. With
        ``shell_state=False`` the shells start as a create's would (the image's environment
        plus ``spec.env``, the image's workdir), not with the snapshot's exports and cwd.
        """

    async def filesystem(self, source: Snapshot | str) -> LayerStack:
        """Return a host-side, read-only view of a snapshot's or an image's files (:mod:`sandboxes.layers`).

        Raises:
            SandboxError: the backend keeps no layers this host can read (a remote engine,
                a storage driver other than overlay2).
        """

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Forget the snapshot and free its storage once nothing uses it (idempotent)."""

    async def list_snapshots(self) -> builtins.list[Snapshot]:
        """Return the snapshots this backend holds on this node."""

    async def aclose(self) -> None:
        """Release the backend's own resources (not the sandboxes)."""


_launched_hook: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "sandboxes_launched_hook", default=None)


@contextlib.contextmanager
def on_launched(callback: Callable[[], None]) -> Iterator[None]:
    """Have ``callback`` called when a sandbox that the block creates or restores is launched.

    Launched: its start has left this process (the local backend's runtime process is
    spawned; the Docker engine is asked), so what remains is mostly waiting, and the
    caller's own work fits there without slowing the start. Tasks started in the block
    call it too. It runs in the event loop's thread, once per sandbox (so perhaps more
    than once), and a backend that does not say so never calls it.
    """
    token = _launched_hook.set(callback)
    try:
        yield
    finally:
        _launched_hook.reset(token)


def announce_launched() -> None:
    """Tell the caller of :func:`on_launched`, if any, that a sandbox was launched (a backend calls this)."""
    callback = _launched_hook.get()
    if callback is not None:
        callback()


def normalize_sandbox_path(path: str, workdir: str = "/") -> str:
    """Return ``path`` as an absolute, normalized path inside the sandbox.

    Relative paths are taken from ``workdir``. A path whose ``..`` components climb
    above the root is refused rather than clamped, so callers learn of the mistake.

    Raises:
        PathEscapeError: the path is empty, has a NUL byte or escapes the root.
    """
    if not path or "\x00" in path:
        raise PathEscapeError(f"invalid sandbox path {path!r}")
    joined = path if path.startswith("/") else posixpath.join(workdir or "/", path)
    depth = 0
    parts: list[str] = []
    for part in joined.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if depth == 0:
                raise PathEscapeError(f"path {path!r} escapes the sandbox root")
            parts.pop()
            depth -= 1
            continue
        parts.append(part)
        depth += 1
    return "/" + "/".join(parts)


class SandboxLedger:
    """A bounded record of the sandboxes a backend made, whether they still live or not.

    A node lists its live sandboxes once per heartbeat, so one made and destroyed between two
    listings (a short episode, a failed setup) would never be seen; the ledger keeps the last
    ``size`` made, numbered, and a listing also asks for those made after the previous one's mark.
    """

    def __init__(self, size: int = 10_000) -> None:
        self._made: collections.deque[SandboxInfo] = collections.deque(maxlen=size)
        self._count = 0

    def add(self, info: SandboxInfo) -> SandboxInfo:
        """Record ``info`` (just made) and return it."""
        self._made.append(info)
        self._count += 1
        return info

    def after(self, mark: int) -> tuple[builtins.list[SandboxInfo], int]:
        """Return the sandboxes recorded after ``mark`` (as many as are still held), oldest first, and the new mark."""
        n = min(max(self._count - mark, 0), len(self._made))
        return builtins.list(self._made)[len(self._made) - n:], self._count


async def create_cancel_safe(
    create: Coroutine[Any, Any, SandboxInfo], destroy: Callable[[str], Awaitable[None]]
) -> SandboxInfo:
    """Run a backend's ``create`` so that cancelling the caller never leaks the sandbox.

    Engine calls run on in their threads after a cancel; a half-made sandbox would then
    belong to nobody. The work runs as a shielded task: on cancel it is allowed to
    finish, what it made is destroyed, and the cancellation goes on.
    """
    task = asyncio.ensure_future(create)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            info = await task
        except BaseException:  # noqa: BLE001 - it failed on its own and cleaned up after itself
            raise asyncio.CancelledError from None
        await asyncio.shield(destroy(info.id))
        raise

"""The setup cache: a snapshot of each task's sandbox right after its reset and setup.

A reset with an ``forkyard/reset.sh`` (install dependencies, generate data) can take
seconds to minutes; the state it leaves depends only on the environment's version, the
task's content and the image it runs on. The first reset of such a key snapshots the
sandbox and stores it here; later resets restore the snapshot instead of running the
setup again. Changing any part of the key misses.

Entries live in an index (one JSON file per backend and node in the cache directory,
rewritten atomically on every change) so they survive restarts; an entry whose backend
snapshot no longer exists is dropped at load. The bytes the snapshots hold (local: the
snapshot's own layer dir; docker: the top layer of its image) are capped: storing past
the cap evicts the least recently used entries and deletes their backend snapshots.

Evicting while a sandbox restored from the entry still runs is safe: both backends only
forget the snapshot then (local keeps every layer a sandbox, image or snapshot still
lists; docker only untags an image a container uses) and free its storage at a later
``delete_snapshot``. The cache remembers such snapshots and deletes them again at the next
change, and at :meth:`SetupCache.clear`, until their storage is gone.

Every change commits the index before deleting anything: the snapshots it drops are listed
as released in the same write, so a write that fails changes nothing, and a delete that
fails leaves its snapshot listed, to be deleted again at the next change.

A setup that leaves processes running (a service, a daemon) cannot be cached: snapshots
keep files, not processes, so a restored sandbox would lack them. The environment marks
such a key :meth:`SetupCache.mark_uncacheable`; the mark lives in memory only, and its
resets run setup every time without taking the key's build lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandboxes.base import SandboxBackend
from sandboxes.errors import SandboxError
from sandboxes.snapshots import Snapshot

logger = logging.getLogger(__name__)

#: Default cap on the bytes the cached snapshots hold.
DEFAULT_MAX_BYTES = 20 * 1024**3
#: Format of the index file; an index of another version is ignored (and its snapshots left to the backend).
INDEX_VERSION = 1

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class SetupCacheKey:
    """What a setup's result depends on: environment version, task content and image."""

    environment: str
    """The environment's version (its name@version plus the env family's own version)."""
    task_hash: str
    """The task's content hash."""
    image_digest: str
    """The digest of the image the sandbox starts from (see ``SandboxBackend.image_digest``)."""

    @property
    def id(self) -> str:
        """Return the sha256 hex of the key's parts."""
        parts = json.dumps([self.environment, self.task_hash, self.image_digest], separators=(",", ":"))
        return hashlib.sha256(parts.encode()).hexdigest()


@dataclass
class SetupCacheEntry:
    """One cached setup: the backend snapshot and the environment's logical state at that point."""

    key: SetupCacheKey
    snapshot: Snapshot
    state: dict[str, Any]
    """The environment's ``export_state()`` data right after setup."""
    bytes: int
    """Storage the snapshot holds beyond its image."""
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        """Return the entry as plain JSON data."""
        return {
            "key": {
                "environment": self.key.environment,
                "task_hash": self.key.task_hash,
                "image_digest": self.key.image_digest,
            },
            "snapshot": self.snapshot.to_json(),
            "state": self.state,
            "bytes": self.bytes,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SetupCacheEntry:
        """Build an entry from :meth:`to_json` data."""
        return cls(
            key=SetupCacheKey(**data["key"]),
            snapshot=Snapshot.from_json(data["snapshot"]),
            state=dict(data.get("state") or {}),
            bytes=int(data.get("bytes") or 0),
            created_at=float(data.get("created_at") or 0.0),
            last_used_at=float(data.get("last_used_at") or 0.0),
        )


class SetupCache:
    """Snapshots of sandboxes right after setup, keyed by :class:`SetupCacheKey`, LRU-capped in bytes."""

    def __init__(self, backend: SandboxBackend, directory: str | os.PathLike[str], *,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.backend = backend
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        node = _UNSAFE_FILENAME.sub("_", backend.node)
        self.index_path = self.directory / f"{backend.name}-{node}.json"
        self._entries: OrderedDict[str, SetupCacheEntry] = OrderedDict()
        """Least recently used first."""
        self._released: dict[str, Snapshot] = {}
        """Snapshots the index dropped whose storage is not gone yet (a sandbox or snapshot still held it,
        or the delete failed); deleted again at every change."""
        self._uncacheable: dict[str, str] = {}
        """Key id to why its setup cannot be cached."""
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._mutex = asyncio.Lock()
        self._loaded = False
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # ------------------------------------------------------------------ reading

    async def load(self) -> None:
        """Read the index, dropping entries whose snapshot the backend no longer has (once; idempotent)."""
        async with self._mutex:
            if self._loaded:
                return
            self.directory.mkdir(parents=True, exist_ok=True)
            entries, released = self._read_index()
            known = {snap.id for snap in await self.backend.list_snapshots()}
            for entry in entries:
                if entry.snapshot.id in known:
                    self._entries[entry.key.id] = entry
                else:
                    logger.info("setup cache: dropping entry %s, whose snapshot %s is gone",
                                entry.key.id[:12], entry.snapshot.id)
            self._released = {snap.id: snap for snap in released}
            self._loaded = True
            await self._collect_released()
            self._write_index()
            logger.info("setup cache: %d entries (%d bytes) in %s", len(self._entries), self.bytes, self.index_path)

    def _read_index(self) -> tuple[list[SetupCacheEntry], list[Snapshot]]:
        try:
            data = json.loads(self.index_path.read_text())
        except FileNotFoundError:
            return [], []
        except (OSError, ValueError) as exc:
            logger.warning("setup cache: ignoring unreadable index %s: %s", self.index_path, exc)
            return [], []
        if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
            logger.warning("setup cache: ignoring index %s of another format", self.index_path)
            return [], []
        try:
            entries = [SetupCacheEntry.from_json(e) for e in data.get("entries") or []]
            released = [Snapshot.from_json(s) for s in data.get("released") or []]
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("setup cache: ignoring malformed index %s: %s", self.index_path, exc)
            return [], []
        entries.sort(key=lambda e: e.last_used_at)
        return entries, released

    @property
    def bytes(self) -> int:
        """Return the bytes the cached snapshots hold."""
        return sum(entry.bytes for entry in self._entries.values())

    def entries(self) -> list[SetupCacheEntry]:
        """Return the entries, least recently used first."""
        return list(self._entries.values())

    def stats(self) -> dict[str, int]:
        """Return hits, misses and evictions since start; entries, bytes and keys marked uncacheable now."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "bytes": self.bytes,
            "uncacheable": len(self._uncacheable),
        }

    def holds(self, snapshot_id: str) -> bool:
        """Tell whether an entry holds the snapshot (a caller whose :meth:`put` failed must not delete it then)."""
        return any(entry.snapshot.id == snapshot_id for entry in self._entries.values())

    def uncacheable(self, key: SetupCacheKey) -> str | None:
        """Return why the setup of ``key`` cannot be cached, or None if it can (or nobody has tried yet)."""
        return self._uncacheable.get(key.id)

    def mark_uncacheable(self, key: SetupCacheKey, reason: str) -> None:
        """Remember (in memory) that the setup of ``key`` cannot be cached: its claims miss without building."""
        self._uncacheable[key.id] = reason

    @asynccontextmanager
    async def claim(self, key: SetupCacheKey) -> AsyncIterator[SetupCacheEntry | None]:
        """Yield the entry of ``key`` (a hit) or None (a miss: build it and :meth:`put` it inside the block).

        Concurrent claims of one missing key build once: the others wait for the
        builder's block to end and then hit (or, if it failed, the next one builds).
        A key marked uncacheable yields None at once, counted as neither hit nor
        miss and without the lock, so its resets run side by side.
        """
        await self.load()
        entry = self._hit(key)
        if entry is None and key.id not in self._uncacheable:
            lock = self._build_locks.setdefault(key.id, asyncio.Lock())
            async with lock:
                entry = self._hit(key)
                if entry is None and key.id not in self._uncacheable:
                    self.misses += 1
                    yield None
                    return
        yield entry

    def _hit(self, key: SetupCacheKey) -> SetupCacheEntry | None:
        entry = self._entries.get(key.id)
        if entry is not None:
            self.hits += 1
            entry.last_used_at = time.time()  # written with the next change
            self._entries.move_to_end(key.id)
        return entry

    # ------------------------------------------------------------------ changing

    async def put(self, key: SetupCacheKey, snapshot: Snapshot, state: Mapping[str, Any]) -> SetupCacheEntry:
        """Store ``snapshot`` (taken right after setup) under ``key``, then evict down to the cap.

        An error (the snapshot's size or the index cannot be read or written) leaves the
        cache as it was, and ``snapshot`` the caller's; only a cancellation can land after
        the commit, so a caller cleaning up asks :meth:`holds` first.
        """
        await self.load()
        size = await self._snapshot_bytes(snapshot)
        entry = SetupCacheEntry(key=key, snapshot=snapshot, state=dict(state), bytes=size)
        async with self._mutex:
            entries = self._entries.copy()
            old = entries.pop(key.id, None)
            entries[key.id] = entry
            dropped = [old.snapshot] if old is not None and old.snapshot.id != snapshot.id else []
            victims: list[SetupCacheEntry] = []
            total = sum(e.bytes for e in entries.values())
            while total > self.max_bytes and entries:
                victims.append(entries.popitem(last=False)[1])
                total -= victims[-1].bytes
            await self._commit(entries, dropped + [victim.snapshot for victim in victims])
            for victim in victims:
                self.evictions += 1
                logger.info("setup cache: evicted %s (%d bytes, snapshot %s) to stay under %d bytes",
                            victim.key.id[:12], victim.bytes, victim.snapshot.id, self.max_bytes)
        logger.info("setup cache: stored %s (snapshot %s, %d bytes)", key.id[:12], snapshot.id, size)
        return entry

    async def discard(self, key: SetupCacheKey) -> None:
        """Drop the entry of ``key`` (its snapshot is gone or unusable) and delete its snapshot."""
        await self.load()
        async with self._mutex:
            entries = self._entries.copy()
            entry = entries.pop(key.id, None)
            if entry is not None:
                await self._commit(entries, [entry.snapshot])

    async def discard_id(self, entry_id: str) -> bool:
        """Drop the entry whose key id is (or starts with, 12 characters at least) ``entry_id``; return whether one was."""
        await self.load()
        matches = [entry.key for key_id, entry in self._entries.items()
                   if key_id == entry_id or (len(entry_id) >= 12 and key_id.startswith(entry_id))]
        if len(matches) != 1:
            return False
        await self.discard(matches[0])
        return True

    def summary(self, limit: int = 200) -> dict[str, Any]:
        """Return :meth:`stats` and the ``limit`` most recently used entries (id, environment, bytes, times)."""
        entries = [{"id": entry.key.id, "environment": entry.key.environment, "task_hash": entry.key.task_hash[:16],
                    "snapshot": entry.snapshot.id, "bytes": entry.bytes, "created_at": entry.created_at,
                    "last_used_at": entry.last_used_at}
                   for entry in reversed(self._entries.values())][:limit]
        return {**self.stats(), "max_bytes": self.max_bytes, "items": entries}

    async def clear(self) -> None:
        """Delete every entry and its backend snapshot (one that fails to delete stays released, retried later)."""
        await self.load()
        async with self._mutex:
            await self._commit(OrderedDict(), [entry.snapshot for entry in self._entries.values()])

    async def _commit(self, entries: OrderedDict[str, SetupCacheEntry], dropped: list[Snapshot]) -> None:
        """Make ``entries`` the cache's and delete the ``dropped`` snapshots, index first.

        The index is written with ``dropped`` listed as released before any is deleted: if
        the write fails, memory is put back and the error raised, with nothing deleted; once
        it succeeds, a failing delete only leaves its snapshot listed for the next change.
        """
        before = self._entries, self._released
        held = {entry.snapshot.id for entry in entries.values()}
        released = {**self._released, **{snap.id: snap for snap in dropped}}
        self._entries = entries
        self._released = {sid: snap for sid, snap in released.items() if sid not in held}
        try:
            self._write_index()
        except BaseException:
            self._entries, self._released = before
            raise
        if await self._collect_released():
            self._try_write_index()

    async def _collect_released(self) -> bool:
        """Delete released snapshots (freeing what nothing uses any more); forget those now gone.

        Errors are logged, not raised: such a snapshot stays released and is tried again at
        the next change. Returns whether any was forgotten.
        """
        forgotten = False
        for snapshot in list(self._released.values()):
            try:
                await self.backend.delete_snapshot(snapshot.id)
                present = await self._storage_present(snapshot)
            except (SandboxError, OSError) as exc:
                logger.warning("setup cache: cannot delete snapshot %s now (will retry at the next change): %s",
                               snapshot.id, exc)
                continue
            if not present:
                del self._released[snapshot.id]
                forgotten = True
        return forgotten

    def _try_write_index(self) -> None:
        """Rewrite the index after deletes; if that fails, the one on disk lists gone snapshots, which is harmless."""
        try:
            self._write_index()
        except OSError as exc:
            logger.warning("setup cache: cannot rewrite the index %s: %s", self.index_path, exc)

    def _write_index(self) -> None:
        data = {
            "version": INDEX_VERSION,
            "backend": self.backend.name,
            "node": self.backend.node,
            "entries": [entry.to_json() for entry in self._entries.values()],
            "released": [snap.to_json() for snap in self._released.values()],
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".index-", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.index_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------------ storage

    async def _snapshot_bytes(self, snapshot: Snapshot) -> int:
        if snapshot.layers:  # local: the snapshot's own layer; the ones below belong to the image
            return await asyncio.to_thread(tree_bytes, snapshot.layers[-1])
        return await self.backend.image_layer_bytes(snapshot.ref)  # type: ignore[attr-defined]

    async def _storage_present(self, snapshot: Snapshot) -> bool:
        if snapshot.layers:
            return Path(snapshot.layers[-1]).exists()
        return await self.backend.has_image(snapshot.digest)


def tree_bytes(root: str | os.PathLike[str]) -> int:
    """Return the disk bytes of a directory tree, counting hard-linked files once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


__all__ = ["DEFAULT_MAX_BYTES", "SetupCache", "SetupCacheEntry", "SetupCacheKey", "tree_bytes"]

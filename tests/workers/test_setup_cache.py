"""The setup cache on real backends: reset.sh runs once per key, later resets restore its snapshot.

The slow-setup example task (``sensor-stats``: a virtualenv plus a generated data set)
shows a hit serves the same state as the cold run without running setup again. Small
in-memory tasks with a quick setup cover the key, the LRU cap, eviction while a
restored sandbox still runs, persistence, concurrency, a setup that leaves a process
running (never cached) and failures, of setup and of the cache itself.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandboxes.base import LABEL_OWNER
from sandboxes.errors import ImageNotFoundError, SandboxError
from sandboxes.snapshots import Snapshot
from workers.envs.base import Action, run_actions
from workers.envs.sandboxed import BASE_SNAPSHOT_KEY
from workers.envs.terminal import FAMILY
from workers.envs.terminal.env import TerminalEnv
from workers.envs.terminal.task import TerminalTask, load_task_dir, load_task_files
from workers.errors import TaskFormatError, TaskSetupError
from workers.setup_cache import SetupCache, SetupCacheKey

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "terminal"
SLOW_TASK = load_task_dir(EXAMPLES / "sensor-stats")

QUICK_DOCKERFILE = b"FROM ubuntu:24.04\nRUN mkdir -p /opt/quick\nWORKDIR /app\n"
# Appends one line per run and leaves 256 KiB of random bytes, so entries have a size and runs differ.
QUICK_SETUP = b"""#!/bin/bash
set -euo pipefail
echo "run $(cat /proc/sys/kernel/random/uuid)" >> /var/log/quick-setup.log
head -c 262144 /dev/urandom > /opt/blob
echo "setup saw PWD=$PWD MARK=${MARK:-unset}" > /opt/setup-env.txt
"""
# Starts a "service" (a shell loop) that outlives reset.sh and records its pid.
SERVICE_SETUP = b"""#!/bin/bash
set -euo pipefail
echo "run $(cat /proc/sys/kernel/random/uuid)" >> /var/log/quick-setup.log
(while :; do sleep 1; done) >/dev/null 2>&1 &
echo $! > /opt/service.pid
"""
QUICK_TEST = b"""#!/bin/bash
mkdir -p /logs/verifier
test -f /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
"""


def quick_task(instruction: str = "Create /app/done.\n", *, setup: bytes = QUICK_SETUP, toml: str = "") -> TerminalTask:
    """Return a small task whose reset.sh takes milliseconds; the instruction varies its content hash only."""
    return load_task_files(
        "quick-setup",
        {
            "instruction.md": instruction.encode(),
            "task.toml": f"[agent]\ntimeout_sec = 600\n[environment]\n{toml}".encode(),
            "environment/Dockerfile": QUICK_DOCKERFILE,
            "forkyard/reset.sh": setup,
            "tests/test.sh": QUICK_TEST,
        },
    )


# ------------------------------------------------------------------ task format (no backend)


def test_setup_fields_are_parsed() -> None:
    task = quick_task()
    assert task.setup_script == QUICK_SETUP
    assert task.setup_timeout_s == 600.0 and task.deterministic_tools is False
    task = quick_task(toml="setup_timeout_sec = 90\ndeterministic_tools = true\n")
    assert task.setup_timeout_s == 90.0 and task.deterministic_tools is True
    assert SLOW_TASK.setup_script is not None and SLOW_TASK.setup_timeout_s == 120.0


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ("setup_timeout_sec = 0\n", "environment.setup_timeout_sec"),
        ('setup_timeout_sec = "10"\n', "environment.setup_timeout_sec"),
        ("setup_timeout_sec = true\n", "environment.setup_timeout_sec"),
        ('deterministic_tools = "yes"\n', "environment.deterministic_tools"),
        ("deterministic_tools = 1\n", "environment.deterministic_tools"),
    ],
)
def test_bad_setup_fields_are_refused(toml: str, field: str) -> None:
    with pytest.raises(TaskFormatError, match=field.split(".")[1]) as info:
        quick_task(toml=toml)
    assert info.value.field == field


def test_setup_script_must_be_text() -> None:
    with pytest.raises(TaskFormatError, match="reset.sh"):
        quick_task(setup=b"\xff\xfe not utf-8")


def test_key_id_depends_on_every_part() -> None:
    key = SetupCacheKey("terminal@1", "a" * 64, "sha256:1")
    assert key.id == SetupCacheKey("terminal@1", "a" * 64, "sha256:1").id
    others = [SetupCacheKey("terminal@2", "a" * 64, "sha256:1"), SetupCacheKey("terminal@1", "b" * 64, "sha256:1"),
              SetupCacheKey("terminal@1", "a" * 64, "sha256:2")]
    assert len({key.id, *(k.id for k in others)}) == 4


# ------------------------------------------------------------------ real backends


class Rig:
    """One backend with the images of the slow and the quick tasks built on it."""

    def __init__(self, backend, root: Path, slow_image: str, quick_image: str) -> None:
        self.backend = backend
        self.root = root
        self.slow_image = slow_image
        self.quick_image = quick_image
        self.owner = f"test-setup-cache-{uuid.uuid4().hex[:8]}"

    def env(self, task: TerminalTask, cache: SetupCache | None, counters: collections.Counter[str], *,
            env_version: str = "terminal@1") -> TerminalEnv:
        image = self.slow_image if task.name == SLOW_TASK.name else self.quick_image
        return TerminalEnv(task, self.backend, image=image, labels={LABEL_OWNER: self.owner},
                           setup_cache=cache, env_version=env_version, counters=counters)

    async def storage_present(self, snap: Snapshot) -> bool:
        """Tell whether the snapshot's own storage (its layer dir, or its image) still exists."""
        if snap.layers:
            return Path(snap.layers[-1]).exists()
        return await self.backend.has_image(snap.digest)

    async def snapshot_storage(self) -> set[str]:
        """Return what holds snapshot storage on the backend: layer dirs (local) or snapshot images (docker)."""
        if self.backend.name == "local":
            return {p.name for p in (self.root / "layers").iterdir() if not p.name.startswith(".")}
        import docker

        client = docker.from_env()
        try:
            images = client.images.list(all=True, filters={"label": f"forkyard.snapshot.node={self.backend.node}"})
            return {image.id for image in images}
        finally:
            client.close()


@pytest.fixture(
    scope="module",
    params=[pytest.param("local", marks=pytest.mark.local), pytest.param("docker", marks=pytest.mark.docker)],
)
async def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    from sandboxes.backends import create_backend
    from tests.conftest import base_image
    from workers.dockerfile import build_task_image

    kind = request.param
    root = tmp_path_factory.mktemp(f"setup-cache-{kind}")
    backend = create_backend(kind, node=f"test-setup-cache-{kind}-{uuid.uuid4().hex[:8]}", root_dir=root)
    images: list[str] = []
    try:
        base = await base_image(backend)
        for task in (SLOW_TASK, quick_task()):
            images.append(await build_task_image(backend, dockerfile=task.dockerfile or "",
                                                 context=task.environment_context, base_image=base))
        yield Rig(backend, root, *images)
    finally:
        try:
            for sandbox in await backend.list():
                await backend.destroy(sandbox.id)
            for image in images:
                await backend.remove_image(image)
        finally:
            await backend.aclose()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def cache(rig: Rig, tmp_path: Path) -> AsyncIterator[SetupCache]:
    """A setup cache in a fresh dir; afterwards every sandbox goes, then the cache, checked on the backend."""
    before = await rig.snapshot_storage()
    made = SetupCache(rig.backend, tmp_path / "setup-cache")
    yield made
    for sandbox in await rig.backend.list():
        await rig.backend.destroy(sandbox.id)
    await made.clear()
    assert made.stats()["entries"] == 0 and made.stats()["bytes"] == 0
    assert await rig.backend.list_snapshots() == []
    assert await rig.snapshot_storage() == before, "the setup cache left snapshot storage behind"


async def _sh(env: TerminalEnv, command: str) -> str:
    result = await env.backend.exec(env.sandbox.id, command, timeout_s=60)
    assert result.exit_code == 0, (command, result)
    return result.stdout


SLOW_STATE = (
    "cat /var/log/sensor-stats-setup.log; sha256sum /app/data/readings.csv; cat /app/data/readings.sha256; "
    "/opt/venv/bin/python -c 'import statkit; print(statkit.__version__, statkit.__file__)'; "
    "test -e /setup && echo setup-dir-left || echo setup-dir-gone; pwd; ls /logs"
)


async def test_second_reset_of_a_slow_setup_is_a_hit_with_the_same_state(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    cold = rig.env(SLOW_TASK, cache, counters)
    warm = rig.env(SLOW_TASK, cache, counters)
    try:
        assert await cold.reset() == SLOW_TASK.instruction
        assert counters == {"resets": 1, "setup_runs": 1, "setup_cache_misses": 1}
        cold_state = await _sh(cold, SLOW_STATE)
        assert cold_state.count("setup ") == 1 and "setup-dir-gone" in cold_state, cold_state

        assert await warm.reset() == SLOW_TASK.instruction
        assert counters == {"resets": 2, "setup_runs": 1, "setup_cache_misses": 1, "setup_cache_hits": 1}
        assert warm.sandbox.id != cold.sandbox.id
        # The very run of the cold reset (its random id included), not a second one.
        assert await _sh(warm, SLOW_STATE) == cold_state
        assert warm.workdir == cold.workdir == "/app"
        assert warm.export_state()["initial_env"] == cold.export_state()["initial_env"]
        assert warm.time_left() > SLOW_TASK.agent_timeout_s - 60
        stats = cache.stats()
        assert (stats["hits"], stats["misses"], stats["entries"]) == (1, 1, 1) and stats["bytes"] > 1 << 20

        # The restored sandbox is an ordinary episode: the oracle solves it; steps are counted.
        step = await warm.step(Action("bash", {"command": "test -d /opt/venv && echo ready"}))
        assert step.observation.startswith("ready")
        result = await run_actions(warm, FAMILY.oracle(SLOW_TASK))
        assert result.reward == 1.0, result.info
        assert counters["env_steps"] == 3  # the probe, then the oracle's bash call and its submit

        # A second reset of the same env hits too.
        await warm.reset()
        assert counters["setup_runs"] == 1 and counters["setup_cache_hits"] == 2
    finally:
        await cold.close()
        await warm.close()


async def test_changing_the_task_or_the_environment_version_misses(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    task = quick_task()
    other_task = quick_task("Create /app/done, please.\n")
    assert other_task.content_hash != task.content_hash
    for t, version, hit in [
        (task, "terminal@1", False),
        (task, "terminal@1", True),
        (other_task, "terminal@1", False),
        (task, "terminal@2", False),
        (other_task, "terminal@1", True),
    ]:
        hits = counters["setup_cache_hits"]
        env = rig.env(t, cache, counters, env_version=version)
        try:
            await env.reset()
            log = await _sh(env, "cat /var/log/quick-setup.log")
            assert log.count("run ") == 1
        finally:
            await env.close()
        assert counters["setup_cache_hits"] - hits == int(hit), (t.instruction, version)
    assert counters == {"resets": 5, "setup_runs": 3, "setup_cache_misses": 3, "setup_cache_hits": 2}
    assert cache.stats()["entries"] == 3


async def test_setup_runs_from_the_workdir_with_the_image_environment(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    env = rig.env(quick_task(), cache, counters)
    try:
        await env.reset()
        assert await _sh(env, "cat /opt/setup-env.txt") == "setup saw PWD=/app MARK=unset\n"
        assert await _sh(env, "test -e /setup || echo gone") == "gone\n"
    finally:
        await env.close()


async def test_a_cap_under_two_entries_evicts_the_older_one_even_while_a_restore_of_it_runs(
    rig: Rig, cache: SetupCache
) -> None:
    counters: collections.Counter[str] = collections.Counter()
    first, second = quick_task("Task one.\n"), quick_task("Task two.\n")
    envs = [rig.env(first, cache, counters), rig.env(first, cache, counters), rig.env(second, cache, counters)]
    try:
        await envs[0].reset()
        [entry] = cache.entries()
        assert entry.bytes >= 256 * 1024
        cache.max_bytes = entry.bytes * 3 // 2
        await envs[1].reset()  # restored from the entry: its sandbox stands on the snapshot's storage
        assert counters["setup_cache_hits"] == 1
        blob = await _sh(envs[1], "sha256sum /opt/blob")

        await envs[2].reset()
        assert cache.stats()["evictions"] == 1
        assert [e.key.task_hash for e in cache.entries()] == [second.content_hash]
        assert entry.snapshot.id not in {s.id for s in await rig.backend.list_snapshots()}
        # The sandbox restored from the evicted snapshot goes on unharmed...
        assert await _sh(envs[1], "sha256sum /opt/blob") == blob
        step = await envs[1].step(Action("bash", {"command": "touch /app/done"}))
        assert "[exit code: 0]" in step.observation
        # ...and the snapshot's storage is freed once that sandbox is gone.
        assert await rig.storage_present(entry.snapshot)
        await envs[1].close()
        await cache.clear()
        assert not await rig.storage_present(entry.snapshot)
    finally:
        for env in envs:
            await env.close()


async def test_the_least_recently_used_entry_is_evicted(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    tasks = {name: quick_task(f"Task {name}.\n") for name in "abc"}

    async def reset(name: str) -> None:
        env = rig.env(tasks[name], cache, counters)
        try:
            await env.reset()
        finally:
            await env.close()

    await reset("a")
    cache.max_bytes = cache.entries()[0].bytes * 5 // 2  # room for two entries
    await reset("b")
    await reset("a")  # a hit: now b is the least recently used
    assert counters["setup_cache_hits"] == 1
    evicted = cache.entries()[0]
    assert evicted.key.task_hash == tasks["b"].content_hash
    await reset("c")
    assert cache.stats()["evictions"] == 1
    assert [e.key.task_hash for e in cache.entries()] == [tasks["a"].content_hash, tasks["c"].content_hash]
    assert not await rig.storage_present(evicted.snapshot)  # nothing used it: freed at once
    await reset("a")
    assert counters["setup_cache_hits"] == 2


async def test_the_index_survives_a_restart_and_drops_vanished_snapshots(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    one, two = quick_task("Task one.\n"), quick_task("Task two.\n")
    for task in (one, two):
        env = rig.env(task, cache, counters)
        try:
            await env.reset()
        finally:
            await env.close()
    index = json.loads(cache.index_path.read_text())
    assert len(index["entries"]) == 2 and not list(cache.directory.glob(".index-*"))

    # Another process's snapshot deletion (or a wiped backend) leaves one entry without its snapshot.
    gone = next(e for e in cache.entries() if e.key.task_hash == two.content_hash)
    await rig.backend.delete_snapshot(gone.snapshot.id)
    restarted = SetupCache(rig.backend, cache.directory, max_bytes=cache.max_bytes)
    await restarted.load()
    assert [e.key.task_hash for e in restarted.entries()] == [one.content_hash]
    kept = next(e for e in cache.entries() if e.key.task_hash == one.content_hash)
    assert restarted.stats()["bytes"] == kept.bytes and restarted.entries()[0].snapshot == kept.snapshot

    for task, hit in ((one, True), (two, False)):
        env = rig.env(task, restarted, counters)
        try:
            await env.reset()
        finally:
            await env.close()
        assert restarted.stats()["hits" if hit else "misses"] == 1
    assert counters["setup_runs"] == 3
    await restarted.clear()  # the fixture's clear() of the first instance then finds its snapshots gone


async def test_a_vanished_snapshot_is_rebuilt_on_the_next_reset(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    task = quick_task()
    env = rig.env(task, cache, counters)
    try:
        await env.reset()
        [entry] = cache.entries()
        await rig.backend.delete_snapshot(entry.snapshot.id)
        await env.reset()
        assert counters["setup_runs"] == 2
        [rebuilt] = cache.entries()
        assert rebuilt.snapshot.id != entry.snapshot.id
        await env.reset()
        assert counters["setup_runs"] == 2 and counters["setup_cache_hits"] == 1
    finally:
        await env.close()


async def test_concurrent_resets_of_one_key_run_setup_once(rig: Rig, cache: SetupCache) -> None:
    counters: collections.Counter[str] = collections.Counter()
    envs = [rig.env(quick_task(), cache, counters) for _ in range(4)]
    try:
        await asyncio.gather(*(env.reset() for env in envs))
        assert counters == {"resets": 4, "setup_runs": 1, "setup_cache_misses": 1, "setup_cache_hits": 3}
        logs = {await _sh(env, "cat /var/log/quick-setup.log") for env in envs}
        assert len(logs) == 1
    finally:
        for env in envs:
            await env.close()


async def test_without_a_cache_setup_runs_at_every_reset(rig: Rig) -> None:
    counters: collections.Counter[str] = collections.Counter()
    env = rig.env(quick_task(), None, counters)
    try:
        await env.reset()
        first = await _sh(env, "cat /var/log/quick-setup.log")
        await env.reset()
        second = await _sh(env, "cat /var/log/quick-setup.log")
        assert first.count("run ") == second.count("run ") == 1 and first != second
        assert counters == {"resets": 2, "setup_runs": 2}
        await env.step(Action("bash", {"command": "true"}))
        await env.truncate("max turns reached")
        assert counters["env_steps"] == 2
    finally:
        await env.close()


async def test_a_setup_that_leaves_a_process_running_runs_at_every_reset(
    rig: Rig, cache: SetupCache, caplog: pytest.LogCaptureFixture
) -> None:
    counters: collections.Counter[str] = collections.Counter()
    task = quick_task("Serve.\n", setup=SERVICE_SETUP)
    envs = [rig.env(task, cache, counters) for _ in range(3)]
    try:
        with caplog.at_level(logging.WARNING, logger="workers.envs.terminal"):
            await envs[0].reset()
            # Known uncacheable now: later resets run setup, side by side (no build lock).
            await asyncio.gather(envs[1].reset(), envs[2].reset())
        assert counters == {"resets": 3, "setup_runs": 3, "setup_cache_misses": 1, "setup_uncacheable": 1}
        reason = cache.uncacheable(await envs[0].setup_key())
        assert reason is not None and "left processes running (bash" in reason, reason
        stats = cache.stats()
        assert (stats["entries"], stats["hits"], stats["misses"], stats["uncacheable"]) == (0, 0, 1, 1)
        # Only what each env keeps of its reset, for its verifier to compare with (deleted at close).
        kept = await rig.backend.list_snapshots()
        assert len(kept) == 3 and all(BASE_SNAPSHOT_KEY in s.metadata for s in kept), kept
        warnings = [r.getMessage() for r in caplog.records if "not caching its setup" in r.getMessage()]
        assert len(warnings) == 1 and "bash" in warnings[0], warnings
        # Every sandbox ran its own setup and has its own service running, not only the first.
        logs = set()
        for env in envs:
            log = await _sh(env, "cat /var/log/quick-setup.log")
            assert log.count("run ") == 1
            logs.add(log)
            assert await _sh(env, "cat /proc/$(cat /opt/service.pid)/comm") == "bash\n"
        assert len(logs) == 3
    finally:
        for env in envs:
            await env.close()
    assert await rig.backend.list_snapshots() == []  # closing an env deletes what it kept of its reset


async def test_a_failing_delete_while_evicting_keeps_the_new_entry_and_retries_the_delete(
    rig: Rig, cache: SetupCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    counters: collections.Counter[str] = collections.Counter()
    tasks = [quick_task(f"Task {n}.\n") for n in ("one", "two", "three")]
    env = rig.env(tasks[0], cache, counters)
    try:
        await env.reset()
    finally:
        await env.close()
    [evicted] = cache.entries()
    cache.max_bytes = evicted.bytes * 3 // 2  # room for one entry
    real_delete = rig.backend.delete_snapshot
    deleted: list[str] = []

    async def delete_failing_once(snapshot_id: str) -> None:
        deleted.append(snapshot_id)
        if len(deleted) == 1:
            raise SandboxError("injected: the engine did not answer")
        await real_delete(snapshot_id)

    monkeypatch.setattr(rig.backend, "delete_snapshot", delete_failing_once)
    envs = [rig.env(tasks[1], cache, counters), rig.env(tasks[1], cache, counters)]
    try:
        await envs[0].reset()  # evicts task one, whose delete fails: this reset is unharmed
        assert deleted == [evicted.snapshot.id]
        [stored] = cache.entries()
        assert stored.key.task_hash == tasks[1].content_hash and cache.stats()["evictions"] == 1
        # The index has the new entry, and lists the evicted snapshot for another delete.
        index = json.loads(cache.index_path.read_text())
        assert [e["snapshot"]["id"] for e in index["entries"]] == [stored.snapshot.id]
        assert [s["id"] for s in index["released"]] == [evicted.snapshot.id]
        assert await rig.storage_present(evicted.snapshot)
        await envs[1].reset()  # the new entry serves
        assert counters["setup_cache_hits"] == 1 and counters["setup_runs"] == 2
    finally:
        for env in envs:
            await env.close()
    env = rig.env(tasks[2], cache, counters)
    try:
        await env.reset()  # the next change deletes the evicted snapshot again, and task two's
    finally:
        await env.close()
    assert not await rig.storage_present(evicted.snapshot)
    assert not await rig.storage_present(stored.snapshot)
    assert json.loads(cache.index_path.read_text())["released"] == []


async def test_a_failing_index_write_changes_nothing_and_the_reset_goes_on_uncached(
    rig: Rig, cache: SetupCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    counters: collections.Counter[str] = collections.Counter()
    one, two = quick_task("Task one.\n"), quick_task("Task two.\n")
    env = rig.env(one, cache, counters)
    try:
        await env.reset()
    finally:
        await env.close()
    [kept] = cache.entries()
    cache.max_bytes = kept.bytes * 3 // 2  # storing task two would evict task one
    index = cache.index_path.read_text()

    def disk_full() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache, "_write_index", disk_full)
    env = rig.env(two, cache, counters)
    try:
        with caplog.at_level(logging.WARNING, logger="workers.envs.terminal"):
            await env.reset()
        assert "cannot store its setup in the setup cache" in caplog.text and "No space left" in caplog.text
        # The reset goes on with its freshly set-up sandbox, an ordinary episode.
        assert (await _sh(env, "cat /var/log/quick-setup.log")).count("run ") == 1
        await env.step(Action("bash", {"command": "touch /app/done"}))
        assert (await env.step(Action("submit"))).reward == 1.0
        # The cache is as it was: task one kept, its index unchanged, task two's snapshot deleted.
        assert cache.entries() == [kept] and cache.stats()["evictions"] == 0
        assert cache.index_path.read_text() == index
        cached = [s.id for s in await rig.backend.list_snapshots() if BASE_SNAPSHOT_KEY not in s.metadata]
        assert cached == [kept.snapshot.id]

        monkeypatch.undo()
        await env.reset()  # the disk has room again: this reset fills the cache
        assert [e.key.task_hash for e in cache.entries()] == [two.content_hash]
        assert cache.stats()["evictions"] == 1
        assert counters == {"resets": 3, "setup_runs": 3, "setup_cache_misses": 3, "env_steps": 2}
    finally:
        await env.close()


@pytest.mark.parametrize("cached", [True, False])
async def test_a_failing_or_slow_setup_fails_the_reset(rig: Rig, cache: SetupCache, cached: bool) -> None:
    counters: collections.Counter[str] = collections.Counter()
    failing = quick_task(setup=b"#!/bin/bash\necho preparing\necho 'pip: no such package: frobnicate' >&2\nexit 3\n")
    slow = quick_task(setup=b"#!/bin/bash\nsleep 30\n", toml="setup_timeout_sec = 1\n")
    for task, message in ((failing, "exit code 3.*no such package: frobnicate"), (slow, "setup_timeout_sec")):
        env = rig.env(task, cache if cached else None, counters)
        try:
            with pytest.raises(TaskSetupError, match=f"forkyard/reset.sh.*{message}"):
                await env.reset()
            assert env.sandbox is None
        finally:
            await env.close()
    assert [s for s in await rig.backend.list() if s.labels.get(LABEL_OWNER) == rig.owner] == []
    assert cache.stats()["entries"] == 0


async def test_image_digest_names_the_image_content(rig: Rig) -> None:
    digest = await rig.backend.image_digest(rig.quick_image)
    assert digest.startswith("sha256:") and digest == await rig.backend.image_digest(rig.quick_image)
    assert digest != await rig.backend.image_digest(rig.slow_image)
    with pytest.raises(ImageNotFoundError):
        await rig.backend.image_digest("forkyard/no-such-image:1")

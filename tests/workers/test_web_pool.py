"""Web sandboxes on the docker backend: warm pools that start Chromium ahead of resets, and a hung browser.

On the docker backend, whose engine keeps the web image the web tests built (a local
backend rebuilds it per data dir); the pool's claims themselves are backend-agnostic
(tests/workers/test_pool.py runs them on both).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sandboxes.backends import create_backend, docker_available
from sandboxes.base import LABEL_OWNER
from tests.conftest import DEFAULT_IMAGE_CACHE, base_image
from tests.live import ROOT
from tests.workers.test_pool import settle
from workers.archives import read_dir
from workers.envs.base import run_actions
from workers.envs.web import FAMILY
from workers.pool import PoolPolicy, WarmPool, is_pooled
from workers.runtime import WorkerRuntime
from workers.trust import SYSTEM_CA_BUNDLE, read_ca_bundle

pytestmark = pytest.mark.skipif(not docker_available(), reason="needs a Docker engine")


async def test_resets_claim_sandboxes_whose_browser_already_runs(tmp_path: Path) -> None:
    backend = create_backend("docker", node=f"test-web-pool-{uuid.uuid4().hex[:6]}", root_dir=tmp_path)
    pool = WarmPool(backend, PoolPolicy(max_idle=2, headroom=1.0, window_s=3600))
    runtime = WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=await base_image(backend),
                            ca_bundle=read_ca_bundle(SYSTEM_CA_BUNDLE), pool=pool)
    task = FAMILY.load_task("click-button", read_dir(ROOT / "examples" / "tasks" / "web" / "click-button",
                                                     max_bytes=1 << 20, max_files=100))
    owner = {LABEL_OWNER: f"test-web-pool-{uuid.uuid4().hex[:6]}"}
    envs = []
    try:
        image = await runtime.task_image(task)
        cold = runtime.new_env(task, image=image, labels=owner)
        envs.append(cold)
        await cold.reset()  # a miss: the env starts its own browser
        assert runtime.ctx.counters["warm_browsers"] == 0 and pool.stats()["misses"] == 1
        await settle(pool, idle=1)
        (waiting,) = [info for info in await backend.list() if is_pooled(info)]
        answer = await backend.exec(waiting.id, "pgrep -c chromium", timeout_s=10)
        assert int(answer.stdout) > 0, "a pooled web sandbox waits with Chromium running"

        warm = runtime.new_env(task, image=image, labels=owner)
        envs.append(warm)
        observation = await warm.reset()
        assert warm.sandbox is not None and warm.sandbox.id == waiting.id
        assert runtime.ctx.counters["warm_browsers"] == 1 and "[submit] button" in observation
        result = await run_actions(warm, FAMILY.oracle(task))
        assert result.terminated and result.reward == 1.0
    finally:
        for env in envs:
            await env.close()
        await pool.aclose()
        left = [info.id for info in await backend.list() if info.labels.get(LABEL_OWNER) == owner[LABEL_OWNER]]
        await backend.aclose()
    assert left == []


async def test_a_hung_browser_fails_the_episode_as_infra_and_recycles_the_sandbox(tmp_path: Path) -> None:
    """Chromium stopped (SIGSTOP) mid-episode: the step gives up after its budget, the sandbox is destroyed."""
    import signal

    from sandboxes.errors import SandboxCrashedError
    from workers.envs.base import Action
    from workers.errors import SessionClosedError

    backend = create_backend("docker", node=f"test-web-hang-{uuid.uuid4().hex[:6]}", root_dir=tmp_path)
    runtime = WorkerRuntime(backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=await base_image(backend),
                            ca_bundle=read_ca_bundle(SYSTEM_CA_BUNDLE))
    task = FAMILY.load_task("click-button", read_dir(ROOT / "examples" / "tasks" / "web" / "click-button",
                                                     max_bytes=1 << 20, max_files=100))
    owner = {LABEL_OWNER: f"test-web-hang-{uuid.uuid4().hex[:6]}"}
    env = runtime.new_env(task, image=await runtime.task_image(task), labels=owner)
    try:
        await env.reset()
        assert env.sandbox is not None
        sandbox_id = env.sandbox.id
        stopped = await backend.exec(sandbox_id, f"pkill -{int(signal.SIGSTOP)} -f '[c]hromium-headless'; echo $?",
                                     timeout_s=10)
        assert stopped.stdout.strip() == "0", stopped
        with pytest.raises(SandboxCrashedError, match="did not answer within 5s"):
            await env.step(Action("click", {"bid": "submit"}), budget_s=5)
        assert env.sandbox is None and sandbox_id not in {info.id for info in await backend.list()}
        assert runtime.ctx.counters["browser_failures"] == 1
        with pytest.raises(SessionClosedError):
            await env.step(Action("noop", {}))
    finally:
        await env.close()
        await backend.aclose()

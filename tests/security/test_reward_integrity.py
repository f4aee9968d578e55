"""The escape suite, reward level: nothing the agent leaves behind can write the reward.

Each attempt runs a real terminal episode on every backend and tier: the agent prepares its
trick with ``bash``, submits, and the verifier (which fails honestly) must still score
0. A service the agent started must still answer the verifier on localhost (Harbor's
tests rely on that), and nothing of the verifier's fork may be left afterwards.
"""

from __future__ import annotations

import pytest

from tests.sandboxes.conftest import BACKENDS, GVISOR
from tests.workers.test_terminal_env import make_harness, probe_task
from workers.envs.base import Action
from workers.envs.terminal.env import REWARD_MAX_BYTES, VERIFIER_SNAPSHOT_KEY

pytestmark = pytest.mark.timeout(300)

#: Fails honestly (the agent never solves the task), slowly enough for a race to be won.
HONEST_FAILURE = b"""#!/bin/bash
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
sleep 2
echo "verifier done: $(cat /logs/verifier/reward.txt)"
"""


@pytest.fixture(scope="module", params=[*BACKENDS, GVISOR])
async def harness(request, tmp_path_factory):
    """A terminal harness on every backend and isolation tier."""
    async for ready in make_harness(request.param, tmp_path_factory):
        yield ready


async def _submit(env):
    result = await env.step(Action("submit", {}))
    assert result.terminated or result.truncated
    return result


async def _nothing_left(harness) -> None:
    snapshots = [s for s in await harness.backend.list_snapshots() if VERIFIER_SNAPSHOT_KEY in s.metadata]
    assert snapshots == []
    roles = [i for i in await harness.backend.list() if i.labels.get("forkyard.role") == "verifier"]
    assert roles == []


async def test_background_process_cannot_rewrite_the_reward(harness):
    # "report": the writes to /logs/verifier are a finding, and the verifier still runs.
    async with harness.env(probe_task(HONEST_FAILURE, tamper="report")) as env:
        forge = (
            "nohup bash -c 'while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
            "sleep 0.01; done' >/dev/null 2>&1 & echo started"
        )
        assert "started" in (await env.step(Action("bash", {"command": forge}))).observation
        result = await _submit(env)
        assert result.reward == 0.0, result.observation
        assert "verifier done: 0" in result.info["verifier"]["stdout"]
    await _nothing_left(harness)


async def test_background_process_cannot_rewrite_the_tests(harness):
    async with harness.env(probe_task(HONEST_FAILURE, tamper="report")) as env:
        forge = (
            "nohup bash -c 'while :; do if [ -f /tests/test.sh ]; then "
            "printf \"#!/bin/bash\\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\\n\" > /tests/test.sh; "
            "fi; sleep 0.005; done' >/dev/null 2>&1 & echo started"
        )
        await env.step(Action("bash", {"command": forge}))
        result = await _submit(env)
        assert result.reward == 0.0, result.observation
    await _nothing_left(harness)


async def test_verifier_still_reaches_a_service_the_agent_started(harness):
    check = b"""#!/bin/bash
mkdir -p /logs/verifier
if python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/ok.txt', timeout=5).read().decode())" | grep -q served; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
"""
    async with harness.env(probe_task(check)) as env:
        serve = (
            "mkdir -p /srv/www && echo served > /srv/www/ok.txt && cd /srv/www && "
            "(nohup python3 -m http.server 8123 --bind 127.0.0.1 >/dev/null 2>&1 &) && sleep 1 && "
            "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/ok.txt').read())\""
        )
        assert "served" in (await env.step(Action("bash", {"command": serve}))).observation
        result = await _submit(env)
        assert result.reward == 1.0, result.observation
    await _nothing_left(harness)


async def test_oversized_reward_file_is_a_verifier_error(harness):
    sparse = b"""#!/bin/bash
mkdir -p /logs/verifier
truncate -s 256M /logs/verifier/reward.txt
"""
    async with harness.env(probe_task(sparse)) as env:
        result = await _submit(env)
        assert result.reward is None and result.info["outcome"] == "verifier_error"  # never a 0
        error = result.info["verifier_error"]
        assert f"{REWARD_MAX_BYTES // 1024} KiB" in error and "reward.txt" in error
    await _nothing_left(harness)

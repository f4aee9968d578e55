"""The terminal family's reward files: where the verifier writes them and how the host reads them.

``tests/test.sh`` writes ``/logs/verifier/reward.txt`` (one finite number) or
``/logs/verifier/reward.json`` (a non-empty object of finite numbers; the reward is its
``reward`` key, else the mean). The host reads at most :data:`REWARD_MAX_BYTES` of it.
"""

from __future__ import annotations

import json
import math

from workers.envs.sandboxed import finite_number

#: Where the verifier writes its reward.
VERIFIER_LOG_DIR = "/logs/verifier"
REWARD_TXT = f"{VERIFIER_LOG_DIR}/reward.txt"
REWARD_JSON = f"{VERIFIER_LOG_DIR}/reward.json"
#: The most a reward file may hold; the host never reads more of it.
REWARD_MAX_BYTES = 64 * 1024


class RewardError(Exception):
    """The verifier's reward file is missing or malformed."""


def parse_reward_txt(raw: bytes) -> tuple[float, dict[str, float]]:
    """Parse ``reward.txt`` (one finite number); raise RewardError otherwise."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        number = float(text)
    except ValueError:
        raise RewardError(f"{REWARD_TXT} must hold one number, got {text[:100]!r}") from None
    if not math.isfinite(number):
        raise RewardError(f"{REWARD_TXT} must hold a finite number, got {text[:100]!r}")
    return number, {"reward": number}


def parse_reward_json(raw: bytes) -> tuple[float, dict[str, float]]:
    """Parse ``reward.json`` (an object of finite numbers); the reward is its "reward" key, else the mean."""
    try:
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise RewardError(f"{REWARD_JSON} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise RewardError(f"{REWARD_JSON} must hold a non-empty object of numbers")
    details: dict[str, float] = {}
    for key, value in data.items():
        number = finite_number(value)
        if number is None:
            raise RewardError(f"{REWARD_JSON}: {key!r} must be a finite number, got {value!r}")
        details[str(key)] = number
    reward = details["reward"] if "reward" in details else sum(details.values()) / len(details)
    return reward, details


__all__ = ["REWARD_JSON", "REWARD_MAX_BYTES", "REWARD_TXT", "VERIFIER_LOG_DIR", "RewardError", "parse_reward_json", "parse_reward_txt"]

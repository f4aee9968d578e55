"""Torch-free helpers that turn training views of episodes into per-token arrays and advantages."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._models import Episode

__all__ = ["EpisodeArrays", "episode_arrays", "group_advantages"]

DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class EpisodeArrays:
    """One episode's token-aligned lists, checked for consistency."""

    episode_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """One value per position of input_ids: the sampled token's logprob, 0.0 where there is none."""
    has_logprob: list[int]
    """1 where logprobs holds the inference server's value (a sampled token it returned one for)."""
    reward: float
    group_id: Hashable


def _field(episode: Episode | Mapping[str, Any], name: str) -> Any:
    if isinstance(episode, Mapping):
        return episode.get(name)
    return getattr(episode, name, None)


def episode_arrays(episode: Episode | Mapping[str, Any]) -> EpisodeArrays:
    """Check one episode's training view and align its logprobs to token positions.

    Raises:
        ValueError: lengths disagree, the loss mask is not 0/1, or the reward is missing.
    """
    episode_id = _field(episode, "episode_id") or _field(episode, "id")
    name = f"Episode {episode_id!r}" if episode_id else "An episode"
    input_ids = list(_field(episode, "input_ids") or [])
    loss_mask = list(_field(episode, "loss_mask") or [])
    if len(loss_mask) != len(input_ids):
        raise ValueError(f"{name} has {len(input_ids)} input_ids but {len(loss_mask)} loss_mask values.")
    if any(m not in (0, 1) for m in loss_mask):
        raise ValueError(f"{name} has a loss_mask value other than 0 or 1.")
    sampled = sum(loss_mask)
    raw_logprobs = _field(episode, "logprobs")
    if raw_logprobs is None:
        if sampled:
            raise ValueError(f"{name} has {sampled} sampled tokens but no logprobs.")
        raw_logprobs = []
    if len(raw_logprobs) != sampled:
        raise ValueError(
            f"{name} has {len(raw_logprobs)} logprobs for {sampled} sampled tokens (positions where loss_mask is 1)."
        )
    sampled_logprobs = iter(raw_logprobs)
    # A server may return no logprob for some tokens; those positions hold 0.0 and are
    # marked in has_logprob rather than passed off as real values.
    logprobs: list[float] = []
    has_logprob: list[int] = []
    for m in loss_mask:
        value = next(sampled_logprobs) if m else None
        logprobs.append(float(value) if value is not None else 0.0)
        has_logprob.append(int(value is not None))
    reward = _field(episode, "reward")
    if reward is None:
        status = _field(episode, "status")
        raise ValueError(f"{name} has no reward (status {getattr(status, 'value', status)!r}); it cannot be trained on.")
    group_id = _field(episode, "group_id")
    return EpisodeArrays(
        episode_id=str(episode_id) if episode_id is not None else "",
        input_ids=[int(t) for t in input_ids],
        loss_mask=[int(m) for m in loss_mask],
        logprobs=logprobs,
        has_logprob=has_logprob,
        reward=float(reward),
        # An episode without a group is a group of its own.
        group_id=group_id if group_id is not None else ("episode", episode_id, id(episode)),
    )


def group_advantages(
    rewards: Sequence[float], group_ids: Iterable[Hashable], *, eps: float = DEFAULT_EPS
) -> list[float]:
    """Return each reward normalized within its group: (r - mean) / (std + eps); a group of one gets 0.

    The std is the sample standard deviation (n - 1 in the denominator), as in TRL's and
    verl's GRPO. Groups are formed from the rewards given, nothing else.
    """
    groups = list(group_ids)
    if len(groups) != len(rewards):
        raise ValueError(f"Got {len(rewards)} rewards but {len(groups)} group ids.")
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        if len(indices) < 2:
            continue
        values = [float(rewards[i]) for i in indices]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i, value in zip(indices, values):
            advantages[i] = (value - mean) / (std + eps)
    return advantages

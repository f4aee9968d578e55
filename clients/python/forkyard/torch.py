"""Turn episodes into padded torch tensors for a policy-gradient step (needs `pip install forkyard[torch]`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "forkyard.torch needs PyTorch, which is not installed: pip install 'forkyard[torch]' (or pip install torch)."
    ) from exc

from ._models import Episode
from ._training import DEFAULT_EPS, episode_arrays, group_advantages

__all__ = ["collate"]


def collate(
    episodes: Iterable[Episode | Mapping[str, Any]], *, pad_token_id: int = 0, eps: float = DEFAULT_EPS
) -> dict[str, torch.Tensor]:
    """Pad a batch of episodes' training views into tensors, with group-normalized advantages.

    Returns (B episodes, T the longest sequence; sequences are right-padded):
        input_ids [B, T] int64, pad_token_id after each sequence's end.
        attention_mask [B, T] int64, 1 on real tokens.
        loss_mask [B, T] int64, 1 on sampled tokens (the ones to train on).
        logprobs [B, T] float32, each sampled token's logprob at its position, 0.0 elsewhere
            (and where the inference server returned no logprob for a token).
        has_logprob [B, T] int64, 1 where logprobs holds a server-returned value; check
            has_logprob[loss_mask == 1].all() before trusting logprobs as the behaviour policy's.
        rewards [B] float32.
        advantages [B] float32, (reward - group mean) / (group std + eps) over the episodes
            of this batch with the same group_id (sample std); a group of one gets 0.
        group_index [B] int64, the group of each episode numbered 0.. in order of appearance.

    Episodes may be Episode models (e.g. an EpisodeBatch) or plain dicts of the same fields.

    Raises:
        ValueError: an episode's lengths disagree (logprobs must have one value per
            loss_mask == 1 position), or it has no reward; the message names the episode.
    """
    arrays = [episode_arrays(episode) for episode in episodes]
    if not arrays:
        raise ValueError("collate needs at least one episode.")
    batch = len(arrays)
    length = max(len(a.input_ids) for a in arrays)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.long)
    logprobs = torch.zeros((batch, length), dtype=torch.float32)
    has_logprob = torch.zeros((batch, length), dtype=torch.long)
    for row, a in enumerate(arrays):
        n = len(a.input_ids)
        if n == 0:
            continue
        input_ids[row, :n] = torch.tensor(a.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(a.loss_mask, dtype=torch.long)
        logprobs[row, :n] = torch.tensor(a.logprobs, dtype=torch.float32)
        has_logprob[row, :n] = torch.tensor(a.has_logprob, dtype=torch.long)
    group_ids = [a.group_id for a in arrays]
    numbering: dict[Any, int] = {}
    group_index = [numbering.setdefault(g, len(numbering)) for g in group_ids]
    rewards = [a.reward for a in arrays]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "has_logprob": has_logprob,
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "advantages": torch.tensor(group_advantages(rewards, group_ids, eps=eps), dtype=torch.float32),
        "group_index": torch.tensor(group_index, dtype=torch.long),
    }

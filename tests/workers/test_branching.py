"""BranchingSpec as the runner reads it back from a stored rollout, and a tree's branch budget."""

from __future__ import annotations

import pytest

from workers.branching import BranchingSpec, Tree
from workers.protocol import BranchingSpec as BranchingRequest
from workers.reporting import MemoryReporter


def stored(body: dict) -> BranchingSpec:
    """What the runner sees for a rollout created with ``branching=body``."""
    return BranchingSpec.from_dict(BranchingRequest.model_validate(body).stored())


def test_adaptive_fanout_survives_storage():
    spec = stored({"adaptive": {"budget": 6, "min_entropy": 1.0, "fanout": 4}})
    assert (spec.adaptive, spec.fanout, spec.budget, spec.min_entropy) == (True, 4, 6, 1.0)
    assert spec.max_tree_episodes == 7
    assert stored({"adaptive": {"budget": 2, "min_entropy": 0.5}}).fanout == 2
    # Only the chosen way's fields are stored and echoed.
    assert BranchingRequest.model_validate({"adaptive": {"budget": 2, "min_entropy": 0.5}}).stored() == \
        {"adaptive": {"budget": 2, "min_entropy": 0.5, "fanout": 2}}


def test_at_turns_defaults():
    spec = stored({"at_turns": [1, 3], "fanout": 3})
    assert (spec.at_turns, spec.fanout, spec.max_episodes, spec.adaptive) == ((1, 3), 3, 9, False)
    assert stored({"at_turns": [1, 3], "fanout": 3, "max_episodes": 5}).max_episodes == 5
    assert BranchingRequest.model_validate({"at_turns": [2], "fanout": 3}).stored() == {"at_turns": [2], "fanout": 3}


@pytest.mark.parametrize(
    ("body", "grants"),
    [
        ({"adaptive": {"budget": 5, "min_entropy": 0.0, "fanout": 3}}, [2, 2, 1, 0]),
        ({"at_turns": [1, 2], "fanout": 3, "max_episodes": 6}, [2, 2, 1, 0]),
    ],
)
def test_grants_stop_at_the_tree_budget(body, grants):
    async def nothing(*args):
        return []

    tree = Tree(stored(body), root_episode_id="ep_root", reporter=MemoryReporter(), delete_snapshot=nothing)
    assert [tree.grant() for _ in grants] == grants
    assert tree.episodes == tree.spec.max_tree_episodes
    tree.refund(1)
    assert tree.grant() == 1

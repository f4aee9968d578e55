"""forkyard.torch.collate: padded tensors with aligned logprobs and group-normalized advantages.

PyTorch is an optional dependency of the SDK (`forkyard[torch]`). These tests need it
and fail, rather than skip, where it is missing; the checks that `import forkyard`
works without torch run in a subprocess where torch is made unimportable.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

import forkyard

try:
    import torch
except ImportError:
    torch = None


@pytest.fixture
def tc():
    """Return forkyard.torch; fail with instructions when PyTorch is not installed."""
    if torch is None:
        pytest.fail(
            "PyTorch is not installed in this interpreter, so forkyard.torch cannot be tested: "
            "pip install 'torch==2.13.0' (the CPU wheel in /opt/wheels) or pip install './clients/python[torch]'.",
            pytrace=False,
        )
    import forkyard.torch

    return forkyard.torch


def ep(eid: str, ids: list[int], mask: list[int], logprobs: list[float] | None, reward: float | None,
       group: str | None = "g") -> dict:
    return {"episode_id": eid, "input_ids": ids, "loss_mask": mask, "logprobs": logprobs, "reward": reward,
            "group_id": group, "weight_versions": [0], "termination": "submitted", "status": "completed"}


def test_pads_right_and_aligns_logprobs_to_sampled_positions(tc):
    episodes = [
        ep("a", [11, 12, 13, 14, 15], [0, 0, 1, 0, 1], [-0.5, -1.5], 1.0),   # two turns: sample, observe, sample
        ep("b", [21, 22], [0, 1], [-0.25], 0.0),
        ep("c", [], [], [], 0.5, group="solo"),                          # no tokens at all (e.g. scripted)
    ]
    out = tc.collate(episodes, pad_token_id=-7)
    assert set(out) == {"input_ids", "attention_mask", "loss_mask", "logprobs", "has_logprob", "rewards",
                        "advantages", "group_index"}
    assert out["input_ids"].tolist() == [[11, 12, 13, 14, 15], [21, 22, -7, -7, -7], [-7] * 5]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0] * 5]
    assert out["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0], [0] * 5]
    assert out["logprobs"].tolist() == [[0.0, 0.0, -0.5, 0.0, -1.5], [0.0, -0.25, 0.0, 0.0, 0.0], [0.0] * 5]
    assert out["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert out["group_index"].tolist() == [0, 0, 1]
    assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long
    assert out["loss_mask"].dtype == torch.long
    assert out["logprobs"].dtype == torch.float32 and out["advantages"].dtype == torch.float32
    # Where the mask is 0 the logprob is exactly 0.0; where it is 1 it is the sampled token's value.
    assert torch.all(out["logprobs"][out["loss_mask"] == 0] == 0.0)
    assert out["logprobs"][out["loss_mask"] == 1].tolist() == [-0.5, -1.5, -0.25]
    assert torch.equal(out["has_logprob"], out["loss_mask"])


def test_tokens_without_a_server_logprob_are_marked(tc):
    out = tc.collate([ep("a", [1, 2, 3, 4], [0, 1, 1, 1], [-0.5, None, -0.75], 1.0)])
    assert out["logprobs"].tolist() == [[0.0, -0.5, 0.0, -0.75]]
    assert out["has_logprob"].tolist() == [[0, 1, 0, 1]]
    assert out["loss_mask"].tolist() == [[0, 1, 1, 1]], "the token is still trained on"


def test_advantages_are_normalized_within_each_group(tc):
    rewards = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.2, 0.8], "c": [3.0, 3.0, 3.0], "d": [0.7]}
    episodes = []
    for group, values in rewards.items():
        for i, r in enumerate(values):
            episodes.append(ep(f"{group}{i}", [1, 2], [0, 1], [-1.0], r, group=group))
    # Interleave the groups: grouping follows group_id, not position.
    episodes = episodes[::2] + episodes[1::2]
    eps = 1e-6
    out = tc.collate(episodes, eps=eps)
    by_id = dict(zip([e["episode_id"] for e in episodes], out["advantages"].tolist()))
    for group, values in rewards.items():
        t = torch.tensor(values, dtype=torch.float64)
        if len(values) == 1:
            expected = [0.0]
        else:
            expected = ((t - t.mean()) / (t.std() + eps)).tolist()   # torch.std: the sample std, as in GRPO
        got = [by_id[f"{group}{i}"] for i in range(len(values))]
        assert got == pytest.approx(expected, abs=1e-5), group
    assert all(by_id[f"c{i}"] == 0.0 for i in range(3)), "equal rewards give zero advantage, not NaN"
    assert not any(math.isnan(a) for a in by_id.values())
    group_of = [e["group_id"] for e in episodes]
    assert out["group_index"].tolist() == [sorted(set(group_of), key=group_of.index).index(g) for g in group_of]


def test_a_group_of_one_and_an_ungrouped_episode_get_zero(tc):
    out = tc.collate([ep("x", [1], [1], [-0.1], 1.0, group="only"), ep("y", [1], [1], [-0.1], 0.0, group=None)])
    assert out["advantages"].tolist() == [0.0, 0.0]
    assert out["group_index"].tolist() == [0, 1]


def test_collates_an_episode_batch(tc):
    episodes = [forkyard.Episode.model_validate(ep(f"e{i}", [1, 2, 3], [0, 1, 1], [-0.1, -0.2], float(i % 2)))
                for i in range(4)]
    batch = forkyard.EpisodeBatch(episodes, rollout_id="r1", consumer="c", acker=len)
    out = tc.collate(batch)
    assert out["input_ids"].shape == (4, 3)
    assert out["advantages"].tolist() == pytest.approx(batch.advantages(), abs=1e-6)


@pytest.mark.parametrize(
    ("episode", "message"),
    [
        (ep("bad1", [1, 2, 3], [0, 1, 1], [-0.1], 1.0), r"'bad1' has 1 logprobs for 2 sampled tokens"),
        (ep("bad2", [1, 2, 3], [0, 1], [-0.1], 1.0), r"'bad2' has 3 input_ids but 2 loss_mask"),
        (ep("bad3", [1, 2], [0, 2], [-0.1], 1.0), r"'bad3' has a loss_mask value other than 0 or 1"),
        (ep("bad4", [1, 2], [0, 1], None, 1.0), r"'bad4' has 1 sampled tokens but no logprobs"),
        (ep("bad5", [1, 2], [0, 1], [-0.1], None), r"'bad5' has no reward"),
    ],
)
def test_inconsistent_episodes_are_refused_by_name(tc, episode, message):
    with pytest.raises(ValueError, match=message):
        tc.collate([ep("fine", [1], [1], [-0.1], 1.0), episode])


def test_an_empty_batch_is_refused(tc):
    with pytest.raises(ValueError, match="at least one episode"):
        tc.collate([])


def _run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    # sys.modules["torch"] = None makes every `import torch` raise ImportError, as on a
    # machine without PyTorch.
    prelude = "import sys\nsys.modules['torch'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
    )


def test_forkyard_imports_without_torch():
    result = _run_without_torch("""
        import forkyard
        client = forkyard.Client(base_url="http://127.0.0.1:9", api_key="k")
        assert client.rollouts is not None
        assert forkyard.group_advantages([1.0, 0.0], ["g", "g"])[0] > 0
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_forkyard_torch_says_how_to_install_torch():
    result = _run_without_torch("""
        try:
            import forkyard.torch
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("forkyard.torch imported without torch")
    """)
    assert result.returncode == 0, result.stderr
    assert "pip install 'forkyard[torch]'" in result.stdout

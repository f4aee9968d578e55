"""Trajectory trees in the episode store: branch episodes, root-to-leaf training views, the tree route.

The tests play the runner's part through the service functions the dispatcher calls
(spawn branches, record steps, finish), on a nested tree:

    trunk  t0 t1 t2 t3          (forks at turn 1 into B, and at turn 3 into C)
    B         t1 t2             (forked at 1; forks at turn 2 into D)
    D            t2
    C               t3
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from gateway.episodes import service as episodes_service
from tests.gateway.rollout_helpers import (
    RecordingDispatcher,
    create_rollout,
    episodes_of,
    import_tasks,
    make_step,
    recording_dispatcher,
)
from workers.protocol import EpisodeOutcome
from workers.runner import failure_info


@pytest.fixture(autouse=True)
def dispatcher(request: pytest.FixtureRequest) -> Iterator[RecordingDispatcher | None]:
    with recording_dispatcher(request.getfixturevalue("gateway").app) as recorder:
        yield recorder


async def build_tree(gateway, failed: tuple[str, ...] = (), info: dict | None = None
                     ) -> tuple[dict, dict[str, list[dict]]]:
    sm = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["tree"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=1, agent={"max_turns": 6},
                                   branching={"at_turns": [1, 2, 3], "fanout": 2, "max_episodes": 4})
    (trunk,) = await episodes_of(sm, rollout["id"])
    assert trunk.root_episode_id == trunk.id
    rng = random.Random(5)
    steps: dict[str, list[dict]] = {}
    async with sm() as db:
        assert await episodes_service.mark_episode_running(db_session=db, episode_id=trunk.id, node="n")
        (b,) = await episodes_service.spawn_branches(db_session=db, parent_episode_id=trunk.id, turn=1, n=1)
        (d,) = await episodes_service.spawn_branches(db_session=db, parent_episode_id=b, turn=2, n=1)
        (c,) = await episodes_service.spawn_branches(db_session=db, parent_episode_id=trunk.id, turn=3, n=1)
        ids = {"trunk": trunk.id, "B": b, "C": c, "D": d}
        for name, turns in {"trunk": [0, 1, 2, 3], "B": [1, 2], "D": [2], "C": [3]}.items():
            steps[name] = [make_step(i, rng, version=0, first=i == 0) for i in turns]
            for step in steps[name]:
                await episodes_service.record_step(db_session=db, episode_id=ids[name], step=step)
        for name, reward in {"B": 0.0, "D": 1.0, "C": 0.5, "trunk": 1.0}.items():
            await episodes_service.finish_episode(
                db_session=db, episode_id=ids[name], status="failed" if name in failed else "completed",
                termination="error" if name in failed else "submitted", reward=None if name in failed else reward,
                info=info if name in failed else None)
    return ids, steps


async def test_nested_tree_training_views_are_root_to_leaf_paths(gateway):
    ids, steps = await build_tree(gateway)
    paths = {  # the steps each leaf's path takes, as (owner, turn)
        "trunk": [("trunk", 0), ("trunk", 1), ("trunk", 2), ("trunk", 3)],
        "B": [("trunk", 0), ("B", 1), ("B", 2)],
        "D": [("trunk", 0), ("B", 1), ("D", 2)],
        "C": [("trunk", 0), ("trunk", 1), ("trunk", 2), ("C", 3)],
    }
    shared_by = {("trunk", 0): 4, ("trunk", 1): 2, ("trunk", 2): 2, ("trunk", 3): 1, ("B", 1): 2, ("B", 2): 1,
                 ("D", 2): 1, ("C", 3): 1}
    views = {}
    for name, path in paths.items():
        response = await gateway.client.get(f"/v1/episodes/{ids[name]}/training")
        assert response.status_code == 200, response.text
        view = views[name] = response.json()
        by_turn = {(owner, s["index"]): s for owner, ss in steps.items() for s in ss}
        expected = [t for key in path for t in by_turn[key]["prompt_ids"] + by_turn[key]["completion_ids"]]
        assert view["input_ids"] == expected
        sampled = [t for key in path for t in by_turn[key]["completion_ids"]]
        assert [t for t, m in zip(view["input_ids"], view["loss_mask"], strict=True) if m] == sampled
        assert view["logprobs"] == [lp for key in path for lp in by_turn[key]["logprobs"]]
        # Segments cover input_ids in order and name who ran each run of steps and how many leaves share it.
        assert view["segments"][0]["start"] == 0 and view["segments"][-1]["end"] == len(expected)
        for seg in view["segments"]:
            owner = next(n for n, i in ids.items() if i == seg["episode_id"])
            for turn in range(seg["first_turn"], seg["last_turn"] + 1):
                assert shared_by[(owner, turn)] == seg["shared_by"]
        # The shared prefix: the steps another leaf also runs through, plus the prompt of the diverging turn.
        last_shared = max(i for i, key in enumerate(path) if shared_by[key] > 1)
        upto = path[:last_shared + 1]
        n = sum(len(by_turn[k]["prompt_ids"]) + len(by_turn[k]["completion_ids"]) for k in upto)
        assert view["shared_prefix_len"] == n + len(by_turn[path[last_shared + 1]]["prompt_ids"])
    assert views["D"]["parent_episode_id"] == ids["B"] and views["D"]["branch_turn"] == 2
    assert len({v["group_id"] for v in views.values()}) == 1

    # The detail of a branch lists its whole path, each step naming the episode that ran it.
    detail = (await gateway.client.get(f"/v1/episodes/{ids['D']}")).json()
    assert [(s["episode_id"], s["index"]) for s in detail["steps"]] == [(ids[o], t) for o, t in paths["D"]]
    assert detail["num_turns"] == 1 and detail["root_episode_id"] == ids["trunk"]


async def test_tree_route_returns_nodes_edges_leaves_and_branch_points(gateway):
    ids, _ = await build_tree(gateway)
    response = await gateway.client.get(f"/v1/episodes/{ids['C']}/tree")
    assert response.status_code == 200, response.text
    tree = response.json()
    assert tree["root_episode_id"] == ids["trunk"]
    node = {f"{n}:{t}": f"{ids[n]}:{t}" for n, ts in {"trunk": [0, 1, 2, 3], "B": [1, 2], "D": [2], "C": [3]}.items()
            for t in ts}
    assert {n["id"] for n in tree["nodes"]} == {"root", *node.values()}
    edges = {(e["parent"], e["child"]) for e in tree["edges"]}
    assert edges == {
        ("root", node["trunk:0"]), (node["trunk:0"], node["trunk:1"]), (node["trunk:1"], node["trunk:2"]),
        (node["trunk:2"], node["trunk:3"]), (node["trunk:0"], node["B:1"]), (node["B:1"], node["B:2"]),
        (node["B:1"], node["D:2"]), (node["trunk:2"], node["C:3"]),
    }
    leaves = {leaf["episode_id"]: leaf for leaf in tree["leaves"]}
    assert {leaves[ids[n]]["node"] for n in ("trunk", "B", "C", "D")} == {
        node["trunk:3"], node["B:2"], node["C:3"], node["D:2"]}
    assert leaves[ids["D"]]["reward"] == 1.0 and leaves[ids["C"]]["reward"] == 0.5
    assert sorted((b["node"], b["children"]) for b in tree["branch_points"]) == sorted(
        [(node["trunk:0"], 2), (node["B:1"], 2), (node["trunk:2"], 2)])
    # An episode outside a tree is a one-leaf tree; an unknown one is a 404.
    plain_task = await import_tasks(gateway.client, ["plain"])
    plain = await create_rollout(gateway.client, plain_task, group_size=1)
    (episode,) = await episodes_of(gateway.app.state.sessionmaker, plain["id"])
    one = (await gateway.client.get(f"/v1/episodes/{episode.id}/tree")).json()
    assert one["nodes"] == [{"id": "root", "episode_id": None, "turn": None, "tool": None, "summary": "",
                             "observation": "", "reward": None, "parse_error": False}]
    assert one["leaves"][0]["node"] == "root"
    assert (await gateway.client.get("/v1/episodes/ep_missing/tree")).status_code == 404


async def test_branching_rollouts_release_a_group_per_tree_and_count_trees_as_samples(gateway):
    sm = gateway.app.state.sessionmaker
    task_ids = await import_tasks(gateway.client, ["forest"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=3, agent={"max_turns": 4},
                                   branching={"at_turns": [1], "fanout": 3})
    assert rollout["branching"] == {"at_turns": [1], "fanout": 3} and rollout["progress"]["total"] == 3
    trunks = await episodes_of(sm, rollout["id"])
    assert len(trunks) == 3 and len({t.group_id for t in trunks}) == 3
    async with sm() as db:
        await episodes_service.mark_episode_running(db_session=db, episode_id=trunks[0].id, node="n")
        branches = await episodes_service.spawn_branches(db_session=db, parent_episode_id=trunks[0].id, turn=1, n=2)
        await episodes_service.finish_episode(db_session=db, episode_id=trunks[0].id, status="completed",
                                              termination="submitted", reward=1.0)
    progress = (await gateway.client.get(f"/v1/rollouts/{rollout['id']}")).json()["progress"]
    assert progress["finished"] == 0 and progress["streamed"] == 0  # the tree's branches still run
    async with sm() as db:
        for branch in branches:
            await episodes_service.finish_episode(db_session=db, episode_id=branch, status="completed",
                                                  termination="submitted", reward=0.0)
    progress = (await gateway.client.get(f"/v1/rollouts/{rollout['id']}")).json()["progress"]
    assert progress["finished"] == 1 and progress["streamed"] == 3  # the whole tree, as one group


async def test_deleting_a_finished_rollout_removes_its_trees(gateway):
    ids, _ = await build_tree(gateway)
    episode = (await gateway.client.get(f"/v1/episodes/{ids['trunk']}")).json()
    rollout_id = episode["rollout_id"]
    assert (await gateway.client.get(f"/v1/rollouts/{rollout_id}")).json()["status"] == "completed"
    pulled = await gateway.client.post(f"/v1/rollouts/{rollout_id}/pull", json={"consumer": "c", "max_episodes": 8})
    assert len(pulled.json()["episodes"]) == 4  # delivery state exists too
    response = await gateway.client.delete(f"/v1/rollouts/{rollout_id}")
    assert response.status_code == 204, response.text
    assert (await gateway.client.get(f"/v1/rollouts/{rollout_id}")).status_code == 404
    for episode_id in ids.values():
        assert (await gateway.client.get(f"/v1/episodes/{episode_id}")).status_code == 404
    assert (await gateway.client.delete(f"/v1/rollouts/{rollout_id}")).status_code == 404


async def test_an_active_rollout_cannot_be_deleted(gateway):
    task_ids = await import_tasks(gateway.client, ["busy"])
    rollout = await create_rollout(gateway.client, task_ids, group_size=1)
    response = await gateway.client.delete(f"/v1/rollouts/{rollout['id']}")
    assert response.status_code == 409 and response.json()["error"]["code"] == "rollout_active"
    assert "cancel it" in response.json()["error"]["message"]
    assert (await gateway.client.post(f"/v1/rollouts/{rollout['id']}/cancel")).status_code == 200
    assert (await gateway.client.delete(f"/v1/rollouts/{rollout['id']}")).status_code == 204


async def test_a_failed_leaf_shares_nothing_with_the_leaves_that_train(gateway):
    """D failed (it is dead-lettered, never trains): B's turn 1 is B's alone; D's own view still counts D."""
    ids, steps = await build_tree(gateway, failed=("D",))

    async def view(name: str) -> dict:
        response = await gateway.client.get(f"/v1/episodes/{ids[name]}/training")
        assert response.status_code == 200, response.text
        return response.json()

    b, d, trunk = await view("B"), await view("D"), await view("trunk")
    assert [seg["shared_by"] for seg in b["segments"]] == [3, 1]  # trunk t0 (trunk, B, C); B t1-t2
    assert [seg["shared_by"] for seg in d["segments"]] == [4, 2, 1]  # as if D counted: its own view
    assert [seg["shared_by"] for seg in trunk["segments"]] == [3, 2, 1]  # t0; t1-t2 (trunk, C); t3
    t0 = len(steps["trunk"][0]["prompt_ids"]) + len(steps["trunk"][0]["completion_ids"])
    assert b["shared_prefix_len"] == t0 + len(steps["B"][0]["prompt_ids"])


async def test_a_leaf_failed_for_the_infrastructure_is_not_rerun_and_its_tree_arrives_partial(gateway):
    ids, _ = await build_tree(gateway, failed=("D",), info=failure_info(EpisodeOutcome.INFRA))
    client = gateway.client
    rid = (await client.get(f"/v1/episodes/{ids['D']}")).json()["rollout_id"]
    assert len((await client.get("/v1/episodes", params={"rollout_id": rid})).json()["items"]) == 4  # no rerun
    d = (await client.get(f"/v1/episodes/{ids['D']}")).json()
    assert d["outcome"] == "infra" and d["dead_letter_reason"].endswith("episodes of trajectory trees are not rerun")
    trained = (await client.post(f"/v1/rollouts/{rid}/pull", json={"consumer": "t", "max_episodes": 10})).json()
    assert sorted(x["episode_id"] for x in trained["episodes"]) == sorted(ids[n] for n in ("trunk", "B", "C"))
    assert {x["group_reason"] for x in trained["episodes"]} == {
        "1 of 4 episodes failed for good: infra: the episode failed; episodes of trajectory trees are not rerun"}
    everything = (await client.post(f"/v1/rollouts/{rid}/pull", json={
        "consumer": "i", "max_episodes": 10, "include": ["failed"]})).json()["episodes"]
    (masked,) = [x for x in everything if x["episode_id"] == ids["D"]]
    assert masked["outcome"] == "infra" and masked["reward"] is None and set(masked["loss_mask"]) == {0}
    assert masked["segments"] and masked["group_partial"] is True
    body = (await client.get(f"/v1/rollouts/{rid}")).json()
    assert (body["status"], body["partial_groups"], body["failures"]) == ("completed", 1, {"infra": 1})

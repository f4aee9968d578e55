"""forkyard.trees: trajectory trees rendered as indented text and as SVG, and malformed trees refused."""

from __future__ import annotations

import copy
import json
import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from forkyard.trees import main, render_tree_svg, render_tree_text

SVG = "{http://www.w3.org/2000/svg}"


class TreeBuilder:
    """Build tree JSON shaped like GET /v1/episodes/{id}/tree, one episode's steps at a time."""

    def __init__(self, task_id: str = "task-1") -> None:
        self.task_id = task_id
        self.nodes: list[dict[str, Any]] = [{"id": "root"}]
        self.edges: list[dict[str, str]] = []
        self.leaves: list[dict[str, Any]] = []
        self.root_episode_id: str | None = None

    def steps(self, parent: str, episode: str, first_turn: int, *summaries: str, tool: str | None = "bash") -> str:
        """Add one step per summary after `parent`, all by `episode`; return the last node id."""
        self.root_episode_id = self.root_episode_id or episode
        for offset, summary in enumerate(summaries):
            node = f"{episode}:{first_turn + offset}"
            self.nodes.append({
                "id": node, "episode_id": episode, "turn": first_turn + offset, "tool": tool,
                "summary": summary, "observation": f"output of {summary}", "reward": None, "parse_error": False,
            })
            self.edges.append({"parent": parent, "child": node})
            parent = node
        return parent

    def leaf(self, episode: str, node: str, reward: float | None, status: str = "completed",
             termination: str | None = None, parent: str | None = None, branch_turn: int | None = None) -> None:
        self.leaves.append({
            "episode_id": episode, "node": node, "reward": reward, "status": status, "termination": termination,
            "parent_episode_id": parent, "branch_turn": branch_turn,
        })

    def tree(self) -> dict[str, Any]:
        branch_points = []
        children: dict[str, int] = {}
        for edge in self.edges:
            children[edge["parent"]] = children.get(edge["parent"], 0) + 1
        branch_points = [{"node": n, "children": c} for n, c in children.items() if c > 1]
        return {
            "root_episode_id": self.root_episode_id or "e0", "rollout_id": "ro-1", "task_id": self.task_id,
            "group_id": "g-1", "nodes": self.nodes, "edges": self.edges, "leaves": self.leaves,
            "branch_points": branch_points,
        }


def terminal_sample_tree() -> dict[str, Any]:
    """A terminal task as the gateway reports it: turns 0-based, every episode a leaf, the trunk one of the branches.

    The trunk ep-0 runs turns 0 and 1, forks 3-way at turn 2 (itself, ep-1, ep-2) and again
    2-way at turn 4 (itself, ep-3).
    """
    b = TreeBuilder(task_id="fix-calc-add")
    trunk = b.steps("root", "ep-0", 0, "ls -la", "python -m pytest -q tests/")
    fork = b.steps(trunk, "ep-0", 2, "sed -n 1,40p calc/ops.py", "sed -i 's/a - b/a + b/' calc/ops.py")
    end = b.steps(fork, "ep-0", 4, "python -m pytest -q tests/", "git diff --stat")
    b.leaf("ep-0", end, 1.0, termination="submitted")
    end = b.steps(trunk, "ep-1", 2, "pip install pytest-xdist", "python -m pytest -n 4 tests/")
    b.leaf("ep-1", end, None, status="failed", termination="error", parent="ep-0", branch_turn=2)
    end = b.steps(trunk, "ep-2", 2, "rm -rf calc/__pycache__ && echo done")
    b.leaf("ep-2", end, 0.0, termination="submitted", parent="ep-0", branch_turn=2)
    end = b.steps(fork, "ep-3", 4, "python -m pytest -q -x tests/test_ops.py", "sed -i 's/a \\* b/a + b/' calc/ops.py",
                  "python -m pytest -q tests/")
    b.leaf("ep-3", end, 0.5, status="truncated", termination="max_turns", parent="ep-0", branch_turn=4)
    tree = b.tree()
    for node in tree["nodes"]:
        if node.get("summary", "").startswith("python -m pytest"):
            node["observation"] = "F.F.. [100%]\nFAILED tests/test_ops.py::test_add - assert -1 == 5"
    return tree


def svg_root(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode("utf-8"))


def node_positions(svg: str) -> dict[str, tuple[float, float]]:
    """Return each node's centre, read from the drawn SVG."""
    positions = {}
    for group in svg_root(svg).iter(f"{SVG}g"):
        if group.get("class") != "node":
            continue
        shape = group.find(f"{SVG}circle")
        if shape is not None:
            positions[group.get("data-node")] = (float(shape.get("cx")), float(shape.get("cy")))
        else:
            rect = group.find(f"{SVG}rect")
            positions[group.get("data-node")] = (float(rect.get("x")) + 6.5, float(rect.get("y")) + 6.5)
    return positions


def edge_widths(svg: str) -> dict[str, tuple[int, float]]:
    """Return, per child node, the edge's leaf count and stroke width."""
    return {
        path.get("data-child"): (int(path.get("data-leaves")), float(path.get("stroke-width")))
        for path in svg_root(svg).iter(f"{SVG}path")
        if path.get("class") == "edge"
    }


def leaf_labels(svg: str) -> list[str]:
    """Return the leaves' labels, reward and status joined by a space (the SVG spaces them with dx)."""
    return [
        " ".join(text.itertext())
        for text in svg_root(svg).iter(f"{SVG}text")
        if text.find(f"{SVG}tspan") is not None
    ]


# --------------------------------------------------------------------------- shapes


def test_linear_chain_prints_every_step_at_one_indent():
    b = TreeBuilder()
    last = b.steps("root", "e0", 1, *[f"echo {i}" for i in range(1, 31)])
    b.leaf("e0", last, 1.0, termination="done")
    text = render_tree_text(b.tree())
    lines = text.splitlines()
    assert lines[0] == "reset (task task-1)"
    assert lines[1] == "t1 bash: echo 1"
    assert len(lines) == 31
    assert lines[-1] == "t30 bash: echo 30  => reward 1.00 (completed, done)"
    assert not any(mark in text for mark in "├└│")

    svg = render_tree_svg(b.tree())
    positions = node_positions(svg)
    assert len(positions) == 31
    assert len({y for _, y in positions.values()}) == 1
    xs = [positions[f"e0:{t}"][0] for t in range(1, 31)]
    assert xs == sorted(xs) and len(set(xs)) == 30
    assert leaf_labels(svg) == ["1.00 completed, done"]


def test_fanout_three_at_one_branch_point():
    b = TreeBuilder()
    trunk = b.steps("root", "e0", 1, "ls", "cat README.md")
    for i, reward in enumerate([1.0, 0.0, 0.5], start=1):
        end = b.steps(trunk, f"e{i}", 3, f"try {i}")
        b.leaf(f"e{i}", end, reward, parent="e0", branch_turn=2)
    assert render_tree_text(b.tree()).splitlines() == [
        "reset (task task-1)",
        "t1 bash: ls",
        "t2 bash: cat README.md",
        "├─ t3 bash: try 1  => reward 1.00 (completed)",
        "├─ t3 bash: try 2  => reward 0.00 (completed)",
        "└─ t3 bash: try 3  => reward 0.50 (completed)",
    ]

    svg = render_tree_svg(b.tree())
    positions = node_positions(svg)
    ys = [positions[f"e{i}:3"][1] for i in (1, 2, 3)]
    assert ys == sorted(ys) and len(set(ys)) == 3
    assert positions["e0:2"][1] == ys[1] == positions["e0:1"][1]
    widths = edge_widths(svg)
    assert widths["e0:1"][0] == widths["e0:2"][0] == 3
    assert widths["e0:2"][1] > widths["e1:3"][1]
    assert widths["e1:3"][0] == 1
    assert "×3" in [t.text for t in svg_root(svg).iter(f"{SVG}text")]
    assert leaf_labels(svg) == ["1.00 completed", "0.00 completed", "0.50 completed"]


def test_nested_two_by_two_indents_with_continuation_bars():
    b = TreeBuilder()
    trunk = b.steps("root", "e0", 1, "a")
    for i in (1, 2):
        mid = b.steps(trunk, f"e{i}", 2, f"b{i}", f"c{i}")
        for j in (1, 2):
            end = b.steps(mid, f"e{i}{j}", 4, f"d{i}{j}")
            b.leaf(f"e{i}{j}", end, float(j - 1), parent=f"e{i}", branch_turn=3)
    assert render_tree_text(b.tree()).splitlines() == [
        "reset (task task-1)",
        "t1 bash: a",
        "├─ t2 bash: b1",
        "│  t3 bash: c1",
        "│  ├─ t4 bash: d11  => reward 0.00 (completed)",
        "│  └─ t4 bash: d12  => reward 1.00 (completed)",
        "└─ t2 bash: b2",
        "   t3 bash: c2",
        "   ├─ t4 bash: d21  => reward 0.00 (completed)",
        "   └─ t4 bash: d22  => reward 1.00 (completed)",
    ]

    svg = render_tree_svg(b.tree())
    positions = node_positions(svg)
    rows = [positions[f"e{i}{j}:4"][1] for i in (1, 2) for j in (1, 2)]
    assert rows == sorted(rows) and len(set(rows)) == 4
    for i in (1, 2):
        assert positions[f"e{i}:3"][1] == (positions[f"e{i}1:4"][1] + positions[f"e{i}2:4"][1]) / 2
    widths = edge_widths(svg)
    assert widths["e0:1"][1] > widths["e1:2"][1] > widths["e11:4"][1]


def test_a_leaf_that_ended_before_the_next_branch_turn():
    b = TreeBuilder()
    trunk = b.steps("root", "e0", 1, "a", "b")
    long = b.steps(trunk, "e1", 3, "c", "d")
    for j in (1, 2):
        end = b.steps(long, f"e1{j}", 5, f"e{j}")
        b.leaf(f"e1{j}", end, 1.0, parent="e1", branch_turn=4)
    short = b.steps(trunk, "e2", 3, "exit")
    b.leaf("e2", short, 0.0, termination="submitted", parent="e0", branch_turn=2)
    lines = render_tree_text(b.tree()).splitlines()
    assert lines[-1] == "└─ t3 bash: exit  => reward 0.00 (completed, submitted)"
    assert lines[4:7] == ["│  t4 bash: d", "│  ├─ t5 bash: e1  => reward 1.00 (completed)",
                          "│  └─ t5 bash: e2  => reward 1.00 (completed)"]

    positions = node_positions(render_tree_svg(b.tree()))
    assert positions["e2:3"][0] == positions["e1:3"][0] < positions["e11:5"][0]
    assert positions["e2:3"][1] > positions["e12:5"][1] > positions["e11:5"][1]


def test_uneven_adaptive_tree_has_no_overlapping_nodes_and_parents_between_children():
    b = TreeBuilder()
    trunk = b.steps("root", "e0", 1, "s1")
    x = b.steps(trunk, "x", 2, "x2", "x3")
    for k in range(3):
        end = b.steps(x, f"x{k}", 4, *[f"x{k}-{t}" for t in range(k + 1)])
        b.leaf(f"x{k}", end, k / 2, parent="x", branch_turn=3)
    y = b.steps(trunk, "y", 2, "y2", "y3", "y4", "y5")
    for k in range(2):
        end = b.steps(y, f"y{k}", 6, "y6")
        b.leaf(f"y{k}", end, None if k else 0.25, status="failed" if k else "completed", parent="y", branch_turn=5)
    z = b.steps(trunk, "z", 2, "z2")
    b.leaf("z", z, 1.0, parent="e0", branch_turn=1)
    tree = b.tree()

    svg = render_tree_svg(tree)
    positions = node_positions(svg)
    assert len(positions) == len(tree["nodes"])
    assert len(set(positions.values())) == len(positions)
    leaf_rows = sorted(positions[leaf["node"]][1] for leaf in tree["leaves"])
    assert len(set(leaf_rows)) == len(leaf_rows) == 6
    children: dict[str, list[str]] = {}
    for edge in tree["edges"]:
        children.setdefault(edge["parent"], []).append(edge["child"])
    for parent, kids in children.items():
        kid_rows = [positions[k][1] for k in kids]
        assert min(kid_rows) <= positions[parent][1] <= max(kid_rows)
        assert all(positions[k][0] > positions[parent][0] for k in kids)
    assert edge_widths(svg)["e0:1"] == (6, max(w for _, w in edge_widths(svg).values()))

    text = render_tree_text(tree)
    assert text.count("=> reward") == 6
    assert "=> reward none (failed)" in text
    assert len(text.splitlines()) == len(tree["nodes"])


def test_episodes_ending_where_others_continue_get_their_own_rows():
    b = TreeBuilder()
    trunk = b.steps("root", "e0", 1, "a")
    end = b.steps(trunk, "e1", 2, "b")
    b.leaf("e1", end, 1.0)
    b.leaf("e2", trunk, 0.0, status="failed", termination="restore_error")
    b.leaf("e3", "root", None, status="failed")
    assert render_tree_text(b.tree()).splitlines() == [
        "reset (task task-1)",
        "├─ (ends here) => reward none (failed)",
        "└─ t1 bash: a",
        "   ├─ (ends here) => reward 0.00 (failed, restore_error)",
        "   └─ t2 bash: b  => reward 1.00 (completed)",
    ]
    svg = render_tree_svg(b.tree())
    ends = [g.get("data-episode") for g in svg_root(svg).iter(f"{SVG}g") if g.get("class") == "end"]
    assert ends == ["e3", "e2"]
    assert leaf_labels(svg) == ["none failed", "0.00 failed, restore_error", "1.00 completed"]


def test_a_tree_with_only_the_reset_state():
    tree = {"nodes": [{"id": "root"}], "edges": [], "leaves": []}
    assert render_tree_text(tree) == "reset\n"
    assert list(node_positions(render_tree_svg(tree))) == ["root"]


def test_steps_without_tool_and_with_parse_errors():
    b = TreeBuilder()
    first = b.steps("root", "e0", 0, "click", tool="click")
    last = b.steps(first, "e0", 1, "unparseable output", tool=None)
    b.nodes[-1]["parse_error"] = True
    b.leaf("e0", last, 0.0)
    assert render_tree_text(b.tree()).splitlines()[1:] == [
        "t0 click",
        "t1 unparseable output [parse error]  => reward 0.00 (completed)",
    ]
    svg = render_tree_svg(b.tree())
    axis = [t.text for t in svg_root(svg).iter(f"{SVG}text")][2:4]
    assert axis == ["reset", "t0"]
    assert "parse error" in [t.text for t in svg_root(svg).iter(f"{SVG}text")]


# --------------------------------------------------------------------------- SVG content


def test_svg_is_well_formed_and_escapes_hostile_text():
    b = TreeBuilder(task_id='<task & "quotes">')
    hostile = "cat <<'EOF' > a.sh && echo \"$((1<2))\" & \x1b[31mred\x1b[0m \x00\x07"
    last = b.steps("root", "e0", 1, hostile)
    b.nodes[-1]["observation"] = "<html>\x1b[1mbold</html> ]]> &amp;"
    b.leaf('e<0>&"', last, 1.0, status="<done>")
    svg = render_tree_svg(b.tree(), title="Tree <of> & 'stuff'")
    root = svg_root(svg)
    assert root.tag == f"{SVG}svg"
    assert root.find(f"{SVG}title").text == "Tree <of> & 'stuff'"
    tooltips = "\n".join(t.text or "" for t in root.iter(f"{SVG}title"))
    assert "<html>" in tooltips and "bold</html> ]]> &amp;" in tooltips
    assert "\x1b" not in svg and "\x00" not in svg
    assert "<script" not in svg and "<html>" not in svg
    assert "1.00 <done>" in leaf_labels(svg)
    text = render_tree_text(b.tree())
    assert "\x1b" not in text and "\x00" not in text


def test_svg_colours_nodes_by_reward_and_is_deterministic():
    tree = terminal_sample_tree()
    svg = render_tree_svg(tree)
    assert svg == render_tree_svg(copy.deepcopy(tree))
    root = svg_root(svg)
    fills = {}
    for group in root.iter(f"{SVG}g"):
        if group.get("class") == "node":
            circles = group.findall(f"{SVG}circle")
            if circles:
                fills[group.get("data-node")] = circles[-1].get("fill")

    def rgb(colour: str) -> tuple[int, int, int]:
        return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))

    won, lost, unknown = rgb(fills["ep-0:5"]), rgb(fills["ep-2:2"]), fills["ep-1:3"]
    assert won[1] > won[0] and lost[0] > lost[1]
    assert unknown == "#9ca3af"
    assert int(root.get("width")) > 600 and root.get("viewBox") == f"0 0 {root.get('width')} {root.get('height')}"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "Trajectory tree of task fix-calc-add" in texts
    assert "4 leaf episodes · 12 executed steps · 2 branch points · mean reward 0.50 · rollout ro-1" in texts
    assert "branch point (×children)" in texts and "4 leaves below" in texts
    assert re.search(r"<title>t4 bash: python -m pytest -q tests/\nepisode ep-0.*FAILED tests/test_ops.py", svg,
                     re.S)


def test_sample_tree_text():
    assert render_tree_text(terminal_sample_tree()) == (
        "reset (task fix-calc-add)\n"
        "t0 bash: ls -la\n"
        "t1 bash: python -m pytest -q tests/\n"
        "├─ t2 bash: sed -n 1,40p calc/ops.py\n"
        "│  t3 bash: sed -i 's/a - b/a + b/' calc/ops.py\n"
        "│  ├─ t4 bash: python -m pytest -q tests/\n"
        "│  │  t5 bash: git diff --stat  => reward 1.00 (completed, submitted)\n"
        "│  └─ t4 bash: python -m pytest -q -x tests/test_ops.py\n"
        "│     t5 bash: sed -i 's/a \\* b/a + b/' calc/ops.py\n"
        "│     t6 bash: python -m pytest -q tests/  => reward 0.50 (truncated, max_turns)\n"
        "├─ t2 bash: pip install pytest-xdist\n"
        "│  t3 bash: python -m pytest -n 4 tests/  => reward none (failed, error)\n"
        "└─ t2 bash: rm -rf calc/__pycache__ && echo done  => reward 0.00 (completed, submitted)\n"
    )


# --------------------------------------------------------------------------- validation


def _bad(mutate) -> dict[str, Any]:
    tree = terminal_sample_tree()
    mutate(tree)
    return tree


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (["not", "a", "mapping"], "must be a mapping"),
        ({"edges": []}, "no 'nodes' list"),
        ({"nodes": [{"id": "root"}]}, "no 'edges' list"),
        (_bad(lambda t: t["nodes"].pop(0)), "no 'root' node"),
        (_bad(lambda t: t["nodes"].append({"id": "ep-0:1", "turn": 1})), "'ep-0:1' appears twice"),
        (_bad(lambda t: t["nodes"].append({"id": "x:9"})), "'x:9' needs an integer 'turn'"),
        (_bad(lambda t: t["nodes"].append({"turn": 3})), r"nodes\[\d+\] must be an object with a string 'id'"),
        (_bad(lambda t: t["edges"].append({"parent": "ghost", "child": "ep-2:2"})), "unknown parent 'ghost'"),
        (_bad(lambda t: t["edges"].append({"parent": "ep-2:2", "child": "ghost"})), "unknown child 'ghost'"),
        (_bad(lambda t: t["edges"].append({"parent": "ep-2:2", "child": "root"})), "gives the root a parent"),
        (_bad(lambda t: t["edges"].append({"parent": "ep-1:3", "child": "ep-2:2"})), "'ep-2:2' has two parents"),
        (_bad(lambda t: t["edges"].pop()), "'ep-3:6' has no parent"),
        (_bad(lambda t: t["nodes"][1].update(turn=5)), "turns must increase"),
        (_bad(lambda t: t["leaves"].append({"episode_id": "e9", "node": "nowhere"})), "unknown node 'nowhere'"),
        (_bad(lambda t: t["leaves"][0].update(reward="high")), "must be a number or null"),
    ],
)
def test_malformed_trees_are_refused_with_the_reason(tree, message):
    with pytest.raises(ValueError, match=message):
        render_tree_text(tree)
    with pytest.raises(ValueError, match=message):
        render_tree_svg(tree)


def test_a_cycle_is_named():
    tree = {
        "nodes": [{"id": "root"}, {"id": "a", "turn": 1}, {"id": "b", "turn": 2}, {"id": "c", "turn": 3}],
        "edges": [{"parent": "a", "child": "b"}, {"parent": "b", "child": "c"}, {"parent": "c", "child": "a"}],
    }
    with pytest.raises(ValueError, match=r"cycle: 'a' <- 'c' <- 'b' <- 'a'"):
        render_tree_svg(tree)
    tree["edges"] = [{"parent": "a", "child": "a"}]
    with pytest.raises(ValueError, match=r"cycle: 'a' <- 'a'"):
        render_tree_text(tree)


# --------------------------------------------------------------------------- command line


def test_command_line_prints_text_and_writes_svg(tmp_path, capsys):
    source = tmp_path / "tree.json"
    source.write_text(json.dumps(terminal_sample_tree()), encoding="utf-8")
    assert main([str(source)]) == 0
    assert capsys.readouterr().out == render_tree_text(terminal_sample_tree())
    out = tmp_path / "tree.svg"
    assert main([str(source), "--svg", str(out), "--title", "Sample"]) == 0
    assert out.read_text(encoding="utf-8") == render_tree_svg(terminal_sample_tree(), title="Sample")

    source.write_text(json.dumps({"nodes": []}), encoding="utf-8")
    with pytest.raises(SystemExit) as exited:
        main([str(source)])
    assert exited.value.code == 2
    assert "no 'root' node" in capsys.readouterr().err

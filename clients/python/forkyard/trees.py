"""Render a trajectory tree (the JSON of `GET /v1/episodes/{id}/tree`) as indented text or as an SVG picture.

Both renderers are pure functions of the tree: the same input gives the same output.
Siblings keep the order in which `edges` lists them. Run `python -m forkyard.trees
TREE.json` to print a saved tree, or add `--svg OUT.svg` to draw it.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["render_tree_svg", "render_tree_text"]

ROOT_ID = "root"
TEXT_SUMMARY_CHARS = 72

# SVG geometry, in pixels.
COLUMN_WIDTH = 136
ROW_HEIGHT = 40
MARGIN = 28
NODE_RADIUS = 5.5
LEAF_RADIUS = 6.5
BRANCH_RADIUS = 8.0
FONT = "ui-sans-serif, system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
CHAR_WIDTH = 0.6  # of the font size: a generous average for a sans-serif face
NO_REWARD_COLOUR = "#9ca3af"
INK = "#1f2937"
MUTED = "#6b7280"
PARSE_ERROR_COLOUR = "#d97706"
LABEL_STYLE = (
    ' font-family="ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"'
    ' stroke="#ffffff" stroke-width="3" stroke-linejoin="round" paint-order="stroke"'
)

# Characters XML 1.0 does not allow (terminal output carries ESC and friends).
_XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class _Leaf:
    """One episode's end, attached to the node of its last step."""

    episode_id: str
    reward: float | None
    status: str
    termination: str | None


@dataclass
class _Node:
    """One state of the tree: the reset state (root) or the state after one executed step."""

    id: str
    turn: int
    tool: str | None = None
    summary: str = ""
    observation: str = ""
    reward: float | None = None
    parse_error: bool = False
    episode_id: str | None = None
    children: list[_Node] = field(default_factory=list)
    ends: list[_Leaf] = field(default_factory=list)
    leaf_rewards: list[float | None] = field(default_factory=list)
    """Rewards of every leaf at or below this node, filled in after parsing."""

    @property
    def is_root(self) -> bool:
        return self.id == ROOT_ID

    @property
    def mean_reward(self) -> float | None:
        known = [r for r in self.leaf_rewards if r is not None]
        return sum(known) / len(known) if known else None


@dataclass
class _Tree:
    root: _Node
    nodes: dict[str, _Node]
    task_id: str | None
    rollout_id: str | None

    @property
    def leaves(self) -> list[_Leaf]:
        return [leaf for node in self.nodes.values() for leaf in node.ends]


# --------------------------------------------------------------------------- parsing


def _as_list(tree: Mapping[str, Any], key: str, *, required: bool) -> list[Any]:
    value = tree.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(
            f"The tree has no {key!r} list (got {type(value).__name__}); "
            "pass the JSON object returned by GET /v1/episodes/{id}/tree."
        )
    return list(value)


def _optional_float(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number or null, not {value!r}.")
    return float(value)


def _parse_node(raw: Any, index: int) -> _Node:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
        raise ValueError(f"nodes[{index}] must be an object with a string 'id', got {raw!r}.")
    node_id = raw["id"]
    if node_id == ROOT_ID:
        return _Node(id=ROOT_ID, turn=0)
    turn = raw.get("turn")
    if isinstance(turn, bool) or not isinstance(turn, int):
        raise ValueError(f"Node {node_id!r} needs an integer 'turn', got {turn!r}.")
    tool = raw.get("tool")
    return _Node(
        id=node_id,
        turn=turn,
        tool=str(tool) if tool is not None else None,
        summary=str(raw.get("summary") or ""),
        observation=str(raw.get("observation") or ""),
        reward=_optional_float(raw.get("reward"), f"Node {node_id!r} reward"),
        parse_error=bool(raw.get("parse_error", False)),
        episode_id=str(raw["episode_id"]) if raw.get("episode_id") is not None else None,
    )


def _parse_nodes(raw_nodes: list[Any]) -> dict[str, _Node]:
    nodes: dict[str, _Node] = {}
    for index, raw in enumerate(raw_nodes):
        node = _parse_node(raw, index)
        if node.id in nodes:
            raise ValueError(f"Node id {node.id!r} appears twice in 'nodes'; each step needs its own id.")
        nodes[node.id] = node
    if ROOT_ID not in nodes:
        raise ValueError(f"The tree has no {ROOT_ID!r} node; 'nodes' must start with {{'id': '{ROOT_ID}'}}.")
    return nodes


def _link_edges(nodes: dict[str, _Node], raw_edges: list[Any]) -> dict[str, str]:
    parent_of: dict[str, str] = {}
    for index, raw in enumerate(raw_edges):
        if not isinstance(raw, Mapping):
            raise ValueError(f"edges[{index}] must be an object with 'parent' and 'child', got {raw!r}.")
        parent, child = raw.get("parent"), raw.get("child")
        if parent not in nodes:
            raise ValueError(f"edges[{index}] names unknown parent {parent!r}; every edge must join two listed nodes.")
        if child not in nodes:
            raise ValueError(f"edges[{index}] names unknown child {child!r}; every edge must join two listed nodes.")
        if child == ROOT_ID:
            raise ValueError(f"edges[{index}] gives the root a parent ({parent!r}); the root starts the tree.")
        if child in parent_of:
            raise ValueError(
                f"Node {child!r} has two parents ({parent_of[child]!r} and {parent!r}); in a tree each step has one."
            )
        parent_of[child] = parent
        nodes[parent].children.append(nodes[child])
    return parent_of


def _check_connected(nodes: dict[str, _Node], parent_of: dict[str, str]) -> None:
    reached = {ROOT_ID}
    stack = [nodes[ROOT_ID]]
    while stack:
        for child in stack.pop().children:
            reached.add(child.id)
            stack.append(child)
    for node_id in nodes:
        if node_id in reached:
            continue
        if node_id not in parent_of:
            raise ValueError(f"Node {node_id!r} has no parent; every step must descend from {ROOT_ID!r} through edges.")
        path = [node_id]
        current = parent_of[node_id]
        while current not in path and current in parent_of:
            path.append(current)
            current = parent_of[current]
        cycle = path[path.index(current) :] + [current] if current in path else path
        raise ValueError(f"The edges form a cycle: {' <- '.join(repr(n) for n in cycle)}; a tree has none.")


def _check_turns(nodes: dict[str, _Node]) -> None:
    for node in nodes.values():
        for child in node.children:
            if not node.is_root and child.turn <= node.turn:
                raise ValueError(
                    f"Edge {node.id!r} -> {child.id!r} goes from turn {node.turn} to turn {child.turn}; "
                    "turns must increase from parent to child."
                )


def _attach_leaves(nodes: dict[str, _Node], raw_leaves: list[Any]) -> None:
    for index, raw in enumerate(raw_leaves):
        if not isinstance(raw, Mapping):
            raise ValueError(f"leaves[{index}] must be an object, got {raw!r}.")
        episode_id = str(raw.get("episode_id", f"leaves[{index}]"))
        node_id = raw.get("node")
        if node_id not in nodes:
            raise ValueError(f"The leaf of episode {episode_id!r} names unknown node {node_id!r}.")
        termination = raw.get("termination")
        nodes[node_id].ends.append(
            _Leaf(
                episode_id=episode_id,
                reward=_optional_float(raw.get("reward"), f"The reward of episode {episode_id!r}"),
                status=str(raw.get("status") or "unknown"),
                termination=str(termination) if termination is not None else None,
            )
        )


def _postorder(root: _Node) -> list[_Node]:
    order: list[_Node] = []
    stack: list[tuple[_Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(node.children))
    return order


def _parse_tree(tree: Mapping[str, Any]) -> _Tree:
    if not isinstance(tree, Mapping):
        raise ValueError(
            f"A tree must be a mapping (the JSON of GET /v1/episodes/{{id}}/tree), not {type(tree).__name__}."
        )
    nodes = _parse_nodes(_as_list(tree, "nodes", required=True))
    parent_of = _link_edges(nodes, _as_list(tree, "edges", required=True))
    _check_connected(nodes, parent_of)
    _check_turns(nodes)
    _attach_leaves(nodes, _as_list(tree, "leaves", required=False))
    root = nodes[ROOT_ID]
    # The root is the state before the first step: one turn before the earliest step.
    root.turn = min((n.turn for n in nodes.values() if not n.is_root), default=1) - 1
    for node in _postorder(root):
        node.leaf_rewards = [leaf.reward for leaf in node.ends]
        for child in node.children:
            node.leaf_rewards.extend(child.leaf_rewards)

    def text(key: str) -> str | None:
        value = tree.get(key)
        return str(value) if value is not None else None

    return _Tree(
        root=root,
        nodes=nodes,
        task_id=text("task_id"),
        rollout_id=text("rollout_id"),
    )


# --------------------------------------------------------------------------- shared formatting


def _one_line(text: str, limit: int) -> str:
    line = _WHITESPACE.sub(" ", _XML_ILLEGAL.sub("", text)).strip()
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def _reward_text(reward: float | None) -> str:
    return "none" if reward is None else f"{reward:.2f}"


def _status_text(leaf: _Leaf) -> str:
    return f"{leaf.status}, {leaf.termination}" if leaf.termination else leaf.status


def _step_label(node: _Node, limit: int) -> str:
    summary = _one_line(node.summary, limit)
    if node.is_root:
        return "reset"
    if node.tool and summary and summary != node.tool:
        label = f"t{node.turn} {node.tool}: {summary}"
    else:
        label = f"t{node.turn} {node.tool or summary or '(no action)'}"
    return label + (" [parse error]" if node.parse_error else "")


def _own_row_ends(node: _Node) -> list[_Leaf]:
    """Return the ends drawn on rows of their own: all of them unless the node is a plain leaf."""
    if not node.children and len(node.ends) == 1:
        return []
    return node.ends


# --------------------------------------------------------------------------- text


def render_tree_text(tree: Mapping[str, Any]) -> str:
    """Draw the tree as indented text, one line per step; linear stretches stay at one indent.

    Each step reads `t<turn> <tool>: <summary>`; an episode's last step ends with
    `=> reward R (status)`. An episode that ended at a step which other episodes continue
    from gets a line `(ends here) => ...` of its own.

    Raises:
        ValueError: the tree is malformed (missing root, unknown node, cycle, ...).
    """
    parsed = _parse_tree(tree)
    root_line = _step_label(parsed.root, TEXT_SUMMARY_CHARS)
    if parsed.task_id:
        root_line += f" (task {parsed.task_id})"
    lines = [root_line + _leaf_suffix(parsed.root)]
    # Each item: a node whose line is printed and the prefix its continuation lines carry,
    # or an entry still to print behind a branch connector.
    stack: list[tuple[str, Any, str, bool]] = [("follow", parsed.root, "", False)]
    while stack:
        kind, item, prefix, last = stack.pop()
        if kind == "end":
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}(ends here) => {_end_text(item)}")
            continue
        if kind == "branch":
            connector = "└─ " if last else "├─ "
            lines.append(f"{prefix}{connector}{_step_label(item, TEXT_SUMMARY_CHARS)}{_leaf_suffix(item)}")
            stack.append(("follow", item, prefix + ("   " if last else "│  "), False))
            continue
        node: _Node = item
        entries: list[tuple[str, Any]] = [("end", e) for e in _own_row_ends(node)]
        entries += [("branch", c) for c in node.children]
        if len(entries) == 1 and entries[0][0] == "branch":
            child = node.children[0]
            lines.append(f"{prefix}{_step_label(child, TEXT_SUMMARY_CHARS)}{_leaf_suffix(child)}")
            stack.append(("follow", child, prefix, False))
            continue
        for position in range(len(entries) - 1, -1, -1):
            entry_kind, entry = entries[position]
            stack.append((entry_kind, entry, prefix, position == len(entries) - 1))
    return "\n".join(lines) + "\n"


def _end_text(leaf: _Leaf) -> str:
    return f"reward {_reward_text(leaf.reward)} ({_status_text(leaf)})"


def _leaf_suffix(node: _Node) -> str:
    if node.children or len(node.ends) != 1:
        return ""
    return f"  => {_end_text(node.ends[0])}"


# --------------------------------------------------------------------------- SVG layout


@dataclass(frozen=True)
class _EndMark:
    """An episode end drawn on a row of its own, next to the node where it ended."""

    leaf: _Leaf
    node: _Node
    row: float


@dataclass
class _Layout:
    column: dict[str, int]
    row: dict[str, float]
    end_marks: list[_EndMark]
    rows: int
    columns: int


def _layout(parsed: _Tree) -> _Layout:
    """Place nodes: column = turn, row = leaf order; a parent sits midway between its first and last child."""
    column = {node_id: node.turn - parsed.root.turn for node_id, node in parsed.nodes.items()}
    row: dict[str, float] = {}
    end_marks: list[_EndMark] = []
    next_row = 0
    # Top to bottom, every end drawn on a row of its own and every childless node takes the next row.
    stack: list[_Node | tuple[_Leaf, _Node]] = [parsed.root]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            end_marks.append(_EndMark(item[0], item[1], float(next_row)))
            next_row += 1
            continue
        if not item.children and not _own_row_ends(item):
            row[item.id] = float(next_row)
            next_row += 1
        slots: list[_Node | tuple[_Leaf, _Node]] = [(leaf, item) for leaf in _own_row_ends(item)]
        stack.extend(reversed(slots + item.children))
    end_rows: dict[str, list[float]] = {}
    for mark in end_marks:
        end_rows.setdefault(mark.node.id, []).append(mark.row)
    for node in _postorder(parsed.root):
        if node.id not in row:
            slots_rows = end_rows.get(node.id, []) + [row[c.id] for c in node.children]
            row[node.id] = (min(slots_rows) + max(slots_rows)) / 2
    return _Layout(column, row, end_marks, rows=max(next_row, 1), columns=max(column.values()) + 1)


# --------------------------------------------------------------------------- SVG drawing


def _xml(text: str) -> str:
    text = _XML_ILLEGAL.sub("\ufffd", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _num(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _reward_colour(reward: float | None, *, lightness: float = 0.45) -> str:
    """Map a reward to a colour from red (0 or less) through yellow to green (1 or more); grey for none."""
    if reward is None or math.isnan(reward):
        return NO_REWARD_COLOUR
    share = min(max(reward, 0.0), 1.0)
    red, green, blue = colorsys.hls_to_rgb((4 + 130 * share) / 360, lightness, 0.68)
    return f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}"


def _edge_width(leaves_below: int) -> float:
    return 1.5 + 2.2 * math.log2(max(leaves_below, 1))


def _text_width(text: str, size: float) -> float:
    return len(text) * size * CHAR_WIDTH


class _Canvas:
    """Collects SVG elements and the extent they need."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.right = 0.0

    def add(self, element: str, *, right: float = 0.0) -> None:
        self.parts.append(element)
        self.right = max(self.right, right)

    def text(self, x: float, y: float, content: str, *, size: float = 11, fill: str = INK, anchor: str = "start",
             weight: str | None = None, extra: str = "") -> None:
        weight_attr = f' font-weight="{weight}"' if weight else ""
        anchor_attr = f' text-anchor="{anchor}"' if anchor != "start" else ""
        width = _text_width(content, size)
        right = x + width if anchor == "start" else x + width / 2 if anchor == "middle" else x
        self.add(
            f'<text x="{_num(x)}" y="{_num(y)}" font-size="{_num(size)}" fill="{fill}"'
            f"{anchor_attr}{weight_attr}{extra}>{_xml(content)}</text>",
            right=right,
        )


def render_tree_svg(tree: Mapping[str, Any], *, title: str | None = None) -> str:
    """Draw the tree left to right as a standalone SVG document: x is the turn, y the leaf order.

    Nodes are coloured by the mean reward of the leaves below them (red 0 .. green 1, grey
    when unknown), branch points are ringed and marked with their fanout, an edge is as
    thick as the number of leaves below it warrants, leaves carry their reward and status,
    and every node has a tooltip with its action and observation. A legend sits below.

    Args:
        tree: the JSON object of `GET /v1/episodes/{id}/tree`.
        title: the heading; by default it names the task.

    Raises:
        ValueError: the tree is malformed (missing root, unknown node, cycle, ...).
    """
    parsed = _parse_tree(tree)
    layout = _layout(parsed)
    canvas = _Canvas()
    top = _draw_heading(canvas, parsed, title)
    axis_y = top + 8
    origin_x, origin_y = MARGIN + 24, axis_y + 30

    def x_of(node: _Node) -> float:
        return origin_x + layout.column[node.id] * COLUMN_WIDTH

    def y_of(node: _Node) -> float:
        return origin_y + layout.row[node.id] * ROW_HEIGHT

    _draw_axis(canvas, layout, parsed.root.turn, origin_x, axis_y, origin_y + (layout.rows - 1) * ROW_HEIGHT + 12)
    for node in _postorder(parsed.root):
        for child in node.children:
            _draw_edge(canvas, (x_of(node), y_of(node)), (x_of(child), y_of(child)), child)
    for mark in layout.end_marks:
        _draw_end_mark(canvas, mark, (x_of(mark.node), y_of(mark.node)), origin_y + mark.row * ROW_HEIGHT)
    for node in _postorder(parsed.root):
        _draw_node(canvas, node, x_of(node), y_of(node))
    legend_y = origin_y + (layout.rows - 1) * ROW_HEIGHT + 44
    bottom = _draw_legend(canvas, parsed, MARGIN, legend_y)
    width = math.ceil(canvas.right + MARGIN)
    height = math.ceil(bottom + MARGIN)
    heading = title if title is not None else _default_title(parsed)
    return "\n".join(
        [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="{_xml(FONT)}" role="img" aria-label="{_xml(heading)}">',
            f"<title>{_xml(heading)}</title>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
            *canvas.parts,
            "</svg>",
            "",
        ]
    )


def _default_title(parsed: _Tree) -> str:
    return f"Trajectory tree of task {parsed.task_id}" if parsed.task_id else "Trajectory tree"


def _draw_heading(canvas: _Canvas, parsed: _Tree, title: str | None) -> float:
    heading = title if title is not None else _default_title(parsed)
    canvas.text(MARGIN, MARGIN + 6, heading, size=16, weight="600")
    leaves = parsed.leaves
    steps = len(parsed.nodes) - 1
    branch_points = sum(1 for n in parsed.nodes.values() if len(n.children) > 1)
    facts = [
        f"{len(leaves)} leaf episode{'s' * (len(leaves) != 1)}",
        f"{steps} executed step{'s' * (steps != 1)}",
        f"{branch_points} branch point{'s' * (branch_points != 1)}",
        f"mean reward {_reward_text(parsed.root.mean_reward)}",
    ]
    if parsed.rollout_id:
        facts.append(f"rollout {parsed.rollout_id}")
    canvas.text(MARGIN, MARGIN + 26, " · ".join(facts), size=11, fill=MUTED)
    return MARGIN + 40


def _draw_axis(canvas: _Canvas, layout: _Layout, root_turn: int, origin_x: float, y: float, bottom: float) -> None:
    canvas.add('<g class="axis">')
    for column in range(layout.columns):
        x = origin_x + column * COLUMN_WIDTH
        label = "reset" if column == 0 else f"t{root_turn + column}"
        canvas.add(
            f'<line x1="{_num(x)}" y1="{_num(y + 8)}" x2="{_num(x)}" y2="{_num(bottom)}" '
            'stroke="#e5e7eb" stroke-width="1" stroke-dasharray="3 4"/>'
        )
        canvas.text(x, y, label, size=10, fill=MUTED, anchor="middle")
    canvas.add("</g>")


def _curve(start: tuple[float, float], end: tuple[float, float]) -> str:
    (x1, y1), (x2, y2) = start, end
    if y1 == y2:
        return f"M{_num(x1)} {_num(y1)} H{_num(x2)}"
    bend = min((x2 - x1) / 2, COLUMN_WIDTH / 2)
    return (
        f"M{_num(x1)} {_num(y1)} C{_num(x1 + bend)} {_num(y1)} {_num(x2 - bend)} {_num(y2)} "
        f"{_num(x2)} {_num(y2)}"
    )


def _draw_edge(canvas: _Canvas, start: tuple[float, float], end: tuple[float, float], child: _Node) -> None:
    below = len(child.leaf_rewards)
    tooltip = f"{below} leaf episode{'s' * (below != 1)} below"
    canvas.add(
        f'<path class="edge" data-child="{_xml(child.id)}" data-leaves="{below}" d="{_curve(start, end)}" '
        f'fill="none" stroke="{_reward_colour(child.mean_reward, lightness=0.62)}" '
        f'stroke-width="{_num(_edge_width(below))}" stroke-linecap="round"><title>{_xml(tooltip)}</title></path>'
    )


def _node_tooltip(node: _Node) -> str:
    if node.is_root:
        lines = ["reset state"]
    else:
        lines = [_step_label(node, 200)]
        details = [f"episode {node.episode_id}"] if node.episode_id else []
        if node.reward is not None:
            details.append(f"step reward {node.reward:g}")
        if details:
            lines.append(" · ".join(details))
    if len(node.children) > 1:
        lines.append(f"branch point: {len(node.children)} continuations")
    if node.leaf_rewards:
        lines.append(f"mean reward below: {_reward_text(node.mean_reward)} over {len(node.leaf_rewards)} leaves")
    for leaf in node.ends:
        lines.append(f"episode {leaf.episode_id} ends: {_end_text(leaf)}")
    if node.observation:
        lines += ["", _XML_ILLEGAL.sub("", node.observation)]
    return "\n".join(lines)


def _draw_node(canvas: _Canvas, node: _Node, x: float, y: float) -> None:
    fill = _reward_colour(node.mean_reward)
    branching = len(node.children) > 1
    plain_leaf = not node.children and len(node.ends) == 1
    parts = [f'<g class="node" data-node="{_xml(node.id)}"><title>{_xml(_node_tooltip(node))}</title>']
    if node.is_root:
        parts.append(
            f'<rect x="{_num(x - 6.5)}" y="{_num(y - 6.5)}" width="13" height="13" rx="2.5" fill="#ffffff" '
            f'stroke="{INK}" stroke-width="2"/>'
        )
    elif branching:
        parts.append(f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(BRANCH_RADIUS + 3)}" fill="#ffffff" '
                     f'stroke="{INK}" stroke-width="1.5"/>')
        parts.append(f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(BRANCH_RADIUS)}" fill="{fill}"/>')
    else:
        radius = LEAF_RADIUS if plain_leaf else NODE_RADIUS
        parts.append(f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(radius)}" fill="{fill}" '
                     'stroke="#ffffff" stroke-width="1.5"/>')
    if node.parse_error:
        parts.append(f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(NODE_RADIUS + 3.5)}" fill="none" '
                     f'stroke="{PARSE_ERROR_COLOUR}" stroke-width="1.5" stroke-dasharray="2 2"/>')
    parts.append("</g>")
    canvas.add("".join(parts), right=x + BRANCH_RADIUS + 3)
    if branching:
        canvas.text(x, y - BRANCH_RADIUS - 7, f"×{len(node.children)}", size=10, fill=INK, anchor="middle",
                    weight="600")
    elif not node.is_root:
        label = _one_line(node.summary or node.tool or "", int((COLUMN_WIDTH - 12) / (9.5 * CHAR_WIDTH)))
        # A white halo keeps the label readable where an edge into a sibling passes behind it.
        canvas.text(x, y - 10, label, size=9.5, fill=MUTED, anchor="middle", extra=LABEL_STYLE)
    if plain_leaf:
        _leaf_label(canvas, node.ends[0], x + LEAF_RADIUS + 6, y)


def _leaf_label(canvas: _Canvas, leaf: _Leaf, x: float, y: float) -> None:
    reward = _reward_text(leaf.reward)
    status = _status_text(leaf)
    canvas.add(
        f'<text x="{_num(x)}" y="{_num(y + 4)}" font-size="11">'
        f'<tspan font-weight="700" fill="{_reward_colour(leaf.reward, lightness=0.36)}">{_xml(reward)}</tspan>'
        f'<tspan dx="5" fill="{MUTED}">{_xml(status)}</tspan></text>',
        right=x + 5 + _text_width(reward + status, 11),
    )


def _draw_end_mark(canvas: _Canvas, mark: _EndMark, start: tuple[float, float], y: float) -> None:
    x = start[0] + COLUMN_WIDTH * 0.4
    colour = _reward_colour(mark.leaf.reward)
    tooltip = f"episode {mark.leaf.episode_id} ends here: {_end_text(mark.leaf)}"
    canvas.add(
        f'<path d="{_curve(start, (x, y))}" fill="none" stroke="{MUTED}" stroke-width="1.2" '
        'stroke-dasharray="3 3"/>'
        f'<g class="end" data-episode="{_xml(mark.leaf.episode_id)}"><title>{_xml(tooltip)}</title>'
        f'<rect x="{_num(x - 5)}" y="{_num(y - 5)}" width="10" height="10" fill="{colour}" '
        f'transform="rotate(45 {_num(x)} {_num(y)})"/></g>'
    )
    _leaf_label(canvas, mark.leaf, x + 11, y)


def _draw_legend(canvas: _Canvas, parsed: _Tree, x: float, y: float) -> float:
    """Draw the legend from (x, y) rightwards and return its bottom edge."""
    canvas.add('<g class="legend">')
    stops = "".join(
        f'<stop offset="{_num(share * 100)}%" stop-color="{_reward_colour(share)}"/>'
        for share in (0.0, 0.25, 0.5, 0.75, 1.0)
    )
    canvas.add(f'<defs><linearGradient id="forkyard-reward-scale">{stops}</linearGradient></defs>')
    canvas.text(x, y + 4, "reward", size=10, fill=MUTED)
    bar_x = x + 42
    canvas.add(f'<rect x="{_num(bar_x)}" y="{_num(y - 4)}" width="80" height="8" rx="2" '
               'fill="url(#forkyard-reward-scale)"/>')
    canvas.text(bar_x, y + 16, "0", size=9, fill=MUTED, anchor="middle")
    canvas.text(bar_x + 80, y + 16, "1", size=9, fill=MUTED, anchor="middle")
    cursor = bar_x + 96
    canvas.add(f'<circle cx="{_num(cursor)}" cy="{_num(y)}" r="{_num(NODE_RADIUS)}" fill="{NO_REWARD_COLOUR}"/>')
    canvas.text(cursor + 10, y + 4, "no reward", size=10, fill=MUTED)
    cursor += 84
    canvas.add(f'<circle cx="{_num(cursor)}" cy="{_num(y)}" r="{_num(BRANCH_RADIUS + 3)}" fill="#ffffff" '
               f'stroke="{INK}" stroke-width="1.5"/>'
               f'<circle cx="{_num(cursor)}" cy="{_num(y)}" r="{_num(BRANCH_RADIUS)}" fill="{NO_REWARD_COLOUR}"/>')
    canvas.text(cursor + 16, y + 4, "branch point (×children)", size=10, fill=MUTED)
    cursor += 160
    most = max((len(c.leaf_rewards) for n in parsed.nodes.values() for c in n.children), default=1)
    for leaves in sorted({1, max(most, 1)}):
        canvas.add(f'<line x1="{_num(cursor)}" y1="{_num(y)}" x2="{_num(cursor + 26)}" y2="{_num(y)}" '
                   f'stroke="{NO_REWARD_COLOUR}" stroke-width="{_num(_edge_width(leaves))}" stroke-linecap="round"/>')
        label = f"{leaves} lea{'ves' if leaves != 1 else 'f'} below"
        canvas.text(cursor + 34, y + 4, label, size=10, fill=MUTED)
        cursor += 40 + _text_width(label, 10)
    if any(n.parse_error for n in parsed.nodes.values()):
        canvas.add(f'<circle cx="{_num(cursor + 8)}" cy="{_num(y)}" r="{_num(NODE_RADIUS + 3.5)}" fill="none" '
                   f'stroke="{PARSE_ERROR_COLOUR}" stroke-width="1.5" stroke-dasharray="2 2"/>')
        canvas.text(cursor + 22, y + 4, "parse error", size=10, fill=MUTED)
    canvas.add("</g>")
    return y + 18


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """Print a saved tree as text, or draw it as SVG with --svg."""
    parser = argparse.ArgumentParser(
        prog="python -m forkyard.trees",
        description="Render the JSON of GET /v1/episodes/{id}/tree as text (default) or SVG.",
    )
    parser.add_argument("tree", help="a JSON file holding the tree, or - for standard input")
    parser.add_argument("--svg", metavar="OUT", help="write an SVG picture to OUT instead of printing text")
    parser.add_argument("--title", help="the SVG's heading (default: names the task)")
    args = parser.parse_args(argv)
    try:
        if args.tree == "-":
            tree = json.load(sys.stdin)
        else:
            with open(args.tree, encoding="utf-8") as handle:
                tree = json.load(handle)
        if args.svg:
            picture = render_tree_svg(tree, title=args.title)
            with open(args.svg, "w", encoding="utf-8") as handle:
                handle.write(picture)
        else:
            sys.stdout.write(render_tree_text(tree))
    except (OSError, ValueError) as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

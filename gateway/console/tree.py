"""The trajectory tree drawn as SVG: a column per turn, a row per leaf, edges as wide as the leaves sharing them.

Input is ``GET /v1/episodes/{id}/tree``'s body (:func:`gateway.episodes.service.get_tree`);
each node links to its step, and each edge and node is coloured by the mean reward of the
leaves below it (red 0 .. green 1).
"""

from __future__ import annotations

import statistics
from html import escape
from typing import Any

from markupsafe import Markup

COL_W, ROW_H, PAD = 90, 34, 24


def reward_colour(mean: float | None) -> str:
    """Return an HSL colour for a mean reward: grey when none, red (0) through amber to green (1)."""
    if mean is None:
        return "hsl(0, 0%, 60%)"
    clamped = min(1.0, max(0.0, mean))
    return f"hsl({round(120 * clamped)}, 65%, 42%)"


def layout(tree: dict[str, Any]) -> dict[str, Any]:
    """Place the tree's nodes: x by depth, y by leaf order (parents centred on their children).

    Returns nodes (id, x, y, leaves below, mean reward below, the step's fields), edges (with
    their width and colour) and the leaves in drawing order.
    """
    children: dict[str, list[str]] = {}
    for edge in tree["edges"]:
        children.setdefault(edge["parent"], []).append(edge["child"])
    info = {n["id"]: n for n in tree["nodes"]}
    leaf_rewards: dict[str, list[float]] = {}
    for leaf in tree["leaves"]:
        if leaf["reward"] is not None:
            leaf_rewards.setdefault(leaf["node"], []).append(float(leaf["reward"]))
    leaf_count: dict[str, int] = {}
    for leaf in tree["leaves"]:
        leaf_count[leaf["node"]] = leaf_count.get(leaf["node"], 0) + 1

    placed: dict[str, dict[str, Any]] = {}
    next_row = [0]

    def visit(node: str, depth: int) -> tuple[int, list[float]]:
        kids = children.get(node, [])
        rewards = list(leaf_rewards.get(node, []))
        leaves = leaf_count.get(node, 0)
        ys = []
        for kid in kids:
            n, r = visit(kid, depth + 1)
            leaves += n
            rewards += r
            ys.append(placed[kid]["y"])
        if not kids:
            y = PAD + next_row[0] * ROW_H
            next_row[0] += max(1, leaf_count.get(node, 1))
        else:
            y = sum(ys) / len(ys)
        mean = statistics.fmean(rewards) if rewards else None
        placed[node] = {**info.get(node, {"id": node}), "x": PAD + depth * COL_W, "y": y, "leaves": leaves,
                        "mean_reward": mean, "colour": reward_colour(mean)}
        return leaves, rewards

    visit("root", 0)
    edges = []
    for edge in tree["edges"]:
        parent, child = placed.get(edge["parent"]), placed.get(edge["child"])
        if parent is None or child is None:
            continue
        edges.append({"parent": parent, "child": child, "width": 1.5 + 2.5 * max(1, child["leaves"]) ** 0.5,
                      "colour": child["colour"]})
    width = PAD * 2 + COL_W * max((n["x"] - PAD) // COL_W for n in placed.values()) + 160
    height = PAD * 2 + ROW_H * max(1, next_row[0] - 1)
    return {"nodes": list(placed.values()), "edges": edges, "width": int(width), "height": int(height)}


def tree_svg(tree: dict[str, Any], *, step_url: str) -> Markup:
    """Return the tree as an SVG whose nodes load their step (``step_url`` with ``{episode}`` and ``{turn}``)
    into ``#tree-step`` with htmx, or open it as a page without."""
    placed = layout(tree)
    parts = [f'<svg class="tree" role="img" width="{placed["width"]}" height="{placed["height"]}" '
             f'viewBox="0 0 {placed["width"]} {placed["height"]}"><title>trajectory tree of '
             f'{escape(tree["root_episode_id"])}</title>']
    for edge in placed["edges"]:
        p, c = edge["parent"], edge["child"]
        mid = (p["x"] + c["x"]) / 2
        parts.append(f'<path d="M{p["x"]},{p["y"]:.1f} C{mid},{p["y"]:.1f} {mid},{c["y"]:.1f} {c["x"]},{c["y"]:.1f}" '
                     f'fill="none" stroke="{edge["colour"]}" stroke-width="{edge["width"]:.1f}" '
                     f'stroke-opacity="0.7" data-leaves="{c["leaves"]}"/>')
    leaves_at = {leaf["node"]: leaf for leaf in tree["leaves"]}
    for node in placed["nodes"]:
        label = "start" if node["id"] == "root" else f'{node.get("turn", "")}: {node.get("summary") or node.get("tool") or ""}'
        mean = "–" if node["mean_reward"] is None else f'{node["mean_reward"]:.2f}'
        tip = f'{label} — {node["leaves"]} leaves below, mean reward {mean}'
        circle = (f'<circle cx="{node["x"]}" cy="{node["y"]:.1f}" r="7" fill="{node["colour"]}"/>'
                  f'<title>{escape(tip)}</title>')
        if node["id"] == "root":
            parts.append(f'<g class="node" data-node="root">{circle}</g>')
            continue
        url = step_url.format(episode=node["episode_id"], turn=node["turn"])
        parts.append(f'<a href="{escape(url)}" hx-get="{escape(url)}" hx-target="#tree-step" hx-push-url="false" '
                     f'class="node" data-node="{escape(node["id"])}" tabindex="0">{circle}</a>')
        leaf = leaves_at.get(node["id"])
        if leaf is not None and not any(e["parent"] is node for e in placed["edges"]):
            reward = "–" if leaf["reward"] is None else f'{leaf["reward"]:g}'
            parts.append(f'<text x="{node["x"] + 12}" y="{node["y"] + 4:.1f}" class="leaf" '
                         f'data-episode="{escape(leaf["episode_id"])}" data-reward="{reward}">'
                         f'{escape(leaf["episode_id"][-8:])} · r={reward}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))

"""Small charts drawn on the server as inline SVG: no chart library, nothing for the browser to run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from markupsafe import Markup


def _fmt(value: float) -> str:
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def line_chart(points: Sequence[tuple[str, float | None]], *, label: str, width: int = 320, height: int = 80,
               y_min: float | None = None, y_max: float | None = None) -> Markup:
    """Return an SVG line chart of ``points`` (x label, value or None for a gap), with its range marked.

    ``label`` names the series (the SVG's accessible title).
    """
    values = [v for _, v in points if v is not None and math.isfinite(v)]
    title = f"<title>{escape(label)}</title>"
    if not values:
        return Markup(f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
                      f'{title}<text x="4" y="{height // 2}" class="muted">no data yet</text></svg>')
    lo = min(values) if y_min is None else y_min
    hi = max(values) if y_max is None else y_max
    if hi <= lo:
        hi = lo + 1
    pad_l, pad_r, pad_y = 34, 4, 8
    span_x = max(1, len(points) - 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad_l + (width - pad_l - pad_r) * i / span_x
        y = height - pad_y - (height - 2 * pad_y) * (v - lo) / (hi - lo)
        return round(x, 1), round(y, 1)

    paths, current, dots = [], [], []
    for i, (name, v) in enumerate(points):
        if v is None or not math.isfinite(v):
            if current:
                paths.append(current)
                current = []
            continue
        x, y = xy(i, v)
        current.append(f"{x},{y}")
        dots.append(f'<circle cx="{x}" cy="{y}" r="2"><title>{escape(name)}: {_fmt(v)}</title></circle>')
    if current:
        paths.append(current)
    lines = "".join(f'<polyline fill="none" points="{" ".join(p)}"/>' for p in paths)
    axis = (f'<text x="0" y="{pad_y + 4}" class="axis">{_fmt(hi)}</text>'
            f'<text x="0" y="{height - pad_y + 4}" class="axis">{_fmt(lo)}</text>'
            f'<line x1="{pad_l}" y1="{height - pad_y}" x2="{width - pad_r}" y2="{height - pad_y}" class="base"/>')
    return Markup(f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
                  f'{title}{axis}<g class="series">{lines}{"".join(dots)}</g></svg>')


def bar_chart(bars: Sequence[tuple[str, float]], *, label: str, width: int = 320, height: int = 80) -> Markup:
    """Return an SVG bar chart of ``bars`` (label, value), each bar titled with its label and value."""
    title = f"<title>{escape(label)}</title>"
    if not bars or max(v for _, v in bars) <= 0:
        return Markup(f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
                      f'{title}<text x="4" y="{height // 2}" class="muted">no data yet</text></svg>')
    top = max(v for _, v in bars)
    gap, pad_b = 2, 14
    w = (width - gap * (len(bars) - 1)) / len(bars)
    parts = []
    for i, (name, v) in enumerate(bars):
        h = (height - pad_b) * v / top
        x = i * (w + gap)
        parts.append(f'<rect x="{x:.1f}" y="{height - pad_b - h:.1f}" width="{w:.1f}" height="{h:.1f}">'
                     f'<title>{escape(name)}: {_fmt(v)}</title></rect>')
    first, last = escape(bars[0][0]), escape(bars[-1][0])
    axis = (f'<text x="0" y="{height - 2}" class="axis">{first}</text>'
            f'<text x="{width}" y="{height - 2}" class="axis" text-anchor="end">{last}</text>')
    return Markup(f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
                  f'{title}<g class="bars">{"".join(parts)}</g>{axis}</svg>')

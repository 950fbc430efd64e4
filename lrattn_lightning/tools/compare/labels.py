"""Labels that cover nothing: where `lrattn compare` writes a point's name in a figure (figures.py, Figure 1).

Each label is tried at offsets on rings around its point, nearest first, 16 directions a ring (right of the point
first), each aligned away from the point; a place is taken when the label's drawn box (measured with the figure's
renderer, with a small margin) overlaps no point, error bar, Pareto ring, drawn line (`line_boxes`), tick label,
axis label, title, legend or earlier label. `place` with `inside`: only places within the axes and within `reach`
points of the point (None when one label finds none: the caller then numbers the points and keys the numbers in
the legend); without it the search goes on outward, past the axes, until a free place is found, and a label set
away from its point gets a thin leader line to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels
RADII = (9, 13, 18, 24, 31, 39, 48, 58, 70, 84, 100, 120, 145, 175, 210, 250, 300, 360)  # points
LEADER_FROM = 20  # points: a label farther than this from its point is tied to it by a line


def overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def box_of(extent: Any) -> Box:
    return (extent.x0, extent.y0, extent.x1, extent.y1)


def furniture(fig: Any, ax: Any) -> list[Box]:
    """What a label must not cover besides the data: tick labels, axis labels, the title, the legend."""
    renderer = fig.canvas.get_renderer()
    texts = [*ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label, ax.yaxis.label, ax.title]
    boxes = [box_of(t.get_window_extent(renderer)) for t in texts if t.get_visible() and t.get_text()]
    legend = ax.get_legend()
    if legend is not None:
        boxes.append(box_of(legend.get_window_extent(renderer)))
    return boxes


ANGLES = (0, 30, -30, 60, -60, 90, -90, 150, -150, 180, 120, -120, 15, -15, 165, -165)  # degrees, right first


def line_boxes(ax: Any) -> list[Box]:
    """Thin boxes along each straight piece of the axes' lines (the Pareto front's steps, the control's level):
    a label is not written across them."""
    boxes = []
    for line in ax.get_lines():
        points = line.get_transform().transform(line.get_xydata())
        for (x0, y0), (x1, y1) in zip(points[:-1], points[1:], strict=True):
            if math.isfinite(x0 + y0 + x1 + y1):
                boxes.append((min(x0, x1) - 1, min(y0, y1) - 1, max(x0, x1) + 1, max(y0, y1) + 1))
    return boxes


def _candidates(reach: float | None) -> list[tuple[float, float, str, str]]:
    """(dx, dy, ha, va) in points, nearest first: the text aligned away from its point in each direction."""
    out = []
    for radius in RADII:
        if reach is not None and radius > reach:
            break
        for degrees in ANGLES:
            c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
            ha = "left" if c > 0.3 else "right" if c < -0.3 else "center"
            va = "bottom" if s > 0.3 else "top" if s < -0.3 else "center"
            out.append((radius * c, radius * s, ha, va))
    return out


def place(fig: Any, ax: Any, items: Sequence[tuple[tuple[float, float], str, Any]], avoid: list[Box], *,
          inside: bool, reach: float | None = None, fontsize: float = 9) -> list[Any] | None:
    """Annotate each (xy in data, text, colour) where it covers nothing in `avoid` (extended with each label
    placed): within the axes (and `reach` points) if it can; with `inside`, None (and nothing drawn) when one
    label cannot, else past the axes."""
    renderer = fig.canvas.get_renderer()
    frame = box_of(ax.get_window_extent(renderer))
    taken, made = list(avoid), []
    for xy, text, color in items:
        probe = ax.annotate(text, xy, fontsize=fontsize)
        size = probe.get_window_extent(renderer)
        probe.remove()
        x, y = ax.transData.transform(xy)
        found = _free(x, y, size.width, size.height, fig.dpi / 72, taken, frame, reach)
        if found is None and not inside:
            found = _free(x, y, size.width, size.height, fig.dpi / 72, taken, None, None) or \
                (RADII[-1], 0.0, "left", "center", (x, y, x + size.width, y + size.height))  # past every ring
        if found is None:
            for label in made:
                label.remove()
            return None
        dx, dy, ha, va, box = found
        far = math.hypot(dx, dy) > LEADER_FROM
        made.append(ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                                fontsize=fontsize, annotation_clip=False, zorder=6,
                                arrowprops={"arrowstyle": "-", "lw": 0.6, "color": color, "shrinkA": 1, "shrinkB": 6}
                                if far else None))
        taken.append(box)
    return made


def _free(x: float, y: float, w: float, h: float, px: float, taken: list[Box], frame: Box | None,
          reach: float | None) -> tuple | None:
    """The nearest candidate place (dx, dy, ha, va, its box) for a w x h label of the point at (x, y) pixels
    that overlaps nothing taken (and lies in `frame` when given)."""
    for dx, dy, ha, va in _candidates(reach):
        left = x + dx * px - {"left": 0, "center": w / 2, "right": w}[ha]
        bottom = y + dy * px - {"bottom": 0, "center": h / 2, "top": h}[va]
        box = (left - 2, bottom - 2, left + w + 2, bottom + h + 2)
        within = frame is None or (frame[0] <= box[0] <= box[2] <= frame[2] and frame[1] <= box[1] <= box[3] <= frame[3])
        if not within:
            continue
        if not any(overlap(box, other) for other in taken):
            return dx, dy, ha, va, box
    return None

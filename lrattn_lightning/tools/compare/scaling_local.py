"""Per-size compute multipliers read off the reference's own ladder, no law assumed: for a method's mean loss at one
size, the compute at which the reference's seed-mean losses (piecewise linear in log compute between its sizes)
reach that loss, over the method's compute there. Where the ladder bends away from one power law (every method
alike), the shared law's fit is poor and scaling.py gives no multiplier; this reading still holds, size by size.

    k_s = C_ref(L_m(s)) / C_m(s)        k > 1: the method at size s is worth k times its compute in reference runs

A loss below the reference's lowest (or above its highest) is read off the line through its last (first) two
sizes, and marked extrapolated. Interval: percentile bootstrap over seeds (each (method, size) cell's seeds, the
reference's included, resampled with replacement; deviations scaled by sqrt(n/(n-1))), its ends expanded to
Student's t for the cell's degrees of freedom, as scaling.py's. A reference whose mean loss does not fall from one
size to the next gives no reading there, said in one line.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from lrattn_lightning.tools.compare.scaling import LEVEL, RESAMPLES, Point, expanded_tail


@dataclass(frozen=True)
class LocalMultiplier:
    method: str
    size: str
    seeds: int
    delta: float  # the method's mean loss minus the reference's at this size
    k: float | None  # None: the reference's curve cannot be read (not falling)
    low: float | None
    high: float | None
    extrapolated: bool


def reference_compute(curve: list[tuple[float, float]], loss: float) -> tuple[float | None, bool]:
    """log C at which the piecewise-linear curve [(log C, loss), ...] (sorted by C, losses falling) reaches `loss`;
    (None, False) when the losses do not fall; extrapolated beyond the ends from the end segments."""
    xs, ys = zip(*curve, strict=True)
    if len(xs) < 2 or any(b >= a for a, b in zip(ys, ys[1:], strict=False)):
        return None, False
    for i in range(len(xs) - 1):
        if ys[i] >= loss >= ys[i + 1]:
            return xs[i] + (loss - ys[i]) * (xs[i + 1] - xs[i]) / (ys[i + 1] - ys[i]), False
    i = 0 if loss > ys[0] else len(xs) - 2  # beyond the first or the last size: the end segment's line
    return xs[i] + (loss - ys[i]) * (xs[i + 1] - xs[i]) / (ys[i + 1] - ys[i]), True


def local_multipliers(points: list[Point], reference: str = "baseline", resamples: int = RESAMPLES,
                      seed: int = 0) -> tuple[list[LocalMultiplier], list[str]]:
    """One LocalMultiplier per (method, size) the reference also ran at, and the lines to say under the table."""
    cells: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in points:
        cells[(p.method, p.size)].append(p)
    ref_log_c = {s: _mean_log_c(cell) for (m, s), cell in cells.items() if m == reference}
    if len(ref_log_c) < 2:
        return [], [f"No per-size multipliers: `{reference}` ran at fewer than 2 sizes."]
    ref_sizes = sorted(ref_log_c, key=ref_log_c.get)
    ref_losses = {s: np.array([p.loss for p in cells[(reference, s)]]) for s in ref_sizes}
    rng = np.random.default_rng(seed)
    out, notes = [], []
    methods = sorted({m for m, _ in cells} - {reference})
    for size, method in ((s, m) for s in ref_sizes for m in methods if (m, s) in cells):  # by the ladder's order
        mine = cells[(method, size)]
        losses, log_c = np.array([p.loss for p in mine]), _mean_log_c(mine)
        delta = float(losses.mean() - ref_losses[size].mean())
        curve = [(ref_log_c[s], float(ref_losses[s].mean())) for s in ref_sizes]
        at, extrapolated = reference_compute(curve, float(losses.mean()))
        if at is None:
            out.append(LocalMultiplier(method, size, len(mine), delta, None, None, None, False))
            continue
        draws = []
        for _ in range(resamples):
            curve = [(ref_log_c[s], float(_resample(rng, ref_losses[s]).mean())) for s in ref_sizes]
            again, _ = reference_compute(curve, float(_resample(rng, losses).mean()))
            if again is not None:
                draws.append(again - log_c)
        low = high = None
        if len(mine) > 1 and len(draws) >= 0.9 * resamples:
            tail = expanded_tail(len(mine) - 1, LEVEL)
            low, high = (math.exp(float(np.quantile(draws, q))) for q in (tail, 1 - tail))
        out.append(LocalMultiplier(method, size, len(mine), delta, math.exp(at - log_c), low, high, extrapolated))
    if any(r.k is None for r in out):
        notes.append(f"`{reference}`'s mean loss does not fall with compute across its sizes: no per-size reading.")
    return out, notes


def _mean_log_c(cell: list[Point]) -> float:
    return float(np.mean([math.log(p.compute) for p in cell]))


def _resample(rng: np.random.Generator, y: np.ndarray) -> np.ndarray:
    """A bootstrap draw of a cell's losses, deviations scaled by sqrt(n/(n-1)) (the seeds' spread unbiased)."""
    if len(y) < 2:
        return y
    draw = rng.choice(y, size=len(y), replace=True)
    return y.mean() + (draw - y.mean()) * math.sqrt(len(y) / (len(y) - 1))

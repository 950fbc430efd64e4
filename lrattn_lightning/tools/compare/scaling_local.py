"""Per-size compute multipliers read off the reference's own ladder, no law fitted: for a method's mean loss at one
size, the compute at which the reference's seed-mean losses (ln loss piecewise linear in ln compute between its
sizes: a power law's straight line) reach that loss, over the method's compute there. Where the ladder bends away
from one power law (every method alike), the shared law's fit is poor and scaling.py gives no multiplier; this
reading still holds, size by size.

    k_s = C_ref(L_m(s)) / C_m(s)        k > 1: the method at size s is worth k times its compute in reference runs

A loss below the reference's lowest (or above its highest) is read off the line through its last (first) two
sizes, and marked extrapolated. A reference whose mean loss does not fall from one size to the next gives no
reading, said in one line.

Interval: Welch's t on ln k. On the segment [i, i+1] of the ladder the reading is
x(l) = x_i + (l - y_i) (x_{i+1} - x_i) / (y_{i+1} - y_i) (x: mean ln C, y: ln of the seed-mean loss, l: ln of the
method's), so ln k depends on three means; with Dx, Dy the segment's steps and t = (l - y_i) / Dy,

    d ln k / dl = Dx / Dy,   d ln k / dy_i = Dx (t - 1) / Dy,   d ln k / dy_{i+1} = -Dx t / Dy
    V = sum_j g_j^2 v_j / n_j,   df = V^2 / sum_j (g_j^2 v_j / n_j)^2 / (n_j - 1)     (Welch-Satterthwaite)
    ln k +- t_{0.975, df} sqrt(V)

(v_j = s_j^2 / L_j^2: each cell's sample variance of ln loss to first order; n_j its seeds). Where the method's mean
sits at a reference size (t = 0: a method no different from the reference) this is Welch's test of the loss
difference (to first order in s / L), so the interval leaves out the reference's own multiplier when Welch's p
< 0.05; between sizes it adds the uncertainty of the segment's slope. On simulated ladders (tests/tools/
test_scaling_local.py: the scaling study's law, L = 30 C^-0.0957 over 6e10-1.2e13 FLOPs, Gaussian seed noise)
the nominal 95 % interval leaves out the true multiplier in 2.5-3 % of studies at 2 seeds a cell, 3.5-4 % at 3
and 4.5-5 % at 5, for a method equal to the reference and for one worth 1.3x or 1.6x, at every size; the
percentile bootstrap it replaces, expanded to Student's t, left out k = 1 in 23 % (2 seeds) and 7 % (3). The
reading, not the interval, is what a ladder with a floor (L = E + A C^-alpha, E > 0) bends: ln L is then not
straight in ln C, the chord between sizes reads k too high or low, and with 5 seeds at 1 % noise a 1.3x method's
interval misses in 12-20 % of such studies (E = 1.5, alpha = 0.2 over 200x). No interval, and a line saying why,
where a cell it reads has one seed, or where the segment's fall in loss is within its seeds' noise
(t_{0.975} times its standard error): there the slope, and so the reading, is unknown. An interval whose end lies
beyond the reference's ladder is marked, as the reading is.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from lrattn_lightning.tools.compare.scaling import LEVEL, Point


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
    why: str | None = None  # why there is no interval (k is not None, low is None)
    beyond: bool = False  # an end of the interval lies beyond the reference's ladder (read off an end segment)


def reference_compute(curve: list[tuple[float, float]], loss: float) -> tuple[float | None, bool]:
    """log C at which the piecewise-linear curve [(log C, loss), ...] (sorted by C, losses falling) reaches `loss`;
    (None, False) when the losses do not fall; extrapolated beyond the ends from the end segments."""
    xs, ys = (np.array(v, dtype=float) for v in zip(*curve, strict=True))
    if len(xs) < 2 or np.any(np.diff(ys) >= 0):
        return None, False
    at, _, extrapolated = read(xs, ys, np.float64(loss))
    return float(at), bool(extrapolated)


def read(xs: np.ndarray, ys: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reading for many studies at once: xs (S,) the reference's mean log C per size, ys (..., S) its seed-mean
    losses (falling), loss (...) the method's mean: (log C (...), the segment i (...), beyond the ends (...))."""
    S = xs.shape[-1]
    below = np.sum(ys > loss[..., None], axis=-1)  # sizes whose mean loss is above `loss`
    i = np.clip(below - 1, 0, S - 2)  # on [i, i + 1]; beyond the first or last size: the end segment's line
    y0, y1 = (np.take_along_axis(ys, (i + j)[..., None], axis=-1)[..., 0] for j in (0, 1))
    at = xs[i] + (loss - y0) * (xs[i + 1] - xs[i]) / (y1 - y0)
    return at, i, (below == 0) | (below == S)


def interval(xs: np.ndarray, ys: np.ndarray, var: np.ndarray, n: np.ndarray, loss: np.ndarray, loss_var: np.ndarray,
             loss_n: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The interval of the reading's log C (module doc) for many studies at once: the reference's seed-mean losses
    ys (..., S), their sample variances var (..., S) over n (S,) seeds, and the method's mean `loss` (...) with its
    variance over loss_n seeds: (low, high, slope_known (...)). Where the slope is not known, low and high are NaN."""
    from scipy.stats import t as student

    at, i, _ = read(xs, ys, loss)
    pick = lambda a, j: np.take_along_axis(np.broadcast_to(a, ys.shape), (i + j)[..., None], axis=-1)[..., 0]  # noqa: E731
    dx, dy = xs[i + 1] - xs[i], pick(ys, 1) - pick(ys, 0)
    frac = (loss - pick(ys, 0)) / dy
    grads = (dx / dy, dx * (frac - 1) / dy, -dx * frac / dy)
    cells = ((loss_var, loss_n), (pick(var, 0), pick(n, 0)), (pick(var, 1), pick(n, 1)))
    parts = [g * g * v / m for g, (v, m) in zip(grads, cells, strict=True)]
    q = 1 - (1 - level) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = [v / m for v, m in cells[1:]]
        slope_df = sum(slope) ** 2 / sum(v * v / (m - 1) for v, (_, m) in zip(slope, cells[1:], strict=True))
        known = ~(np.abs(dy) <= student.ppf(q, slope_df) * np.sqrt(sum(slope)))
        total = sum(parts)
        df = total**2 / sum(v * v / (m - 1) for v, (_, m) in zip(parts, cells, strict=True))
        half = np.where(total > 0, student.ppf(q, df) * np.sqrt(total), 0.0)
    return np.where(known, at - half, np.nan), np.where(known, at + half, np.nan), known


def local_multipliers(points: list[Point], reference: str = "baseline") -> tuple[list[LocalMultiplier], list[str]]:
    """One LocalMultiplier per (method, size) the reference also ran at, and the lines to say under the table."""
    cells: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in points:
        cells[(p.method, p.size)].append(p)
    ref_log_c = {s: _mean_log_c(cell) for (m, s), cell in cells.items() if m == reference}
    if len(ref_log_c) < 2:
        return [], [f"No per-size multipliers: `{reference}` ran at fewer than 2 sizes."]
    sizes = sorted(ref_log_c, key=ref_log_c.get)
    ref = [np.array([p.loss for p in cells[(reference, s)]]) for s in sizes]
    means = np.array([y.mean() for y in ref])
    # the ladder in ln loss: ys the log mean losses, var their variances to first order (var(L) / L^2)
    xs, ys = np.array([ref_log_c[s] for s in sizes]), np.log(means)
    var, n = np.array([_var(y) for y in ref]) / means**2, np.array([len(y) for y in ref])
    falling = bool(np.all(np.diff(ys) < 0))
    out, notes = [], []
    methods = sorted({m for m, _ in cells} - {reference})
    for size, method in ((s, m) for s in sizes for m in methods if (m, s) in cells):  # by the ladder's order
        losses = np.array([p.loss for p in cells[(method, size)]])
        log_c, mean = _mean_log_c(cells[(method, size)]), np.float64(losses.mean())
        delta = float(mean - means[sizes.index(size)])
        if not falling:
            out.append(LocalMultiplier(method, size, len(losses), delta, None, None, None, False))
            continue
        at, i, extrapolated = read(xs, ys, np.log(mean))
        low = high = why = None
        beyond = False
        if len(losses) < 2 or n[i] < 2 or n[i + 1] < 2:
            why = "a cell it reads has one seed, so no seed spread"
        else:
            lo, hi, known = interval(xs, ys, var, n, np.log(mean), np.float64(_var(losses) / mean**2),
                                     np.float64(len(losses)))
            if known:
                low, high = math.exp(float(lo) - log_c), math.exp(float(hi) - log_c)
                beyond = bool(lo < xs[0] or hi > xs[-1])
            else:
                why = (f"`{reference}`'s mean loss from {sizes[i]} to {sizes[i + 1]} falls by less than its seeds' "
                       "noise can tell from flat, so the slope the reading needs is unknown")
        out.append(LocalMultiplier(method, size, len(losses), delta, math.exp(float(at) - log_c), low, high,
                                   bool(extrapolated), why, beyond))
    if not falling and out:
        notes.append(f"`{reference}`'s mean loss does not fall with compute across its sizes: no per-size reading.")
    for why in dict.fromkeys(r.why for r in out if r.why):
        who = ", ".join(f"`{r.method}` at {r.size}" for r in out if r.why == why)
        notes.append(f"No interval ({who}): {why}.")
    return out, notes


def _var(y: np.ndarray) -> float:
    return float(y.var(ddof=1)) if len(y) > 1 else math.nan


def _mean_log_c(cell: list[Point]) -> float:
    return statistics.fmean(math.log(p.compute) for p in cell)

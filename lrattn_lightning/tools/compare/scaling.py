"""Compute multipliers over a size ladder: validation loss against training compute, one saturating power law per
method, and how much more compute the reference (the baseline) needs for each method's loss; and the same read off
the reference's own ladder size by size, no law fitted (local_multipliers, below).

    L_m(C) = E + A_m C^(-alpha)          E, alpha shared by every method: methods differ by a constant factor in
                                         effective compute (--per-method-exponents: one alpha_m per method)
    k_m    = (A_ref / A_m)^(1 / alpha)   the baseline at k_m C reaches method m's loss at C; k > 1: m is worth more
                                         compute. With per-method exponents k depends on C: it is read at the
                                         ladder's largest compute C*, solving L_ref(k C*) = L_m(C*)

C is a run's training FLOPs, 3 x (the core's + the routing's forward FLOPs per token) x tokens trained (the
non-embedding compute, model/accounting.py). The fit is least squares over every run, in C / C0 (C0 the
geometric mean compute) with ln A_m as parameters, bounds 0 <= E < min loss and ALPHA_BOUNDS; it starts from the
best of a grid of E (each a linear fit of ln(L - E) against ln C).

The interval is Welch's t, as the per-size one (below): ln k linearised in the losses through the
least-squares fit, ln k(y + dy) ~ ln k + c . dy with c = J (J'J)^-1 g (J the law's Jacobian in its parameters, g
the gradient of ln k in them), its variance sum_i c_i^2 s_i^2 with each run's s^2 its (method, size) cell's seed
variance (a one-seed cell: the other cells' pooled variance), Welch-Satterthwaite degrees of freedom over the cells,
and ln k +- t sqrt(V) (welch_interval). On simulated ladders (4 sizes, 2 methods; tests/tools/test_scaling.py) it
leaves out the true multiplier in 2-5 % of studies at 2, 3 and 5 seeds a cell, k = 1 or 1.25. The percentile
bootstrap it replaces (each cell's seeds resampled, refit, ends expanded to Student's t for the pooled degrees of
freedom) left it out in 13-15 % of studies at 2 seeds; it still runs, as a check on the point estimate: its median
is reported, and how many resamples failed to refit. A seeded RNG makes a report reproducible.

No multiplier (one line saying why, and no fitted curve in the figure) when: the reference or every other method
has fewer than MIN_POINTS distinct computes (E, A, alpha need three), the fit fails or runs into a bound of alpha
or E, or the cell means sit further from the law than POOR_FIT times the seeds' own spread (a poor fit). With
one seed per cell the fit is reported, its quality unjudged and without an interval, and said so.

The per-size reading (local_multipliers): multipliers read off the reference's own ladder, no law fitted: for a
method's mean loss at one size, the compute at which the reference's seed-mean losses (ln loss piecewise linear in ln compute between its
sizes: a power law's straight line) reach that loss, over the method's compute there. Where the ladder bends away
from one power law (every method alike), the shared law's fit is poor and the law gives no multiplier; this
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

import copy
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

MIN_POINTS = 3  # distinct computes per method: E, A and alpha are three numbers
POOR_FIT = 2.0  # a fit is poor when the RMS of its cell-mean residuals exceeds this many seed standard deviations
ALPHA_BOUNDS = (1e-3, 3.0)
RESAMPLES = 1000
LEVEL = 0.95


@dataclass(frozen=True)
class Point:
    """One finished run on the ladder."""

    method: str
    size: str
    seed: int | None
    compute: float  # training FLOPs
    loss: float


@dataclass
class LawFit:
    """L_m(C) = E + exp(log_a[m]) (C / c0)^(-alpha[m]); `residuals` (fit - loss) in the order of the points."""

    E: float
    alpha: dict[str, float]
    log_a: dict[str, float]
    c0: float
    residuals: list[float]
    shared: bool

    def predict(self, method: str, compute: np.ndarray | float) -> np.ndarray:
        x = np.asarray(compute, dtype=float) / self.c0
        return self.E + np.exp(self.log_a[method] - self.alpha[method] * np.log(x))

    def A(self, method: str) -> float:
        """A_m in L = E + A_m C^(-alpha) with C in FLOPs."""
        return math.exp(self.log_a[method] + self.alpha[method] * math.log(self.c0))

    @property
    def rms(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.residuals))))

    def multiplier(self, method: str, reference: str, at: float) -> float:
        """The factor k with L_ref(k C) = L_m(C), at compute `at` (the same for every C with a shared alpha)."""
        return float(_multiplier(self.log_a[method], self.alpha[method], self.log_a[reference], self.alpha[reference],
                                 math.log(at / self.c0)))


def _multiplier(log_a, alpha, log_a_ref, alpha_ref, lx):
    """k with L_ref(k C) = L_m(C) at ln(C / c0) = lx, of numbers or of arrays (one per resample)."""
    gap = log_a - alpha * lx  # ln(L_m(C) - E)
    return np.exp((log_a_ref - gap) / alpha_ref - lx)


@dataclass
class Scaling:
    """What compare reports: the fit (None when refused), the multipliers, their interval and the fit's quality."""

    points: list[Point]
    reference: str
    shared: bool
    fit: LawFit | None = None
    refusal: str | None = None  # one line: why there is no multiplier
    notes: list[str] = field(default_factory=list)  # one line each: methods left out, unjudged quality, ...
    at: float = 0.0  # the compute the multipliers are read at (the ladder's largest)
    k: dict[str, float] = field(default_factory=dict)  # from the fit
    median: dict[str, float] = field(default_factory=dict)  # over the resamples
    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)
    resamples: int = 0
    failed: int = 0  # resamples whose refit failed or ran into a bound (left out of the interval)
    cell_rms: float | None = None  # RMS of the cell-mean residuals
    seed_std: float | None = None  # pooled within-cell standard deviation
    seed_dof: int = 0  # its degrees of freedom

    @property
    def methods(self) -> list[str]:
        """The reference first, then the others by name."""
        names = sorted({p.method for p in self.points} - {self.reference})
        return [self.reference, *names] if any(p.method == self.reference for p in self.points) else names


# ---- the fit ---------------------------------------------------------------------------------------
class _Data:
    """The points as arrays: method index per point, ln(C / c0), loss."""

    def __init__(self, points: list[Point], methods: list[str]):
        self.methods = methods
        self.index = np.array([methods.index(p.method) for p in points])
        compute = np.array([p.compute for p in points], dtype=float)
        self.c0 = float(np.exp(np.mean(np.log(compute))))
        self.lx = np.log(compute / self.c0)
        self.y = np.array([p.loss for p in points], dtype=float)

    def design(self) -> tuple[np.ndarray, np.ndarray]:
        """Each point's design point (n,) and the number of points at each (D,): a design point is a distinct
        (method, compute) pair, where the law takes one value (a cell's seeds share one)."""
        _, design, counts = np.unique(np.stack([self.index.astype(float), self.lx], axis=1), axis=0,
                                      return_inverse=True, return_counts=True)
        return design.reshape(-1), counts

    def at_design(self) -> tuple[_Data, np.ndarray]:
        """The design points as a _Data of their own (y: their mean losses), and the number of points at each."""
        design, counts = self.design()
        first = np.zeros(len(counts), dtype=int)
        first[design] = np.arange(len(design))  # a point of each design point
        cells = copy.copy(self)
        cells.index, cells.lx, cells.y = self.index[first], self.lx[first], np.bincount(design, self.y) / counts
        return cells, counts


def fit_law(points: list[Point], methods: list[str], shared: bool = True) -> tuple[LawFit | None, str | None]:
    """Least squares of the law over `points` (methods: each point's method is one of them): (fit, None) or
    (None, why it failed)."""
    fit, why, _ = _fit(_Data(points, methods), shared)
    return fit, why


def _fit(data: _Data, shared: bool, start: np.ndarray | None = None
         ) -> tuple[LawFit | None, str | None, np.ndarray | None]:
    """(fit, None, parameters [E, alpha(s), ln A_m...]) or (None, why, None); `start`: the parameters to start at."""
    from scipy.optimize import least_squares

    methods = data.methods
    M, na = len(methods), (1 if shared else len(methods))
    top = float(data.y.min()) * (1 - 1e-9)  # E < the smallest loss
    theta0 = _start(data, na, top) if start is None else start
    if theta0 is None:
        return None, "no starting point: every grid value of E left a loss at or below it", None
    lower = np.r_[0.0, [ALPHA_BOUNDS[0]] * na, [-np.inf] * M]
    upper = np.r_[top, [ALPHA_BOUNDS[1]] * na, [np.inf] * M]
    theta0 = _inside(np.asarray(theta0, dtype=float)[None], np.array([top]), na)[0]

    def residuals(theta: np.ndarray) -> np.ndarray:
        return theta[0] + _terms(data, na, theta[None])[0] - data.y

    def jacobian(theta: np.ndarray) -> np.ndarray:
        return _jacobian(data, na, _terms(data, na, theta[None]))[0]

    try:
        result = least_squares(residuals, theta0, jac=jacobian, bounds=(lower, upper), x_scale="jac")
    except (ValueError, np.linalg.LinAlgError) as err:
        return None, f"the least-squares fit failed ({err})", None
    theta = result.x
    if not result.success or not np.all(np.isfinite(theta)):
        return None, f"the fit did not converge ({result.message})", None
    alphas = theta[1:1 + na]
    alpha_at_bound, e_at_top = _at_bounds(theta[None], np.array([top]), na)
    if alpha_at_bound.any():
        return None, (f"the fit ran into its bound alpha = {alphas[alpha_at_bound[0]][0]:.3g} (allowed "
                      f"{ALPHA_BOUNDS[0]:g}-{ALPHA_BOUNDS[1]:g}): the losses do not follow the law"), None
    if e_at_top[0]:
        return None, f"the fit ran into its bound E = {theta[0]:.4f} (the smallest loss): no saturating law fits", None
    fit = LawFit(E=float(theta[0]), alpha={m: float(alphas[0 if shared else i]) for i, m in enumerate(methods)},
                 log_a={m: float(theta[1 + na + i]) for i, m in enumerate(methods)}, c0=data.c0,
                 residuals=residuals(theta).tolist(), shared=shared)
    return fit, None, theta


def _start(data: _Data, na: int, top: float) -> np.ndarray | None:
    """The best of a grid of E: for each, ln(L - E) = ln A_m - alpha ln x by linear least squares."""
    best, best_sse = None, math.inf
    M = len(data.methods)
    for E in np.linspace(0.0, top, 25)[:-1]:
        z = np.log(data.y - E)
        design = np.zeros((len(z), na + M))
        design[np.arange(len(z)), 0 if na == 1 else data.index] = -data.lx
        design[np.arange(len(z)), na + data.index] = 1.0
        coef, *_ = np.linalg.lstsq(design, z, rcond=None)
        alphas = np.clip(coef[:na], ALPHA_BOUNDS[0] * 2, ALPHA_BOUNDS[1] / 2)
        theta = np.r_[E, alphas, coef[na:]]
        sse = float(np.sum((E + _terms(data, na, theta[None])[0] - data.y) ** 2))
        if sse < best_sse:
            best, best_sse = theta, sse
    return best


# The law's pieces for R parameter vectors at once, theta (R, 1 + na + M) = [E, alpha(s), ln A_m...] (na: 1 with a
# shared alpha, else one per method): _fit (R = 1), _start and _refits.
def _terms(data: _Data, na: int, theta: np.ndarray) -> np.ndarray:
    """exp(ln A_m - alpha_m ln x) at every point: (R, n); the law is E + this."""
    a_of = data.index if na > 1 else np.zeros_like(data.index)
    return np.exp(theta[:, 1 + na + data.index] - theta[:, 1 + a_of] * data.lx)


def _jacobian(data: _Data, na: int, terms: np.ndarray) -> np.ndarray:
    """d(E + terms) / d theta: (R, n, 1 + na + M)."""
    a_of = data.index if na > 1 else np.zeros_like(data.index)
    R, n = terms.shape
    jac = np.zeros((R, n, 1 + na + len(data.methods)))
    rows = np.arange(n)
    jac[:, :, 0] = 1.0
    jac[:, rows, 1 + a_of] = -terms * data.lx
    jac[:, rows, 1 + na + data.index] = terms
    return jac


def _inside(theta: np.ndarray, top: np.ndarray, na: int) -> np.ndarray:
    """A copy strictly inside the bounds, E below each row's `top` (a resample's smallest loss may be lower)."""
    theta = np.array(theta, dtype=float)
    theta[:, 0] = np.clip(theta[:, 0], 0.0, top * (1 - 1e-6))
    theta[:, 1:1 + na] = np.clip(theta[:, 1:1 + na], ALPHA_BOUNDS[0] * 1.01, ALPHA_BOUNDS[1] * 0.99)
    return theta


def _at_bounds(theta: np.ndarray, top: np.ndarray, na: int) -> tuple[np.ndarray, np.ndarray]:
    """Where a fit is refused: each alpha at a bound (R, na), E at the smallest loss (R,)."""
    alphas = theta[:, 1:1 + na]
    return ((alphas <= ALPHA_BOUNDS[0] * 1.001) | (alphas >= ALPHA_BOUNDS[1] * 0.999),
            theta[:, 0] >= top - 1e-6 * np.abs(top))


# ---- the analysis ----------------------------------------------------------------------------------
def analyse(points: list[Point], reference: str = "baseline", shared: bool = True, resamples: int = RESAMPLES,
            seed: int = 0) -> Scaling:
    """The fit, the multipliers against `reference` with their bootstrap interval, or one line refusing them."""
    usable = [p for p in points if p.compute > 0 and math.isfinite(p.compute) and math.isfinite(p.loss)]
    out = Scaling(points=usable, reference=reference, shared=shared)
    out.refusal = _too_few(out)
    if out.refusal:
        return out
    methods = out.methods
    data = _Data(out.points, methods)
    fit, why, theta = _fit(data, shared)
    if fit is None:
        out.refusal = why
        return out
    cells = _cells(out.points)
    out.cell_rms = math.sqrt(float(np.mean([np.mean([fit.residuals[i] for i in idx]) ** 2 for idx in cells.values()])))
    out.seed_std, out.seed_dof = _pooled_std(out.points, cells)
    out.at = max(p.compute for p in out.points)
    if out.seed_std is not None and out.cell_rms > POOR_FIT * out.seed_std:
        ratio = out.cell_rms / out.seed_std
        out.refusal = (f"a poor fit: the cell means sit {out.cell_rms:.4f} (RMS) from the law, {ratio:.1f} times the "
                       f"seeds' own spread ({out.seed_std:.4f}; the limit is {POOR_FIT:g} times)")
        return out
    out.fit = fit
    out.k = {m: fit.multiplier(m, reference, out.at) for m in methods}
    if out.seed_std is None:
        out.notes.append("One seed per size: the fit's quality cannot be judged against a seed spread, and there is "
                         "no interval.")
        return out
    _bootstrap(out, data, cells, theta, resamples, np.random.default_rng(seed))
    low, high = welch_interval(data, theta[None], data.y[None], list(cells.values()), shared, math.log(out.at / data.c0))
    out.low[reference] = out.high[reference] = 1.0  # the reference's own k is 1 exactly
    for i, m in enumerate(methods[1:], start=1):
        if np.isfinite(low[0, i]):
            out.low[m], out.high[m] = float(low[0, i]), float(high[0, i])
        else:
            out.low.pop(m, None), out.high.pop(m, None)
    return out


def _too_few(out: Scaling) -> str | None:
    """Why there can be no multiplier for want of runs, or None; methods short of sizes are left out, noted."""
    counts = {m: len({round(math.log(p.compute), 9) for p in out.points if p.method == m}) for m in out.methods}
    if out.reference not in counts:
        return f"no `{out.reference}` runs on the ladder to compare with"
    if len(counts) == 1:
        return f"only `{out.reference}` ran on the ladder: no method to compare with it"
    few = [m for m, n in counts.items() if n < MIN_POINTS]
    if out.reference in few or len(few) == len(counts) - 1:
        who = [out.reference] if out.reference in few else few
        return (f"fewer than {MIN_POINTS} sizes (distinct computes) for "
                + ", ".join(f"{m} ({counts[m]})" for m in who) + ": E, A and alpha need three")
    if few:
        out.notes.append(f"Left out (fewer than {MIN_POINTS} sizes): {', '.join(few)}.")
        out.points = [p for p in out.points if p.method not in few]
    return None


def _cells(points: list[Point]) -> dict[tuple[str, str], list[int]]:
    cells: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, p in enumerate(points):
        cells[(p.method, p.size)].append(i)
    return cells


def expanded_tail(dof: int, level: float = LEVEL) -> float:
    """The tail probability of the expanded percentile interval: Phi(-t) with t Student's quantile at `level` for
    `dof` degrees of freedom (Phi(-z), (1 - level) / 2, as dof grows)."""
    from scipy.stats import norm, t

    return float(norm.cdf(-t.ppf(1 - (1 - level) / 2, dof)))


def _pooled_std(points: list[Point], cells: dict[tuple[str, str], list[int]]) -> tuple[float | None, int]:
    """The seeds' standard deviation pooled over the cells with two or more seeds (None without any), and its
    degrees of freedom."""
    ss, dof = 0.0, 0
    for idx in cells.values():
        if len(idx) > 1:
            y = np.array([points[i].loss for i in idx])
            ss += float(np.sum((y - y.mean()) ** 2))
            dof += len(idx) - 1
    return (math.sqrt(ss / dof) if dof else None), dof


def _bootstrap(out: Scaling, data: _Data, cells: dict, theta: np.ndarray, resamples: int,
               rng: np.random.Generator) -> None:
    """Percentile interval of every multiplier over `resamples` refits (module doc), all fitted at once (_refits)."""
    y, methods = data.y, out.methods
    groups = [(np.array(idx), y[idx].mean(), math.sqrt(len(idx) / (len(idx) - 1))) for idx in cells.values()
              if len(idx) > 1]
    design, counts = data.design()
    moments = _Moments(np.empty((resamples, len(counts))), np.empty(resamples), np.empty(resamples))
    losses = y.copy()  # one resample's at a time: memory of one ladder, not of `resamples` of them
    for r in range(resamples):
        for idx, mean, inflate in groups:
            losses[idx] = mean + inflate * (y[idx][rng.integers(0, len(idx), len(idx))] - mean)
        means = np.bincount(design, losses, len(counts)) / counts
        moments.means[r], moments.within[r], moments.low[r] = means, np.sum((losses - means[design]) ** 2), losses.min()
    thetas, ok = _refit_moments(data, moments, out.shared, theta)
    out.failed, out.resamples = int(np.sum(~ok)), resamples
    na = 1 if out.shared else len(methods)
    lx = math.log(out.at / data.c0)
    alpha, log_a = thetas[ok, 1:1 + na], thetas[ok, 1 + na:]
    tail = 100 * expanded_tail(out.seed_dof)
    for i, m in enumerate(methods if ok.any() else []):  # methods[0] is the reference
        values = _multiplier(log_a[:, i], alpha[:, 0 if out.shared else i], log_a[:, 0], alpha[:, 0], lx)
        out.median[m], out.low[m], out.high[m] = (float(v) for v in np.percentile(values, [50, tail, 100 - tail]))


def welch_interval(data: _Data, thetas: np.ndarray, losses: np.ndarray, cells: list, shared: bool, lx: float,
                   level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """The multipliers' interval (module doc) for R fits at once: thetas (R, p) fitted to losses (R, n), the points'
    cells (lists of point indices): (low, high), each (R, M) in the order of data.methods, NaN where there is none.

    ln k is linearised in the losses through the fit, ln k(y + dy) ~ ln k + c . dy with c = J (J'J)^-1 g (J the law's
    Jacobian in theta, g the gradient of ln k in theta); its variance sum_i c_i^2 s^2_cell(i), each cell's s^2 its
    seeds' sample variance (a one-seed cell: the pooled variance of the others), degrees of freedom
    Welch-Satterthwaite over the cells, and ln k +- t sqrt(V)."""
    from scipy.stats import t as student

    methods, na = data.methods, (1 if shared else len(data.methods))
    R, n = losses.shape
    jac = _jacobian(data, na, _terms(data, na, thetas))  # (R, n, p)
    jtj = np.einsum("rnp,rnq->rpq", jac, jac)

    def log_k(th: np.ndarray) -> np.ndarray:  # (R, M)
        alpha, log_a = th[:, 1:1 + na], th[:, 1 + na:]
        return np.stack([np.log(_multiplier(log_a[:, i], alpha[:, 0 if shared else i], log_a[:, 0], alpha[:, 0], lx))
                         for i in range(len(methods))], axis=1)

    grads = np.zeros((R, len(methods), thetas.shape[1]))
    for j in range(thetas.shape[1]):
        h = 1e-6 * np.maximum(1.0, np.abs(thetas[:, j]))
        up, down = thetas.copy(), thetas.copy()
        up[:, j] += h
        down[:, j] -= h
        grads[:, :, j] = (log_k(up) - log_k(down)) / (2 * h[:, None])
    try:
        weights = np.linalg.solve(jtj[:, None], grads[..., None])[..., 0]  # (R, M, p)
    except np.linalg.LinAlgError:
        weights = np.einsum("rpq,rmq->rmp", np.linalg.pinv(jtj), grads)
    c = np.einsum("rnp,rmp->rmn", jac, weights)  # (R, M, n)
    several = [np.asarray(idx) for idx in cells if len(idx) > 1]
    single = np.array([idx[0] for idx in cells if len(idx) == 1], dtype=int)
    parts, dofs = [], []
    for idx in several:
        var = losses[:, idx].var(axis=1, ddof=1)  # (R,)
        parts.append(np.sum(c[:, :, idx] ** 2, axis=2) * var[:, None])
        dofs.append(len(idx) - 1)
    if not several:
        nan = np.full((R, len(methods)), np.nan)
        return nan, nan
    if len(single):
        pool = sum(losses[:, idx].var(axis=1, ddof=1) * (len(idx) - 1) for idx in several) / sum(dofs)
        parts.append(np.sum(c[:, :, single] ** 2, axis=2) * pool[:, None])
        dofs.append(sum(dofs))
    total = sum(parts)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = total**2 / sum(v * v / d for v, d in zip(parts, dofs, strict=True))
        half = student.ppf(1 - (1 - level) / 2, df) * np.sqrt(total)
    centre = log_k(thetas)
    return np.exp(centre - half), np.exp(centre + half)


class _Moments(NamedTuple):
    """R sets of losses at the fit's design points (the distinct (method, compute) pairs, _Data.design): their means
    (R, D), the sum of squares within the points of each (R,) and the smallest loss (R,). The law takes one value at
    each design point, so the sum of squares over all n runs is sum_d n_d (law_d - mean_d)^2 + within: a refit needs
    these, not the n losses, and costs the same at 15 runs or 20,000."""

    means: np.ndarray
    within: np.ndarray
    low: np.ndarray

    @classmethod
    def of(cls, losses: np.ndarray, design: np.ndarray, counts: np.ndarray) -> _Moments:
        """Of losses (R, n), each point's design point `design` (n,), their numbers of points `counts` (D,)."""
        losses = np.atleast_2d(np.asarray(losses, dtype=float))
        onehot = np.zeros((losses.shape[1], len(counts)))
        onehot[np.arange(losses.shape[1]), design] = 1.0
        means = (losses @ onehot) / counts
        return cls(means, np.sum((losses - means[:, design]) ** 2, axis=1), losses.min(axis=1))


def _refits(data: _Data, losses: np.ndarray, shared: bool, theta0: np.ndarray, iterations: int = 400
            ) -> tuple[np.ndarray, np.ndarray]:
    """_fit of every row of `losses` (R, n) at once, from theta0 (_refit_moments of their _Moments)."""
    design, counts = data.design()
    return _refit_moments(data, _Moments.of(losses, design, counts), shared, theta0, iterations)


def _refit_moments(data: _Data, moments: _Moments, shared: bool, theta0: np.ndarray, iterations: int = 400
                   ) -> tuple[np.ndarray, np.ndarray]:
    """_fit of R sets of losses at once, given as their _Moments, from theta0: Levenberg-Marquardt on all R problems
    together (numpy, no loop over rows), on the design points weighted by their numbers of runs (the same sums of
    squares, gradients and Gauss-Newton matrices as over every run); a parameter a bound holds (at the bound, its
    gradient pointing out) takes no step, the others a step of the system without it, each step then projected
    into _fit's bounds. (thetas (R, p), ok (R,)): ok is False where a fit did not converge or ended where _fit
    refuses one (alpha at a bound, E at the smallest loss). Against _fit one resample at a time (scipy's least
    squares; tests/tools/test_scaling.py): the same resamples refused, a cost never higher, parameters equal to
    scipy's own tolerance."""
    points, weight = data.at_design()
    M, R = len(data.methods), len(moments.means)
    na = 1 if shared else M
    top = moments.low * (1 - 1e-9)
    lower = np.r_[0.0, [ALPHA_BOUNDS[0]] * na, [-np.inf] * M]
    upper = np.tile(np.r_[np.inf, [ALPHA_BOUNDS[1]] * na, [np.inf] * M], (R, 1))
    upper[:, 0] = top
    theta = _inside(np.tile(np.asarray(theta0, dtype=float), (R, 1)), top, na)
    eye = np.eye(theta.shape[1])

    def residuals(th: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        g = _terms(points, na, th)  # (R, D)
        r = th[:, :1] + g - moments.means
        return r, g, np.sum(weight * r * r, axis=1) + moments.within

    r, g, cost = residuals(theta)
    damping = np.full(R, 1e-3)
    done = np.zeros(R, dtype=bool)
    for _ in range(iterations):
        jac = _jacobian(points, na, g)  # (R, D, p)
        jtj = np.einsum("rnp,n,rnq->rpq", jac, weight, jac)
        jtr = np.einsum("rnp,n,rn->rp", jac, weight, r)
        scale = np.einsum("rpp->rp", jtj)
        # converged: the residuals orthogonal to every column of the Jacobian (MINPACK's gtol test) but those of
        # parameters a bound holds, or no step that lowers the cost (damping run away)
        held = ((theta <= lower) & (jtr > 0)) | ((theta >= upper) & (jtr < 0))
        cosine = np.abs(jtr) / np.sqrt(scale * cost[:, None] + 1e-300)
        cosine[held] = 0.0
        done |= (cosine.max(axis=1) <= 1e-10) | (damping > 1e14)
        if done.all():
            break
        free = (~held).astype(float)
        system = (jtj + damping[:, None, None] * scale[:, :, None] * eye) * free[:, :, None] * free[:, None, :]
        step = _solve(system + (1.0 - free)[:, :, None] * eye, -jtr * free)  # a held parameter's row: step 0
        trial = np.clip(theta + step, lower, upper)
        r_new, g_new, cost_new = residuals(trial)
        better = (cost_new < cost) & ~done
        theta[better], r[better], g[better], cost[better] = trial[better], r_new[better], g_new[better], cost_new[better]
        damping = np.where(better, damping / 3, damping * 4)
    alpha_at_bound, e_at_top = _at_bounds(theta, top, na)
    return theta, done & np.isfinite(cost) & np.all(np.isfinite(theta), axis=1) & ~alpha_at_bound.any(axis=1) & ~e_at_top


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x with a x = b for each row; where a row's system is singular or not finite, its least-squares x (or 0)."""
    try:
        return np.linalg.solve(a, b[..., None])[..., 0]
    except np.linalg.LinAlgError:
        return np.stack([np.linalg.pinv(x) @ y if np.all(np.isfinite(x)) else np.zeros_like(y)
                         for x, y in zip(a, b, strict=True)])


# ---- the per-size reading -------------------------------------------------------------------------
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

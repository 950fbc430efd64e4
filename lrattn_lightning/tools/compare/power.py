"""Welch's t-test across seeds, its power and multiplicity for `lrattn compare`: a difference's p, how many seeds
it needs, and every pair of methods tested.

    welch(a, b)          (mean a - mean b, two-sided p): two means over na, nb seeds with sample variances va, vb,
                             t = (mean a - mean b) / sqrt(va / na + vb / nb)
                             df = (va / na + vb / nb)^2 / ((va / na)^2 / (na - 1) + (vb / nb)^2 / (nb - 1))
                         (Welch-Satterthwaite), p = 2 P(T >= |t|) for Student's t with df degrees of freedom (scipy;
                         equal to the regularised incomplete beta function I_x(df / 2, 1 / 2) at x = df / (df + t^2))
    seeds_needed(Δ, s_a, s_b)
                         seeds per arm for power 0.8 in Welch's two-sided test at α = 0.05 (welch: the test whose p
                         is printed beside it), equal arms of n, a true difference Δ and the arms' true
                         stds s_a, s_b: the smallest n (>= 2) with power(n) >= 0.8, where
                             power(n) = E[ P(|Δ̂| > t_{1-α/2, ν̂} ŝe) ]     Δ̂ ~ N(Δ, (s_a² + s_b²) / n)
                         over the two sample variances (s² χ²_{n-1} / (n - 1) each, independent of Δ̂), ŝe and ν̂
                         Welch's standard error and Welch-Satterthwaite degrees of freedom from them: the inner
                         probability is two normal tails, the outer expectation a 48 x 48 generalised Gauss-Laguerre
                         rule over the two chi-squares; above n = 100 the noncentral t with ν at the true variances
                         (within a seed there). At n = 2 or 3, ν̂ is often near 1 and Welch's test far weaker than
                         the pooled t-test's 2n - 2 degrees of freedom suggest. None where no spread is known (one
                         seed a side) or Δ = 0; 2 where both spreads are 0 and Δ != 0.
    spreads(a, b)        the two arms' sample stds; an arm of one seed takes the other's (None: one seed a side)
    holm(p)              Holm's step-down adjustment of m p-values: sorted ascending, p_(k) (m - k + 1) (k = 1..m),
                         made non-decreasing by a running maximum, capped at 1; a pair is resolved when its adjusted
                         p < α. It bounds the chance of any false "resolved" in the family by α, whatever the tests'
                         dependence.
    pairwise(rows)       Welch's test for every pair of rows of one size and recipe, Holm-adjusted
                         within that group (pairs with a one-seed side have no p and are not in the family); a
                         pair's seeds needed at α / m, the level Holm asks of the first of m pairs: enough to
                         resolve it after the correction, whatever the other pairs do

Seeds needed are computed as if the observed difference and spread were the true ones: with two or three seeds
the spread is itself uncertain by a factor of about two, so the number is a size, not a promise.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.words import count
from lrattn_lightning.tools.compare.words import size_list

if TYPE_CHECKING:
    from lrattn_lightning.tools.compare.table import Row

ALPHA, POWER = 0.05, 0.8
MAX_SEEDS = 100_000  # beyond this the answer is "more than" (a difference far inside the noise)
NODES, QUADRATURE_MAX = 48, 100  # power(): the quadrature's nodes per chi-square, and the n it is used up to


def welch(a: list[float], b: list[float]) -> tuple[float, float | None]:
    """(mean(a) - mean(b), two-sided p of Welch's t-test); p is None below two seeds a side."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va == 0 and vb == 0:
        return diff, (1.0 if diff == 0 else 0.0)
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return diff, student_t_two_sided_p(t, df)


def student_t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    if df <= 0:
        raise InputError(f"degrees of freedom must be positive, got {df}")
    from scipy import stats

    return float(2.0 * stats.t.sf(abs(t), df))


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for 0 <= x <= 1, a, b > 0 (scipy's betainc)."""
    from scipy import special

    return float(special.betainc(a, b, min(max(x, 0.0), 1.0)))


def power(n: int, delta: float, std_a: float, std_b: float | None = None, alpha: float = ALPHA) -> float:
    """The power of Welch's two-sided test with n seeds per arm, true difference `delta` and true stds (module doc)."""
    from scipy import special, stats

    std_b = std_a if std_b is None else std_b
    spread = math.sqrt((std_a**2 + std_b**2) / n)
    if spread == 0:
        return 1.0 if delta else alpha
    if n > QUADRATURE_MAX:
        va, vb = std_a**2 / n, std_b**2 / n
        df = (va + vb) ** 2 / ((va**2 + vb**2) / (n - 1))
        crit, nc = stats.t.ppf(1 - alpha / 2, df), abs(delta) / spread
        return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))
    nodes, weights = special.roots_genlaguerre(NODES, (n - 1) / 2 - 1)  # z = chi² / 2 ~ Gamma((n - 1) / 2)
    weights = weights / weights.sum()
    za, zb = np.meshgrid(nodes, nodes, indexing="ij")
    va, vb = std_a**2 * 2 * za / (n - 1) / n, std_b**2 * 2 * zb / (n - 1) / n  # Welch's squared errors, per arm
    se = np.sqrt(va + vb)
    # ν̂ = (n - 1) / (r² + (1 - r)²) with r = va / (va + vb): the critical value on a grid of r, interpolated
    share = np.linspace(0.0, 1.0, 129)
    grid = stats.t.ppf(1 - alpha / 2, (n - 1) / (share**2 + (1 - share) ** 2))
    crit = np.interp(va / np.maximum(va + vb, 1e-300), share, grid)
    hit = stats.norm.cdf((abs(delta) - crit * se) / spread) + stats.norm.cdf((-abs(delta) - crit * se) / spread)
    return float(np.einsum("i,j,ij->", weights, weights, hit))


def seeds_needed(delta: float | None, std: float | None, std_b: float | None = None, alpha: float = ALPHA,
                 target: float = POWER) -> int | None:
    """Seeds per arm for `target` power in Welch's test at two-sided `alpha` (module doc), the arms' stds `std` and
    `std_b` (default: `std`); MAX_SEEDS + 1: more."""
    std_b = std if std_b is None else std_b
    if delta is None or std is None or delta == 0 or math.isnan(delta) or math.isnan(std) or math.isnan(std_b):
        return None
    if std == 0 and std_b == 0:
        return 2
    from scipy import stats

    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(target)
    n = max(2, math.floor(z * z * (std**2 + std_b**2) / delta**2))  # the z-test's n: Welch's needs at least this
    if n > MAX_SEEDS:
        return MAX_SEEDS + 1
    while power(n, delta, std, std_b, alpha) < target:
        if n > MAX_SEEDS:
            return MAX_SEEDS + 1
        n += 1
    return n


def spreads(a: list[float], b: list[float]) -> tuple[float, float] | tuple[None, None]:
    """The two samples' stds; a one-seed sample takes the other's ((None, None): one seed each)."""
    sa = statistics.stdev(a) if len(a) > 1 else None
    sb = statistics.stdev(b) if len(b) > 1 else None
    if sa is None and sb is None:
        return None, None
    return (sb if sa is None else sa), (sa if sb is None else sb)


def pooled_std(a: list[float], b: list[float]) -> float | None:
    """The common std of two samples from their squared deviations (None: no degree of freedom)."""
    df = len(a) + len(b) - 2
    if df <= 0:
        return None
    squares = sum((x - statistics.fmean(s)) ** 2 for s in (a, b) for x in s)
    return math.sqrt(squares / df)


def need_text(n: int | None) -> str:
    """A seeds-needed cell: '≥ N' seeds per arm, '> MAX' beyond the search, '—' where there is no answer."""
    if n is None:
        return "—"
    return f"> {MAX_SEEDS:,}" if n > MAX_SEEDS else f"≥ {n}"


def holm(pvalues: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given."""
    m = len(pvalues)
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass
class Pair:
    low: Row  # the row with the lower mean val loss
    high: Row
    delta: float  # mean(low) - mean(high), <= 0
    p: float | None  # Welch's two-sided p; None: a side has one seed
    p_holm: float | None = None
    need: int | None = None  # seeds per arm for 80 % power in Welch's test at α / m (m pairs), the observed Δ and stds

    @property
    def resolved(self) -> bool:
        return self.p_holm is not None and self.p_holm < ALPHA


def pairwise(rows: list[Row]) -> dict[tuple[str, str], list[Pair]]:
    """(size, recipe letter) -> every pair of its rows, Holm-adjusted within the group; resolved pairs first,
    then by adjusted p."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.size, row.group), []).append(row)
    out = {}
    for key, mine in groups.items():
        pairs = []
        for a, b in itertools.combinations(mine, 2):
            low, high = (a, b) if a.mean <= b.mean else (b, a)
            pairs.append(Pair(low, high, *welch(low.losses, high.losses)))
        tested = [pair for pair in pairs if pair.p is not None]
        for pair, adjusted in zip(tested, holm([pair.p for pair in tested]), strict=True):
            pair.p_holm = adjusted
        level = ALPHA / max(len(tested), 1)
        for pair in pairs:
            std_a, std_b = spreads(pair.low.losses, pair.high.losses)
            pair.need = seeds_needed(pair.delta, std_a, std_b, alpha=level)
        pairs.sort(key=lambda pair: (not pair.resolved, 2.0 if pair.p_holm is None else pair.p_holm))
        out[key] = pairs
    return out


# ---- the pairwise section of the report ----------------------------------------------------------
def _p(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f}" if value >= 0.001 else f"{value:.1e}")


def ordering(mine: list[Row], pairs: list[Pair]) -> str:
    """What may be said about the order of one group's rows: a row is the lowest only when its tests against
    every other row resolve; otherwise the rows not resolved from the lowest mean are a leading group whose
    order is open."""
    lowest = min(mine, key=lambda r: r.mean)
    mine_pairs = [p for p in pairs if lowest in (p.low, p.high)]
    if all(p.resolved and p.low is lowest for p in mine_pairs):
        others = "the other row" if len(mine) == 2 else f"each of the other {count(len(mine) - 1, 'row')}"
        return (f"`{lowest.label}` has the lowest validation loss of the group, resolved against {others} "
                f"(Holm-adjusted p < {ALPHA}).")
    open_ = sorted((p for p in mine_pairs if not p.resolved), key=lambda p: p.high.mean)
    leading = ", ".join(f"`{r.label}`" for r in [lowest, *(p.high for p in open_)])
    needs = "; ".join(f"`{p.high.label}` {need_text(p.need)}" for p in open_)
    return (f"No row is resolved as the lowest. The lowest mean is `{lowest.label}`'s, but its differences to "
            f"{count(len(open_), 'row')} are not resolved, so the leading group {leading} has no established order "
            f"(seeds per arm that would resolve each difference from the lowest at 80 % power: {needs}).")


def pairwise_section(rows: list[Row]) -> str:
    """## Pairwise tests: per size and recipe, every pair, resolved ones first, and what the order allows saying."""
    groups = pairwise(rows)
    if not any(groups.values()):
        return ""
    several = len(groups) > 1
    parts = ["\n## Pairwise tests\n",
             "Every pair of rows of one size and recipe: Welch's two-sided t-test across seeds, Holm-corrected over "
             "the pairs of the group (pairs with a one-seed side have no test and are not counted); *resolved*: "
             f"adjusted p < {ALPHA}. Seeds needed: per arm, for 80 % power in Welch's test (the p beside it) at "
             f"two-sided α = {ALPHA} / m for the m pairs of the group (the level Holm's correction asks of its first "
             "pair: enough to resolve the pair after the correction) if the observed difference and the two rows' "
             "spreads were the true ones; with two or three seeds the spread is itself uncertain, so read it as a size, not a "
             "promise.\n"]
    order = {size: i for i, size in enumerate(size_list(rows))}  # the ladder's order, not the alphabet's
    for (size, group), pairs in sorted(groups.items(), key=lambda item: (order.get(item[0][0], len(order)), item[0])):
        mine = [r for r in rows if (r.size, r.group) == (size, group)]
        if not pairs:
            continue
        resolved = sum(p.resolved for p in pairs)
        where = f"Size {size}, recipe {group}: " if several else ""
        parts.append(f"{where}{count(len(mine), 'row')}, {count(len(pairs), 'pair')}: {resolved} resolved, "
                     f"{len(pairs) - resolved} not. "
                     + ordering(mine, pairs) + "\n")
        parts.append("| lower mean | higher mean | Δ | p | Holm p | resolved | seeds needed |\n"
                     "|---|---|---:|---:|---:|---|---:|")
        parts += [f"| {p.low.label} | {p.high.label} | {p.delta:+.4f} | {_p(p.p)} | {_p(p.p_holm)} | "
                  f"{'yes' if p.resolved else 'no'} | {need_text(p.need)} |" for p in pairs]
        parts.append("")
    return "\n".join(parts) + "\n"

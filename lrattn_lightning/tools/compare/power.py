"""Power and multiplicity for `lrattn compare`: how many seeds a difference needs, and every pair of methods tested.

    seeds_needed(Δ, s)   seeds per arm for power 0.8 in a two-sided two-sample t-test at α = 0.05, equal arms of n
                         and a true difference Δ with common std s: the smallest n (>= 2) with
                             P(|T| > t_{1-α/2, 2n-2}) >= 0.8,   T ~ noncentral t(df = 2n - 2, nc = Δ / (s sqrt(2 / n)))
                         (scipy.stats.nct; power grows with n, so doubling then bisection finds it). None where s is
                         unknown (fewer than two seeds in all) or Δ = 0; 2 where s = 0 and Δ != 0.
    pooled_std(a, b)     s = sqrt((Σ (a_i - ā)^2 + Σ (b_i - b̄)^2) / (n_a + n_b - 2)), over the seeds there are
    holm(p)              Holm's step-down adjustment of m p-values: sorted ascending, p_(k) (m - k + 1) (k = 1..m),
                         made non-decreasing by a running maximum, capped at 1; a pair is resolved when its adjusted
                         p < α. It bounds the chance of any false "resolved" in the family by α, whatever the tests'
                         dependence.
    pairwise(rows)       Welch's test (significance.py) for every pair of rows of one size and recipe, Holm-adjusted
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

from lrattn_lightning.tools.compare.significance import welch

if TYPE_CHECKING:
    from lrattn_lightning.tools.compare.table import Row

ALPHA, POWER = 0.05, 0.8
MAX_SEEDS = 100_000  # beyond this the answer is "more than" (a difference far inside the noise)


def power(n: int, effect: float, alpha: float = ALPHA) -> float:
    """The power of the two-sided two-sample t-test with n seeds per arm at standardised difference Δ / s."""
    from scipy import stats

    df = 2 * n - 2
    nc = effect * math.sqrt(n / 2)
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seeds_needed(delta: float | None, std: float | None, alpha: float = ALPHA, target: float = POWER) -> int | None:
    """Seeds per arm for `target` power at two-sided `alpha` (see the module docstring); MAX_SEEDS + 1: more."""
    if delta is None or std is None or delta == 0 or math.isnan(delta) or math.isnan(std):
        return None
    if std == 0:
        return 2
    effect = abs(delta) / std
    low, high = 1, 2  # power(low) < target <= power(high) once the doubling stops
    while power(high, effect, alpha) < target:
        if high > MAX_SEEDS:
            return MAX_SEEDS + 1
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if power(mid, effect, alpha) >= target else (mid, high)
    return max(high, 2)


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
    need: int | None = None  # seeds per arm for 80 % power at α / m (m pairs), the observed Δ and pooled std

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
            pair.need = seeds_needed(pair.delta, pooled_std(pair.low.losses, pair.high.losses), alpha=level)
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
        return (f"`{lowest.label}` has the lowest validation loss of the group, resolved against each of the "
                f"other {len(mine) - 1} row(s) (Holm-adjusted p < {ALPHA}).")
    open_ = sorted((p for p in mine_pairs if not p.resolved), key=lambda p: p.high.mean)
    leading = ", ".join(f"`{r.label}`" for r in [lowest, *(p.high for p in open_)])
    needs = "; ".join(f"`{p.high.label}` {need_text(p.need)}" for p in open_)
    return (f"No row is resolved as the lowest. The lowest mean is `{lowest.label}`'s, but its differences to "
            f"{len(open_)} row(s) are not resolved, so the leading group {leading} has no established order "
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
             f"adjusted p < {ALPHA}. Seeds needed: per arm, for 80 % power in a two-sample t-test at two-sided "
             f"α = {ALPHA} / m for the m pairs of the group (the level Holm's correction asks of its first pair: "
             "enough to resolve the pair after the correction) if the observed difference and pooled spread were "
             "the true ones; with two or three seeds the spread is itself uncertain, so read it as a size, not a "
             "promise.\n"]
    for (size, group), pairs in sorted(groups.items()):
        mine = [r for r in rows if (r.size, r.group) == (size, group)]
        if not pairs:
            continue
        resolved = sum(p.resolved for p in pairs)
        where = f"Size {size}, recipe {group}: " if several else ""
        parts.append(f"{where}{len(mine)} rows, {len(pairs)} pairs: {resolved} resolved, {len(pairs) - resolved} not. "
                     + ordering(mine, pairs) + "\n")
        parts.append("| lower mean | higher mean | Δ | p | Holm p | resolved | seeds needed |\n"
                     "|---|---|---:|---:|---:|---|---:|")
        parts += [f"| {p.low.label} | {p.high.label} | {p.delta:+.4f} | {_p(p.p)} | {_p(p.p_holm)} | "
                  f"{'yes' if p.resolved else 'no'} | {need_text(p.need)} |" for p in pairs]
        parts.append("")
    return "\n".join(parts) + "\n"

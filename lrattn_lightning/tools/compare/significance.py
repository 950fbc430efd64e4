"""Welch's t-test across seeds (Student's t from scipy, as power.py's noncentral t).

Two means a and b with sample variances va, vb over na, nb seeds:

    t = (mean a - mean b) / sqrt(va / na + vb / nb)
    df = (va / na + vb / nb)^2 / ((va / na)^2 / (na - 1) + (vb / nb)^2 / (nb - 1))     (Welch-Satterthwaite)

and the two-sided p-value is that of Student's t with df degrees of freedom, 2 P(T >= |t|) (equal to the regularised
incomplete beta function I_x(df / 2, 1 / 2) at x = df / (df + t^2)).
"""

from __future__ import annotations

import math
import statistics

from lrattn_lightning.core.errors import InputError


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

"""Welch's t-test across seeds, in plain Python (no scipy).

Two means a and b with sample variances va, vb over na, nb seeds:

    t = (mean a - mean b) / sqrt(va / na + vb / nb)
    df = (va / na + vb / nb)^2 / ((va / na)^2 / (na - 1) + (vb / nb)^2 / (nb - 1))     (Welch-Satterthwaite)

and the two-sided p-value of Student's t with df degrees of freedom is the regularised incomplete beta
function p = I_x(df / 2, 1 / 2) at x = df / (df + t^2), evaluated by its continued fraction (the modified
Lentz method; the fraction converges fast for x < (a + 1) / (a + b + 2), and the symmetry
I_x(a, b) = 1 - I_{1-x}(b, a) covers the rest).
"""

from __future__ import annotations

import math
import statistics

from lrattn_lightning.core.errors import InputError

_TINY = 1e-300  # keeps the Lentz recurrences off zero


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
    return regularized_beta(df / (df + t * t), df / 2, 0.5)


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for 0 <= x <= 1, a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    # x^a (1 - x)^b / B(a, b), in logs
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(x, a, b) / a
    return 1.0 - front * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float, max_terms: int = 500, eps: float = 1e-15) -> float:
    """The continued fraction 1 / (1 + d1 / (1 + d2 / (1 + ...))) of I_x(a, b), by modified Lentz, with
    d_{2m} = m (b - m) x / ((a + 2m - 1)(a + 2m)) and d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1))."""

    def nonzero(v: float) -> float:
        return v if abs(v) > _TINY else _TINY

    c, d = 1.0, 1.0 / nonzero(1.0 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, max_terms + 1):
        for coefficient in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / nonzero(1.0 + coefficient * d)
            c = nonzero(1.0 + coefficient / c)
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    return h

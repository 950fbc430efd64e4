"""Per-size multipliers read off the reference's ladder (tools/compare/scaling.py) against ladders built with a
known answer: a method that is the reference at k times its compute reads k at every size, whatever the ladder's
shape; beyond the ladder's end it is marked; a reference whose loss does not fall gives no reading, said in a line;
the interval leaves out the true multiplier in at most ~5 % of simulated studies at 2, 3 and 5 seeds (issue 52)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lrattn_lightning.tools.compare.power import welch
from lrattn_lightning.tools.compare.scaling import Point, interval, local_multipliers, reference_compute

SIZES = {"xs": 1e11, "s": 4e11, "m": 2e12, "l": 1e13}


def bent(c: float) -> float:
    """A loss curve no single power law fits (ln L linear in log C with a kink at size m): the shared-law fit would
    be poor; between ladder sizes the reading is exact because ln L is linear there."""
    x, kink = math.log10(c), math.log10(SIZES["m"])
    return 3.0 * math.exp(-0.09 * (x - 11) - (0.08 * (x - kink) if x > kink else 0.0))


def ladder(k_true: float, noise: float = 0.0, seeds: int = 3, method_sizes=("xs", "s", "m", "l")) -> list[Point]:
    rng = np.random.default_rng(1)
    points = []
    for size, c in SIZES.items():
        for seed in range(seeds):
            points.append(Point("baseline", size, seed, c, bent(c) + noise * rng.standard_normal()))
            if size in method_sizes:  # the method spends 3 % more compute and reaches the reference's loss at k x C
                cm = 1.03 * c
                points.append(Point("method", size, seed, cm, bent(k_true * cm) + noise * rng.standard_normal()))
    return points


@pytest.mark.parametrize("k_true", [0.8, 1.0, 1.25, 1.6])
def test_a_method_worth_k_times_its_compute_reads_k_at_every_size(k_true):
    rows, notes = local_multipliers(ladder(k_true))
    assert notes == [] and [r.size for r in rows] == list(SIZES)
    for r in rows:
        assert r.k == pytest.approx(k_true, rel=1e-9), r.size
        assert r.extrapolated == (k_true > 1 / 1.03 and r.size == "l" or k_true < 1 / 1.03 and r.size == "xs")
        assert r.delta == pytest.approx(bent(k_true * 1.03 * SIZES[r.size]) - bent(SIZES[r.size]))


def test_the_interval_holds_the_true_multiplier_and_narrows_with_seeds():
    wide = [r for r in local_multipliers(ladder(1.25, noise=0.02, seeds=3))[0] if r.size == "m"][0]
    narrow = [r for r in local_multipliers(ladder(1.25, noise=0.02, seeds=12))[0] if r.size == "m"][0]
    for r in (wide, narrow):
        assert r.low < 1.25 < r.high
    assert narrow.high - narrow.low < wide.high - wide.low
    one_seed = local_multipliers(ladder(1.25, noise=0.02, seeds=1))[0]
    assert all(r.low is None and r.high is None and r.k is not None for r in one_seed)  # no spread, no interval


def test_a_reference_whose_loss_does_not_fall_gives_no_reading_and_says_so():
    points = [p if not (p.method == "baseline" and p.size == "m") else Point(p.method, p.size, p.seed, p.compute, 9.0)
              for p in ladder(1.25)]
    rows, notes = local_multipliers(points)
    assert all(r.k is None for r in rows) and len(notes) == 1 and "does not fall" in notes[0]
    assert local_multipliers([p for p in ladder(1.25) if p.size == "m"])[1] == [
        "No per-size multipliers: `baseline` ran at fewer than 2 sizes."]


def test_reading_the_curve_interpolates_in_log_compute():
    curve = [(0.0, 3.0), (1.0, 2.0), (3.0, 1.0)]
    assert reference_compute(curve, 2.5) == (0.5, False)
    assert reference_compute(curve, 1.5) == (2.0, False)
    assert reference_compute(curve, 0.5) == (4.0, True)  # past the end: the last segment's line
    assert reference_compute(curve, 3.5) == (-0.5, True)
    assert reference_compute([(0.0, 2.0), (1.0, 2.0)], 2.0) == (None, False)


# ---- the interval's coverage (issue 52) ----------------------------------------------------------------
STUDY = np.geomspace(6e10, 1.2e13, 4)  # the scaling study's ladder (docs/scaling-study.md): 200x in compute


def study_law(c):
    """The scaling study's fitted law (E at its bound 0): L = 30 C^-0.0957."""
    return 30.0 * np.asarray(c) ** -0.0957


def misses(k: float, n: int, studies: int, sigma: float = 0.02, seed: int = 0) -> np.ndarray:
    """Per size, the share of simulated studies whose interval leaves out the true multiplier k (a method whose
    loss at C is the reference's at k C, n seeds a cell, Gaussian seed noise), all studies at once through the
    same function local_multipliers uses; a study without an interval (slope unknown) claims nothing."""
    rng, x = np.random.default_rng(seed), np.log(STUDY)
    ref = study_law(STUDY)[None, :, None] + sigma * rng.standard_normal((studies, len(STUDY), n))
    mine = study_law(k * STUDY)[None, :, None] + sigma * rng.standard_normal((studies, len(STUDY), n))
    means = ref.mean(-1)
    out = []
    for j in range(len(STUDY)):
        m = mine[:, j].mean(-1)
        low, high, known = interval(x, np.log(means), ref.var(-1, ddof=1) / means**2, np.full(len(STUDY), n),
                                    np.log(m), mine[:, j].var(-1, ddof=1) / m**2, np.full(studies, n))
        assert known.mean() > 0.9  # (at 2 seeds and 2 % noise, 1-6 % of studies have no interval: slope unknown)
        truth = x[j] + math.log(k)
        out.append(np.mean(known & ~((low <= truth) & (truth <= high))))
    return np.array(out)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("k", [1.0, 1.3, 1.6])
def test_the_interval_leaves_out_the_true_multiplier_at_most_as_often_as_it_says(n, k):
    """4,000 simulated studies a case, at each of the 4 sizes: false exclusions <= 5 % plus three Monte Carlo
    standard errors (1 %), for a method equal to the reference (null) and ones worth 1.3x and 1.6x. The percentile
    bootstrap this replaced left out k = 1 in ~21 % of studies at 2 seeds and ~7 % at 3."""
    rates = misses(k, n, 4000, seed=10 * n + int(10 * k))
    assert np.all(rates <= 0.06), rates
    assert np.all(rates >= 0.01), rates  # not a wide interval that covers by being wide


def test_the_report_interval_at_two_seeds_excludes_the_reference_about_as_often_as_welchs_test():
    """Through local_multipliers itself: 400 null studies at 2 seeds (a method that is the reference): its interval
    leaves out 1 in at most ~5 % of them, and, where the method's mean sits at the reference's size, only when
    Welch's p on the same runs is below 0.05 (the bootstrap printed `1.35 (1.24-1.47)` beside p = 0.11)."""
    rng, left_out, cells, disagree = np.random.default_rng(3), 0, 0, 0
    for _ in range(400):
        points = []
        for i, c in enumerate(STUDY):
            for seed in range(2):
                for method in ("baseline", "method"):
                    points.append(Point(method, f"s{i}", seed, float(c), float(study_law(c) + 0.02 * rng.normal())))
        rows, _ = local_multipliers(points)
        for r in rows:
            if r.low is None:
                continue
            cells += 1
            excluded = not r.low <= 1.0 <= r.high
            left_out += excluded
            losses = {m: [p.loss for p in points if (p.method, p.size) == (m, r.size)] for m in ("baseline", "method")}
            disagree += excluded and welch(losses["method"], losses["baseline"])[1] >= 0.05
    assert left_out / cells <= 0.06 and disagree <= 0.01 * cells, (left_out, disagree, cells)


def test_no_interval_without_a_spread_or_a_slope_and_one_line_says_why():
    points = [p for p in ladder(1.25, noise=0.02) if not (p.method == "baseline" and p.size == "s" and p.seed)]
    rows, notes = local_multipliers(points)
    one = [r for r in rows if r.low is None]
    assert one and all(r.k is not None and "one seed" in r.why for r in one)
    assert any(line.startswith("No interval (") and "one seed" in line for line in notes)
    flat = [Point(p.method, p.size, p.seed, p.compute, p.loss + (0.0 if p.seed is None else 0.3 * (p.seed % 2)))
            if p.size in ("m", "l") else p for p in ladder(1.25, noise=0.0, seeds=2)]
    # the reference's fall from m to l (~0.04) is inside its seeds' spread (0.3): no slope, no interval
    rows, notes = local_multipliers([p for p in flat])
    assert any(r.why and "falls by less than its seeds' noise" in r.why for r in rows), rows

"""Per-size multipliers read off the reference's ladder (tools/compare/scaling_local.py) against ladders built with a
known answer: a method that is the reference at k times its compute reads k at every size, whatever the ladder's
shape; beyond the ladder's end it is marked; a reference whose loss does not fall gives no reading, said in a line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lrattn_lightning.tools.compare.scaling import Point
from lrattn_lightning.tools.compare.scaling_local import local_multipliers, reference_compute

SIZES = {"xs": 1e11, "s": 4e11, "m": 2e12, "l": 1e13}


def bent(c: float) -> float:
    """A loss curve no single power law fits (linear in log C with a kink at size m): the shared-law fit would be
    poor; between ladder sizes the reading is exact because the curve is linear there."""
    x, kink = math.log10(c), math.log10(SIZES["m"])
    return 3.0 - 0.25 * (x - 11) - (0.2 * (x - kink) if x > kink else 0.0)


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
    rows, notes = local_multipliers(ladder(k_true), resamples=50)
    assert notes == [] and [r.size for r in rows] == list(SIZES)
    for r in rows:
        assert r.k == pytest.approx(k_true, rel=1e-9), r.size
        assert r.extrapolated == (k_true > 1 / 1.03 and r.size == "l" or k_true < 1 / 1.03 and r.size == "xs")
        assert r.delta == pytest.approx(bent(k_true * 1.03 * SIZES[r.size]) - bent(SIZES[r.size]))


def test_the_interval_holds_the_true_multiplier_and_narrows_with_seeds():
    wide = [r for r in local_multipliers(ladder(1.25, noise=0.02, seeds=3), resamples=400)[0] if r.size == "m"][0]
    narrow = [r for r in local_multipliers(ladder(1.25, noise=0.02, seeds=12), resamples=400)[0] if r.size == "m"][0]
    for r in (wide, narrow):
        assert r.low < 1.25 < r.high
    assert narrow.high - narrow.low < wide.high - wide.low
    one_seed = local_multipliers(ladder(1.25, noise=0.02, seeds=1), resamples=50)[0]
    assert all(r.low is None and r.high is None and r.k is not None for r in one_seed)  # no spread, no interval


def test_a_reference_whose_loss_does_not_fall_gives_no_reading_and_says_so():
    points = [p if not (p.method == "baseline" and p.size == "m") else Point(p.method, p.size, p.seed, p.compute, 9.0)
              for p in ladder(1.25)]
    rows, notes = local_multipliers(points, resamples=20)
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

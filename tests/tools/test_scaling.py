"""Size ladders and compute multipliers (issue 40): the fit recovers a multiplier planted in synthetic ladders and
its interval covers it about as often as it says; too few sizes and a poor fit are one line, not a number; a real
MLflow store of synthetic finished runs goes through `lrattn compare`; the registry's ladders and the scaling sweep
files hold what their comments say.
"""

from __future__ import annotations

import csv
import itertools
import json
import math

import numpy as np
import pytest
import yaml
from helpers.tracking import seed_store
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.compare.scaling import Point, _Data, _fit, _refits, _solve, analyse, fit_law
from lrattn_lightning.tools.sweep.file import SweepError, load_sweep
from lrattn_lightning.train.schema import Artifact

CPU_LADDER = ["ladder-xs", "ladder-s", "ladder-m", "ladder-l", "ladder-xl"]
GPU_LADDER = ["d768", "ladder-d832", "ladder-d896", "paper-0.5b"]
METHODS = ["baseline", "s-lr-block-n8-r64", "p-lr-block-n8-r32", "attnres-block-n8", "muddformer",
           "value-residual-learned"]


def law(compute, E, A, alpha):
    return E + A * np.asarray(compute, dtype=float) ** (-alpha)


def ladder(rng, k=1.25, E=1.5, A=40.0, alpha=0.2, sigma=0.005, sizes=4, seeds=3, loss=None):
    """Points of 'baseline' and 's-lr' whose losses follow the law, s-lr worth k times the compute: A_m = A k^-alpha.
    `loss(compute, A)`: another law instead."""
    points = []
    for method, kk in (("baseline", 1.0), ("s-lr", k)):
        a = A * kk ** (-alpha)
        for i, c in enumerate(np.geomspace(1e12, 1e15, sizes)):
            for seed in range(seeds):
                mean = law(c, E, a, alpha) if loss is None else loss(c, a)
                points.append(Point(method, f"size{i}", seed, float(c), float(mean + rng.normal(0, sigma))))
    return points


# ---- the fit ---------------------------------------------------------------------------------------------------
def test_the_fit_recovers_a_planted_law_and_multiplier():
    points = ladder(np.random.default_rng(0), sigma=0.0005, sizes=5)
    result = analyse(points, resamples=200)
    assert result.refusal is None, result.refusal
    fit = result.fit
    assert fit.E == pytest.approx(1.5, abs=0.02) and fit.alpha["s-lr"] == pytest.approx(0.2, rel=0.05)
    assert result.k["s-lr"] == pytest.approx(1.25, rel=0.03) and result.k["baseline"] == pytest.approx(1.0)
    # the multiplier is (A_ref / A_m)^(1/alpha) of the fitted numbers, the same at every compute
    assert result.k["s-lr"] == pytest.approx((fit.A("baseline") / fit.A("s-lr")) ** (1 / fit.alpha["s-lr"]))
    assert fit.multiplier("s-lr", "baseline", 1e9) == pytest.approx(result.k["s-lr"])
    assert result.low["s-lr"] < 1.25 < result.high["s-lr"] and result.failed == 0
    assert result.cell_rms < result.seed_std  # a good fit: the means sit within the seeds' spread


def test_per_method_exponents_read_the_multiplier_at_the_largest_compute():
    """Methods with their own exponents: k at C* solves L_ref(k C*) = L_m(C*), computed here from the true law."""
    rng, points = np.random.default_rng(1), []
    E, laws = 1.2, {"baseline": (30.0, 0.18), "fast": (60.0, 0.21)}
    for (method, (a, alpha)), (i, c), seed in itertools.product(laws.items(), enumerate(np.geomspace(1e12, 1e16, 5)),
                                                                range(3)):
        points.append(Point(method, f"size{i}", seed, float(c), float(law(c, E, a, alpha) + rng.normal(0, 2e-4))))
    result = analyse(points, shared=False, resamples=100)
    assert result.refusal is None, result.refusal
    top = 1e16
    gap = law(top, 0.0, *laws["fast"])  # L_fast(C*) - E
    truth = (laws["baseline"][0] / gap) ** (1 / laws["baseline"][1]) / top
    assert result.at == pytest.approx(top) and result.k["fast"] == pytest.approx(truth, rel=0.05)
    assert result.fit.alpha["fast"] == pytest.approx(0.21, rel=0.05) != result.fit.alpha["baseline"]


def test_the_interval_covers_the_true_multiplier_about_as_often_as_it_says():
    """120 simulated ladders (4 sizes x 2 methods x 3 seeds): the 95 % interval covers the planted k in 87-99 % of
    them, and is about as wide as the estimates actually spread (not a wide interval that covers by being wide)."""
    rng, hits, estimates, widths = np.random.default_rng(2024), 0, [], []
    for study in range(120):
        result = analyse(ladder(rng), resamples=150, seed=study)
        assert result.refusal is None, result.refusal
        hits += result.low["s-lr"] <= 1.25 <= result.high["s-lr"]
        estimates.append(math.log(result.k["s-lr"]))
        widths.append(math.log(result.high["s-lr"] / result.low["s-lr"]))
    assert 0.87 <= hits / 120 <= 0.99, hits
    assert abs(np.median(estimates) - math.log(1.25)) < 0.03  # the point estimate is unbiased enough
    spread = 2 * 1.96 * np.std(estimates)  # the width a 95 % interval needs
    assert 0.7 * spread < np.median(widths) < 1.4 * spread, (np.median(widths), spread)


def law_cost(data, shared: bool, theta: np.ndarray) -> float:
    """The least-squares cost of parameters [E, alpha(s), ln A_m...] on data's losses, written out."""
    na = 1 if shared else len(data.methods)
    alpha = theta[1 + (np.zeros_like(data.index) if shared else data.index)]
    fitted = theta[0] + np.exp(theta[1 + na + data.index] - alpha * data.lx)
    return float(np.sum((fitted - data.y) ** 2))


@pytest.mark.parametrize("shared", [True, False])
def test_the_batched_refits_agree_with_scipys_least_squares(shared):
    """The bootstrap's refits (_refits: all resamples at once) against scipy's bounded least squares (_fit) one
    resample at a time, on noisy and very noisy ladders (a third of the resamples run into a bound there): the same
    resamples refused (all but 1 %), and where both fit, a cost no higher than scipy's and the same parameters to
    scipy's own tolerance."""
    agree, both, total = 0, 0, 0
    for sigma in (0.005, 0.02):
        points = ladder(np.random.default_rng(1), sigma=sigma)
        data = _Data(points, ["baseline", "s-lr"])
        _, _, theta = _fit(data, shared)
        losses = data.y + np.random.default_rng(9).normal(0, sigma / 3, (100, len(data.y)))
        thetas, ok = _refits(data, losses, shared, theta)
        for y, mine, fitted in zip(losses, thetas, ok, strict=True):
            data.y = y
            fit, _, theirs = _fit(data, shared, start=theta)
            total += 1
            agree += (fit is not None) == bool(fitted)
            if fit is not None and fitted:
                both += 1
                assert law_cost(data, shared, mine) <= law_cost(data, shared, theirs) * (1 + 1e-9)
                assert np.allclose(mine, theirs, rtol=2e-3, atol=2e-4), (mine, theirs)
    assert agree >= 0.99 * total and both >= 0.6 * total, (agree, both, total)
    # a row whose losses are not numbers is refused, and leaves the others as they were
    losses[3] = np.nan
    again, ok_again = _refits(data, losses, shared, theta)
    assert not ok_again[3] and np.array_equal(ok_again[4:], ok[4:]) and np.allclose(again[ok_again], thetas[ok_again])


def test_a_singular_step_is_the_least_squares_one_and_the_other_rows_are_solved():
    a = np.array([np.eye(2), [[1.0, 1.0], [1.0, 1.0]]])  # the second row's system is singular
    x = _solve(a, np.array([[1.0, 2.0], [2.0, 2.0]]))
    assert np.allclose(x[0], [1.0, 2.0]) and np.allclose(x[1], [1.0, 1.0])  # the minimum-norm solution


def test_the_bootstrap_is_reproducible():
    points = ladder(np.random.default_rng(5))
    first, second = analyse(points, resamples=60, seed=3), analyse(points, resamples=60, seed=3)
    assert first.median == second.median and (first.low, first.high) == (second.low, second.high)
    assert analyse(points, resamples=60, seed=4).median != first.median
    assert analyse(points, resamples=60, seed=4).low == first.low  # the interval is Welch's: no resampling in it


def test_the_refits_need_the_design_points_moments_not_every_run(monkeypatch):
    """The law takes one value per (method, compute), so a set of losses enters a refit only through its _Moments
    (the mean at each design point, the sum of squares within them, the smallest loss): the cost over every run,
    written out, equals n_d-weighted squares at the means plus the within sum, for any parameters; and the bootstrap's
    moments, built one resample at a time, equal those of every resample's losses drawn as before, resample by
    resample (the same seeded draws: the report's median is reproduced)."""
    from lrattn_lightning.tools.compare.scaling import _cells, _Moments

    points = ladder(np.random.default_rng(8), seeds=4)
    points += [Point("s-lr", "size3", 9, points[-1].compute, points[-1].loss)]  # a design point of 5 runs among 4s
    data = _Data(points, ["baseline", "s-lr"])
    design, counts = data.design()
    assert len(counts) == 8 and sorted(counts) == [4] * 7 + [5]
    losses = data.y + np.random.default_rng(1).normal(0, 0.01, (7, len(data.y)))
    moments = _Moments.of(losses, design, counts)
    cells, weight = data.at_design()
    for shared, row in itertools.product((True, False), range(7)):
        na = 1 if shared else 2
        theta = np.r_[1.3, [0.21] * na, 1.1, 1.0]
        data.y = losses[row]
        terms = theta[0] + np.exp(theta[1 + na + cells.index] - theta[1 + (cells.index if na > 1 else 0)] * cells.lx)
        by_moments = np.sum(weight * (terms - moments.means[row]) ** 2) + moments.within[row]
        assert by_moments == pytest.approx(law_cost(data, shared, theta), rel=1e-12)
    # the bootstrap's draws, as _bootstrap made them before it streamed (every resample's losses held at once)
    data.y = np.array([p.loss for p in points])
    y, rng = data.y, np.random.default_rng(5)
    held = np.tile(y, (40, 1))
    for r in range(40):
        for idx in (np.array(i) for i in _cells(points).values() if len(i) > 1):
            mean, inflate = y[idx].mean(), math.sqrt(len(idx) / (len(idx) - 1))
            held[r, idx] = mean + inflate * (y[idx][rng.integers(0, len(idx), len(idx))] - mean)
    expected = _Moments.of(held, design, counts)
    seen = {}

    def spy(data_, moments_, shared_, theta_):
        seen["moments"] = moments_
        return np.tile(theta_, (len(moments_.means), 1)), np.zeros(len(moments_.means), dtype=bool)

    monkeypatch.setattr("lrattn_lightning.tools.compare.scaling._refit_moments", spy)
    analyse(points, resamples=40, seed=5)
    for got, want in zip(seen["moments"], expected, strict=True):
        assert np.allclose(got, want, rtol=1e-12, atol=1e-15)


def test_the_refits_of_a_ladder_with_no_floor_converge_with_E_held_at_zero():
    """The stored scaling study's losses follow a pure power law (E fitted at its bound 0): every bootstrap refit
    used to end unconverged, E held at 0 while the clipped steps of the others crept ("1000 of 1000 bootstrap
    resamples failed to refit: no median"). A parameter a bound holds now takes no step: the refits converge, E at
    0, and the median sits by the fitted k."""
    rng, points = np.random.default_rng(0), []
    for method, a in (("baseline", 30.0), ("s-lr", 30.0 * 1.2**-0.0957)):
        for i, c in enumerate(np.geomspace(6e10, 1.2e13, 5)):
            points += [Point(method, f"size{i}", s, float(c), float(a * c**-0.0957 * (1 + rng.normal(0, 0.01))))
                       for s in range(3)]
    for shared in (True, False):
        result = analyse(points, shared=shared, resamples=200)
        assert result.refusal is None and result.fit.E < 1e-6, (result.refusal, result.fit)
        assert result.failed <= 10, result.failed
        assert result.median["s-lr"] == pytest.approx(result.k["s-lr"], rel=0.05)


def test_too_few_sizes_is_one_line_and_no_multiplier():
    result = analyse(ladder(np.random.default_rng(3), sizes=2), resamples=20)
    assert result.fit is None and not result.k
    assert "fewer than 3 sizes" in result.refusal and "baseline (2)" in result.refusal and "\n" not in result.refusal


def test_a_method_short_of_sizes_is_left_out_and_named():
    points = ladder(np.random.default_rng(4))
    points += [Point("partial", f"size{i}", s, p.compute, 2.0) for i, p in enumerate(points[:2]) for s in range(2)]
    result = analyse(points, resamples=20)
    assert result.refusal is None and "partial" not in result.k
    assert any("partial" in note and "fewer than 3 sizes" in note for note in result.notes)


def test_a_poor_fit_is_refused_in_one_line():
    """Losses that fall linearly in log C and then stop (a kink) follow no saturating power law: refused, with the
    residuals against the seeds' spread; losses that fall then rise drive E into its bound: refused too."""
    def kink(c, a):
        return 3.0 - 0.4 * np.minimum(np.log10(c) - 12, 1.5) - 0.02 * (a - 40.0)

    def bowl(c, a):
        return 2.0 + 0.05 * (np.log10(c) - 13.5) ** 2 + (a - 40.0) * 1e-3

    for loss, needle in ((kink, "a poor fit: the cell means sit"), (bowl, "ran into its bound")):
        result = analyse(ladder(np.random.default_rng(6), loss=loss, sizes=5), resamples=20)
        assert result.fit is None and not result.k and not result.low
        assert needle in result.refusal and "\n" not in result.refusal, result.refusal


def test_no_reference_and_one_seed_per_size_are_said():
    points = ladder(np.random.default_rng(7), seeds=1)
    assert "no `control` runs" in analyse(points, reference="control").refusal
    alone = analyse([p for p in points if p.method == "baseline"], resamples=20)
    assert alone.refusal.startswith("only `baseline` ran") and alone.fit is None
    result = analyse(points, resamples=20)
    assert result.k and not result.low and any("cannot be judged" in note for note in result.notes)
    fit, why = fit_law([Point("a", "s", 0, 1e12, 2.0)] * 3, ["a"])  # one compute three times: no exponent
    assert (fit is None) == (why is not None)


# ---- a real store through `lrattn compare` ---------------------------------------------------------------------
K_TRUE, E_TRUE, A_TRUE, ALPHA_TRUE, SIGMA = 1.3, 1.2, 3000.0, 0.3, 0.002
STEPS = {"ladder-xs": 98, "ladder-s": 232, "ladder-m": 595, "ladder-l": 1360}  # scaling-cpu.yaml's, 512 tokens a step


def expected_compute(params: dict, steps: int) -> float:
    """An independent formula: 6 L (4 d^2 + 3 d h) (1 + added %) x tokens."""
    L, d, h = (int(params[k]) for k in ("n_layers", "d_model", "d_mlp"))
    return 6 * L * (4 * d * d + 3 * d * h) * (1 + float(params["added_flops_pct"]) / 100) * steps * 512


@pytest.fixture(scope="module")
def ladder_store(tmp_path_factory, store_template):
    """Finished runs as `lrattn fit` logs them (its params, tags, val/loss at the last step) over four ladder sizes x
    baseline and block S-LR x three seeds; losses from the law with S-LR worth K_TRUE times the compute."""
    from lrattn_lightning.train.callbacks import flat_run_params

    folder = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{seed_store(folder, store_template)}"
    client, reg, rng = MlflowClient(uri), load_registry(), np.random.default_rng(11)
    exp = client.create_experiment("ladder", artifact_location=(folder / "artifacts").as_uri())
    computes = {}
    for (size, steps), ablation, seed in itertools.product(STEPS.items(), ["baseline", "s-lr-block-n8-r64"], range(3)):
        cfg = reg.model(size, ablation)
        params = {**flat_run_params(cfg), "train_max_steps": steps, "train_tokens_per_step": 512, "train_seed": seed}
        compute = expected_compute(params, steps)
        a = A_TRUE * (K_TRUE if ablation != "baseline" else 1.0) ** (-ALPHA_TRUE)
        loss = law(compute, E_TRUE, a, ALPHA_TRUE) + rng.normal(0, SIGMA)
        run = client.create_run(exp, run_name=f"{size}-{ablation}-seed{seed}")
        tags = {"size": size, "ablation": ablation, "seed": str(seed), "control": cfg.ablation.control or "none",
                "lrattn.last_step": str(steps)}
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()],
                         tags=[RunTag(k, v) for k, v in tags.items()],
                         metrics=[Metric("train/loss", float(loss) + 0.05, 0, steps - 1),
                                  Metric("val/loss", float(loss), 0, steps)])
        if ablation != "baseline":  # routing weights as fit logs them: one heatmap figure per size
            weights = {"step": steps, "kind": "attnres", "sites_by_sources": [[1.0], [0.4, 0.6], [0.2, 0.3, 0.5]]}
            client.log_text(run.info.run_id, json.dumps(weights), Artifact.ROUTING_WEIGHTS)
        client.set_terminated(run.info.run_id, "FINISHED")
        computes[(size, ablation, seed)] = compute
    return uri, computes


def test_compare_reports_the_planted_multiplier_from_a_store(ladder_store, tmp_path, capsys):
    uri, computes = ladder_store
    out = tmp_path / "report"
    command = ["compare", "--experiment", "ladder", "--tracking_uri", uri, "--no-summary-run"]
    assert main([*command, "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "## Compute multipliers" in report and "![loss against training compute](scaling.png)" in report
    assert "No compute multipliers" not in report
    for name in ("scaling.md", "scaling.csv", "scaling_points.csv", "scaling.svg"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "scaling.png").read_bytes().startswith(b"\x89PNG")
    with (out / "scaling.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    slr = rows["s-lr-block-n8-r64"]
    # (the seed noise moves k by ~0.3 % here; whether one study's interval covers K_TRUE is a coin with 95 % odds:
    # the coverage itself is test_the_interval_covers_the_true_multiplier_about_as_often_as_it_says)
    assert float(slr["multiplier"]) == pytest.approx(K_TRUE, rel=0.02), slr
    assert float(slr["low"]) < float(slr["multiplier"]) < float(slr["high"]) < 1.1 * float(slr["low"])
    assert float(slr["alpha"]) == pytest.approx(ALPHA_TRUE, rel=0.1) and slr["shared_exponent"] == "True"
    assert float(rows["baseline"]["multiplier"]) == pytest.approx(1.0)
    with (out / "scaling_points.csv").open() as f:
        points = list(csv.DictReader(f))
    assert len(points) == 24
    for p in points:  # the compute compare read back equals the independent formula
        assert float(p["compute"]) == pytest.approx(computes[(p["size"], p["method"], int(p["seed"]))], rel=1e-9)
        assert float(p["residual"]) == pytest.approx(float(p["fitted"]) - float(p["val_loss"]))
    assert "| s-lr-block-n8-r64 | 4 | 12 | " in (out / "scaling.md").read_text()
    # one heatmap figure per size, the largest in the report, the others linked under it
    assert "![routing weights at size ladder-l](routing_heatmaps.png)" in report
    assert ("Routing weights at the other sizes: [ladder-m](routing_heatmaps-ladder-m.png), "
            "[ladder-s](routing_heatmaps-ladder-s.png), [ladder-xs](routing_heatmaps-ladder-xs.png).") in report
    for stem in ("routing_heatmaps", "routing_heatmaps-ladder-m", "routing_heatmaps-ladder-s", "routing_heatmaps-ladder-xs"):
        assert (out / f"{stem}.png").read_bytes().startswith(b"\x89PNG"), stem

    out2 = tmp_path / "per-method"
    assert main([*command, "--out", str(out2), "--per-method-exponents"]) == 0
    with (out2 / "scaling.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert rows["s-lr-block-n8-r64"]["shared_exponent"] == "False"
    assert float(rows["s-lr-block-n8-r64"]["multiplier"]) == pytest.approx(K_TRUE, rel=0.1)
    assert "read at the ladder's largest compute" in (out2 / "report.md").read_text()


def test_one_size_writes_no_section():
    from lrattn_lightning.tools.compare.scaling_report import write_scaling
    from lrattn_lightning.tools.compare.table import Row

    rows = [Row("tiny", "baseline", None, []), Row("tiny", "x", "baseline", [])]
    assert write_scaling(None, rows, None, "t") == ([], "")  # before it reads a run or writes a file


# ---- the registry's ladders and the sweep files ----------------------------------------------------------------
def test_the_ladders_grow_layers_and_width_together_over_30x():
    from lrattn_lightning.model.accounting import core_flops

    reg = load_registry()
    for names, span in ((CPU_LADDER, 30), (GPU_LADDER, 3.5)):
        sizes = [reg.size(n) for n in names]
        for small, big in itertools.pairwise(sizes):
            assert small.n_layers < big.n_layers and small.d_model < big.d_model and small.d_mlp < big.d_mlp
        flops = [6 * s.n_layers * (4 * s.d_model ** 2 + 3 * s.d_model * s.d_mlp) for s in sizes]  # independent
        assert flops == [3 * core_flops(s) for s in sizes] and flops[-1] / flops[0] >= span
        for size, ablation in itertools.product(names, METHODS):  # every pair builds (rank <= d, blocks <= 2L)
            reg.model(size, ablation)
    assert all(reg.size(n).vocab_size == 512 and reg.size(n).seq_len == 128 for n in CPU_LADDER)
    assert all(reg.size(n).n_layers >= 4 and reg.size(n).n_layers % 2 == 0 for n in CPU_LADDER + GPU_LADDER)


@pytest.mark.parametrize("name,sizes,tokens_per_param", [("scaling-cpu", CPU_LADDER, 0.25),
                                                         ("scaling-gpu", GPU_LADDER, 20.0)])
def test_the_scaling_sweeps_expand_to_sizes_x_methods_x_seeds_with_budgets_proportional_to_parameters(
        name, sizes, tokens_per_param, tmp_path, capsys):
    from lrattn_lightning.model.accounting import core_params

    path = f"experiments/sweeps/{name}.yaml"
    sweep, reg = load_sweep(path)
    assert {(r.size, r.ablation, r.seed) for r in sweep.runs} == set(itertools.product(sizes, METHODS, [0, 1, 2]))
    assert len(sweep.runs) == len(sizes) * len(METHODS) * 3
    accumulate = sweep.setting("trainer.accumulate_grad_batches", 1) or 1
    for run in sweep.runs:
        args = sweep.fit_args(run)
        steps = int(args[len(args) - 1 - args[::-1].index("--trainer.max_steps") + 1])  # the last one given wins
        seq = int(sweep.setting("data.seq_len") or reg.size(run.size).seq_len)
        tokens = steps * sweep.setting("data.batch_size") * seq * accumulate
        assert tokens / core_params(reg.size(run.size)) == pytest.approx(tokens_per_param, rel=0.005), run
    # the sweep's own dry run: every run's fit arguments parsed by fit's parser, every run listed as new
    assert main(["sweep", path, "--dry-run", "--tracking_uri", f"sqlite:///{tmp_path / 'dry.db'}"]) == 0
    assert capsys.readouterr().out.count("  new ") == len(sweep.runs)


def test_size_args_apply_per_size_between_args_and_a_runs_own(tmp_path):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"trainer": {"max_steps": 5}}))
    sweep = {"doc": "d", "recipe": "recipe.yaml", "sizes": ["tiny", "ladder-xs"], "ablations": ["baseline"],
             "seeds": [0], "args": {"trainer.max_steps": 7, "model.lr": 0.1},
             "size_args": {"ladder-xs": {"trainer.max_steps": 9}},
             "runs": [{"size": "ladder-xs", "ablation": "baseline", "seed": 1, "variant": "long",
                       "args": {"trainer.max_steps": 11}}]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    loaded, _ = load_sweep(path)

    def steps(run):
        args = loaded.fit_args(run)
        return [args[i + 1] for i, a in enumerate(args) if a == "--trainer.max_steps"][-1]

    by_name = {(r.size, r.seed): r for r in loaded.runs}
    assert [steps(by_name[k]) for k in (("tiny", 0), ("ladder-xs", 0), ("ladder-xs", 1))] == ["7", "9", "11"]
    for bad, needle in (({"ladder-s": {"trainer.max_steps": 3}}, "size_args.ladder-s"),
                        ({"ladder-xs": {"seed_everything": 3}}, "set by the sweep itself"),
                        ({"ladder-xs": 5}, "size_args.ladder-xs")):
        path.write_text(yaml.safe_dump({**sweep, "size_args": bad}))
        with pytest.raises(SweepError, match=needle.replace(".", r"\.")):
            load_sweep(path)


# ---- the interval's coverage at 2, 3 and 5 seeds (issue 52) ---------------------------------------------------
@pytest.mark.parametrize("seeds", [2, 3, 5])
def test_the_interval_leaves_out_the_true_multiplier_at_most_as_often_as_it_says(seeds):
    """800 simulated ladders per case (4 sizes, 2 methods, Gaussian seed noise), fitted all at once (_refits) from
    the noiseless fit and given the interval analyse reports (welch_interval): a method equal to the baseline
    (k = 1) and one worth 1.25x, each left out in at most 5 % of studies plus three Monte Carlo errors (~2 %), and
    in at least 1 % (not a wide interval that covers by being wide). The expanded percentile bootstrap it replaced
    left out the true k in 13-15 % of two-seed studies."""
    from lrattn_lightning.tools.compare.scaling import _cells, welch_interval

    for k in (1.0, 1.25):
        exact = ladder(np.random.default_rng(0), k=k, sigma=0.0, seeds=seeds)
        data = _Data(exact, ["baseline", "s-lr"])
        truth = data.y.copy()
        _, _, theta = _fit(data, True)
        losses = truth + np.random.default_rng(seeds).normal(0, 0.01, (800, len(truth)))
        thetas, ok = _refits(data, losses, True, theta)
        low, high = welch_interval(data, thetas, losses, list(_cells(exact).values()), True, 0.0)
        assert ok.mean() > 0.95
        left_out = ~((low[ok, 1] <= k) & (k <= high[ok, 1]))
        assert 0.01 <= left_out.mean() <= 0.07, (k, seeds, left_out.mean())

"""The comparison report's words and figures over a size ladder (issue 55): sizes in ladder order (parameters,
never the alphabet) in tables, titles and figures; every counted noun counted right ("1 ablation", "2 ablations"
for two ablations at three sizes, not six); and each figure checked for what a reader needs: legend entries
unique, no text outside the canvas, every size present, no idle half of the canvas, no "Tight layout not applied".
A synthetic three-size study; LRATTN_FIGURES_OUT=DIR also writes the PNGs there, to look at.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from lrattn_lightning.core.words import count
from lrattn_lightning.tools.compare import words
from lrattn_lightning.tools.compare.notes import delta_notes, recipe_notes
from lrattn_lightning.tools.compare.power import pairwise_section
from lrattn_lightning.tools.compare.scaling import Point, analyse, local_multipliers
from lrattn_lightning.tools.compare.scaling_report import local_section
from lrattn_lightning.tools.compare.summary_run import compared, description
from lrattn_lightning.tools.compare.table import RunRecord, markdown_table, summarise
from lrattn_lightning.train.schema import Metric, Param

# alphabetical order would be ladder-m, ladder-s, ladder-xs; the ladder's is xs < s < m
SIZES = {"ladder-xs": (1_000, 60), "ladder-s": (2_000, 120), "ladder-m": (4_000, 400)}  # params, steps
LADDER = ["ladder-xs", "ladder-s", "ladder-m"]


def _curve(start: float, end: float, steps: int, every: int) -> list[tuple[int, float]]:
    return [(s, end + (start - end) * np.exp(-s / (steps / 4))) for s in range(0, steps + 1, every)]


def _records(sizes=SIZES, ablations=("baseline", "attnres-block-n8"), seeds=(0, 1)) -> list[RunRecord]:
    out = []
    for size, (params, steps) in sizes.items():
        floor = 3.0 - 0.3 * LADDER.index(size)
        for a, ablation in enumerate(ablations):
            for seed in seeds:
                final = floor - 0.02 * a + 0.005 * seed
                out.append(RunRecord(
                    run_id=f"{size}-{ablation}-{seed}", name=f"{size}-{ablation}-seed{seed}", size=size,
                    ablation=ablation, control=None if ablation == "baseline" else "baseline", seed=seed,
                    start_time=seed, val_loss=final, params=params + a, added_flops_pct=1.2 * a, metrics={},
                    curves={Metric.TRAIN_LOSS: _curve(6.0, final, steps, max(1, steps // 40)),
                            Metric.VAL_LOSS: _curve(5.0, final, steps, steps // 4)},
                    last_val_step=steps, final_step=steps))
    return out


def _text_outside(fig) -> list[str]:
    """Every drawn piece whose box leaves the canvas, after a draw with the figure's renderer: each axes with its
    drawn tick labels, axis labels, title and legend (Axes.get_tightbbox counts only what is drawn, not the tick
    labels matplotlib keeps for ticks outside the view), each figure legend and figure text (the suptitle)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    pieces = [(f"axes {ax.get_title()!r}", ax.get_tightbbox(renderer)) for ax in fig.axes]
    pieces += [("legend", legend.get_window_extent(renderer)) for legend in fig.legends]
    pieces += [(repr(t.get_text()), t.get_window_extent(renderer)) for t in fig.texts if t.get_text().strip()]
    return [f"{name} at {box.bounds} (canvas {canvas.bounds})" for name, box in pieces
            if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1]


def _legend_texts(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def _save(fig, stem: str, tight: bool = True) -> None:
    """As save_figure writes it (bbox_inches="tight"), or as MLflow's log_figure does (`tight` False: the canvas)."""
    out = os.environ.get("LRATTN_FIGURES_OUT")
    if out:
        fig.savefig(Path(out) / f"{stem}.png", dpi=110, bbox_inches="tight" if tight else None)


@pytest.fixture(autouse=True)
def layout_warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "Tight layout not applied", "constrained_layout not applied"
        yield


# ---- words -------------------------------------------------------------------------------------------------------
def test_count_and_plural():
    assert count(1, "ablation") == "1 ablation" and count(2, "ablation") == "2 ablations"
    assert count(0, "run") == "0 runs" and count(1200, "run") == "1,200 runs"
    assert words.ladder(["ladder-m", "ladder-s", "ladder-xs"], {"ladder-xs": 1, "ladder-s": 2, "ladder-m": 3}) == LADDER


def test_sizes_come_in_ladder_order_and_ablations_are_counted_once():
    rows = summarise(_records())
    assert words.size_list(rows) == LADDER
    assert list(dict.fromkeys(r.size for r in rows)) == LADDER  # the table's rows
    table = markdown_table(rows)
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("| ladder")][::2] == LADDER
    title = words.title("study", rows)
    assert title == "study: sizes ladder-xs, ladder-s, ladder-m, 2 seeds per ablation", title
    assert words.summary(rows) == "2 ablations at 3 sizes (6 rows)"
    one = summarise(_records(sizes={"ladder-s": SIZES["ladder-s"]}, ablations=("baseline",), seeds=(0,)))
    assert words.summary(one) == "1 ablation"
    assert words.title("study", one) == "study: size ladder-s, 1 seed per ablation"
    notes = recipe_notes(one)
    assert "all 1 runs" not in notes and "its only run" in notes, notes
    assert "shared by all 2 runs" in recipe_notes(summarise(_records(sizes={"ladder-s": SIZES["ladder-s"]},
                                                                     ablations=("baseline",))))


def test_the_pairwise_section_takes_the_sizes_in_ladder_order_and_counts_one_pair_as_one():
    """It listed the sizes alphabetically (ladder-m first) and said "2 rows, 1 pairs", "the other 1 row(s)"."""
    text = pairwise_section(summarise(_records(ablations=("baseline", "attnres-block-n8"), seeds=(0, 1, 2))))
    heads = [line.split(",")[0] for line in text.splitlines() if line.startswith("Size ")]
    assert heads == [f"Size {size}" for size in LADDER], heads
    assert "2 rows, 1 pair: " in text and "1 pairs" not in text, text
    assert "(s)" not in text and "other 1 row" not in text and "1 row are" not in text, text


def test_a_control_missing_at_every_size_is_one_not_compared_line_naming_the_sizes_in_ladder_order():
    """It said "Not compared: Δ vs control and vs baseline — where `baseline` did not run at size ladder-m ..." once a
    size, one line for each: the same reason at three sizes is one line, the sizes named once, in ladder order."""
    rows = summarise(_records(ablations=("attnres-block-n8",)))
    text = delta_notes(rows, "baseline")
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert lines == ["- Δ vs control and vs baseline — where `baseline` did not run at that size in this experiment: "
                     "`attnres-block-n8` at ladder-xs, ladder-s, ladder-m."], text
    one = summarise(_records(sizes={"ladder-s": SIZES["ladder-s"]}, ablations=("attnres-block-n8",)))
    assert delta_notes(one, "baseline").splitlines()[-1].endswith(": `attnres-block-n8`."), delta_notes(one, "baseline")


def test_the_summary_runs_description_takes_the_sizes_in_ladder_order_and_counts_its_nouns():
    """MLflow's Description of the summary run said "size(s) ladder-m,ladder-s,ladder-xs, 1/2 seed(s) per row"."""
    rows = summarise(_records(seeds=(0, 1)))
    head = description(compared("study", rows, "baseline"), {}).splitlines()[0]
    assert "12 finished runs, sizes ladder-xs, ladder-s, ladder-m, 2 seeds per row;" in head, head
    one = summarise(_records(sizes={"ladder-s": SIZES["ladder-s"]}, ablations=("baseline",), seeds=(0,)))
    head = description(compared("study", one, "baseline"), {}).splitlines()[0]
    assert "1 finished run, size ladder-s, 1 seed per row;" in head and "(s)" not in head, head
    params = compared("study", rows, "baseline").params()
    assert params[Param.REPORT_SIZES] == ",".join(LADDER) and params[Param.REPORT_METHODS] == "2", params  # not 6 rows


def _points() -> list[Point]:
    points = []
    for i, size in enumerate(LADDER):
        for method, k in (("baseline", 1.0), ("attnres-block-n8", 1.2), ("muddformer", 1.1)):
            for seed in range(3):
                c = 1e11 * 4 ** i
                loss = 30 * (c * k) ** -0.0957 + 0.004 * (seed - 1) + 0.002 * (i % 2)
                points.append(Point(method, size, seed, c, float(loss)))
    return points


def test_the_extrapolated_reading_names_the_two_sizes_at_that_end():
    local, notes = local_multipliers(_points())
    text = local_section(local, notes, "baseline")
    assert "two end sizes" not in text and "its two largest sizes" in text and "its two smallest" in text
    head = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert head == "| method | ladder-xs | ladder-s | ladder-m |", head


# ---- figures -----------------------------------------------------------------------------------------------------
def test_training_curves_have_one_row_of_panels_per_size_each_on_its_own_steps():
    from lrattn_lightning.tools.compare.figures import curves_figure

    rows = summarise(_records())
    fig = curves_figure(rows, words.title("study", rows))
    _save(fig, "training_curves")
    assert not _text_outside(fig)
    axes = fig.axes
    assert len(axes) == 3 * len(LADDER)
    for i, size in enumerate(LADDER):  # every size present, each zoom on the second half of its own run
        whole, zoom, val = axes[3 * i: 3 * i + 3]
        steps = SIZES[size][1]
        assert all(ax.get_title().startswith(f"{size}: ") for ax in (whole, zoom, val))
        assert zoom.get_xlim() == (steps // 2, steps), (size, zoom.get_xlim())
        assert whole.get_xlim()[1] == pytest.approx(steps * 1.02)
        assert len(whole.get_lines()) == 2  # both ablations drawn at this size
    legend = _legend_texts(fig)
    assert legend == sorted(set(legend)) and set(legend) == {"baseline", "attnres-block-n8"}, legend


def test_loss_vs_flops_has_one_legend_entry_for_the_controls():
    from lrattn_lightning.tools.compare.figures import loss_vs_flops_figure

    rows = summarise(_records())
    fig = loss_vs_flops_figure(rows, words.title("study", rows))
    _save(fig, "loss_vs_flops")
    legend = _legend_texts(fig)
    assert len(legend) == len(set(legend)), legend
    assert sum("control" in t for t in legend) == 1, legend
    # its legend sits under the axes, past the canvas: save_figure writes it with bbox_inches="tight"
    named = " ".join(t.get_text() for t in fig.axes[0].texts) + " ".join(legend)
    assert all(size in named for size in LADDER)


def test_loss_vs_flops_gives_a_method_one_colour_at_every_size_and_a_size_one_marker():
    """It coloured each (size, ablation): three sizes of one method in three colours, two methods' colours mixed."""
    from lrattn_lightning.tools.compare.figures import SIZE_MARKERS, loss_vs_flops_figure

    rows = summarise(_records())
    fig = loss_vs_flops_figure(rows, words.title("study", rows))
    ax = fig.axes[0]
    points = [line for line in ax.get_lines() if len(line.get_xdata()) == 1 and line.get_marker() in SIZE_MARKERS]
    assert len(points) == len(rows)  # one a row
    colour = {}
    for line, row in zip(sorted(points, key=lambda p: (float(p.get_xdata()[0]), float(p.get_ydata()[0]))),
                         sorted(rows, key=lambda r: (r.added_flops_pct, r.mean)), strict=True):
        colour.setdefault(row.ablation, set()).add(line.get_color() if isinstance(line.get_color(), str)
                                                   else tuple(line.get_color()))
        assert line.get_marker() == SIZE_MARKERS[LADDER.index(row.size)], (row.size, line.get_marker())
    assert all(len(c) == 1 for c in colour.values()), colour  # one colour a method, whatever the size
    assert len({next(iter(c)) for c in colour.values()}) == 2  # and the two methods apart
    assert all(f"size {size}" in _legend_texts(fig) for size in LADDER), _legend_texts(fig)


def test_a_recipe_that_validates_once_gets_its_validation_panel_as_points_side_by_side():
    """A recipe validating only at its end gave one point a run at the right edge of a whole-run panel (mostly
    empty): its rows now stand side by side, each with its seeds' range, and the title says the step."""
    from lrattn_lightning.tools.compare.figures import curves_figure

    records = _records()
    for r in records:
        r.curves[Metric.VAL_LOSS] = [(r.final_step, r.val_loss)]
    rows = summarise(records)
    fig = curves_figure(rows, words.title("study", rows))
    assert not _text_outside(fig)
    for i, size in enumerate(LADDER):
        val = fig.axes[3 * i + 2]
        assert val.get_title() == (f"{size}: validation loss at step {SIZES[size][1]}, its only one "
                                   "(bar: seed range)"), val.get_title()
        xs = sorted(float(line.get_xdata()[0]) for line in val.get_lines() if len(line.get_xdata()) == 1
                    and line.get_marker() not in ("_", "", "None", None))
        assert xs == [0.0, 1.0], xs  # two methods, side by side
        assert val.get_xlim() == (-0.7, 1.7)
    whole = summarise(_records())  # several validations: the whole-run curves as before
    assert curves_figure(whole, "t").axes[2].get_title().endswith("validation loss, whole run (mean over seeds)")


def test_scaling_figure_fills_its_width_and_shows_the_per_size_multipliers():
    from lrattn_lightning.tools.compare.scaling_report import scaling_figure

    points = _points()
    result = analyse(points, "baseline", resamples=20)
    local, _ = local_multipliers(points)
    fig = scaling_figure(result, "study — validation loss against training compute", local)
    _save(fig, "scaling")
    assert not _text_outside(fig)
    fig.canvas.draw()
    main, side = fig.axes[:2]
    width = fig.bbox.width
    assert (main.bbox.width + side.bbox.width) / width > 0.75  # no idle side of the canvas
    assert [t.get_text() for t in side.get_xticklabels()] == LADDER  # every size, in ladder order
    assert len(side.lines) > 0 and side.get_ylabel().startswith("multiplier k")
    legend = _legend_texts(fig)
    assert len(legend) == len(set(legend)) == 3
    assert any(t.startswith("attnres-block-n8: k 1.2") for t in legend), legend


def test_the_routing_heatmap_fit_logs_keeps_every_text_on_its_canvas():
    from lrattn_lightning.train.diagnostics import heatmap_figure

    for n_sites, n_src in ((4, 3), (8, 9), (20, 21)):
        table = {"kind": "attnres", "sites_by_sources": [[round(1 / (j + 1), 3)] * min(n_src, j + 1)
                                                        for j in range(n_sites)],
                 "value": "mean routing weight"}
        fig = heatmap_figure(table, f"attnres-block-n8 @ ladder-xs, step {n_sites * 10}")
        _save(fig, f"routing_heatmap_{n_sites}", tight=False)
        fig.canvas.draw()  # a "Tight layout not applied" warning would be an error here
        assert not _text_outside(fig), _text_outside(fig)
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_every_registry_kinds_heatmap_at_tiny_keeps_its_axis_labels_on_the_canvas():
    """The tables fit logs for real entries: their long axis and bar labels (DenseFormer's 'DWA (its average is
    what the next layer and the head read)', the value residual's) ran off the canvas before."""
    import matplotlib.pyplot as plt
    import torch

    from lrattn_lightning.model.decoder import build_decoder
    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.train.diagnostics import heatmap_figure, weights_table

    reg = load_registry()
    seen = set()
    for name in ("denseformer", "value-residual-learned", "delta-attnres-block", "muddformer", "laurel-rw",
                 "hyper-connections-n4", "attnres-full", "gated-residual"):
        if name not in reg.ablations:
            continue
        cfg = reg.model("tiny", name)
        torch.manual_seed(0)
        with torch.no_grad():
            out = build_decoder(cfg)(torch.randint(0, 200, (1, 8)), return_routing=True)
        if not out.routing:
            continue
        fig = heatmap_figure(weights_table(cfg, out.routing), f"{name} @ tiny, step 40")
        _save(fig, f"fit_heatmap_{name}", tight=False)
        assert not _text_outside(fig), (name, _text_outside(fig))
        plt.close(fig)
        seen.add(cfg.kind.name)
    assert len(seen) >= 4, seen

"""The table of `lrattn compare`: finished training runs read back from MLflow, one row per (size, ablation,
recipe) with its seeds, the differences to its control and to the reference (Welch's t-test,
tools/compare/power.py), the Pareto front of (added FLOPs %, mean val loss), as markdown and CSV.

One row is one recipe. Each run carries its recipe fingerprint (tag lrattn.recipe, train/fingerprint.py;
runs from before it: rebuilt from their params, `legacy-...`). Runs of different fingerprints are never
pooled into one row, and a Δ or p pairs a row only with the control (or reference) row of its own size and
recipe; where there is none the cell is — and compare_notes.py says why under the table. An upcycled run
(`lrattn fit --init_from`) differs in its recipe's `init_from`: its row is labelled with its source. Beside each
p: the seeds per arm that would resolve the observed Δ at 80 % power in the same Welch test (power.py). Downstream scores pool only
like with like (evals.py: one column per task configuration; bookkeeping numbers go to the report's appendix).

Only FINISHED runs count; when a (size, ablation, seed, recipe) was run more than once, the latest counts
and the others are named under the table (`RunRecord.superseded`). A run a sweep tagged with a `variant` (its
own training flags) is its own row, `ablation+variant`, whose control is the plain ablation. A run whose last
validation is not at its last step (`RunRecord.stale`: a tracking gap dropped the final validation, or an
older lrattn) does not count; compare_notes.stale_note lists it under the table.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.tools.compare.evals import cell_text, eval_columns, run_configs
from lrattn_lightning.tools.compare.power import need_text, seeds_needed, spreads, welch
from lrattn_lightning.tools.compare.runs import read_histories, search_all
from lrattn_lightning.tools.compare.words import size_list
from lrattn_lightning.train import fingerprint as fp
from lrattn_lightning.train.schema import Metric, Param, Tag

SUMMARY_TAG = Tag.SUMMARY  # the tag of compare's own summary run, which is not a training run
# written by train/tracking.py when a fit ends: the last step it logged; what a store outage dropped
LAST_STEP_TAG, GAP_TAG = Tag.LAST_STEP, Tag.TRACKING_GAP


@dataclass
class RunRecord:
    run_id: str
    name: str
    size: str
    ablation: str
    control: str | None
    seed: int | None
    start_time: int
    val_loss: float
    params: int
    added_flops_pct: float
    metrics: dict[str, float]
    tokens_per_s: float | None = None
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    last_val_step: int | None = None  # the step of the last val/loss
    final_step: int | None = None  # the step the fit ended at (see `declared_end`)
    gap: str | None = None  # the run's lrattn.tracking_gap tag
    recipe: str = ""  # the recipe fingerprint (train/fingerprint.py); LEGACY-prefixed when rebuilt from params
    parts: dict[str, Any] = field(default_factory=dict)  # the recipe's parts
    method: str = ""  # the routing kind's own training options (tag lrattn.method, JSON)
    upcycled_from: str | None = None  # the source of an upcycled run, as a name: 'RUN_NAME, step N'
    superseded: list[RunRecord] = field(default_factory=list)  # earlier runs of its size, ablation, seed, recipe
    eval_configs: dict[str, str | None] = field(default_factory=dict)  # task -> its evaluation's config (evals.py)

    @property
    def stale(self) -> bool:
        """val/loss is the value of an earlier validation than the fit's last: not the run's result."""
        return None not in (self.last_val_step, self.final_step) and self.last_val_step < self.final_step


@dataclass
class Row:
    size: str
    ablation: str  # the entry, `+variant` for a sweep's variant
    control: str | None
    runs: list[RunRecord]
    delta_control: float | None = None
    p_control: float | None = None
    delta_baseline: float | None = None
    p_baseline: float | None = None
    pareto: bool = False
    recipe: str = ""  # the fingerprint of every run in the row
    group: str = "A"  # the recipe's letter within its size: A is the recipe most runs of the size share
    label: str = ""  # the row's name in tables and figures: the ablation, its source if upcycled, its method
    why_no_control: str | None = None  # why Δ vs control is — although the row names a control
    why_no_reference: str | None = None
    need_control: int | None = None  # seeds per arm for 80 % power at Δ vs control (power.py)
    need_baseline: int | None = None
    lost: list[str] = field(default_factory=list)  # 'SEED: why' of each left-out run of the row (left_out.py)

    @property
    def parts(self) -> dict[str, Any]:
        return self.runs[0].parts

    @property
    def losses(self) -> list[float]:
        return [r.val_loss for r in self.runs]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.losses) if len(self.runs) > 1 else None

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.runs]

    @property
    def added_flops_pct(self) -> float:
        return self.runs[0].added_flops_pct

    @property
    def params(self) -> int:
        return self.runs[0].params

    @property
    def tokens_per_s(self) -> float | None:
        values = [r.tokens_per_s for r in self.runs if r.tokens_per_s]
        return statistics.fmean(values) if values else None

    def metric(self, key: str) -> tuple[float | None, float | None, int]:
        """(mean, std, seeds) over the row's runs that have the metric: a row's seed count is per metric."""
        values = [r.metrics[key] for r in self.runs if key in r.metrics]
        if not values:
            return None, None, 0
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None), len(values)


# ---- reading MLflow --------------------------------------------------------------------------------
def experiments_hint(client: Any, experiment: str) -> str:
    """What the store holds instead of `experiment`: " (closest: a, b)", " (it holds: a, b, c, ...)" when
    nothing is close, " (it holds no experiments)" for an empty store."""
    try:
        names = [e.name for e in client.search_experiments(max_results=1000)]
    except Exception:  # noqa: BLE001 (a hint only: the error it belongs to is raised either way)
        return ""
    close = closest_names(experiment, names, fill=False)
    if close:
        return f" (closest: {', '.join(close)})"
    if not names:
        return " (it holds no experiments)"
    return f" (it holds: {', '.join(sorted(names)[:5])}{', ...' if len(names) > 5 else ''})"


def read_runs(client: Any, experiment: str, sweep: str | None = None, curves: bool = True) -> list[RunRecord]:
    """The experiment's finished training runs, one per size, ablation, seed and recipe (the latest; the
    earlier ones in its `superseded`)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise InputError(f"no MLflow experiment '{experiment}' at {client.tracking_uri}{experiments_hint(client, experiment)}; "
                         "check --experiment/--tracking_uri")
    query = "attributes.status = 'FINISHED'" + (f" and tags.{Tag.SWEEP} = '{sweep}'" if sweep else "")
    same: dict[tuple, list[RunRecord]] = defaultdict(list)
    runs = search_all(client, exp.experiment_id, query)
    print(f"[lrattn compare] read {len(runs)} runs", file=sys.stderr, flush=True)
    names = {run.info.run_id: run.info.run_name for run in runs}
    for run in runs:
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        if tags.get(SUMMARY_TAG) == "true" or Param.ABLATION not in params or Metric.VAL_LOSS not in metrics:
            continue
        # a sweep tags its seed; any fit records the one it trained with as the train_seed param
        given = tags.get(Tag.SEED) or params.get(Param.SEED) or ""
        seed = int(given) if given.lstrip("-").isdigit() else None
        control = None if tags.get(Tag.CONTROL) in (None, "none") else tags[Tag.CONTROL]
        ablation = params[Param.ABLATION]
        if tags.get(Tag.VARIANT):  # a training-time variant of the entry: its own row, compared with the entry
            ablation, control = f"{ablation}+{tags[Tag.VARIANT]}", ablation
        record = RunRecord(
            run_id=run.info.run_id, name=run.info.run_name or run.info.run_id, size=params.get(Param.SIZE, "?"),
            ablation=ablation, control=control,
            seed=seed, start_time=run.info.start_time or 0, val_loss=float(metrics[Metric.VAL_LOSS]),
            params=int(float(params.get(Param.PARAMS, 0))), added_flops_pct=_flops_pct(params.get(Param.ADDED_FLOPS)),
            metrics=dict(metrics), final_step=declared_end(params, tags), gap=tags.get(GAP_TAG),
            method=tags.get(Tag.METHOD, ""), upcycled_from=_source(client, params, names),
            eval_configs=run_configs(client, run), **_recipe(tags, params),
        )
        key = (record.size, record.ablation, seed if seed is not None else record.run_id, record.recipe, record.method)
        same[key].append(record)
    for group in same.values():  # the latest counts; the earlier ones are named under the table
        group.sort(key=lambda r: r.start_time)
        group[-1].superseded = group[:-1]
    records = sorted((group[-1] for group in same.values()),
                     key=lambda r: (r.size, r.ablation, r.seed if r.seed is not None else -1, r.recipe))
    read_histories(client, records, curves)
    return records


def _recipe(tags: dict[str, str], params: dict[str, str]) -> dict[str, Any]:
    """The run's recipe fingerprint and parts: from its tags, else rebuilt from its params (train/fingerprint.py)."""
    text = tags.get(Tag.RECIPE_PARTS)
    if tags.get(Tag.RECIPE) and text:
        try:
            return {"recipe": tags[Tag.RECIPE], "parts": json.loads(text)}
        except json.JSONDecodeError:
            pass
    parts = fp.legacy_parts(params)
    return {"recipe": fp.LEGACY + fp.fingerprint(parts), "parts": parts}


def _source(client: Any, params: dict[str, str], names: dict[str, str]) -> str | None:
    """An upcycled run's source as 'RUN_NAME, step N' (its MLflow run's name where the store has it)."""
    if not params.get(Param.INIT_FROM):
        return None
    run_id, step = params.get(Param.INIT_FROM_RUN, "none"), params.get(Param.INIT_FROM_STEP, "?")
    name = names.get(run_id)
    if name is None and run_id != "none":
        try:
            name = client.get_run(run_id).info.run_name
        except Exception:  # noqa: BLE001 - a run in another store, or deleted: the source's entry names it
            name = None
    return f"{name or params.get(Param.INIT_FROM_SOURCE) or Path(params[Param.INIT_FROM]).name}, step {step}"


def declared_end(params: dict[str, str], tags: dict[str, str]) -> int | None:
    """The step a run's last validation belongs at, as the run says: the last step its fit logged (tag
    lrattn.last_step, exact also when max_time or an early stop ended it), else its max_steps (param
    train_max_steps, when positive); None: neither (read_runs then takes its last train/loss step + 1)."""
    for value in (tags.get(LAST_STEP_TAG), params.get(Param.MAX_STEPS)):
        if value is not None and value.lstrip("-").isdigit() and int(value) > 0:
            return int(value)
    return None


# ---- rows ------------------------------------------------------------------------------------------
def _flops_pct(value) -> float:
    """The added_flops_pct param: a number, or NaN where it is `unknown` (an external router that does not
    state its FLOPs; such a row is on no Pareto front and in no FLOPs figure)."""
    if value in (None, "unknown"):
        return 0.0 if value is None else math.nan
    return float(value)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x and lower y are better)."""
    front, best = [], math.inf
    for i in sorted(range(len(points)), key=lambda i: points[i]):
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def summarise(records: list[RunRecord], reference: str = "baseline") -> list[Row]:
    """One row per (size, ablation, recipe, method), ordered by size (smallest model first), recipe, added FLOPs; the differences to
    the control and the reference within the row's size and recipe; the Pareto front per size and recipe."""
    groups: dict[tuple[str, str, str, str], list[RunRecord]] = defaultdict(list)
    for r in records:
        groups[(r.size, r.ablation, r.recipe, r.method)].append(r)
    rows = [Row(size, abl, runs[0].control, runs, recipe=recipe) for (size, abl, recipe, _), runs in groups.items()]
    letters = recipe_letters(records, reference)
    for row in rows:
        row.group = letters[(row.size, row.recipe)]
        row.label = _row_label(row, rows)
    rank = {size: i for i, size in enumerate(size_list(rows))}  # ladder order (words.py), not the alphabet's
    rows.sort(key=lambda row: (rank[row.size], row.group, math.isnan(row.added_flops_pct), row.added_flops_pct, row.label))
    for row in rows:
        if row.control:
            control, row.why_no_control = _partner(row, row.control, rows)
            if control is not None:
                row.delta_control, row.p_control = welch(row.losses, control.losses)
                row.need_control = seeds_needed(row.delta_control, *spreads(row.losses, control.losses))
        if row.ablation != reference:
            base, row.why_no_reference = _partner(row, reference, rows)
            if base is not None:
                row.delta_baseline, row.p_baseline = welch(row.losses, base.losses)
                row.need_baseline = seeds_needed(row.delta_baseline, *spreads(row.losses, base.losses))
    for key in {(row.size, row.recipe) for row in rows}:
        mine = [row for row in rows if (row.size, row.recipe) == key]
        mine = [row for row in mine if not math.isnan(row.added_flops_pct)]  # unknown cost: on no front
        for i in pareto_front([(row.added_flops_pct, row.mean) for row in mine]):
            mine[i].pareto = True
    return rows


def recipe_letters(records: list[RunRecord], reference: str = "baseline") -> dict[tuple[str, str], str]:
    """(size, fingerprint) -> A, B, ...: A the recipe most runs of the size share (ties: the one the reference
    ran under, then the earliest), B the next."""
    letters = {}
    for size in sorted({r.size for r in records}):
        mine = [r for r in records if r.size == size]
        order = sorted({r.recipe for r in mine}, key=lambda recipe: (
            -sum(r.recipe == recipe for r in mine),
            not any(r.recipe == recipe and r.ablation == reference for r in mine),
            min(r.start_time for r in mine if r.recipe == recipe)))
        letters.update({(size, recipe): _letter(i) for i, recipe in enumerate(order)})
    return letters


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


def _row_label(row: Row, rows: list[Row]) -> str:
    """The ablation; an upcycled row names its source; rows of one ablation and recipe that differ in the kind's
    own training options (no variant label tells them apart) name those."""
    label = row.ablation
    source = row.runs[0].upcycled_from
    if source:
        label += f" (upcycled from {source})"
    twins = [r for r in rows if (r.size, r.ablation, r.recipe) == (row.size, row.ablation, row.recipe) and r is not row]
    if twins and row.runs[0].method:
        method = json.loads(row.runs[0].method)
        label += " (" + ", ".join(f"{k}={v}" for k, v in method.items()) + ")"
    return label


def _partner(row: Row, ablation: str, rows: list[Row]) -> tuple[Row | None, str | None]:
    """The row of `ablation` at the row's size and recipe, or (None, why there is none)."""
    same = [r for r in rows if r.size == row.size and r.ablation == ablation and r is not row]
    here = [r for r in same if r.recipe == row.recipe]
    if len(here) == 1:
        return here[0], None
    if len(here) > 1:
        return None, f"`{ablation}` ran with {len(here)} settings of its routing's training options under this recipe"
    if not same:
        return None, f"`{ablation}` did not run at that size in this experiment"
    others = ", ".join(sorted({r.group for r in same}))
    return None, f"`{ablation}` ran only under recipe {others}, not {row.group}"


# ---- the table -------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 4, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _p(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f}" if value >= 0.001 else f"{value:.1e}")


def _mean_std(mean: float | None, std: float | None, n: int | None = None, of: int | None = None, digits: int = 4) -> str:
    """mean ± std, with `(n k)` where only k of the row's `of` seeds have the value."""
    if mean is None:
        return "—"
    return _num(mean, digits) + ("" if std is None else f" ± {std:.{digits}f}") + ("" if n == of else f" (n {n})")


def several_recipes(rows: list[Row]) -> bool:
    return any(row.group != "A" for row in rows)


def markdown_table(rows: list[Row], reference: str = "baseline") -> str:
    evals = [c for c in eval_columns(rows) if not c.appendix]  # the bookkeeping ones: the report's appendix
    multi_size, recipes = len({row.size for row in rows}) > 1, several_recipes(rows)
    head = (["size"] if multi_size else []) + ["ablation"] + (["recipe"] if recipes else []) + [
        "seeds", "val loss (mean ± std)", "control", "Δ vs control", "p", "seeds needed", f"Δ vs {reference}", "p",
        "seeds needed", "added FLOPs %", "params", "tokens/s", "val bpb", *[c.label for c in evals]]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if h in ("size", "ablation", "recipe", "control") else "---:" for h in head) + "|"]
    for row in rows:
        name = f"**{row.label}**" if row.pareto else row.label
        cells = ([row.size] if multi_size else []) + [name] + ([row.group] if recipes else []) + [
            _seeds_cell(row), _mean_std(row.mean, row.std), row.control or "—",
            _num(row.delta_control, sign=True), _p(row.p_control), need_text(row.need_control),
            _num(row.delta_baseline, sign=True), _p(row.p_baseline), need_text(row.need_baseline),
            "unknown" if math.isnan(row.added_flops_pct) else f"{row.added_flops_pct:.3f}", f"{row.params:,}",
            "—" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}",
            _mean_std(*row.metric(Metric.VAL_BPB), len(row.runs)),
            *[cell_text(c, row) for c in evals]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


MAX_LISTED_SEEDS = 8  # a seeds cell lists up to this many seeds (and lost runs); past it, their count and range


def _seeds_cell(row: Row) -> str:
    """'3 (0,1,2)'; a row that lost seeds: '2 of 3 (0,1; lost 2: KILLED)'; past MAX_LISTED_SEEDS the count and
    range: '600 seeds (0-599)', '598 of 600 seeds (0-599; lost 2: ...)' (table.csv lists every seed)."""
    seeds, many = row.seeds, len(row.runs) + len(row.lost) > MAX_LISTED_SEEDS
    known = sorted(s for s in seeds if s is not None)
    if not many:
        text = ",".join("?" if s is None else str(s) for s in seeds)
    elif not known:
        text = "seeds not recorded"
    else:
        gaps = known[-1] - known[0] + 1 != len(set(known))
        text = f"{known[0]}-{known[-1]}" + (", with gaps" if gaps else "") + (
            f", {len(seeds) - len(known)} not recorded" if len(known) < len(seeds) else "")
    count = f"{len(row.runs)}" + (" seeds" if many else "")
    if not row.lost:
        return f"{count} ({text})"
    lost = "; ".join(row.lost) if len(row.lost) <= MAX_LISTED_SEEDS else "see the runs left out"
    count = f"{len(row.runs)} of {len(row.runs) + len(row.lost)}" + (" seeds" if many else "")
    return f"{count} ({text}; lost {len(row.lost) if many else ''}{': ' if many else ''}{lost})"


def csv_table(rows: list[Row], reference: str = "baseline") -> str:
    evals = eval_columns(rows)  # every one, the appendix's too
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    # (the columns of the recipe come after the older ones, so that a reader by position reads what it did)
    writer.writerow(["size", "ablation", "n_seeds", "seeds", "val_loss_mean", "val_loss_std", "val_loss_per_seed",
                     "control", "delta_control", "p_control", f"delta_{reference}", f"p_{reference}",
                     "added_flops_pct", "params", "tokens_per_s", "val_bpb_mean", "pareto", "run_ids",
                     "row", "recipe", "fingerprint", "upcycled_from", "seeds_needed_control",
                     f"seeds_needed_{reference}", *[f"eval/{c.label}_{s}" for s in ("mean", "std", "n") for c in evals]])
    for row in rows:
        writer.writerow([row.size, row.ablation, len(row.runs), ";".join(map(str, row.seeds)), row.mean,
                         "" if row.std is None else row.std, ";".join(f"{v:.6f}" for v in row.losses),
                         row.control or "", _blank(row.delta_control), _blank(row.p_control),
                         _blank(row.delta_baseline), _blank(row.p_baseline), row.added_flops_pct, row.params,
                         _blank(row.tokens_per_s), _blank(row.metric(Metric.VAL_BPB)[0]), row.pareto,
                         ";".join(r.run_id for r in row.runs), row.label, row.group, row.recipe,
                         row.runs[0].upcycled_from or "", _blank(row.need_control), _blank(row.need_baseline),
                         *[_blank(c.cell(row)[i]) for i in range(3) for c in evals]])
    return out.getvalue()


def _blank(value: Any) -> Any:
    return "" if value is None else value



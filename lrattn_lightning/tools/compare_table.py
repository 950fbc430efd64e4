"""The table of `lrattn compare`: finished training runs read back from MLflow, one row per (size, ablation)
with its seeds, the differences to its control and to the reference (Welch's t-test, tools/significance.py),
the Pareto front of (added FLOPs %, mean val loss), as markdown and CSV.

Only FINISHED runs count; when a (size, ablation, seed) was run more than once, the latest counts. A run
a sweep tagged with a `variant` (its own training flags) is its own row, `ablation+variant`, whose control
is the plain ablation. A run whose last validation is not at its last step (`RunRecord.stale`: a tracking
gap dropped the final validation, or an older lrattn) does not count; `stale_note` lists it under the table.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from lrattn_lightning.errors import InputError
from lrattn_lightning.tools.runs import search_all
from lrattn_lightning.tools.significance import welch

SUMMARY_TAG = "lrattn.summary"  # the tag of compare's own summary run, which is not a training run
# written by train/tracking.py when a fit ends: the last step it logged; what a store outage dropped
LAST_STEP_TAG, GAP_TAG = "lrattn.last_step", "lrattn.tracking_gap"


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

    @property
    def stale(self) -> bool:
        """val/loss is the value of an earlier validation than the fit's last: not the run's result."""
        return None not in (self.last_val_step, self.final_step) and self.last_val_step < self.final_step


@dataclass
class Row:
    size: str
    ablation: str
    control: str | None
    runs: list[RunRecord]
    delta_control: float | None = None
    p_control: float | None = None
    delta_baseline: float | None = None
    p_baseline: float | None = None
    pareto: bool = False

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

    def metric(self, key: str) -> tuple[float | None, float | None]:
        values = [r.metrics[key] for r in self.runs if key in r.metrics]
        if not values:
            return None, None
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


# ---- reading MLflow --------------------------------------------------------------------------------
def read_runs(client: Any, experiment: str, sweep: str | None = None, curves: bool = True) -> list[RunRecord]:
    """The experiment's finished training runs (one per size, ablation, seed: the latest)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise InputError(f"no MLflow experiment '{experiment}' at {client.tracking_uri}; check --experiment/--tracking_uri")
    query = "attributes.status = 'FINISHED'" + (f" and tags.sweep = '{sweep}'" if sweep else "")
    latest: dict[tuple, RunRecord] = {}
    runs = search_all(client, exp.experiment_id, query)
    print(f"[lrattn compare] read {len(runs)} runs", file=sys.stderr, flush=True)
    for run in runs:
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        if tags.get(SUMMARY_TAG) == "true" or "ablation" not in params or "val/loss" not in metrics:
            continue
        # a sweep tags its seed; any fit records the one it trained with as the train_seed param
        given = tags.get("seed") or params.get("train_seed") or ""
        seed = int(given) if given.lstrip("-").isdigit() else None
        control = None if tags.get("control") in (None, "none") else tags["control"]
        ablation = params["ablation"]
        if tags.get("variant"):  # a training-time variant of the entry: its own row, compared with the entry
            ablation, control = f"{ablation}+{tags['variant']}", ablation
        record = RunRecord(
            run_id=run.info.run_id, name=run.info.run_name or run.info.run_id, size=params.get("size", "?"),
            ablation=ablation, control=control,
            seed=seed, start_time=run.info.start_time or 0, val_loss=float(metrics["val/loss"]),
            params=int(float(params.get("params", 0))), added_flops_pct=_flops_pct(params.get("added_flops_pct")),
            metrics=dict(metrics), final_step=declared_end(params, tags), gap=tags.get(GAP_TAG),
        )
        key = (record.size, record.ablation, seed if seed is not None else record.run_id)
        if key not in latest or record.start_time > latest[key].start_time:
            latest[key] = record
    records = sorted(latest.values(), key=lambda r: (r.size, r.ablation, r.seed if r.seed is not None else -1))
    for record in records:
        speed = [m.value for m in client.get_metric_history(record.run_id, "train/device/items_per_sec")]
        record.tokens_per_s = statistics.median(speed) if speed else None
        history = {}
        for key in ("train/loss", "val/loss"):
            values = sorted(client.get_metric_history(record.run_id, key), key=lambda m: (m.step, m.timestamp))
            history[key] = sorted({m.step: m.value for m in values}.items())  # a resumed run's later values win
        record.last_val_step = history["val/loss"][-1][0] if history["val/loss"] else None
        if record.final_step is None and history["train/loss"]:  # train/loss at step s, validation after it: s + 1
            record.final_step = history["train/loss"][-1][0] + 1
        if curves:
            record.curves = history
    return records


def declared_end(params: dict[str, str], tags: dict[str, str]) -> int | None:
    """The step a run's last validation belongs at, as the run says: the last step its fit logged (tag
    lrattn.last_step, exact also when max_time or an early stop ended it), else its max_steps (param
    train_max_steps, when positive); None: neither (read_runs then takes its last train/loss step + 1)."""
    for value in (tags.get(LAST_STEP_TAG), params.get("train_max_steps")):
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
    """One row per (size, ablation), ordered by size then added FLOPs; differences and the Pareto front."""
    groups: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    for r in records:
        groups[(r.size, r.ablation)].append(r)
    rows = [Row(size, abl, runs[0].control, runs) for (size, abl), runs in groups.items()]
    rows.sort(key=lambda row: (row.size, math.isnan(row.added_flops_pct), row.added_flops_pct, row.ablation))
    by_name = {(row.size, row.ablation): row for row in rows}
    for row in rows:
        control = by_name.get((row.size, row.control)) if row.control else None
        if control is not None:
            row.delta_control, row.p_control = welch(row.losses, control.losses)
        base = by_name.get((row.size, reference))
        if base is not None and row is not base:
            row.delta_baseline, row.p_baseline = welch(row.losses, base.losses)
    for size in {row.size for row in rows}:
        mine = [row for row in rows if row.size == size]
        mine = [row for row in mine if not math.isnan(row.added_flops_pct)]  # unknown cost: on no front
        for i in pareto_front([(row.added_flops_pct, row.mean) for row in mine]):
            mine[i].pareto = True
    return rows


# ---- the table -------------------------------------------------------------------------------------
def stale_note(stale: list[RunRecord]) -> str:
    """The line under the table naming the runs left out because their last validation is not their last."""
    if not stale:
        return ""
    names = "; ".join(f"`{r.name}` (val/loss last at step {r.last_val_step} of {r.final_step}"
                      + (f"; {GAP_TAG}: {r.gap}" if r.gap else "") + ")" for r in stale)
    return (f"\nNot counted: {len(stale)} FINISHED run(s) whose last validation is not at their last step, so their "
            f"val/loss is an earlier value, not their result: {names}.\n")


def eval_keys(rows: list[Row]) -> list[str]:
    return sorted({k for row in rows for r in row.runs for k in r.metrics if k.startswith("eval/")})


def _num(value: float | None, digits: int = 4, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _p(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f}" if value >= 0.001 else f"{value:.1e}")


def _mean_std(mean: float | None, std: float | None, digits: int = 4) -> str:
    return "—" if mean is None else _num(mean, digits) + ("" if std is None else f" ± {std:.{digits}f}")


def markdown_table(rows: list[Row], reference: str = "baseline") -> str:
    evals = eval_keys(rows)
    multi_size = len({row.size for row in rows}) > 1
    head = (["size"] if multi_size else []) + [
        "ablation", "seeds", "val loss (mean ± std)", "control", "Δ vs control", "p", f"Δ vs {reference}", "p",
        "added FLOPs %", "params", "tokens/s", "val bpb", *[k[len("eval/"):] for k in evals]]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if h in ("size", "ablation", "control") else "---:" for h in head) + "|"]
    for row in rows:
        name = f"**{row.ablation}**" if row.pareto else row.ablation
        seeds = ",".join("?" if s is None else str(s) for s in row.seeds)
        bpb = row.metric("val/bpb")
        cells = ([row.size] if multi_size else []) + [
            name, f"{len(row.runs)} ({seeds})", _mean_std(row.mean, row.std), row.control or "—",
            _num(row.delta_control, sign=True), _p(row.p_control), _num(row.delta_baseline, sign=True),
            _p(row.p_baseline), "unknown" if math.isnan(row.added_flops_pct) else f"{row.added_flops_pct:.3f}", f"{row.params:,}",
            "—" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}", _mean_std(*bpb),
            *[_mean_std(*row.metric(k)) for k in evals]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_table(rows: list[Row], reference: str = "baseline") -> str:
    evals = eval_keys(rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["size", "ablation", "n_seeds", "seeds", "val_loss_mean", "val_loss_std", "val_loss_per_seed",
                     "control", "delta_control", "p_control", f"delta_{reference}", f"p_{reference}",
                     "added_flops_pct", "params", "tokens_per_s", "val_bpb_mean", "pareto", "run_ids",
                     *[f"{k}_mean" for k in evals], *[f"{k}_std" for k in evals]])
    for row in rows:
        writer.writerow([row.size, row.ablation, len(row.runs), ";".join(map(str, row.seeds)), row.mean,
                         "" if row.std is None else row.std, ";".join(f"{v:.6f}" for v in row.losses),
                         row.control or "", _blank(row.delta_control), _blank(row.p_control),
                         _blank(row.delta_baseline), _blank(row.p_baseline), row.added_flops_pct, row.params,
                         _blank(row.tokens_per_s), _blank(row.metric("val/bpb")[0]), row.pareto,
                         ";".join(r.run_id for r in row.runs),
                         *[_blank(row.metric(k)[0]) for k in evals], *[_blank(row.metric(k)[1]) for k in evals]])
    return out.getvalue()


def _blank(value: Any) -> Any:
    return "" if value is None else value



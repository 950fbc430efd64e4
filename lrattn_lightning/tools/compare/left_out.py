"""Every run `lrattn compare` leaves out, named with its reason (issue 52): a run that failed, diverged, was killed,
is still RUNNING (or was killed by a signal it could not answer, `kill -9`, so nothing marked it), finished without
a val/loss or an ablation, whose last validation is not at its last step, or that a later run of the same size,
ablation, seed and recipe replaces. One line on the terminal (the first MAX_NAMED named, then a count), a table in
the report's appendix, and a row that lost seeds says so in its seeds cell (`2 of 3 (0,1; lost 2: KILLED)`).

Not named: compare's own summary runs and `lrattn eval`'s runs of a checkpoint (not training runs).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from lrattn_lightning.tools.compare.runs import search_all
from lrattn_lightning.tools.compare.table import SUMMARY_TAG, Row, RunRecord
from lrattn_lightning.train.schema import Metric, Param, Tag

MAX_NAMED = 10  # runs the terminal line names before it counts the rest


@dataclass(frozen=True)
class LeftOut:
    name: str
    run_id: str
    size: str
    ablation: str  # as a row names it: `ablation+variant` for a sweep's variant
    seed: int | None
    recipe: str | None
    reason: str


def left_out(client: Any, experiment: str, sweep: str | None, records: list[RunRecord]) -> list[LeftOut]:
    """The experiment's runs (of the sweep, if named) that are not among `records` (the counted ones, stale ones
    included: they are named as stale), each with why; superseded runs of a record are named too."""
    exp = client.get_experiment_by_name(experiment)
    query = f"tags.{Tag.SWEEP} = '{sweep}'" if sweep else ""
    counted = {r.run_id: r for r in records}
    replaced = {old.run_id: r for r in records for old in r.superseded}
    by_run = defaultdict(list)  # (size, ablation, seed) -> its counted records, for the attempts a later run retried
    for r in records:
        by_run[r.size, r.ablation, r.seed].append(r)
    out = []
    for run in search_all(client, exp.experiment_id, query):
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        if tags.get(SUMMARY_TAG) == "true" or tags.get(Tag.EVAL_ONLY) == "true":
            continue
        run_id = run.info.run_id
        record = counted.get(run_id)
        if record is not None and not record.stale:
            continue
        ablation = params.get(Param.ABLATION) or tags.get(Tag.ABLATION) or "?"
        if tags.get(Tag.VARIANT):
            ablation = f"{ablation}+{tags[Tag.VARIANT]}"
        given = tags.get(Tag.SEED) or params.get(Param.SEED) or ""
        size, seed = params.get(Param.SIZE) or tags.get(Tag.SIZE) or "?", int(given) if given.lstrip("-").isdigit() else None
        if record is not None:
            why = f"its last validation is at step {record.last_val_step} of {record.final_step}, not its result"
        elif run_id in replaced:
            why = f"replaced by `{replaced[run_id].name}`, a later run of its size, ablation, seed and recipe"
        elif (later := _retried(by_run.get((size, ablation, seed), []), seed, tags.get(Tag.RECIPE), run.info.start_time)) \
                is not None:
            why = (f"replaced by `{later.name}`, a later finished run of its size, ablation, seed and recipe; this "
                   f"attempt {_reason(run.info.status, tags, params, metrics)}")
        else:
            why = _reason(run.info.status, tags, params, metrics)
        out.append(LeftOut(run.info.run_name or run_id, run_id, size, ablation, seed, tags.get(Tag.RECIPE), why))
    return sorted(out, key=lambda r: (r.size, r.ablation, -1 if r.seed is None else r.seed, r.name))


def _retried(same: list[RunRecord], seed: int | None, recipe: str | None, started: int | None) -> RunRecord | None:
    """The counted run that retried a run which did not finish (FAILED, KILLED, left RUNNING): of `same` (the records
    of its size, ablation and seed), one of its recipe where the attempt's tags name one, started after it; None
    where there is none."""
    if seed is None:
        return None
    later = [r for r in same if not r.stale and (recipe is None or r.recipe == recipe) and r.start_time > (started or 0)]
    return max(later, key=lambda r: r.start_time, default=None)


def _reason(status: str, tags: dict[str, str], params: dict[str, str], metrics: dict[str, float]) -> str:
    if status == "FAILED":
        return f"FAILED, diverged: {tags[Tag.DIVERGED]}" if tags.get(Tag.DIVERGED) else "FAILED"
    if status == "KILLED":
        return f"KILLED: {tags[Tag.KILLED_REASON]}" if tags.get(Tag.KILLED_REASON) else "KILLED"
    if status == "RUNNING":
        return "RUNNING: still training, or killed by a signal it could not answer (kill -9) and never marked"
    if status != "FINISHED":
        return status
    if Param.ABLATION not in params:
        return "FINISHED without an ablation param (not an lrattn fit)"
    if Metric.VAL_LOSS not in metrics:
        return "FINISHED without a val/loss"
    return "FINISHED but not read"  # (not reached: read_runs counts every other FINISHED run)


def mark_lost_seeds(rows: list[Row], left: list[LeftOut]) -> None:
    """Each row's `lost`: the left-out runs of its size and ablation (and recipe, where the run has one) whose seed
    the row does not hold."""
    for run in left:
        mine = [row for row in rows if (row.size, row.ablation) == (run.size, run.ablation)]
        same_recipe = [row for row in mine if run.recipe and row.recipe == run.recipe]
        for row in (same_recipe or mine)[:1]:
            if run.seed is None or run.seed not in row.seeds:
                row.lost.append(f"{'?' if run.seed is None else run.seed}: {run.reason.split(':')[0].split(',')[0]}")


def terminal_line(left: list[LeftOut]) -> str | None:
    """One line naming the left-out runs and why (None: none left out)."""
    if not left:
        return None
    named = ", ".join(f"{r.name} ({r.reason.split(':')[0]})" for r in left[:MAX_NAMED])
    more = f" and {len(left) - MAX_NAMED} more (the report's appendix names them all)" if len(left) > MAX_NAMED else ""
    return f"[lrattn compare] left out {len(left)} run{'s' if len(left) > 1 else ''}: {named}{more}"


def appendix(left: list[LeftOut]) -> str:
    """The report's appendix of the runs left out, or ''."""
    if not left:
        return ""
    lines = [f"\n## Appendix: runs left out\n\n{len(left)} run(s) of the experiment are not in the table or the "
             "figures: a row that lost seeds says so in its seeds cell.\n",
             "| run | size | ablation | seed | why | run id |", "|---|---|---|---:|---|---|"]
    lines += [f"| {r.name} | {r.size} | {r.ablation} | {'?' if r.seed is None else r.seed} | {r.reason} | "
              f"`{r.run_id}` |" for r in left]
    return "\n".join(lines) + "\n"

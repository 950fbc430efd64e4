"""The lines under `lrattn compare`'s table: what it left apart and why.

    recipe_notes      each size's recipes: A in full (its fingerprint and what it is), every other one by
                      how it differs from A (an upcycled run's recipe differs in init_from)
    rule_note         the runs whose fingerprint predates the fingerprint's rule (train/fingerprint.py): pooled
                      only among themselves, never with runs of the rule, and their recipe may leave settings out
    delta_notes       why a Δ is — where the row names a control (or is not the reference): the control did
                      not run, or ran only under another recipe
    superseded_note   runs of one size, ablation, seed and recipe that ran more than once: which counts (the
                      latest FINISHED one) and which do not
    stale_note        FINISHED runs whose last validation is not at their last step (left out)
    power_note        what the seeds-needed cells are
    pooling_note      downstream scores shown apart because their evaluations differ, and cells of fewer seeds
                      (evals.py)
"""

from __future__ import annotations

import time
from collections import defaultdict

from lrattn_lightning.core.words import count as counted
from lrattn_lightning.tools.compare.evals import pooling_note
from lrattn_lightning.tools.compare.power import POWER
from lrattn_lightning.tools.compare.table import GAP_TAG, Row, RunRecord
from lrattn_lightning.tools.compare.words import size_list
from lrattn_lightning.train import fingerprint as fp


def notes(rows: list[Row], reference: str, stale: list[RunRecord]) -> str:
    parts = [recipe_notes(rows), rule_note(rows), delta_notes(rows, reference), superseded_note(rows),
             stale_note(stale), power_note(rows), pooling_note(rows)]
    return "".join(p for p in parts if p)


def describe(parts: dict) -> str:
    """A recipe in words: steps, tokens, data, optimiser, precision, upcycling."""
    opt = parts.get("optimizer") or {}
    text = (f"{parts.get('max_steps')} steps x {parts.get('tokens_per_step')} tokens (seq {parts.get('seq_len')}), "
            f"data {parts.get('data')}, {opt.get('optimizer')} (lr {opt.get('lr')}, Muon lr {opt.get('muon_lr')}, "
            f"warmup {opt.get('warmup_steps')}, decay {opt.get('decay_fraction')}), precision {parts.get('precision')}")
    if str(parts.get("document_masking")).lower() == "true":
        text += ", document masking"
    if parts.get("init_from") not in (None, "none"):
        text += f", upcycled from {parts['init_from']}"
    return text


def recipe_notes(rows: list[Row]) -> str:
    lines = []
    for size in size_list(rows):
        mine = [row for row in rows if row.size == size]
        groups: dict[str, list[Row]] = defaultdict(list)
        for row in mine:
            groups[row.group].append(row)
        where = f" at size {size}" if len({row.size for row in rows}) > 1 else ""
        main = groups["A"][0]
        count = {g: sum(len(r.runs) for r in rs) for g, rs in groups.items()}
        legacy = " (rebuilt from the params of runs that predate the recipe fingerprint; no data checksums)"
        if len(groups) == 1:
            shared = f"shared by all {count['A']} runs" if count["A"] > 1 else "its only run"
            lines.append(f"Recipe{where}, {shared}: fingerprint `{main.recipe}`"
                         f"{legacy if main.recipe.startswith(fp.LEGACY) else ''}: {describe(main.parts)}.")
            continue
        lines.append(f"Recipes{where}: runs of different recipes are never pooled or paired in a Δ or p.")
        for group in sorted(groups):
            row = groups[group][0]
            names = ", ".join(f"`{r.label}`" for r in groups[group])
            runs = counted(count[group], "run")
            head = f"- **{group}** (`{row.recipe}`{legacy if row.recipe.startswith(fp.LEGACY) else ''}; {runs}: {names})"
            if group == "A":
                lines.append(f"{head}: {describe(row.parts)}.")
            else:
                diffs = "; ".join(f"{k} {v} (A: {a})" for k, v, a in fp.differences(row.parts, main.parts))
                lines.append(f"{head}: differs from A in {diffs or 'nothing recorded (older and newer fingerprint)'}.")
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def rule_note(rows: list[Row]) -> str:
    """One line naming the runs whose fingerprint follows an older rule than new runs' (fp.predates_rule): their
    recipes may pool runs that differ in a setting the old rule left out (rule 1: AdamW's betas)."""
    old = [row for row in rows if fp.predates_rule(row.parts)]
    if not old:
        return ""
    sizes = len({row.size for row in rows}) > 1
    named = "; ".join(f"recipe {row.group}{f' at size {row.size}' if sizes else ''} `{row.label}`: "
                      + ", ".join(f"`{r.name}`" for r in row.runs) for row in old)
    return (f"\nFingerprints older than rule {fp.RECIPE_VERSION} (their recipe may leave out settings that change "
            f"the numbers, such as AdamW's betas; pooled only among themselves, never with newer runs): {named}.\n")


def delta_notes(rows: list[Row], reference: str) -> str:
    """One line per reason a Δ is —, naming the rows it applies to; a label that stands at several sizes is named
    once, with its sizes in ladder order (one line for the study, not one a size)."""
    reasons: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.why_no_control and row.why_no_control == row.why_no_reference:
            reasons[f"Δ vs control and vs {reference} — where {row.why_no_control}"][row.label].append(row.size)
            continue
        if row.why_no_control:
            reasons[f"Δ vs control — where {row.why_no_control}"][row.label].append(row.size)
        if row.why_no_reference:
            reasons[f"Δ vs {reference} — where {row.why_no_reference}"][row.label].append(row.size)
    if not reasons:
        return ""
    several = len({row.size for row in rows}) > 1

    def named(label: str, sizes: list[str]) -> str:
        return f"`{label}`" + (f" at {', '.join(dict.fromkeys(sizes))}" if several else "")

    lines = [f"- {why}: {'; '.join(named(label, sizes) for label, sizes in labels.items())}."
             for why, labels in reasons.items()]
    return "\nNot compared:\n" + "\n".join(lines) + "\n"


def superseded_note(rows: list[Row]) -> str:
    lines = []
    for row in rows:
        for run in row.runs:
            if run.superseded:
                old = ", ".join(f"`{r.name}` ({r.run_id[:8]}, started {_when(r.start_time)}, val/loss "
                                f"{r.val_loss:.4f})" for r in run.superseded)
                lines.append(f"- `{row.label}` seed {run.seed}, recipe {row.group}: counted `{run.name}` ({run.run_id[:8]}, "
                             f"started {_when(run.start_time)}, the latest); not counted: {old}.")
    if not lines:
        return ""
    return ("\nRan more than once with one size, ablation, seed and recipe (the latest FINISHED run counts: a rerun "
            "replaces an earlier result of the same recipe):\n" + "\n".join(lines) + "\n")


def power_note(rows: list[Row]) -> str:
    if all(row.need_control is None and row.need_baseline is None for row in rows):
        return ""
    return (f"\nSeeds needed (beside each p): seeds per arm for {POWER * 100:.0f} % power in Welch's test (the test of "
            "the p beside it) at two-sided α = 0.05 if the observed Δ and the two rows' spreads were the true ones "
            "(power.py); — where the spread is unknown (one seed a side) or Δ is 0. With two or three seeds the spread "
            "itself is uncertain: a size, not a promise.\n")


def stale_note(stale: list[RunRecord]) -> str:
    """The line under the table naming the runs left out because their last validation is not their last."""
    if not stale:
        return ""
    names = "; ".join(f"`{r.name}` (val/loss last at step {r.last_val_step} of {r.final_step}"
                      + (f"; {GAP_TAG}: {r.gap}" if r.gap else "") + ")" for r in stale)
    return (f"\nNot counted: {counted(len(stale), 'FINISHED run')} whose last validation is not at their last step, so their "
            f"val/loss is an earlier value, not their result: {names}.\n")


def _when(millis: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(millis / 1000))

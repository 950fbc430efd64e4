"""The recipe fingerprint of a run: what two runs must share for their losses to be compared.

A run's result depends on its architecture (the size and ablation, which name a row of `lrattn compare`),
its seed (which compare pools over) and its recipe. The recipe's parts, as `recipe_parts` returns them:

    size            the registry size (rows are per size anyway; here so that a fingerprint names it)
    max_steps       the run's length (a resume with --model.allow_schedule_change or a longer one: the new one)
    schedule_steps  the learning-rate schedule's length, only where --model.schedule_steps makes it differ from
                    max_steps (a finished run trained on; a part absent elsewhere, so older fingerprints stay)
    tokens_per_step batch x seq_len x devices x nodes x gradient accumulation
    seq_len         the training window
    data            sha256 over the data folder's shard checksums (meta.json `checksums`), 16 hex; a folder
                    prepared without checksums: `meta:` + the hash of its meta.json (token and byte counts)
    optimizer       the optimiser and every setting that shapes its steps: each OptimiserSettings field marked
                    recipe="optimizer" (train/settings.py: learning rates, weight decays, AdamW's betas, Muon's
                    variant and momentum schedule, warmup / decay / final LR, z-loss), gradient clipping; and
                    `muon_dtype`, the dtype Muon's orthogonaliser ran in, only where it is float32 (see below)
    precision       Lightning's precision (32-true, bf16-mixed, ...)
    document_masking  whether attention stops at document boundaries
    init_from       `none`, or the source of an upcycled run: `run RUN_ID step N` (its MLflow run) or
                    `file NAME step N` (a checkpoint without one)
    version         the rule the parts follow (RECIPE_VERSION); absent: rule 1, whose optimizer part was a list
                    written by hand that left out AdamW's betas

The fingerprint is the first 12 hex digits of the sha256 of the parts as sorted JSON. `lrattn fit` records
both as tags (FINGERPRINT_TAG, PARTS_TAG, rewritten when a resume changes the schedule's length), so
`lrattn compare` groups by the one and says what differs from the other. The routing kind's own training
options (the gated residual's `gate_*`) are not recipe: they are the method under test, tagged apart
(METHOD_TAG) and named by a sweep's `variant` label.

Muon's dtype. `--model.muon_dtype auto` resolves per device (bfloat16 on a GPU or a CPU with native bfloat16,
float32 elsewhere), and the two give other numbers: on real directions O differs by a median 10 % (Frobenius), and
over 300 steps at `tiny` the loss curves part by a fifth to a third of what another seed does, the final loss within
the seeds' spread (docs/benchmarks.md "Muon in float32 and batched"): small, not nothing, and not known to be
unbiased in longer runs. So the part is the resolved dtype, not the setting: two `auto` runs on a laptop without bfloat16 and on
a GPU get different fingerprints, and compare says `optimizer.muon_dtype` differs, rather than pool them silently;
to pool runs across such machines, pin `--model.muon_dtype` in the recipe. bfloat16, what every run before this
part did, is the part's absence (so rule-1 fingerprints held when the part came; rule 2 below is a new fingerprint
for every run anyway).

The settings are the one source: every field of train/settings.py's groups is marked recipe="optimizer" (a key of
the optimizer part), "derived" (a part built here: muon_dtype, schedule_steps, document_masking) or Not(why it
does not change the numbers), and a test fails on a field with no mark. Rule 2 (this one) is rule 1 with the
optimizer part derived from the marks (it gained `betas`) and the `version` part: a fingerprint of rule 1 never
equals one of rule 2, so old runs keep grouping among themselves (their tags hold their fingerprint) and never
with new ones, and compare names them (`predates_rule`: runs of rule 1 may differ in betas within one fingerprint).

Runs from before the fingerprint have no tags: `legacy_parts` rebuilds the parts from their MLflow params,
with `data` as `folder PATH` (no checksums were recorded), so they group among themselves and never with
a fingerprinted run; compare marks them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lrattn_lightning.train.schema import Param, Tag
from lrattn_lightning.train.settings import marked

FINGERPRINT_TAG, PARTS_TAG, METHOD_TAG = Tag.RECIPE, Tag.RECIPE_PARTS, Tag.METHOD  # (train/schema.py)
LEGACY = "legacy-"  # prefix of a fingerprint rebuilt from params
RECIPE_VERSION = 2  # the `version` part of the rule recipe_parts follows (rule 1: no such part)

# the module's settings that shape the optimiser's steps (LRAttnModule's arguments), from their marks
OPTIMIZER_SETTINGS = marked("recipe", "optimizer")
# rule 1's hand-written list, frozen: what legacy_parts rebuilds runs from before the fingerprint with (no betas)
RULE_1_OPTIMIZER_SETTINGS = ("optimizer", "lr", "muon_lr", "weight_decay", "muon_weight_decay", "muon_variant",
                             "muon_momentum", "muon_momentum_min", "muon_momentum_warmup_steps",
                             "muon_momentum_cooldown_steps", "warmup_steps", "decay_fraction", "final_lr_fraction",
                             "z_loss")


MUON_DTYPE_UNMARKED = "bfloat16"  # the dtype every run before the part had: no part


def fingerprint(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def data_checksum(data_dir: str | Path, meta: dict[str, Any] | None) -> str:
    """The `data` part: a hash of the shards' recorded checksums (the contents, wherever the folder lies)."""
    if isinstance(meta, dict) and meta.get("checksums"):
        return hashlib.sha256(json.dumps(meta["checksums"], sort_keys=True).encode()).hexdigest()[:16]
    path = Path(data_dir) / "meta.json" if data_dir else None
    if path is None or not path.is_file():
        return "unknown"  # a Trainer built in Python without our data module
    return "meta:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def init_from_part(params: dict[str, Any]) -> str:
    """`none`, or the source of an upcycled run from its init_from* params (as fit records them)."""
    if not params.get(Param.INIT_FROM):
        return "none"
    run, step = params.get(Param.INIT_FROM_RUN), params.get(Param.INIT_FROM_STEP)
    if run and run != "none":
        return f"run {run} step {step}"
    return f"file {Path(str(params[Param.INIT_FROM])).name} step {step}"


def recipe_parts(*, size: str, max_steps: int, tokens_per_step: int | None, seq_len: int | None, data: str,
                 settings: dict[str, Any], gradient_clip_val: Any, precision: str, init_from: str,
                 schedule_steps: int | None = None, muon_dtype: str | None = None,
                 groups: tuple[type, ...] | None = None) -> dict[str, Any]:
    """`muon_dtype`: the dtype Muon's orthogonaliser runs in, resolved (None: no Muon). `groups`: the settings
    groups whose fields marked recipe="optimizer" make the optimizer part (train/settings.py's, unless given)."""
    optimizer = {k: _plain(settings.get(k)) for k in marked("recipe", "optimizer", groups)}
    optimizer["gradient_clip_val"] = _plain(gradient_clip_val)
    if muon_dtype not in (None, MUON_DTYPE_UNMARKED):
        optimizer["muon_dtype"] = muon_dtype
    span = {"schedule_steps": schedule_steps} if schedule_steps not in (None, max_steps) else {}
    return {"size": size, "max_steps": max_steps, **span, "tokens_per_step": tokens_per_step, "seq_len": seq_len,
            "data": data, "optimizer": optimizer, "precision": str(precision),
            "document_masking": bool(settings.get("document_masking")), "init_from": init_from,
            "version": RECIPE_VERSION}


def version_of(parts: dict[str, Any]) -> int:
    """The rule a run's parts follow: their `version` part (1 where they have none: rule 1, or rebuilt by
    legacy_parts)."""
    value = parts.get("version")
    return int(value) if str(value).isdigit() else 1


def predates_rule(parts: dict[str, Any]) -> bool:
    """Whether a fingerprint follows an older rule than recipe_parts does now (its recipe may leave settings out)."""
    return version_of(parts) < RECIPE_VERSION


def legacy_parts(params: dict[str, str]) -> dict[str, Any]:
    """The parts of a run from before the fingerprint, from its MLflow params (values as logged: strings)."""
    def get(key: str) -> Any:
        return params.get(key)

    optimizer = {k: get(Param.TRAIN_PREFIX + k) for k in RULE_1_OPTIMIZER_SETTINGS}
    optimizer["gradient_clip_val"] = get(Param.GRADIENT_CLIP)
    return {"size": get(Param.SIZE), "max_steps": get(Param.MAX_STEPS), "tokens_per_step": get(Param.TOKENS_PER_STEP),
            "seq_len": get(Param.SEQ_LEN), "data": f"folder {get(Param.DATA_DIR)}", "optimizer": optimizer,
            "precision": get(Param.PRECISION), "document_masking": get(Param.TRAIN_PREFIX + "document_masking"),
            "init_from": init_from_part(params)}


def flat(parts: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parts as one level: optimizer.lr, optimizer.z_loss, ..."""
    out: dict[str, Any] = {}
    for key, value in parts.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def differences(parts: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(part, value here, value there) where two recipes differ, in the parts' order."""
    a, b = flat(parts), flat(other)
    return [(k, a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b]) if str(a.get(k)) != str(b.get(k))]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value

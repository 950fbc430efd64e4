"""`lrattn compare` and the fingerprint's rule (issue 52, 2): runs tagged under rule 1 (whose recipe left out AdamW's
betas) keep their fingerprint and pool among themselves, never with runs of rule 2 of the same recipe, and one line
under the table names them. A real sqlite MLflow store holding runs as `lrattn fit` tags them.
"""

from __future__ import annotations

import json

import pytest
from helpers.tracking import seed_store, sqlite_experiment

from lrattn_lightning.cli import main
from lrattn_lightning.tools.compare.table import read_runs, summarise
from lrattn_lightning.train import fingerprint as fp
from lrattn_lightning.train.settings import OptimiserSettings

# the recipe tag a fit of rule 1 wrote (tiny, 10 steps, defaults): its optimizer part without betas, no version
RULE_1_PARTS = json.loads(
    '{"data": "d", "document_masking": false, "init_from": "none", "max_steps": 10, "optimizer": {"decay_fraction": '
    '0.2, "final_lr_fraction": 0.1, "gradient_clip_val": 1.0, "lr": 0.0003, "muon_lr": 0.001, "muon_momentum": 0.95, '
    '"muon_momentum_cooldown_steps": 100, "muon_momentum_min": 0.85, "muon_momentum_warmup_steps": 300, '
    '"muon_variant": "reference", "muon_weight_decay": 0.1, "optimizer": "muon_adamw", "warmup_steps": 2000, '
    '"weight_decay": 0.0, "z_loss": 1e-05}, "precision": "32-true", "seq_len": 32, "size": "tiny", '
    '"tokens_per_step": 64}')
RULE_1_FINGERPRINT = "d5d59eb839d5"  # as rule 1 computed it


def _rule_2_parts(betas=(0.9, 0.95)) -> dict:
    flat = {**{k: getattr(OptimiserSettings(), k) for k in fp.OPTIMIZER_SETTINGS}, "betas": betas}
    return fp.recipe_parts(size="tiny", max_steps=10, tokens_per_step=64, seq_len=32, data="d", settings=flat,
                           gradient_clip_val=1.0, precision="32-true", init_from="none", muon_dtype="bfloat16")


def _run(client, exp, name, seed, loss, parts, betas):
    tags = {"seed": str(seed), "control": "none", fp.FINGERPRINT_TAG: fp.fingerprint(parts),
            fp.PARTS_TAG: json.dumps(parts, sort_keys=True)}
    rid = client.create_run(exp, run_name=name, tags=tags).info.run_id
    for key, value in {"size": "tiny", "ablation": "baseline", "params": "1000", "train_max_steps": "10",
                       "train_betas": str(list(betas))}.items():
        client.log_param(rid, key, value)
    client.log_metric(rid, "train/loss", 4.0, step=9)
    client.log_metric(rid, "val/loss", loss, step=10)
    client.set_terminated(rid, "FINISHED")


@pytest.fixture(scope="module")
def store(tmp_path_factory, store_template):
    root = tmp_path_factory.mktemp("rule")
    seed_store(root, store_template)
    uri, client, exp = sqlite_experiment(root, "rule")
    assert fp.fingerprint(RULE_1_PARTS) == RULE_1_FINGERPRINT  # an old run's tag still reads as it was written
    _run(client, exp, "old-seed0", 0, 3.0, RULE_1_PARTS, (0.9, 0.95))
    _run(client, exp, "old-seed1", 1, 3.1, RULE_1_PARTS, (0.8, 0.9))  # rule 1 could not tell these apart
    _run(client, exp, "new-seed0", 0, 3.2, _rule_2_parts(), (0.9, 0.95))
    _run(client, exp, "new-seed1", 1, 3.3, _rule_2_parts(), (0.9, 0.95))
    _run(client, exp, "new-betas-seed0", 0, 3.4, _rule_2_parts((0.8, 0.9)), (0.8, 0.9))
    return uri, client, root


def test_rule_1_runs_pool_among_themselves_never_with_rule_2_runs(store):
    uri, client, _ = store
    rows = summarise(read_runs(client, "rule", curves=False))
    pooled = {frozenset(r.name for r in row.runs): row.recipe for row in rows}
    assert set(pooled) == {frozenset({"old-seed0", "old-seed1"}), frozenset({"new-seed0", "new-seed1"}),
                           frozenset({"new-betas-seed0"})}
    assert pooled[frozenset({"old-seed0", "old-seed1"})] == RULE_1_FINGERPRINT  # old runs keep their fingerprint


def test_compare_names_the_runs_whose_fingerprint_predates_the_rule_in_one_line(store, tmp_path):
    uri, _, _ = store
    out = tmp_path / "report"
    assert main(["compare", "--experiment", "rule", "--tracking_uri", uri, "--out", str(out), "--no-summary-run"]) == 0
    table = (out / "table.md").read_text()
    lines = [line for line in table.splitlines() if "older than rule 2" in line]
    assert len(lines) == 1, table
    assert "`old-seed0`" in lines[0] and "`old-seed1`" in lines[0] and "new-" not in lines[0]
    assert "betas" in lines[0] and "never with newer runs" in lines[0]
    assert "optimizer.betas [0.8, 0.9]" in table  # the rule-2 recipes differ from each other in betas, said as such

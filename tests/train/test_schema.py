"""The MLflow schema (train/schema.py) names every key the platform writes, and compare and sweep read no other.

One real store, written by the real commands on a tiny model: `lrattn fit` of the gated residual (its gates held
for two steps, a sweep's run tags, Lightning's counters), `lrattn validate` of its checkpoint, `lrattn eval` into
its run and into a new eval-only run, `lrattn compare`, and the orphaned-run housekeeping of a fresh start. Every
tag, param, metric and artifact found there must be declared; the keys compare and sweep read back (recorded as
they read them) must be too. A key the schema lacks is reported, in a store and in a read.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.paths import REGISTRY_PATH
from helpers.prepare import prepared_corpus
from helpers.tracking import seed_store
from mlflow.entities import RunData
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main
from lrattn_lightning.tools.sweep.file import SweepRun
from lrattn_lightning.train import schema
from lrattn_lightning.train.schema import Artifact, Metric, Param, Tag

KINDS = ("tag", "param", "metric", "artifact", "experiment_tag")
SWEPT = SweepRun("tiny", "gated-residual", 0, "hold2")  # the fit, as a sweep names and tags it


@pytest.fixture(scope="module")
def store(tmp_path_factory, store_template) -> str:
    """The tracking URI of a store every writer of the platform has written to (see module doc)."""
    data = prepared_corpus(tmp_path_factory, 40, cloze_items=10, perplexity_documents=4)
    folder = tmp_path_factory.mktemp("schema-store")
    seed_store(folder, store_template)
    uri = f"sqlite:///{folder}/mlflow.db"
    common = ["--size", "tiny", "--ablation", "gated-residual", "--registry", str(REGISTRY_PATH),
              "--data.data_dir", str(data), "--data.batch_size", "2", "--trainer.limit_val_batches", "1",
              "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
              "--tracking_uri", uri]
    tags = json.dumps({Tag.SWEEP: "schema", Tag.SEED: str(SWEPT.seed), Tag.VARIANT: SWEPT.variant})
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        assert main(["fit", *common, "--trainer.max_steps", "3", "--trainer.val_check_interval", "2",
                     "--trainer.log_every_n_steps", "1", "--model.warmup_steps", "1", "--model.gate_freeze_steps", "2",
                     "--log_counters", "true", "--run_tags", tags, "--run_name", SWEPT.name]) == 0
        ckpt = next(folder.glob("runs/lrattn/*/checkpoints/last.ckpt"))
        assert main(["validate", *common, "--ckpt_path", str(ckpt)]) == 0
        evaluate = ["eval", "--checkpoint", str(ckpt), "--tasks", "local", "--limit", "2", "--val-loss",
                    "--bootstrap-iters", "0", "--accelerator", "cpu", "--tracking-uri", uri]
        assert main(evaluate) == 0
        _eval_only_run(ckpt, uri)
        assert main(["compare", "--experiment", "lrattn", "--tracking_uri", uri, "--out", str(folder / "reports")]) == 0
        _orphaned_run(folder, uri)
    return uri


def _eval_only_run(ckpt: Path, uri: str) -> None:
    """What `lrattn eval` writes for a checkpoint whose training run is not in the store: a run of its own."""
    from lrattn_lightning.eval.run import open_eval_run
    from lrattn_lightning.train.checkpoint.load import load_checkpoint

    loaded = dataclasses.replace(load_checkpoint(ckpt), mlflow=None)
    client, run_id, created = open_eval_run(loaded, uri, experiment="eval-only")
    assert created
    client.set_terminated(run_id)


def _orphaned_run(folder: Path, uri: str) -> None:
    """A RUNNING run of a run folder whose fit was killed, ended by the folder's next start."""
    from lrattn_lightning.train.store import end_orphaned_runs, open_store, run_dir_tag

    run_dir = folder / "runs" / "orphans" / "killed"
    exp_id = open_store(uri, "orphans")
    run = MlflowClient(uri).create_run(exp_id, tags={Tag.RUN_DIR: run_dir_tag(run_dir)})
    assert end_orphaned_runs(uri, exp_id, run_dir, keep=None) == [run.info.run_id]


def store_keys(uri: str) -> dict[str, set[str]]:
    """Every key of the store, by kind: experiment tags, run tags, params, metrics and artifact paths."""
    client = MlflowClient(uri)
    found: dict[str, set[str]] = {kind: set() for kind in KINDS}
    for exp in client.search_experiments():
        found["experiment_tag"] |= set(exp.tags)
        for run in client.search_runs([exp.experiment_id]):
            found["tag"] |= set(run.data.tags)
            found["param"] |= set(run.data.params)
            found["metric"] |= set(run.data.metrics)
            found["artifact"] |= _artifacts(client, run.info.run_id, None)
    return found


def _artifacts(client: MlflowClient, run_id: str, path: str | None) -> set[str]:
    out = set()
    for item in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return out


def undeclared_in(found: dict[str, set[str]]) -> dict[str, list[str]]:
    return {kind: bad for kind in KINDS if (bad := schema.undeclared(kind, found[kind]))}


def test_every_key_the_platform_wrote_is_declared(store):
    found = store_keys(store)
    assert not undeclared_in(found), f"keys in the store that train/schema.py does not declare: {undeclared_in(found)}"
    # the store holds what each writer writes (not a vacuous pass)
    assert {Tag.RECIPE, Tag.METHOD, Tag.LAST_STEP, Tag.RUN_DIR, Tag.VARIANT, Tag.EVAL_CONFIG + "val", Tag.SUMMARY,
            Tag.TRAINING_RUN, Tag.KILLED_REASON, Tag.NOTE} <= found["tag"]
    assert {Param.ABLATION, "gate_bias", Param.MUON_DTYPE_RESOLVED, Param.SCHEDULE_STEPS, Param.MAX_STEPS,
            Param.TRAIN_PREFIX + "gate_freeze_steps"} <= found["param"]
    assert {Metric.TRAIN_LOSS, Metric.GATES_HELD, Metric.VAL_LOSS, "validate/" + Metric.VAL_LOSS, Metric.EPOCH,
            Metric.LR + "muon", Metric.MOMENTUM + "muon", Metric.ROUTING_MEAN + "alpha", Metric.TOKENS_PER_SEC,
            "train/batches", Metric.EVAL_VAL + "loss", Metric.EVAL + "lrattn_cloze/acc"} <= found["metric"]
    assert {Artifact.CONFIG, Artifact.ROUTING_WEIGHTS, Artifact.GATES_JSON, Artifact.COMPARE + "table.md"} <= found["artifact"]
    assert any(a.startswith(Artifact.EVAL_RESULTS) for a in found["artifact"])
    assert found["experiment_tag"] == {schema.ExperimentTag.KIND, schema.ExperimentTag.REPORT_OF,
                                       schema.ExperimentTag.RUNS_VIEW}


@pytest.mark.usefixtures("mlflow_store")
def test_a_key_the_schema_lacks_is_reported(tmp_path):
    """The store check on a store holding one undeclared key of each kind, beside declared ones."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("x", artifact_location=(tmp_path / "artifacts").as_uri(),  # not ./mlruns
                                      tags={"lrattn.new_experiment_tag": "1"})
    run_id = client.create_run(exp_id, tags={Tag.RECIPE: "abc", "lrattn.new_tag": "1"}).info.run_id
    client.log_param(run_id, Param.MAX_STEPS, 3)
    client.log_param(run_id, "train_new_setting", 1)
    for key in (Metric.VAL_LOSS, "val/new", Metric.LR + "muon", "train/lr"):
        client.log_metric(run_id, key, 1.0, step=0)
    client.log_dict(run_id, {}, "routing/new.json")
    assert undeclared_in(store_keys(uri)) == {
        "tag": ["lrattn.new_tag"], "param": ["train_new_setting"], "metric": ["train/lr", "val/new"],
        "artifact": ["routing/new.json"], "experiment_tag": ["lrattn.new_experiment_tag"]}
    # the families: a resumed length is declared for the lengths a resume changes only
    assert schema.declared("param", Param.MAX_STEPS + Param.FROM_STEP + "4")
    assert not schema.declared("param", "train_lr" + Param.FROM_STEP + "4")
    assert schema.declared("metric", "test/" + Metric.ROUTING_MEAN + "entropy")
    assert not schema.declared("metric", "fit/" + Metric.VAL_LOSS)


class Reads:
    """The keys read from runs' tags, params and metrics (a lookup, a `get`, an `in`), metric histories asked
    for and keys named in search filters, by kind."""

    FILTER = re.compile(r"\b(tags|params|metrics)\.(`[^`]+`|[\w.]+)")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: dict[str, set[str]] = {"tag": set(), "param": set(), "metric": set()}
        reads = self

        class Recorded(dict):
            kind = ""

            def __getitem__(self, key):
                reads.keys[self.kind].add(key)
                return super().__getitem__(key)

            def get(self, key, default=None):
                reads.keys[self.kind].add(key)
                return super().get(key, default)

            def __contains__(self, key):
                reads.keys[self.kind].add(key)
                return super().__contains__(key)

        def recorded(kind: str, attr: str) -> property:
            cls = type(f"Recorded_{kind}", (Recorded,), {"kind": kind})
            return property(lambda data: cls(getattr(data, attr)))

        for kind, attr, name in (("tag", "_tags", "tags"), ("param", "_params", "params"), ("metric", "_metrics", "metrics")):
            monkeypatch.setattr(RunData, name, recorded(kind, attr))
        history, search = MlflowClient.get_metric_history, MlflowClient.search_runs

        def get_metric_history(client, run_id, key):
            reads.keys["metric"].add(key)
            return history(client, run_id, key)

        def search_runs(client, experiment_ids, filter_string="", *args, **kwargs):
            for table, key in self.FILTER.findall(filter_string or ""):
                reads.keys[table.removesuffix("s")].add(key.strip("`"))
            return search(client, experiment_ids, filter_string, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, "get_metric_history", get_metric_history)
        monkeypatch.setattr(MlflowClient, "search_runs", search_runs)
        from lrattn_lightning.tools.compare import runs as compare_runs

        histories = compare_runs._histories

        def bulk_histories(client, run_ids):  # compare reads histories in bulk (one SQL query per 500 runs)
            found = histories(client, run_ids)  # columns: each point's key an index into HISTORY_KEYS
            reads.keys["metric"].update(compare_runs.HISTORY_KEYS[k] for k in set(found.key.tolist()))
            return found

        monkeypatch.setattr(compare_runs, "_histories", bulk_histories)

    def undeclared(self) -> dict[str, list[str]]:
        return {kind: bad for kind, keys in self.keys.items() if (bad := schema.undeclared(kind, keys))}


def test_compare_and_sweep_read_only_declared_keys(store, tmp_path, monkeypatch):
    from lrattn_lightning.tools.sweep.local import diverged_runs, finished_runs

    reads = Reads(monkeypatch)
    assert main(["compare", "--experiment", "lrattn", "--tracking_uri", store, "--sweep", "schema",
                 "--out", str(tmp_path)]) == 0
    sweep = SimpleNamespace(experiment="lrattn")  # what the two read of a sweep
    assert finished_runs(sweep, store) == {SWEPT} and diverged_runs(sweep, store) == {}
    assert not reads.undeclared(), f"compare/sweep read keys train/schema.py does not declare: {reads.undeclared()}"
    assert {Tag.RECIPE, Tag.RECIPE_PARTS, Tag.LAST_STEP, Tag.SWEEP, Tag.SEED, Tag.VARIANT, Tag.DIVERGED,
            Tag.SWEEP_SUMMARY} <= reads.keys["tag"]
    assert {Param.ABLATION, Param.ADDED_FLOPS, Param.INIT_FROM} <= reads.keys["param"]
    assert {Metric.VAL_LOSS, Metric.TRAIN_LOSS, Metric.TOKENS_PER_SEC} <= reads.keys["metric"]


def test_the_read_check_reports_a_key_the_schema_lacks(store, monkeypatch):
    reads = Reads(monkeypatch)
    client = MlflowClient(store)
    exp_id = client.get_experiment_by_name("lrattn").experiment_id
    assert client.search_runs([exp_id], filter_string="tags.`lrattn.not_declared` = 'x'") == []
    run = client.search_runs([exp_id], filter_string="tags.sweep = 'schema'")[0]
    assert run.data.tags.get(Tag.SWEEP) == "schema" and "lrattn.other" not in run.data.tags
    assert run.data.params.get(Param.ABLATION) == "gated-residual"
    client.get_metric_history(run.info.run_id, "val/undeclared")
    assert reads.undeclared() == {"tag": ["lrattn.not_declared", "lrattn.other"], "metric": ["val/undeclared"]}


def test_the_controls_flags_are_declared_train_params():
    """The train_* params of the routing kinds' training controls are declared here (Param.ROUTING_SETTINGS) and are
    exactly the controls' flags (train/controls.py: today the gated residual's gate_*, GateHold's keyword
    parameters); what a control logs is a declared metric (GateHold: train/gates_held)."""
    import inspect

    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.model.routing.gated import GatedRouter
    from lrattn_lightning.train import controls
    from lrattn_lightning.train.callbacks.run_params import TRAIN_PARAMS

    derived = set(schema.train_settings()) - set(Param.MODULE_SETTINGS)
    assert Param.ROUTING_SETTINGS == controls.option_names()
    assert derived == set(inspect.signature(controls.GateHold).parameters) - {"router"}
    assert {"gate_freeze_steps", "gate_release_loss", "gate_grad_normalize"} == derived
    assert {Param.TRAIN_PREFIX + name for name in derived} <= schema.names("param")
    assert TRAIN_PARAMS == schema.train_settings()  # what the run's description logs
    cfg = load_registry(REGISTRY_PATH).model("tiny", "gated-residual")
    hold = controls.GateHold(GatedRouter(cfg), gate_freeze_steps=2)
    assert list(hold.log_values()) == [Metric.GATES_HELD] and schema.undeclared("metric", hold.log_values()) == []

"""A checkpoint is data from elsewhere: no field of it chooses code to import, a file to read or a store to write.

Crafted copies of a real checkpoint: a `routing: external` entry naming a module whose import writes a file (it
must never appear, in any command), a tracking URI of a server that does not exist, a model_config with a field
too many, too few or of the wrong type, a tokenizer naming /etc/passwd, NaN weights. Each is one line, exit 2.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.cli import in_process
from helpers.paths import GOLDEN_DIR
from helpers.runs import REGISTRY, fit_args
from helpers.tracking import seed_store
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main

EVIL = "evil_router_for_lrattn_tests"


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory, store_template) -> Path:
    """A real checkpoint of a 2-step fit (in this process)."""
    folder = tmp_path_factory.mktemp("trained")
    seed_store(folder, store_template)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert main(fit_args(data, "--trainer.limit_val_batches", "1", steps=2)) == 0
    return next(folder.rglob("last.ckpt"))


def crafted(trained: Path, folder: Path, name: str, edit) -> Path:
    ckpt = torch.load(trained, weights_only=True)
    edit(ckpt)
    path = folder / name
    torch.save(ckpt, path)
    return path


def external(router: str):
    def edit(ckpt):
        ckpt["hyper_parameters"]["model_config"]["ablation"].update(name="user-router", routing="external",
                                                                     router=router)
    return edit


@pytest.fixture
def evil(tmp_path) -> tuple[Path, Path]:
    """A module that, imported, prints and writes a file: (its folder, the file it would write)."""
    marker = tmp_path / "the-import-ran"
    package = tmp_path / "site"
    package.mkdir()
    (package / f"{EVIL}.py").write_text(textwrap.dedent(f'''
        import pathlib
        print("EVIL MODULE IMPORTED")
        pathlib.Path({str(marker)!r}).write_text("ran")
        class Evil:
            pass
    '''))
    return package, marker


def test_no_command_imports_a_router_class_a_checkpoint_names(trained, evil, tmp_path, data, monkeypatch):
    """generate, chat, eval, export and validate of a checkpoint naming an importable module: refused in one line
    naming the class and the flag to pass; the module never runs (its file never appears). `this:Foo` (an
    installed module that prints on import) is not imported either."""
    package, marker = evil
    ckpt = crafted(trained, tmp_path, "evil.ckpt", external(f"{EVIL}:Evil"))
    zen = crafted(trained, tmp_path, "zen.ckpt", external("this:Foo"))
    work = tmp_path / "work"  # no registry.yaml here: the shipped one names no external class
    work.mkdir()
    commands = {
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "x"],
        "chat": ["chat", "--checkpoint", str(ckpt)],
        "eval": ["eval", "--checkpoint", str(ckpt), "--tasks", "", "--val_loss", "--no_log"],
        "export": ["export", "--checkpoint", str(ckpt), "--out", str(work / "hf")],
        "validate": ["validate", "--ckpt_path", str(ckpt), "--data.data_dir", str(data)],
        "zen": ["generate", "--checkpoint", str(zen), "--prompt", "x"],
    }
    monkeypatch.syspath_prepend(str(package))  # the module is importable in the commands (run in this process)
    for name, argv in commands.items():
        proc = in_process(argv, work)
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 2, (name, err[-2000:])
        lines = [line for line in err.splitlines() if line.startswith("lrattn")]
        assert len(lines) == 1 and "Traceback" not in err, (name, err[-2000:])
        router = "this:Foo" if name == "zen" else f"{EVIL}:Evil"
        assert router in lines[0] and "--registry" in lines[0], (name, lines[0])
        if name != "validate":  # validate takes the architecture from the registry, so only --registry serves
            assert f"--trust_router {router}" in lines[0], (name, lines[0])
        assert "EVIL" not in out and "Beautiful is better than ugly" not in out, (name, out)
    assert not marker.exists()
    assert not (work / "hf").exists() and not (work / "mlflow.db").exists() and not (work / "runs").exists()

    # the user's word makes it importable: --trust_router names the same class (then it fails as what it is)
    done = in_process(["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--trust_router", f"{EVIL}:Evil"], work)
    sys.modules.pop(EVIL, None)  # (imported now: the next test's module of that name is another file)
    assert done.returncode == 2 and marker.exists()
    assert "'Evil' in module 'evil_router_for_lrattn_tests' is a type, not an nn.Module class" in done.stderr


@pytest.mark.usefixtures("mlflow_store")
def test_eval_writes_to_the_users_store_not_the_checkpoints(trained, tmp_path, monkeypatch, capsys):
    """A checkpoint naming a tracking server: eval logs to the store of the command line / environment / default,
    says so in one line before connecting anywhere, and never tries the named server."""
    def elsewhere(ckpt):
        ckpt["mlflow"] = {"run_id": "0" * 32, "experiment_id": "1", "tracking_uri": "http://127.0.0.1:9"}

    ckpt = crafted(trained, tmp_path, "elsewhere.ckpt", elsewhere)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "", "--val_loss", "--batch_size", "4"]) == 0
    err = capsys.readouterr().err
    assert f"results go to sqlite:///{tmp_path}/mlflow.db (the default local store), not to 'http://127.0.0.1:9'" in err
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["eval_only"] == "true" and "eval/val/loss" in run.data.metrics
    # the eval-only run's experiment holds the saved view its printed runs-table link opens (issue 55)
    from lrattn_lightning.train.runs_view import VIEW_TAG

    assert VIEW_TAG in client.get_experiment(run.info.experiment_id).tags


@pytest.mark.usefixtures("mlflow_store")
def test_eval_does_not_write_into_another_run_a_checkpoint_names(trained, tmp_path, monkeypatch, capsys):
    """The recorded run id is used only when that run trained this checkpoint's size and ablation."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    other = client.create_run(client.create_experiment("other")).info.run_id
    client.log_param(other, "ablation", "something-else")

    def pointing(ckpt):
        ckpt["mlflow"] = {"run_id": other, "experiment_id": "1", "tracking_uri": uri}

    ckpt = crafted(trained, tmp_path, "pointing.ckpt", pointing)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "", "--val_loss", "--tracking_uri", uri]) == 0
    assert "trained None/something-else, not tiny/baseline; logging to a new run" in capsys.readouterr().err
    assert not any(k.startswith("eval/") for k in client.get_run(other).data.metrics)


def _size(change):
    def edit(ckpt):
        change(ckpt["hyper_parameters"]["model_config"]["size"])
    return edit


CRAFTED = {  # name: (edit, words in the one line)
    "extra size field": (_size(lambda s: s.update(colour="red")), ["model_config.size: field 'colour': unknown field"]),
    "missing size field": (_size(lambda s: s.pop("d_model")), ["model_config.size: field 'd_model': required"]),
    "mistyped size field": (_size(lambda s: s.update(d_model="wide")), ["field 'd_model': must be a positive integer"]),
    "tokenizer naming a file": (lambda c: c.update(tokenizer={"kind": "hf", "file": "/etc/passwd"}),
                                ["tokenizer carries no file content", "names no file to read"]),
    "NaN weights": (lambda c: c["state_dict"]["model.embed.weight"].fill_(float("nan")),
                    ["non-finite weights (embed.weight)", "diverged"]),
    "huge weights": (lambda c: c["state_dict"]["model.head.weight"].fill_(3e38), ["non-finite logits"]),
}


@pytest.mark.parametrize("case", list(CRAFTED))
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_crafted_checkpoint_is_one_line(case, command, trained, tmp_path, monkeypatch, capsys):
    edit, needles = CRAFTED[case]
    ckpt = crafted(trained, tmp_path, "crafted.ckpt", edit)
    monkeypatch.chdir(tmp_path)
    argv = {"generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "x"],
            "export": ["export", "--checkpoint", str(ckpt), "--out", "hf"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["eval", "--limit", "0", "--no_log"], "--limit 0"),
    (["eval", "--batch_size", "0", "--no_log"], "--batch_size 0: must be an integer >= 1"),
    (["eval", "--num_fewshot", "-1", "--no_log"], "--num_fewshot -1: must be an integer >= 0"),
])
def test_bad_generation_and_eval_numbers_are_one_line(argv, needle, trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([argv[0], "--checkpoint", str(trained), *argv[1:]]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_validate_refuses_data_of_another_tokenizer_and_a_resume_another_folder(trained, data, tmp_path, monkeypatch,
                                                                                 capsys):
    from lrattn_lightning.data.prepare import prepare

    bpe = tmp_path / "bpe"
    prepare(source="stdlib-docs", out_dir=bpe, tokenizer="bpe:300", max_documents=40, val_fraction=0.1,
            cloze_items=0, perplexity_documents=0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    capsys.readouterr()
    assert main(["validate", "--ckpt_path", str(trained), "--registry", REGISTRY, "--data.data_dir", str(bpe)]) == 2
    err = capsys.readouterr().err
    assert "lrattn: error: tokenizer mismatch: checkpoint" in err and "pass --data.data_dir of the folder" in err
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    assert main(fit_args(copy, "--ckpt_path", str(trained), "--run_name", "resumed", steps=2)) == 2
    err = capsys.readouterr().err
    assert f"--data.data_dir {copy}: checkpoint {trained} trained on {data}" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


# ---- checkpoints written before typed kind options still load -------------------------------------------
OLD = GOLDEN_DIR / "checkpoints-v0"


@pytest.mark.parametrize("name", ["p-lr-block-n4-r32", "denseformer", "gated-residual"])
def test_a_checkpoint_of_the_earlier_format_loads_with_the_same_logits(name):
    """Their model_config holds every kind's fields at their defaults (and denseformer's options nested): read as
    the registry entry it was trained as, computing what it computed then."""
    from lrattn_lightning.model.registry import load_registry, model_config_from_dict
    from lrattn_lightning.train.checkpoint.compat import architecture_differences
    from lrattn_lightning.train.checkpoint.load import load_checkpoint

    stored = torch.load(OLD / f"{name}.ckpt", weights_only=True)["hyper_parameters"]["model_config"]
    assert "key_source" in stored["ablation"] and "gate_bias" in stored["ablation"]  # the earlier, flat-for-all format
    registry_cfg = load_registry(REGISTRY).model("tiny", name)
    assert architecture_differences(stored, registry_cfg) == []
    assert model_config_from_dict(stored) == registry_cfg
    loaded = load_checkpoint(OLD / f"{name}.ckpt")
    with torch.no_grad():
        logits = loaded.model(torch.arange(1, 17)[None])
    # float32 kernels round differently across CPUs (p-lr-block-n4-r32 is 1 ulp off on some): what it computed
    # then, to float32's precision
    torch.testing.assert_close(logits, torch.load(OLD / "logits.pt")[name], rtol=1e-6, atol=1e-6)

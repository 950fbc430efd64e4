"""Downstream evaluation end to end: the lm-eval model, the real evaluator on the local tasks, Fabric
ranks, MLflow logging, the fit callback and the bad-input errors. One tiny checkpoint per session.

Offline throughout: the local tasks read the prepared folder, and the hub is switched off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.paths import REPO_ROOT
from helpers.tracking import seed_store
from lm_eval.api.instance import Instance
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main
from lrattn_lightning.data.datamodule import TokenDataModule
from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.eval.lm import LRAttnLM
from lrattn_lightning.eval.run import log_eval, validation_loss
from lrattn_lightning.eval.tasks import expand_tasks
from lrattn_lightning.model.generate import generate
from lrattn_lightning.train.checkpoint.load import load_checkpoint
from lrattn_lightning.train.losses import token_losses

REPO = REPO_ROOT
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
os.environ.update(OFFLINE)  # nothing here may download; set before `datasets` reads it


@pytest.fixture(scope="session")
def trained(tmp_path_factory, store_template) -> dict:
    """Prepare a small corpus and train `tiny` for 4 steps with the EvalCallback (cloze, 4 items)."""
    root = tmp_path_factory.mktemp("eval")
    seed_store(root, store_template)
    data = root / "data"
    prepare(source="stdlib-docs", out_dir=data, tokenizer="byte", max_documents=120, val_fraction=0.1,
            cloze_items=20, perplexity_documents=10)
    uri = f"sqlite:///{root}/mlflow.db"
    cwd = os.getcwd()
    os.chdir(root)
    try:
        rc = main(["fit", "--size", "tiny", "--ablation", "s-lr-grid-n4-r16", "--registry", str(REPO / "registry.yaml"),
                   "--data.data_dir", str(data), "--data.batch_size", "4", "--trainer.max_steps", "4",
                   "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
                   "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", "--model.warmup_steps", "2",
                   "--checkpoint_every", "2", "--trainer.log_every_n_steps", "1", "--tracking_uri", uri,
                   "--trainer.callbacks+=lrattn_lightning.eval.callback.EvalCallback",
                   "--trainer.callbacks.tasks=lrattn_cloze", "--trainer.callbacks.limit=4"])
    finally:
        os.chdir(cwd)
    assert rc == 0
    ckpt = root / "runs/lrattn/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt"
    run_id = torch.load(ckpt, weights_only=True)["mlflow"]["run_id"]
    return {"root": root, "data": data, "ckpt": ckpt, "uri": uri, "run_id": run_id}


@pytest.fixture(scope="session")
def lm(trained) -> LRAttnLM:
    return LRAttnLM(checkpoint=str(trained["ckpt"]), batch_size=5)


@pytest.fixture(scope="session")
def single_process_eval(trained) -> dict:
    """`lrattn eval` in this process on both local tasks plus the validation loss, logged to the training run."""
    client = MlflowClient(trained["uri"])
    before = {a.path for a in client.list_artifacts(trained["run_id"], "eval")}
    rc = main(["eval", "--checkpoint", str(trained["ckpt"]), "--tasks", "local", "--limit", "6", "--val-loss",
               "--batch-size", "8", "--accelerator", "cpu", "--tracking-uri", trained["uri"]])
    assert rc == 0
    return {"before": before, "run": client.get_run(trained["run_id"])}


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def manual_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = F.log_softmax(model(ids[:, :-1]).float(), dim=-1)[0]
    n = len(context)
    return float(logp[n - 1:].gather(-1, torch.tensor(continuation)[:, None]).sum())


# ---- the lm-eval model ---------------------------------------------------------------------------
def test_loglikelihood_equals_log_softmax_of_a_manual_forward(lm):
    tok, model = lm.tok, lm.model
    pairs = [("The quick brown", " fox"), ("def f(x):", " return x"), ("", "hello"), ("a", " b c d")]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (logprob, _) in zip(pairs, got, strict=True):
        ctx = tok.encode(context) or [tok.eos_id]
        assert logprob == pytest.approx(manual_logprob(model, ctx, tok.encode(continuation)), abs=1e-4)
    # a context longer than seq_len (32) is left-truncated to the last 32 - len(continuation) tokens
    long_ctx, cont = "x" * 20 + "The quick brown fox jumps over", " the dog"
    (logprob, _), = lm.loglikelihood(requests("loglikelihood", [(long_ctx, cont)]))
    c = tok.encode(cont)
    assert logprob == pytest.approx(manual_logprob(model, tok.encode(long_ctx)[-(33 - len(c)):], c), abs=1e-4)


def test_is_greedy_and_long_continuations_follow_the_chain_rule(lm):
    tok, model = lm.tok, lm.model
    ctx = tok.encode("Return the value")
    greedy = generate(model, torch.tensor([ctx]), 6)[0].tolist()
    (_, is_greedy), = lm._loglikelihood_tokens([(None, ctx, greedy)])
    assert is_greedy
    (_, not_greedy), = lm._loglikelihood_tokens([(None, ctx, greedy[:-1] + [(greedy[-1] + 1) % 256])])
    assert not not_greedy
    # a continuation of 50 tokens (> seq_len) is scored in windows: log p(a b) = log p(a) + log p(b | a)
    cont = tok.encode(" and the quick brown fox jumps over the lazy dog, twice over.")[:50]
    whole = lm._loglikelihood_tokens([(None, ctx, cont), (None, ctx, cont[:32]), (None, ctx + cont[:32], cont[32:])])
    assert whole[0][0] == pytest.approx(whole[1][0] + whole[2][0], abs=1e-4)


def test_rolling_loglikelihood_is_minus_loss_times_tokens(lm):
    tok, model = lm.tok, lm.model
    short = "import os"  # 9 tokens: one window, conditioned on EOS
    ids = tok.encode(short)
    with torch.no_grad():
        ce, _ = token_losses(model(torch.tensor([[tok.eos_id] + ids[:-1]])), torch.tensor([ids]))
    long = "The standard library documents every module in the reference. " * 3  # 189 tokens: 6 windows
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(short,), (long,)]))
    assert got[0] == pytest.approx(-float(ce) * len(ids), abs=1e-4)
    # lm-eval's disjoint windows: 32 predictions each (the last one 29), each token scored once, and
    # every window but the first sees 32 tokens of input (its last 33 - r tokens before the predictions)
    ids = tok.encode(long)
    expected = manual_logprob(model, [tok.eos_id], ids[:32])
    for start in range(32, len(ids), 32):
        r = min(32, len(ids) - start)
        expected += manual_logprob(model, ids[start - (33 - r):start], ids[start:start + r])
    assert got[1] == pytest.approx(expected, abs=1e-3)


def test_batched_scoring_equals_unbatched(lm, trained):
    rows = [json.loads(line) for line in (trained["data"] / "tasks/cloze.jsonl").read_text().splitlines()[:4]]
    pairs = [(r["context"], " " + choice) for r in rows for choice in r["choices"]] + [("Hi", " there"), ("", "x")]
    one = LRAttnLM(model=lm.model, tokenizer=lm.tok, batch_size=1)
    batched = lm.loglikelihood(requests("loglikelihood", pairs))
    single = one.loglikelihood(requests("loglikelihood", pairs))
    for (a, ga), (b, gb) in zip(batched, single, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    docs = [(r["context"],) for r in rows]
    assert lm.loglikelihood_rolling(requests("loglikelihood_rolling", docs)) == pytest.approx(
        one.loglikelihood_rolling(requests("loglikelihood_rolling", docs)), abs=1e-3)


def test_generate_until_stops_at_strings_greedy_and_sampled(lm):
    tok, model = lm.tok, lm.model
    prompt = "def main():"
    row = generate(model, torch.tensor([tok.encode(prompt)]), 12, eos_id=tok.eos_id)[0].tolist()
    free = tok.decode(row[:row.index(tok.eos_id)] if tok.eos_id in row else row)
    stop = free[len(free) // 2:len(free) // 2 + 2]  # a string the greedy continuation contains
    assert stop
    greedy = {"until": [stop], "max_gen_toks": 12, "do_sample": False}
    sampled = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0, "top_k": 50}
    args = [(prompt, greedy), (prompt, {"until": [], "max_gen_toks": 12}), ("class A:", greedy), (prompt, sampled)]
    out = lm.generate_until(requests("generate_until", args))
    assert out[0] == free.split(stop)[0] and stop not in out[0]
    assert out[1] == free
    assert out[3] == lm.generate_until(requests("generate_until", [(prompt, sampled)]))[0]  # seeded per call
    alone = LRAttnLM(model=model, tokenizer=tok, batch_size=1).generate_until(requests("generate_until", args[:3]))
    assert alone == out[:3]


# ---- lrattn eval: real evaluator, MLflow, Fabric ----------------------------------------------------
def test_eval_logs_metrics_and_results_json_on_the_training_run(single_process_eval, trained):
    run, client = single_process_eval["run"], MlflowClient(trained["uri"])
    metrics = run.data.metrics
    for key in ("eval/lrattn_cloze/acc", "eval/lrattn_cloze/acc_norm", "eval/lrattn_cloze/acc_stderr",
                "eval/lrattn_ppl/word_perplexity", "eval/lrattn_ppl/byte_perplexity", "eval/lrattn_ppl/bits_per_byte",
                "eval/val/loss", "eval/val/bpb", "train/loss", "val/loss"):
        assert key in metrics, key
    assert not any("," in k for k in metrics)
    assert 0.0 <= metrics["eval/lrattn_cloze/acc"] <= 1.0 and metrics["eval/lrattn_ppl/byte_perplexity"] > 1.0
    assert client.get_metric_history(run.info.run_id, "eval/lrattn_ppl/bits_per_byte")[-1].step == 4
    new = {a.path for a in client.list_artifacts(run.info.run_id, "eval")} - single_process_eval["before"]
    assert len(new) == 1 and next(iter(new)).endswith(".json")
    results = json.loads(Path(client.download_artifacts(run.info.run_id, next(iter(new)),
                                                        str(trained["root"] / "dl"))).read_text())
    assert results["results"]["lrattn_ppl"]["bits_per_byte,none"] == pytest.approx(metrics["eval/lrattn_ppl/bits_per_byte"])
    assert results["config"]["model_args"]["ablation"] == "s-lr-grid-n4-r16"
    assert results["n-samples"]["lrattn_cloze"]["effective"] == 6
    # what each score was measured under, for `lrattn compare` to pool only like with like
    data = str(trained["data"].resolve())
    cloze = json.loads(run.data.tags["lrattn.eval_config/lrattn_cloze"])
    assert (cloze["limit"], cloze["num_fewshot"], cloze["data"], cloze["items"]) == (6, 0, data, 6)
    assert json.loads(run.data.tags["lrattn.eval_config/val"])["data"] == data


def test_fabric_validation_loss_is_exact_over_the_whole_split(single_process_eval, trained, lm):
    dm = TokenDataModule(str(trained["data"]), batch_size=64, seq_len=32, shuffle=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            ce, _ = token_losses(lm.model(batch[:, :-1]), batch[:, 1:])
            total, count = total + float(ce) * batch[:, 1:].numel(), count + batch[:, 1:].numel()
    assert single_process_eval["run"].data.metrics["eval/val/loss"] == pytest.approx(total / count, rel=1e-6)
    assert single_process_eval["run"].data.metrics["eval/val/tokens"] == count
    halves = [validation_loss(lm.model, trained["data"], rank=r, world_size=2, batch_size=64) for r in (0, 1)]
    assert sum(h["tokens"] for h in halves) == count  # the two shards partition the windows
    assert sum(h["loss"] * h["tokens"] for h in halves) / count == pytest.approx(total / count, rel=1e-6)


@pytest.mark.slow
def test_two_fabric_processes_give_the_same_metrics_as_one(single_process_eval, trained, tmp_path, store_template):
    """gloo, 2 CPU ranks through the CLI; a store without the training run gets a new run tagged with the checkpoint."""
    uri = f"sqlite:///{seed_store(tmp_path, store_template, 'other.db')}"
    env = {**os.environ, **OFFLINE}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "-m", "lrattn_lightning.cli", "eval", "--checkpoint", str(trained["ckpt"]),
                           "--tasks", "local", "--limit", "6", "--val-loss", "--batch-size", "8", "--devices", "2",
                           "--accelerator", "cpu", "--tracking-uri", uri],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Starting with 2 processes" in proc.stderr + proc.stdout
    assert re.search(r"\[lrattn eval\] (\d+)/\1 loglikelihood requests scored", proc.stderr)  # progress, rank 0 only
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("lrattn").experiment_id])
    assert run.data.tags["checkpoint"] == str(trained["ckpt"].resolve()) and run.data.tags["eval_only"] == "true"
    assert run.data.params["ablation"] == "s-lr-grid-n4-r16"
    one = {k: v for k, v in single_process_eval["run"].data.metrics.items() if k.startswith("eval/")}
    two = run.data.metrics
    assert set(one) == set(two)
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-5), key
    assert len(client.list_artifacts(run.info.run_id, "eval")) == 1


def test_fit_callback_logged_eval_on_the_training_run(trained):
    client = MlflowClient(trained["uri"])
    history = client.get_metric_history(trained["run_id"], "eval/lrattn_cloze/acc")
    assert history and history[0].step == 4  # logged by EvalCallback when fit ended, at the last step
    assert "lrattn.eval_config/lrattn_cloze" in client.get_run(trained["run_id"]).data.tags
    assert any(a.path.startswith("eval/results-step000004") for a in client.list_artifacts(trained["run_id"], "eval"))


# ---- bad inputs ----------------------------------------------------------------------------------
def eval_error(capsys, *args: str) -> str:
    assert main(["eval", "--no-log", "--accelerator", "cpu", *args]) == 2
    return capsys.readouterr().err


@pytest.mark.usefixtures("mlflow_store")
def test_two_evaluations_in_one_second_keep_both_results_files(tmp_path):
    """The results file's name is unique, not only to the second (a fast re-run used to overwrite the first)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e", artifact_location=str(tmp_path / "art"))).info.run_id
    for _ in range(2):
        log_eval(client, run_id, 3, None, {"loss": 2.0, "bpb": 3.0, "tokens": 10.0})
    names = [a.path for a in client.list_artifacts(run_id, "eval")]
    assert len(names) == 2 and all(n.startswith("eval/results-step000003-") for n in names), names


def test_missing_or_foreign_checkpoint(tmp_path, capsys):
    assert f"checkpoint {tmp_path / 'nope.ckpt'}: no such file" in eval_error(capsys, "--checkpoint", str(tmp_path / "nope.ckpt"))
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "hyper_parameters": {"lr": 1.0}}, foreign)
    err = eval_error(capsys, "--checkpoint", str(foreign))
    assert str(foreign) in err and "not written by lrattn_lightning" in err


def test_unknown_task_names_the_task_and_the_closest(trained, tmp_path, capsys, monkeypatch):
    """lm-eval's default index (~14 s to build) stands in as a folder holding arc_easy only; it is built
    only for names that are neither local nor in --include-path."""
    import lm_eval.tasks

    defaults = tmp_path / "defaults"
    defaults.mkdir()
    shutil.copy(Path(lm_eval.tasks.__file__).parent / "arc/arc_easy.yaml", defaults)
    built = []

    class SmallDefaults(lm_eval.tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kw):
            built.append(include_defaults)
            paths = list(include_path or []) + ([str(defaults)] if include_defaults else [])
            super().__init__(include_path=paths, include_defaults=False, **kw)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", SmallDefaults)
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--tasks", "lrattn_clozee,arc_easyy")
    assert "unknown task(s) 'lrattn_clozee' (closest: lrattn_cloze" in err and "'arc_easyy' (closest: arc_easy)" in err
    assert built == [True]
    assert "unknown task(s) 'nope'" in eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--tasks", "lrattn_ppl,nope")
    assert built[1:] == [False, True]  # the local folder first, the defaults only for 'nope'
    assert "nothing to evaluate" in eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--tasks", ",")


def test_tokenizer_mismatch_and_missing_task_data(trained, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(trained["data"], other)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"] = {"kind": "bpe", "file": "tokenizer.json", "vocab_size": 300}
    (other / "meta.json").write_text(json.dumps(meta))
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--data-dir", str(other))
    assert "tokenizer mismatch" in err and str(other / "meta.json") in err
    shutil.rmtree(other)
    shutil.copytree(trained["data"], other)
    (other / "tasks/perplexity.jsonl").unlink()
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--data-dir", str(other))
    assert "task 'lrattn_ppl'" in err and str(other / "tasks/perplexity.jsonl") in err


@pytest.mark.parametrize("damage, needle", [("bytes", "contents changed since prepare"), ("ids", "holds token id 300")])
def test_val_loss_checks_the_val_split_before_any_task_runs(damage, needle, trained, tmp_path, capsys, monkeypatch):
    """Issue 53: a changed val chunk (or one rewritten, checksums and all, with ids past the byte tokenizer's) was
    found only after lm-eval had scored every task."""
    from lrattn_lightning.data.shards import shard_files

    bad = tmp_path / "bad"
    shutil.copytree(trained["data"], bad)
    chunk = json.loads((bad / "val/index.json").read_text())["chunks"][0]
    body = np.memmap(bad / "val" / chunk["filename"], dtype=np.uint16, mode="r+", offset=(chunk["chunk_size"] + 2) * 4)
    body[:3] = 300
    body.flush()
    if damage == "ids":
        meta = json.loads((bad / "meta.json").read_text())
        meta["checksums"]["val"] = shard_files(bad / "val")
        (bad / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr("lrattn_lightning.eval.run.run_lm_eval", lambda *a, **k: pytest.fail("a task ran first"))
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--tasks", "local", "--val-loss", "--data-dir", str(bad))
    assert err.startswith("lrattn: error: ") and len(err.strip().splitlines()) == 1, err
    assert needle in err and str(bad / "val" / chunk["filename"]) in err, err


def test_checkpoint_without_data_dir_or_training_run(trained, tmp_path, capsys):
    ckpt = torch.load(trained["ckpt"], weights_only=True)
    del ckpt["data"], ckpt["mlflow"]
    bare = tmp_path / "bare.ckpt"
    torch.save(ckpt, bare)
    err = eval_error(capsys, "--checkpoint", str(bare), "--tasks", "local")
    assert "pass --data-dir" in err
    loaded = load_checkpoint(bare)
    assert loaded.mlflow is None and loaded.cfg.ablation.name == "s-lr-grid-n4-r16"


def test_unreachable_dataset_names_task_and_dataset(trained, tmp_path, capsys, monkeypatch):
    import datasets
    import huggingface_hub

    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    (tmp_path / "hub.yaml").write_text(
        "task: lrattn_test_hub\ndataset_path: lrattn-tests/no-such-dataset\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: 0\n")
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--tasks", "lrattn_test_hub",
                     "--include-path", str(tmp_path))
    assert "task 'lrattn_test_hub' (dataset 'lrattn-tests/no-such-dataset') could not be loaded" in err
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--include-path", str(tmp_path / "missing"))
    assert f"--include-path {tmp_path / 'missing'}: no such folder" in err


def test_presets_expand():
    names, shots = expand_tasks("paper")
    assert shots == 5 and names == ["mmlu", "arc_challenge", "arc_easy", "commonsense_qa", "hellaswag", "openbookqa",
                                    "piqa", "winogrande"]
    assert expand_tasks("local,lrattn_ppl,hellaswag") == (["lrattn_cloze", "lrattn_ppl", "hellaswag"], None)


@pytest.mark.usefixtures("mlflow_store")
def test_evaluation_uses_the_trained_window_not_the_sizes(trained, tmp_path, capsys):
    """`--data.seq_len 16` on size `tiny` (seq_len 32): the checkpoint records the trained window, and the
    validation loss, lm-eval's truncation and chat all use it (they used 32: positions never trained on)."""
    from lrattn_lightning.data.shards import check_shards, count_windows

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc = main(["fit", "--size", "tiny", "--ablation", "s-lr-grid-n4-r16", "--registry", str(REPO / "registry.yaml"),
                   "--data.data_dir", str(trained["data"]), "--data.batch_size", "4", "--data.seq_len", "16",
                   "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar",
                   "false", "--trainer.accelerator", "cpu", "--model.warmup_steps", "1",
                   "--tracking_uri", f"sqlite:///{tmp_path}/mlflow.db"])
    finally:
        os.chdir(cwd)
    assert rc == 0
    ckpt_path = tmp_path / "runs/lrattn/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt"
    ckpt = load_checkpoint(ckpt_path)
    assert (ckpt.seq_len, ckpt.cfg.size.seq_len) == (16, 32)
    assert LRAttnLM(checkpoint=str(ckpt_path)).max_length == 16
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt_path), "--tasks", "lrattn_ppl", "--limit", "2", "--val-loss",
                 "--no-log", "--accelerator", "cpu", "--bootstrap-iters", "0"]) == 0
    tokens = int(re.search(r"over (\d+) tokens", capsys.readouterr().out).group(1))
    chunks = check_shards(trained["data"], "val")
    assert tokens == count_windows(chunks, 17) * 16 != count_windows(chunks, 33) * 32
    # a checkpoint from before the window was recorded evaluates at the size's seq_len
    raw = torch.load(ckpt_path, weights_only=True)
    del raw["data"]["seq_len"]
    torch.save(raw, tmp_path / "old.ckpt")
    assert load_checkpoint(tmp_path / "old.ckpt").seq_len == 32


# ---- the local tasks sized to the trained window -----------------------------------------------------
def test_cloze_contexts_are_cut_to_the_window_at_word_boundaries():
    """Each request (context + " " + choice) fits window + 1 tokens, dropping the fewest leading words;
    items that fit stay as they are, items whose choice fits with no context word stay whole (counted)."""
    from lrattn_lightning.data.tokenizer import ByteTokenizer
    from lrattn_lightning.eval.tasks import fit_cloze_items

    words = "naïve café déjà vu — the quick brown fox jumps over the lazy dog ✓ again and again".split(" ")
    items = [{"id": i, "context": " ".join(words[: 6 + i]), "choices": ["over the lazy dog", "ü ü ü", "x"], "gold": 0}
             for i in range(len(words) - 6)]
    items.append({"id": 99, "context": "a b", "choices": [" ".join(["toolong"] * 14)], "gold": 0})
    # bytes (multi-byte characters), and a word-level tokenizer
    for encode, window in ((ByteTokenizer().encode, 60), (lambda text: text.split(" "), 12)):
        limit = window + 1
        fitted, cut, unfit = fit_cloze_items(items, window, encode)
        assert [f["id"] for f in fitted] == [i["id"] for i in items] and unfit == 1
        for item, new in zip(items, fitted, strict=True):
            longest = max(len(encode(f"{new['context']} {c}")) for c in new["choices"])
            kept = new["context"].split(" ")
            assert item["context"].split(" ")[-len(kept):] == kept and new["choices"] == item["choices"]
            if new["context"] != item["context"]:
                assert longest <= limit  # fits, and one more word would not
                one_more = " ".join(item["context"].split(" ")[-len(kept) - 1:])
                assert max(len(encode(f"{one_more} {c}")) for c in new["choices"]) > limit
            elif longest > limit:  # whole because even one word of context cannot fit
                assert max(len(encode(f"{kept[-1]} {c}")) for c in new["choices"]) > limit
        assert cut == sum(f != i for f, i in zip(fitted, items, strict=True)) and cut >= 3
        assert fitted[-1] == items[-1]  # the unfit one, whole
    assert fit_cloze_items(items, 60, ByteTokenizer().encode)[0][0] == items[0]  # fits as is: untouched


def test_write_tasks_gives_lm_eval_a_folder_for_this_checkpoint(trained, tmp_path, capsys):
    """`lrattn eval --write_tasks DIR`: the YAMLs and the cut cloze items, the lm_eval command printed; a folder
    holding anything else, a file, or no local task are refused in one line and left as they were."""
    out = tmp_path / "tasks"
    assert main(["eval", "--checkpoint", str(trained["ckpt"]), "--write_tasks", str(out)]) == 0
    said = capsys.readouterr()
    assert f"--include_path {out}" in said.out and "lm_eval --model hf" in said.out and "window of 32 tokens" in said.out
    assert {p.name for p in out.iterdir()} == {"lrattn_cloze.yaml", "lrattn_ppl.yaml", "lrattn_cloze.jsonl"}
    header = (out / "lrattn_cloze.yaml").read_text().splitlines()[:2]
    assert header[0].startswith("# lrattn_cloze: written by") and "trained window of 32 tokens" in header[1]
    # tiny's 32-token window holds no 12-word choice: the items stay whole, and the terminal says so
    assert "do not fit the trained window of 32 tokens" in said.err
    assert main(["eval", "--checkpoint", str(trained["ckpt"]), "--write_tasks", str(out)]) == 0  # its own folder
    capsys.readouterr()
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--write_tasks", str(out))
    assert err.strip().count("\n") == 0 and "'notes.txt'" in err and "new or empty folder" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert "is a file" in eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--write_tasks", str(out / "notes.txt"))
    err = eval_error(capsys, "--checkpoint", str(trained["ckpt"]), "--tasks", "hellaswag", "--write_tasks", str(tmp_path / "n"))
    assert "--tasks local" in err and not (tmp_path / "n").exists()

"""`lrattn export`: a checkpoint as a transformers folder, loaded for real and scored by lm-eval's own CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import randomize_routing
from test_training import tiny_data  # noqa: F401  (the fixture)

from lrattn_lightning.data.tokenizer import ByteTokenizer
from lrattn_lightning.model.config import ModelConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.generate import generate
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.export import export_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
REGISTRY = load_registry()
ENTRIES = ["baseline", "attnres-block-n8", "s-lr-block-n8-r64", "p-lr-block-n8-r32", "vp-lr-block-n8-r32",
           "vp-shared-lr-block-n8-r32", "p-lr-block-n8-r32-dynquery", "p-lr-block-n8-r32-projstatic-embkey",
           "gated-residual"]


def make_checkpoint(path: Path, name: str, *, seq_len: int = 64, doc_separator: int | None = None) -> torch.nn.Module:
    """A checkpoint in `lrattn fit`'s format (model_config, state_dict under model.*, tokenizer spec)."""
    size = dataclasses.replace(REGISTRY.size("tiny"), seq_len=seq_len, name=f"tiny-{seq_len}")
    cfg = ModelConfig(size, fit_to_size(REGISTRY.ablation(name), size))
    model = build_decoder(cfg)
    if cfg.ablation.routing == "attnres":
        randomize_routing(model)
    torch.save({"hyper_parameters": {"model_config": cfg.to_dict(), "document_masking": doc_separator is not None,
                                     "doc_separator": doc_separator},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "tokenizer": {"kind": "byte"}, "global_step": 7}, path)
    model.doc_separator = doc_separator
    return model.eval()


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True)
    return model.eval(), AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


@pytest.mark.parametrize("name", ENTRIES)
def test_exported_model_gives_our_logits(tmp_path, name):
    ours = make_checkpoint(tmp_path / "last.ckpt", name)
    folder = export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "modeling_lrattn.py", "tokenizer.json",
            "generation_config.json"} <= {p.name for p in folder.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf-")]  # no staging folder left
    model, _ = load_hf(folder)
    idx = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, ours(idx), rtol=1e-5, atol=1e-5)
        # a left-padded batch: each row's real tokens score as if alone
        mask = torch.ones_like(idx)
        mask[1, :6] = 0
        padded = model(idx, attention_mask=mask).logits
        torch.testing.assert_close(padded[1, 6:], ours(idx[1:, 6:])[0], rtol=1e-5, atol=1e-5)


def test_generate_and_tokenizer_match_ours(tmp_path):
    ours = make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64")
    model, tok = load_hf(export_hf(tmp_path / "last.ckpt", tmp_path / "hf"))
    byte = ByteTokenizer()
    for text in ["Hello, world", "naïve café — ünïcödé ✓", "tabs\tand\nnewlines  ", "ends <|endoftext|> here"]:
        assert tok(text)["input_ids"] == byte.encode(text)
        assert tok.decode(byte.encode(text)) == text
    assert tok.eos_token_id == byte.eos_id == model.config.eos_token_id
    prompt = torch.tensor([byte.encode("def f(x):")])
    with torch.no_grad():
        hf = model.generate(prompt, max_new_tokens=12, do_sample=False)[:, prompt.shape[1]:]
    assert hf.tolist() == generate(ours, prompt, 12).tolist()  # our KV-cache generation, same tokens


def test_document_masking_travels(tmp_path):
    ours = make_checkpoint(tmp_path / "last.ckpt", "p-lr-block-n8-r32", doc_separator=256)
    model, _ = load_hf(export_hf(tmp_path / "last.ckpt", tmp_path / "hf"))
    assert model.config.doc_separator == 256 and model.model.doc_separator == 256
    idx = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    idx[0, 10] = 256
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, ours(idx), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(idx).logits[:, 10:], ours(idx[:, 10:]), rtol=1e-5, atol=1e-5)


def test_export_refuses_a_non_empty_folder_and_bad_checkpoints(tmp_path, capsys):
    from lrattn_lightning.tools.export import main

    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    assert main(["--checkpoint", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--out" in err and "--overwrite" in err
    assert (tmp_path / "taken" / "x").read_text() == "keep me"
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    assert main(["--checkpoint", str(tmp_path / "junk.ckpt"), "--out", str(tmp_path / "new")]) == 2
    assert "junk.ckpt" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_lm_eval_cli_scores_the_export(tmp_path, tiny_data):  # noqa: F811
    """lm-eval's own command line (`--model hf`) scores the exported folder on the offline tasks."""
    from lrattn_lightning.eval.tasks import materialise_local_tasks

    make_checkpoint(tmp_path / "last.ckpt", "p-lr-block-n8-r32", seq_len=512)
    folder = export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    materialise_local_tasks(["lrattn_cloze", "lrattn_ppl"], tiny_data, tasks)
    lm_eval = Path(sys.executable).with_name("lm_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True,dtype=float32",
         "--tasks", "lrattn_cloze,lrattn_ppl", "--include_path", str(tasks), "--limit", "6", "--device", "cpu",
         "--batch_size", "4", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["lrattn_cloze"]["acc,none"] <= 1.0
    assert 1.0 < results["lrattn_ppl"]["bits_per_byte,none"] < 20.0


def test_the_trained_window_is_the_exported_context_length(tmp_path):
    """A run trained with `--data.seq_len 16` on a 64-position size: HF and lm-eval see a 16-token window."""
    make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64")
    raw = torch.load(tmp_path / "last.ckpt", weights_only=True)
    raw["data"] = {"data_dir": None, "source": None, "seq_len": 16}
    torch.save(raw, tmp_path / "last.ckpt")
    out = export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 16
    assert json.loads((out / "generation_config.json").read_text())["max_length"] == 16

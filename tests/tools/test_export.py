"""`lrattn export`: a checkpoint as a transformers folder, loaded for real and scored by lm-eval's own CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.models import make_checkpoint

from lrattn_lightning.data.tokenizer import ByteTokenizer
from lrattn_lightning.model.generate import generate
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.export import export_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
REGISTRY = load_registry()
ENTRIES = ["baseline", "attnres-block-n8", "s-lr-block-n8-r64", "p-lr-block-n8-r32", "vp-lr-block-n8-r32",
           "vp-shared-lr-block-n8-r32", "p-lr-block-n8-r32-dynquery", "p-lr-block-n8-r32-projstatic-embkey",
           "gated-residual", "muddformer-ppn", "value-residual-learned", "laurel", "frac-connections-m2",
           "delta-attnres-block"]


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


def test_lm_eval_cli_scores_the_export(tmp_path, tiny_data, capsys):  # noqa: F811
    """lm-eval's own command line (`--model hf`) scores the exported folder on the offline tasks that
    `lrattn eval --write_tasks` wrote for the checkpoint: every cloze request fits the 256-token window, so
    lm-eval truncates none (it warned "exceeds model's maximum length" for each choice of each item)."""
    from lrattn_lightning.cli import main

    make_checkpoint(tmp_path / "last.ckpt", "p-lr-block-n8-r32", seq_len=256)
    raw = torch.load(tmp_path / "last.ckpt", weights_only=True)
    raw["data"] = {"data_dir": str(tiny_data), "source": "stdlib-docs", "seq_len": 256}
    torch.save(raw, tmp_path / "last.ckpt")
    folder = export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    tasks = tmp_path / "tasks"
    assert main(["eval", "--checkpoint", str(tmp_path / "last.ckpt"), "--write_tasks", str(tasks)]) == 0
    assert f"--include_path {tasks}" in capsys.readouterr().out
    items = [json.loads(line) for line in (tiny_data / "tasks/cloze.jsonl").read_text().splitlines()]
    longest = [max(len((it["context"] + " " + c).encode()) for c in it["choices"]) for it in items[:6]]
    assert min(longest) > 257, longest  # as prepared, each of the scored items is longer than the window
    lm_eval = Path(sys.executable).with_name("lm_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True,dtype=float32",
         "--tasks", "lrattn_cloze,lrattn_ppl", "--include_path", str(tasks), "--limit", "6", "--device", "cpu",
         "--batch_size", "4", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exceeds model's maximum length" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
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
    # the window is not also generation_config's max_length: generate(max_new_tokens=...) would warn each time
    assert "max_length" not in json.loads((out / "generation_config.json").read_text())


# Loads the export as a user would, in a fresh interpreter with no terminal to answer a prompt.
LOAD_AND_GENERATE = """
import sys, warnings
warnings.simplefilter("always")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
stock = PreTrainedTokenizerFast.from_pretrained(folder)  # no remote code at all
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
ids = torch.tensor([tok("def f(x):")["input_ids"]])
assert stock("def f(x):")["input_ids"] == ids[0].tolist()
new = model.generate(ids, max_new_tokens=8)[0, ids.shape[1]:]
print(len(new), type(stock).__name__)
"""


def test_the_export_loads_and_generates_without_warnings(tmp_path):
    """The tokenizer is a stock class (no auto_map of ours); the model's own code loads and generates
    without a warning: no "model of type lrattn to instantiate", no max_new_tokens-and-max_length."""
    make_checkpoint(tmp_path / "last.ckpt", "s-lr-block-n8-r64")
    out = export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in tok_config
    assert "AutoTokenizer" not in json.loads((out / "config.json").read_text())["auto_map"]
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, str(out)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "warning"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "8", proc.stdout  # 8 new tokens
    # what is left on stderr: transformers' weight-loading progress bar, nothing else
    noise = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()
             and not line.startswith("Loading weights")]
    assert noise == [], noise


# ---- --out safety: only ever replace a previous export, atomically, with the umask's modes -----------------------
def lrattn_export(*args: str, cwd: Path, preexec=None) -> subprocess.CompletedProcess:
    """`lrattn export ...` as a real process (a real umask, a real file-size limit)."""
    return subprocess.run([sys.executable, "-m", "lrattn_lightning.cli", "export", *args], cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=preexec,
                          capture_output=True, text=True, timeout=300)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def no_temp_folders(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".") and ("-export-" in p.name or "-old-" in p.name)]


@pytest.mark.parametrize("out", [".", "..", "/", "HOME", "D", "D/..", "taken", "half"])
def test_overwrite_refuses_any_folder_an_export_did_not_write(tmp_path, monkeypatch, capsys, out):
    """The working folder, its parents, home, /, the checkpoint's folder, a folder with a foreign file (with or
    without the marker): one line, exit 2, and every file there byte for byte as it was."""
    from lrattn_lightning.cli import main

    work = tmp_path / "work"
    (work / "D").mkdir(parents=True)
    make_checkpoint(work / "D" / "last.ckpt", "baseline")
    (work / "notes.txt").write_text("mine")
    (work / "taken").mkdir()
    (work / "taken" / "results.csv").write_text("a,b\n")
    export_hf(work / "D" / "last.ckpt", work / "half")  # a real export, plus a file of the user's in it
    (work / "half" / "README.md").write_text("my notes")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work))
    before = snapshot(work)
    assert main(["export", "--checkpoint", "D/last.ckpt", "--out", str(work) if out == "HOME" else out,
                 "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--out" in err, err
    expected = {"taken": "'results.csv'", "half": "'README.md'", "D": "checkpoint", ".": "working folder",
                "D/..": "working folder", "HOME": "working folder", "/": "filesystem root"}.get(out, "parent of the working folder")
    assert expected in err, err
    assert snapshot(work) == before and no_temp_folders(work)


def test_home_and_its_parents_are_refused(tmp_path, monkeypatch, capsys):
    from lrattn_lightning.tools.export import main

    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    (tmp_path / "users" / "me").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "users" / "me"))
    for out, said in [(tmp_path / "users" / "me", "the home folder"), (tmp_path / "users", "parent of the home")]:
        assert main(["--checkpoint", str(tmp_path / "last.ckpt"), "--out", str(out), "--overwrite"]) == 2
        assert said in capsys.readouterr().err
    assert (tmp_path / "users" / "me").is_dir()


@pytest.mark.parametrize("out", ["file.txt/sub", "file.txt/a/b", "file.txt"])
def test_out_at_or_under_a_file_is_one_line(tmp_path, monkeypatch, capsys, out):
    from lrattn_lightning.cli import main

    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    (tmp_path / "file.txt").write_text("keep")
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--checkpoint", "last.ckpt", "--out", out, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "file.txt" in err and "not a folder" in err, err
    assert (tmp_path / "file.txt").read_text() == "keep" and no_temp_folders(tmp_path)


def test_overwrite_replaces_a_previous_export_whole(tmp_path):
    """The marker names what an export wrote; --overwrite swaps in the new export and drops the old one's files
    (here one an older version wrote), leaving no temporary folder; the result loads."""
    from lrattn_lightning.tools.export import MARKER

    make_checkpoint(tmp_path / "a.ckpt", "baseline")
    ours = make_checkpoint(tmp_path / "b.ckpt", "s-lr-block-n8-r64")
    out = export_hf(tmp_path / "a.ckpt", tmp_path / "hf")
    listed = json.loads((out / MARKER).read_text())["files"]
    assert set(listed) == {p.name for p in out.iterdir()} - {MARKER}
    (out / "legacy.bin").write_bytes(b"old")  # an older export's file, named in its marker
    (out / MARKER).write_text(json.dumps({"written_by": "lrattn export", "files": [*listed, "legacy.bin"]}))
    with pytest.raises(Exception, match="previous export; pass --overwrite"):
        export_hf(tmp_path / "b.ckpt", out)
    export_hf(tmp_path / "b.ckpt", out, overwrite=True)
    assert not (out / "legacy.bin").exists() and no_temp_folders(tmp_path)
    assert json.loads((out / "config.json").read_text())["model_config"]["ablation"]["name"].startswith("s-lr-block-n8-r64")
    model, _ = load_hf(out)
    idx = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, ours(idx), rtol=1e-5, atol=1e-5)


def _file_size_limit() -> None:
    """In the child: files past 64 KiB fail with EFBIG (SIGXFSZ ignored), so the 200 KiB model.safetensors
    fails midway through the export, after the temporary folder exists."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_write_failing_midway_leaves_the_previous_export(tmp_path):
    make_checkpoint(tmp_path / "a.ckpt", "baseline")
    make_checkpoint(tmp_path / "b.ckpt", "s-lr-block-n8-r64")
    export_hf(tmp_path / "a.ckpt", tmp_path / "hf")
    before = snapshot(tmp_path / "hf")
    proc = lrattn_export("--checkpoint", "b.ckpt", "--out", "hf", "--overwrite", cwd=tmp_path,
                         preexec=_file_size_limit)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "File too large" in proc.stderr and "previous export is unchanged" in proc.stderr
    assert snapshot(tmp_path / "hf") == before and no_temp_folders(tmp_path)
    # a new --out: neither it nor the parents made for it are left behind
    proc = lrattn_export("--checkpoint", "b.ckpt", "--out", "new/deep/hf", cwd=tmp_path, preexec=_file_size_limit)
    assert proc.returncode == 1 and "nothing was written" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists() and no_temp_folders(tmp_path)


def test_a_failed_rename_in_puts_the_old_export_back(tmp_path):
    """The swap's second rename failing for real (its source is gone): the old export is renamed back."""
    from lrattn_lightning.tools.export import _swap_in

    make_checkpoint(tmp_path / "a.ckpt", "baseline")
    export_hf(tmp_path / "a.ckpt", tmp_path / "hf")
    before = snapshot(tmp_path / "hf")
    with pytest.raises(FileNotFoundError):
        _swap_in(tmp_path / ".hf-export-gone", tmp_path / "hf")
    assert snapshot(tmp_path / "hf") == before and no_temp_folders(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_an_unwritable_parent_is_refused_before_any_work(tmp_path, capsys):
    from lrattn_lightning.tools.export import main

    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    (tmp_path / "ro").mkdir(mode=0o555)
    assert main(["--checkpoint", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "ro" / "hf")]) == 2
    assert "permission denied" in capsys.readouterr().err and not list((tmp_path / "ro").iterdir())


@pytest.mark.parametrize(("umask", "folder", "file"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)],
                         ids=["umask-022", "umask-077"])
def test_the_export_gets_the_modes_the_umask_gives(tmp_path, umask, folder, file):
    """Not a temporary folder's 0700 nor safetensors' 0600: other users can load a 022 export."""
    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    proc = lrattn_export("--checkpoint", "last.ckpt", "--out", "hf", cwd=tmp_path, preexec=lambda: os.umask(umask))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "hf"
    assert out.stat().st_mode & 0o777 == folder
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {file}, modes

"""`lrattn bench` on the tiny size: it runs every phase and mode and writes the JSON it promises."""

from __future__ import annotations

import json

import pytest
import torch

from lrattn_lightning import cli
from lrattn_lightning.tools.bench import bench

torch.set_num_threads(1)

ROW_FIELDS = {
    "mode", "ablation", "impl", "median_step_s", "step_times_s", "tokens_per_s", "ratio_to_baseline",
    "ratios_per_pair", "ratio_quartiles", "peak_mem_bytes", "mem_ratio", "peak_rss_bytes", "rss_ratio", "model_flops_per_step",
    "achieved_flops", "mfu", "traffic", "floor_s", "overhead_s", "routing_efficiency", "profile",
}
META_FIELDS = {"date", "command", "size", "baseline", "phase", "impl", "batch_size", "seq_len", "steps", "warmup",
               "dtype", "device", "device_name", "threads", "torch", "peak_flops", "peak_flops_source", "memory",
               "git_commit", "registry_sha256", "bandwidth_bytes_per_s", "bandwidth_source", "step", "optimizer"}
TINY = ["--size", "tiny", "--fit", "--batch-size", "2", "--seq-len", "16", "--threads", "1", "--device", "cpu"]


def _run(tmp_path, *args: str) -> dict:
    path = tmp_path / "bench.json"
    assert bench.main([*TINY, "--json", str(path), *args]) == 0
    report = json.loads(path.read_text())
    assert META_FIELDS <= report["meta"].keys()
    for row in report["results"]:
        assert ROW_FIELDS <= row.keys()
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0
        assert row["achieved_flops"] > 0 and 0 < row["mfu"] < 1
    return report


def test_train_eager(tmp_path, capsys):
    # 32 tokens a row: at 16 the step's peak is AdamW's temporaries, not the activations routing adds to
    # (the fused loss no longer holds float32 copies of the logits through the backward)
    report = _run(tmp_path, "--ablations", "s-lr-block-n8-r64,attnres-full", "--steps", "3", "--warmup", "1",
                  "--peak-flops", "1e11", "--seq-len", "32")
    rows = {r["ablation"]: r for r in report["results"]}
    assert list(rows) == ["baseline", "s-lr-block-n8-r64", "attnres-full"]
    base = rows["baseline"]
    assert base["ratio_to_baseline"] == 1.0 and base["mem_ratio"] == 1.0 and base["peak_rss_bytes"] is None
    for name in ("s-lr-block-n8-r64", "attnres-full"):
        row = rows[name]
        assert len(row["ratios_per_pair"]) == 3 and row["ratio_to_baseline"] > 0
        assert row["peak_mem_bytes"] > base["peak_mem_bytes"] and row["mem_ratio"] > 1.0  # routing costs memory
    assert len(base["step_times_s"]) == 2 * 3  # the baseline runs before each ablation in every round
    assert report["meta"]["peak_flops_source"] == "given" and report["meta"]["peak_flops"] == 1e11
    table = capsys.readouterr().out
    assert "s-lr-block-n8-r64" in table and "x base" in table


def test_peak_rss_of_a_fresh_process(tmp_path):
    report = _run(tmp_path, "--ablations", "baseline", "--steps", "1", "--warmup", "1", "--memory", "alloc,rss")
    (row,) = report["results"]
    assert row["peak_rss_bytes"] > 50 * 2**20 and row["rss_ratio"] == 1.0  # at least the interpreter and torch
    assert "RSS" in report["meta"]["memory"]


@pytest.mark.parametrize("phase", ["forward", "generate"])
def test_inference_phases(tmp_path, phase):
    report = _run(tmp_path, "--phase", phase, "--ablations", "p-lr-block-n8-r32", "--steps", "2", "--warmup", "1",
                  "--prompt-len", "4", "--new-tokens", "6")
    assert report["meta"]["phase"] == phase
    assert [r["ablation"] for r in report["results"]] == ["baseline", "p-lr-block-n8-r32"]
    if phase == "generate":
        assert report["results"][0]["tokens_per_s"] == pytest.approx(2 * 6 / report["results"][0]["median_step_s"])


def test_compile_mode(tmp_path):
    """The compiled train step (aot_eager backend: no Inductor codegen, to stay fast)."""
    report = _run(tmp_path, "--mode", "compile", "--compile-backend", "aot_eager", "--ablations", "baseline",
                  "--steps", "2", "--warmup", "1", "--inductor", "cpp_wrapper=false")
    assert report["meta"]["inductor_options"] == {"cpp_wrapper": False}
    assert [(r["mode"], r["ablation"]) for r in report["results"]] == [("compile", "baseline")]
    assert report["meta"]["compile_backend"] == "aot_eager"


def test_cli_subcommand_and_bad_names(tmp_path):
    path = tmp_path / "out.json"
    assert cli.main(["bench", *TINY, "--ablations", "attnres-block-n4", "--steps", "1", "--warmup", "0",
                     "--memory", "none", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["results"][1]["peak_mem_bytes"] is None
    with pytest.raises(ValueError, match="no-such-ablation"):
        bench.main([*TINY, "--ablations", "no-such-ablation", "--json", str(path)])
    with pytest.raises(ValueError, match="no option 'no_such_option'"):
        bench.main([*TINY, "--inductor", "no_such_option=1", "--ablations", "baseline", "--json", str(path)])


def test_generate_compile_mode_decodes_with_the_static_cache(tmp_path):
    """--phase generate --mode compile: the static KV cache and its compiled decode step (it was refused)."""
    report = _run(tmp_path, "--phase", "generate", "--mode", "compile", "--compile-backend", "aot_eager",
                  "--ablations", "s-lr-block-n8-r64", "--steps", "1", "--warmup", "1", "--prompt-len", "4",
                  "--new-tokens", "6")
    assert [(r["mode"], r["ablation"]) for r in report["results"]] == [("compile", "baseline"),
                                                                       ("compile", "s-lr-block-n8-r64")]
    assert all(r["tokens_per_s"] > 0 for r in report["results"])


def test_roofline_columns_and_profile_without_kineto_noise(tmp_path, capfd):
    """Every ablation row carries its analytic traffic, floor and efficiency; --profile adds per-op deltas;
    the profiler's USDT start/stop lines do not reach the output."""
    report = _run(tmp_path, "--ablations", "s-lr-block-n8-r64", "--steps", "2", "--warmup", "1", "--clock", "cpu",
                  "--profile", "1")
    base, row = report["results"]
    assert base["routing_efficiency"] is None and base["traffic"]["net_bytes"] == 0
    assert row["traffic"]["net_bytes"] > 0 and row["floor_s"] > 0
    if row["overhead_s"] > 0:
        assert row["routing_efficiency"] == pytest.approx(row["floor_s"] / row["overhead_s"])
    assert report["meta"]["bandwidth_bytes_per_s"] > 0 and "cpu clock" in report["meta"]["bandwidth_source"]
    assert "cpu clock" in report["meta"]["peak_flops_source"]
    assert row["profile"] and {"op", "delta_ms", "calls"} <= row["profile"][0].keys()
    out, err = capfd.readouterr()
    assert "USDT" not in out + err and "profiler_start" not in out + err
    assert "eff" in out and "floor ms" in out


def test_mfu_above_100_percent_is_an_error(tmp_path):
    path = tmp_path / "bench.json"
    with pytest.raises(RuntimeError, match="MFU above 100"):
        bench.main([*TINY, "--ablations", "baseline", "--steps", "1", "--warmup", "0", "--memory", "none",
                    "--peak-flops", "1e3", "--json", str(path)])
    assert json.loads(path.read_text())["results"][0]["mfu"] > 1  # written before the error


def test_train_step_is_the_modules_own(tmp_path, monkeypatch):
    """The train phase calls LRAttnModule.training_step, with the optimiser `--optimizer` names (Muon + AdamW here)."""
    from lrattn_lightning.train.lit_module import LRAttnModule

    calls = []
    original = LRAttnModule.training_step

    def counting(self, batch, batch_idx):
        calls.append(self.hparams.optimizer)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(LRAttnModule, "training_step", counting)
    report = _run(tmp_path, "--optimizer", "muon_adamw", "--ablations", "s-lr-block-n8-r64", "--steps", "1",
                  "--warmup", "1", "--memory", "alloc")
    assert report["meta"]["step"] == "module" and report["meta"]["optimizer"] == "muon_adamw"
    assert calls and set(calls) == {"muon_adamw"}
    assert len(calls) == 2 * 1 + 2 * 1 + 2  # warm-up, the timed round (B A), the memory step of each
    base, row = report["results"]
    assert row["peak_mem_bytes"] > 0 and row["median_step_s"] > 0

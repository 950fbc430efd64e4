"""benchmarks/gpu-check's anchor: litgpt's GPT at our baseline's shape, trained as `litgpt pretrain` trains it.

What a researcher would run instead of `lrattn fit` is `litgpt pretrain`. This arm builds litgpt's own `GPT` (its
model.py and config.py, unchanged) at the registry size's shape: pre-norm, RMSNorm, RoPE at our theta, QK-norm,
SwiGLU of our width, no biases, untied head, vocabulary padded as litgpt pads it (to a multiple of 512); and runs
its pretraining step: Fabric bf16-mixed, logits, `chunked_cross_entropy` (litgpt.utils; 128-row chunks), backward,
gradient clipping at 1.0, AdamW fused on CUDA (pretrain.py's `fused`), zero_grad; compiled as pretrain compiles
it (`torch.compile(model)`).

litgpt's package __init__ imports its whole API (tokenizers, the HF hub, jsonargparse...), which the GPU machine
need not have: the package's modules are loaded under a bare package module instead, and where litgpt.utils or
its HF-checkpoint helper cannot be imported there, the helper (used only to load HF weights) is a stub that raises
and the loss is the same 128-row chunked cross-entropy written here; `source` in the report says which ran.
Carry the wheel: `pip download --no-deps litgpt==0.5.13 -d .whl`, then `--wheels .whl`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

CHUNK = 128  # litgpt.utils.chunked_cross_entropy's default rows per chunk
PAD = 512  # litgpt Config's default padding_multiple


def load() -> tuple[type, type, object, str]:
    """(Config, GPT, chunked_cross_entropy, where the loss came from) of the litgpt on sys.path; ImportError
    (with what to do) where there is none."""
    loaded = sys.modules.get("litgpt")
    if loaded is None or not hasattr(loaded, "__path__"):
        spec = importlib.util.find_spec("litgpt")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("litgpt is not installed: carry its wheel (pip download --no-deps litgpt==0.5.13 "
                              "-d .whl) and pass --wheels .whl")
        package = types.ModuleType("litgpt")  # its modules without its __init__ (the whole API)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["litgpt"] = package
    try:
        utils = importlib.import_module("litgpt.utils")
        loss, source = utils.chunked_cross_entropy, "litgpt.utils.chunked_cross_entropy"
    except Exception:
        loss, source = chunked_cross_entropy, "128-row chunked cross-entropy (litgpt.utils not importable here)"
    try:
        importlib.import_module("litgpt.scripts.convert_hf_checkpoint")
    except Exception:  # its HF-weights helper only: model.py imports one name from it
        stub = types.ModuleType("litgpt.scripts.convert_hf_checkpoint")

        def qkv_reassemble(*args, **kwargs):
            raise RuntimeError("loading HF weights is not part of the GPU check")

        stub.qkv_reassemble = qkv_reassemble
        sys.modules[stub.__name__] = stub
    config = importlib.import_module("litgpt.config")
    model = importlib.import_module("litgpt.model")
    return config.Config, model.GPT, loss, source


def chunked_cross_entropy(logits, targets, chunk_size: int = CHUNK):
    """Mean cross-entropy over [.., V] logits, computed over `chunk_size`-row pieces (as litgpt's default)."""
    import torch
    import torch.nn.functional as F

    logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    pieces = [F.cross_entropy(x, y, reduction="none") for x, y in
              zip(logits.split(chunk_size), targets.split(chunk_size), strict=True)]
    return torch.cat(pieces).mean()


def config(Config, cfg, pad: int = PAD):
    """litgpt's Config at the shape of our ModelConfig `cfg`'s size (our baseline's)."""
    s = cfg.size
    return Config(name=f"lrattn-{s.name}", block_size=s.seq_len, vocab_size=s.vocab_size, padding_multiple=pad,
                  n_layer=s.n_layers, n_head=s.n_heads, n_embd=s.d_model, n_query_groups=s.n_heads,
                  head_size=s.d_model // s.n_heads, rotary_percentage=1.0, rope_base=int(s.rope_theta),
                  parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=1e-6,
                  mlp_class_name="LLaMAMLP", intermediate_size=s.d_mlp, norm_qk=True)


def train_step(cfg, batch, mode: str, backend: str, mark=None):
    """litgpt pretrain's step on `batch` [B, T + 1] (its device's): -> (step, model, optimizer, source)."""
    import torch
    from lightning.fabric import Fabric

    Config, GPT, loss_fn, source = load()
    device = batch.device
    fabric = Fabric(accelerator=device.type, devices=1, precision="bf16-mixed")
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config(Config, cfg))
    core = model
    if mode == "compile":
        model = torch.compile(model, backend=backend)  # pretrain.py compiles the model, not the loss
    model = fabric.setup(model)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1,
                                                          betas=(0.9, 0.95), **fused))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    at = mark or (lambda phase: None)

    def step() -> None:
        at("forward")
        logits = model(inputs)
        at("loss")
        loss = loss_fn(logits, targets)
        at("backward")
        fabric.backward(loss)
        at("optimizer")
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        at("end")

    return step, core, optimizer, source

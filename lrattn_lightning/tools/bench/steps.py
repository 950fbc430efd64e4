"""What `lrattn bench` times: one step of each phase, built from the package's own code.

    train      `module_train_step`: LRAttnModule.training_step under Fabric, Fabric's backward and the
               module's own optimiser (`make_optimizer`, the one `configure_optimizers` returns, without its
               LR schedule): the step `lrattn fit` runs, without the hooks around it (grad-norm and
               throughput logging). Compile mode compiles as `configure_model` does (`LRAttnModule.compile_step`: the decoder, and the loss with it).
    forward    the decoder's forward of a full sequence under inference mode
    generate   `model.generate.generate`: greedy decoding with the KV cache, a prompt then one token at a time
               (--mode compile: the static cache and its compiled decode step)

Each step comes with its tokens and model FLOPs (`accounting.model_flops_per_token` at the sequence run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from lrattn_lightning.core.errors import InputError

OPTIMIZERS = ("adamw", "muon_adamw")  # LRAttnModule's `optimizer` choices


@dataclasses.dataclass
class Subject:
    """One model under test, its step function and what one step amounts to."""

    name: str
    cfg: Any
    model: Any
    step: Callable[[], None]
    tokens_per_step: int
    flops_per_step: float
    optimizer: Any = None
    times: list[float] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)


def model_config(args, reg, ablation: str):
    """The registry's (size, ablation) config; with --fit, rank and block count clipped to the size."""
    from lrattn_lightning.model.config import ModelConfig, fit_to_size

    if args.fit:
        size = reg.size(args.size)
        return ModelConfig(size, fit_to_size(reg.ablation(ablation), size))
    return reg.model(args.size, ablation)


def size_for(cfg, seq_len: int):
    """The config with seq_len replaced (for FLOPs of the sequence actually run)."""
    from lrattn_lightning.model.config import ModelConfig

    return ModelConfig(dataclasses.replace(cfg.size, seq_len=seq_len), cfg.ablation)


def train_flops(cfg, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step over batch x seq_len tokens."""
    from lrattn_lightning.model.accounting import model_flops_per_token

    return model_flops_per_token(size_for(cfg, seq_len), training=True) * batch * seq_len


def build_module(cfg, impl: str = "fast", optimizer: str = "adamw"):
    """The LightningModule `lrattn fit` trains, built from the resolved ModelConfig (the module's defaults
    otherwise; nothing read from the registry or git)."""
    from lrattn_lightning.train.lit_module import LRAttnModule
    from lrattn_lightning.train.settings import OptimiserSettings, RuntimeSettings

    return LRAttnModule.from_config(cfg, OptimiserSettings(optimizer=optimizer), RuntimeSettings(impl=impl))


def module_train_step(module, batch, dtype, mode: str = "eager", backend: str = "inductor",
                      mark: Callable[[str], None] | None = None) -> tuple[Callable[[], None], Any]:
    """One training step of `module` on `batch` [B, T + 1], repeated at every call: training_step under Fabric
    (no loggers; bfloat16 as Fabric's bf16-mixed: autocast, float32 parameters), backward, the module's
    on_before_optimizer_step (the step's loss, the gradient norm) and its own optimiser. -> (step, optimizer).

    mark(phase), when given, is called where each phase starts ("forward": training_step, the loss with it;
    "backward"; "optimizer") and at the step's "end" (benchmarks/gpu-check's profile times the phases)."""
    import torch
    from lightning.fabric import Fabric

    precision = "bf16-mixed" if dtype == torch.bfloat16 else "32-true"
    fabric = Fabric(accelerator=batch.device.type, devices=1, precision=precision)
    wrapped, optimizer = fabric.setup(module, module.make_optimizer())
    if mode == "compile":
        module.compile_step(backend)  # what configure_model does, with the chosen backend
    batch = batch.to(fabric.device)
    batch_idx = itertools.count()

    at = mark or (lambda phase: None)

    def step() -> None:
        at("forward")
        with fabric.autocast():
            loss = wrapped.training_step(batch, next(batch_idx))
        at("backward")
        fabric.backward(loss)
        at("optimizer")
        module.on_before_optimizer_step(optimizer)  # as the Trainer calls it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        at("end")

    return step, optimizer


def _autocast(device, dtype):
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_subject(args, reg, ablation: str, mode: str, device, dtype) -> Subject:
    """The subject of `args.phase` for one ablation, its weights and batch seeded by --seed."""
    import torch

    from lrattn_lightning.model.accounting import model_flops_per_token
    from lrattn_lightning.model.decoder import build_decoder
    from lrattn_lightning.model.routing.attnres import compile_impl

    cfg = model_config(args, reg, ablation)
    T = args.seq_len or cfg.size.seq_len
    B = args.batch_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx = torch.randint(0, cfg.size.vocab_size, (B, T + 1), generator=gen).to(device)
    torch.manual_seed(args.seed)
    impl = compile_impl(args.impl) if mode == "compile" else args.impl  # compiling asks for the compiled backend
    if args.phase == "train":
        module = build_module(cfg, impl, args.optimizer)
        step, opt = module_train_step(module, idx, dtype, mode, args.compile_backend)
        return Subject(ablation, cfg, module.model, step, B * T, train_flops(cfg, B, T), optimizer=opt)

    model = build_decoder(cfg, impl=impl).to(device)
    if args.phase == "forward":
        fwd = torch.compile(model, backend=args.compile_backend) if mode == "compile" else model
        inputs = idx[:, :-1]

        def step() -> None:
            with torch.inference_mode(), _autocast(device, dtype):
                fwd(inputs)

        flops = model_flops_per_token(size_for(cfg, T), training=False) * B * T
        return Subject(ablation, cfg, model, step, B * T, flops)
    return _generate_subject(args, ablation, cfg, model, idx, mode, device, dtype)


def _generate_subject(args, ablation: str, cfg, model, idx, mode: str, device, dtype) -> Subject:
    """Greedy decoding with the KV cache: prefill the prompt, then --new-tokens tokens one by one. --mode compile:
    the static KV cache and its decode step compiled once (model/generate.py; CUDA graphs on CUDA)."""
    import torch

    from lrattn_lightning.model.accounting import model_flops_per_token
    from lrattn_lightning.model.generate import generate

    options = {"cache": "static", "compile": True, "compile_backend": args.compile_backend} if mode == "compile" else {}
    P, G = args.prompt_len, args.new_tokens
    if P + G > cfg.size.seq_len:
        raise InputError(f"--prompt-len + --new-tokens = {P + G} exceeds seq_len={cfg.size.seq_len}")
    prompt = idx[:, :P]

    def step() -> None:
        with torch.inference_mode(), _autocast(device, dtype):
            generate(model, prompt, G, **options)

    # decode FLOPs: the forward of one token attending over its context (the mean context of the run)
    per_token = model_flops_per_token(size_for(cfg, 1), training=False)
    mean_ctx = P + (G - 1) / 2
    attention = 2 * 2 * cfg.size.n_layers * cfg.size.d_model * mean_ctx
    B = idx.shape[0]
    return Subject(ablation, cfg, model, step, B * G, (per_token + attention) * B * G)

"""benchmarks/gpu-check's arms: the field's fused operators as routers on our decoder (each only where its math
contract equals an entry's), the train steps it times, the batch search, the parity checks and the decode rates.
Imported by the script from its own folder; torch and lrattn_lightning are imported lazily, as there.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any


# ---- the fused operators of the field, as routers on our decoder -------------------------------------
def contract_mismatch(cfg, package: str) -> str | None:
    """Why `package`'s operator does not compute entry `cfg`'s routing (None: it does)."""
    from lrattn_lightning.model.routing.attnres.options import logit_scale

    if cfg.ablation.routing != "attnres":
        return f"routing={cfg.ablation.routing!r} (the operator has 'attnres')"
    a = cfg.options
    wanted = { "key_norm": "rms", "query": "static", "query_norm": False, "block_summary": "sum",
              "depth_heads": 1}
    for field_, value in wanted.items():
        if getattr(a, field_) != value:
            return f"{field_}={getattr(a, field_)!r} (the operator has {value!r})"
    if float(a.count_prior) != 0.0:
        return f"count_prior={a.count_prior} (the operator has no prior)"
    if logit_scale(cfg) != 1.0:
        return f"logit scale {logit_scale(cfg)} (the operator is called with scale 1)"
    keys = {"fast-attnres": ("value", "sliced"), "liger": ("value",), "flash-attn-res": ("value",),
            "fla": ("value",)}[package]
    if a.key_source not in keys or a.embedding_key != a.key_source:
        return f"key_source={a.key_source}, embedding_key={a.embedding_key} (the operator keys: {', '.join(keys)})"
    d = cfg.size.d_model
    if package == "flash-attn-res" and d & (d - 1):
        return f"d_model={d} (the operator needs a power of two)"
    return None


def load_operator(package: str, device) -> tuple[Any, str | None]:
    """(op(sources, query) -> h, None), or (None, why not)."""
    import torch

    if device.type != "cuda":
        return None, "CUDA only"
    try:
        if package == "fast-attnres":
            from attnres import __version__, attnres

            def op(sources, query):
                return attnres([s.to(torch.bfloat16) for s in sources], query.to(torch.bfloat16))

            return op, f"fast-attnres {__version__}"
        if package == "flash-attn-res":
            from flash_attn_res import phase_1_batched_attention_triton_op as phase_1

            def op(sources, query):  # one stacked [S, B, T, D] tensor, G = 1 query, eps 2^-23; bf16 out
                out, _ = phase_1(torch.stack([s.to(torch.bfloat16) for s in sources]), query[None].float(), 2.0**-23)
                return out[0]

            return op, "flash-attn-res 0.1.12 (phase 1 over every source of a read)"
        if package == "fla":
            from fla.ops.attnres import fused_attnres

            ones_fla: dict = {}

            def op(sources, query):  # weight-free key RMSNorm: rms_weight = ones; eps 2^-23, scale 1
                w = ones_fla.setdefault(query.device, torch.ones(query.shape[-1], device=query.device))
                return fused_attnres(query.float(), [s.to(torch.bfloat16) for s in sources], w, rms_eps=2.0**-23,
                                     scale=1.0)

            return op, "fla-core (fla.ops.attnres.fused_attnres)"
        from liger_kernel.ops.attn_res import LigerAttnResFunction

        ones: dict = {}

        def op(sources, query):  # weight-free RMSNorm: w_norm = ones in float32 (no rounding of the key)
            w = ones.setdefault(query.device, torch.ones(query.shape[-1], device=query.device))
            V = torch.stack([s.to(torch.bfloat16) for s in sources])
            return LigerAttnResFunction.apply(V, query.float(), w, 2.0**-23)

        return op, "liger-kernel"
    except Exception as e:  # ImportError, or a package that fails on this torch/triton
        return None, f"not available: {type(e).__name__}: {e}"


def package_router(cfg, op, source_dtype=None):
    """A router whose reads call `op(sources, query_j)`: the sources are the embedding (cast once to
    source_dtype when given: the packages take BF16 storage), the completed block sums (raw) and the current
    partial sum, in that order; keys are the package's business."""
    from lrattn_lightning.model.routing._math import PartialBlock
    from lrattn_lightning.model.routing.attnres.reference import ReferenceAttnRes

    class PackageState:
        def __init__(self, emb_BTD):
            self.embedding = emb_BTD  # site 0 reads the embedding as it is
            self.values, self.partial = [], PartialBlock()

    class PackageRouter(ReferenceAttnRes):
        def start(self, emb_BTD, *, record=False, cache=None, segments=None):
            state = PackageState(emb_BTD)
            state.values.append(emb_BTD.to(source_dtype) if source_dtype else emb_BTD)  # one cast, not one per read
            return state

        def write(self, state, i, out_BTE):
            state.partial.add(out_BTE[..., : self.d], None, i)
            if i in self.ends:
                state.values.append(state.partial.value)
                state.partial.clear()

        def read(self, state, j):
            if j == 0:
                return state.embedding
            sources = [*state.values, state.partial.value] if state.partial.count else list(state.values)
            return op(sources, self.queries[j - 1])

    return PackageRouter(cfg)


def build_model(cfg, impl: str, device, op=None, source_dtype=None):
    import torch

    from lrattn_lightning.model.decoder import build_decoder

    torch.manual_seed(0)
    with torch.device(device):
        model = build_decoder(cfg, impl="reference" if op else impl)
    return use_operator(model, cfg, device, op, source_dtype)


def use_operator(model, cfg, device, op=None, source_dtype=None):
    """`model` with its router replaced by one that calls `op` (same weights); as it is without an op."""
    if op is not None:
        router = package_router(cfg, op, source_dtype).to(device)
        router.load_state_dict(model.router.state_dict())
        model.router = router
    return model


# ---- steps ------------------------------------------------------------------------------------------------
class Arm:
    def __init__(self, name: str, entry: str, impl: str, mode: str, op=None, package: str | None = None,
                 attention: str | None = None):
        self.name, self.entry, self.impl, self.mode, self.op, self.package = name, entry, impl, mode, op, package
        self.attention = attention  # document masking through this attention path (None: plain causal windows)
        self.times: list[float] = []
        self.ratios: list[float] = []
        self.step = self.model = self.opt = self.batch = None
        self.peak_bytes: int | None = None
        self.source: str | None = None  # the litgpt arm: where its loss came from


def setup(arm: Arm, reg, args, device, batch: int, mark=None) -> None:
    """The arm's LightningModule (its router replaced by the package's operator for a package arm) and its
    train step under Fabric, bf16-mixed (tools/bench/steps.py); for the litgpt arm (impl "litgpt"), litgpt's GPT
    at the entry's shape and its pretraining step (gpu_check_litgpt.py). mark: the step's phase clock
    (gpu_check_profile.PhaseClock) or None."""
    import torch

    from lrattn_lightning.model.routing.attnres import compile_impl
    from lrattn_lightning.tools.bench.steps import build_module, module_train_step

    cfg = model_config(reg, args, arm.entry)
    if arm.impl == "litgpt":
        import gpu_check_litgpt

        idx = torch.randint(0, cfg.size.vocab_size - 1, (batch, args.seq_len + 1),
                            generator=torch.Generator().manual_seed(1)).to(device)
        arm.step, arm.model, arm.opt, arm.source = gpu_check_litgpt.train_step(cfg, idx, arm.mode,
                                                                               args.compile_backend, mark)
        arm.batch = idx
        return
    torch.manual_seed(0)
    impl = "reference" if arm.op else arm.impl
    if arm.mode == "compile":  # `fast` raises under Dynamo: without this the whole step fell back to eager
        impl = compile_impl(impl)
    with torch.device(device):
        module = build_module(cfg, impl, args.optimizer)
    use_operator(module.model, cfg, device, arm.op, torch.bfloat16 if arm.op else None)
    arm.model = module.model
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.size.vocab_size - 1, (batch, args.seq_len + 1), generator=gen)
    if arm.attention:  # packed documents: separators (the last id) at random places, one per doc_len on average
        separator = cfg.size.vocab_size - 1
        idx[torch.rand(idx.shape, generator=gen) < 1.0 / args.doc_len] = separator
        module.model.doc_separator, module.model.attention = separator, arm.attention
    idx = idx.to(device)
    arm.batch = idx
    arm.step, arm.opt = module_train_step(module, idx, torch.bfloat16, arm.mode, args.compile_backend, mark)


def release(arm: Arm) -> None:
    import torch

    arm.step = arm.model = arm.opt = arm.batch = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def static_bytes(arm: Arm) -> int:
    total = sum(p.numel() * p.element_size() for p in arm.model.parameters())
    for state in arm.opt.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "numel"))
    return total


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(arm: Arm, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    arm.step()
    sync(device)
    return time.perf_counter() - t0


def peak_of_step(arm: Arm, device, resident: int) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    arm.step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - resident


def model_config(reg, args, entry: str):
    from lrattn_lightning.model.config import ModelConfig, fit_to_size

    size = reg.size(args.size)
    return ModelConfig(size, fit_to_size(reg.ablation(entry), size)) if args.dry_run else reg.model(args.size, entry)


def flops_per_step(reg, args, entry: str, batch: int) -> float:
    """Model FLOPs of a train step (accounting.model_flops_per_token at the sequence run)."""
    from lrattn_lightning.tools.bench.steps import train_flops

    return train_flops(model_config(reg, args, entry), batch, args.seq_len)


def is_oom(e: BaseException) -> bool:
    return "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError"


def find_batch(reg, args, device) -> tuple[int, list[dict]]:
    """The largest batch (doubling, then one bisection) at which the baseline and attnres-full, both
    resident, each run a train step in eager mode."""
    if args.batch:
        return args.batch, []
    tried: list[dict] = []
    base = Arm("baseline", "baseline", "fast", "eager")
    hungry = Arm("attnres-full", "attnres-full", "fast", "eager")

    def fits(b: int) -> bool:
        ok = True
        try:
            for arm in (base, hungry):
                setup(arm, reg, args, device, b)
            for arm in (base, hungry):  # two steps: the second has the optimiser state from the start
                arm.step()
                arm.step()
            sync(device)
        except Exception as e:
            if not is_oom(e):
                raise
            ok = False
        finally:
            for arm in (base, hungry):
                release(arm)
        tried.append({"batch": b, "fits": ok})
        print(f"  batch {b}: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    good, bad, b = 0, None, 4
    while b <= args.max_batch:
        if not fits(b):
            bad = b
            break
        good, b = b, 2 * b
    if bad is not None and good and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
    if not good:
        for b in (2, 1):
            if fits(b):
                return b, tried
        raise RuntimeError("not even batch 1 fits")
    return good, tried


def parity(reg, args, device, entry: str, op, impl: str = "fast") -> dict:
    """Forward+backward of the package arm (op; without one: our `impl` backend) and of our fast router (both
    bf16 autocast) against our float32 reference router, with non-zero queries, on a small batch: relative L2
    errors, largest over tensors."""
    import torch
    import torch.nn.functional as F

    from lrattn_lightning.model.routing.attnres.options import key_dim

    cfg = model_config(reg, args, entry)
    T = min(args.seq_len, 256)
    idx = torch.randint(0, cfg.size.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(2)).to(device)
    results, weights = {}, None
    for label, backend, use_op, dtype in (("truth", "reference", None, torch.float32),
                                          ("ours", "fast", None, torch.bfloat16), ("package", impl, op, torch.bfloat16)):
        model = build_model(cfg, backend, device, use_op, torch.bfloat16 if use_op else None)
        if weights is None:
            with torch.no_grad():  # routing far from uniform, logits O(1): q ~ N(0, 1/r)
                model.router.queries.normal_(std=1.0 / key_dim(cfg)**0.5)
            weights = model.state_dict()
        model.load_state_dict(weights)
        ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        with ctx:
            logits = model(idx[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten()).backward()
        results[label] = {"logits": logits.detach().float(),
                          **{n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}}
        del model

    def err(x, t):
        return ((x - t).norm() / (t.norm() + 1e-12)).item()

    truth = results["truth"]
    worst = {"ours": 0.0, "package": 0.0}
    ok = True
    for key, t in truth.items():
        missing = torch.zeros_like(t)  # no gradient at all: an error of 1
        e_ours, e_pkg = err(results["ours"].get(key, missing), t), err(results["package"].get(key, missing), t)
        worst = {"ours": max(worst["ours"], e_ours), "package": max(worst["package"], e_pkg)}
        ok &= e_pkg <= 2 * e_ours + (2e-3 if key == "logits" else 2e-2)
    return {"ok": ok, "worst_rel_err_ours": worst["ours"], "worst_rel_err_package": worst["package"]}


DECODE_PATHS = {  # rows' arm prefix -> generate's options (model/generate.py); "" is today's dynamic KV cache
    "": {},
    "static": {"cache": "static"},
    "static-compiled": {"cache": "static", "compile": True},
}


def decode_rates(reg, args, device, impls: list[str], entries: list[str], spent=lambda: 0.0) -> list[dict]:
    """Greedy decoding with the KV cache (model/generate.py), batch 1, bf16 autocast: tokens/s per arm,
    rounds interleaved with the baseline; the ratio is the arm's time per token over the baseline's (today's
    dynamic cache). Beside each impl's rows, our default backend's baseline and entries with the static KV cache
    (`static:ENTRY`, eager) and its decode step compiled (`static-compiled:ENTRY`: fullgraph, static shapes,
    CUDA graphs on CUDA, --compile-backend; --dry-run: baseline and the first entry only); `ratio_to_path_baseline` is the time per token over the baseline's
    on the same path (issue 54: S-LR at most 1.3x, the compiled baseline at least 3x today's tokens/s).
    spent(): seconds of the run so far; an arm is skipped once it passes the budget."""
    import torch

    from lrattn_lightning.model.generate import generate

    prompt_len = max(1, args.seq_len // 16)
    n = min(args.decode_tokens, args.seq_len - prompt_len)
    prompt = torch.randint(0, 100, (1, prompt_len), generator=torch.Generator().manual_seed(3)).to(device)

    def timer(model, options):
        options = {**options, "compile_backend": args.compile_backend} if options.get("compile") else options

        def once() -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = generate(model, prompt, n, **options)
            sync(device)
            assert out.shape[1] == n
            return time.perf_counter() - t0
        return once

    base = timer(build_model(model_config(reg, args, "baseline"), "fast", device).eval(), {})
    for _ in range(max(1, args.warmup)):
        base()
    arms = [(impl, "", entry) for impl in impls for entry in entries]
    static_entries = ["baseline", *entries][: 2 if args.dry_run else None]  # dry run: baseline and S-LR (time)
    arms += [("fast", path, entry) for path in DECODE_PATHS if path for entry in static_entries]
    rows, base_times = [], []
    for impl, path, entry in arms:
        name = entry if impl == "fast" else f"{impl}:{entry}"
        name = f"{path}:{name}" if path else name
        r = {"mode": "decode", "arm": name, "entry": entry, "impl": impl, "package": None, "batch": 1,
             "seq_len": prompt_len + n, "tokens": n, "path": path or "dynamic"}
        if why := unavailable(impl, device):
            rows.append({**r, "status": f"skipped: {why}"})
            continue
        if spent() > args.budget_s:
            rows.append({**r, "status": f"skipped: time budget ({spent():.0f} s spent)"})
            continue
        try:
            arm = timer(build_model(model_config(reg, args, entry), impl, device).eval(), DECODE_PATHS[path])
            for _ in range(max(1, args.warmup)):
                arm()
            times, ratios = [], []
            for _ in range(min(args.rounds, 3)):
                t_base = base()
                base_times.append(t_base)
                t = arm()
                times.append(t)
                ratios.append(t / t_base)
        except Exception as e:
            if args.dry_run:
                raise
            rows.append({**r, "status": f"failed: {type(e).__name__}: {str(e)[:300]}"})
            continue
        median = statistics.median(times)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append({**r, "status": "ok", "median_step_s": median / n, "tokens_per_s": n / median,
                     "ratio_to_baseline": statistics.median(ratios), "ratio_quartiles": [q[0], q[2]],
                     "decode_times_s": times})
    if base_times:
        median = statistics.median(base_times)
        rows.insert(0, {"mode": "decode", "arm": "baseline", "entry": "baseline", "impl": "fast", "package": None,
                        "batch": 1, "seq_len": prompt_len + n, "tokens": n, "path": "dynamic", "status": "ok",
                        "median_step_s": median / n, "tokens_per_s": n / median, "ratio_to_baseline": 1.0,
                        "ratio_quartiles": [1.0, 1.0], "decode_times_s": base_times})
    for r in rows:  # the ratio to the same path's baseline (median times; today's path: the interleaved ratio)
        path_base = next((b for b in rows if b["status"] == "ok" and b["entry"] == "baseline" and b["impl"] == "fast"
                          and b["path"] == r["path"]), None)
        if r["status"] == "ok" and path_base is not None:
            r["ratio_to_path_baseline"] = (r["ratio_to_baseline"] if r["path"] == "dynamic"
                                           else r["median_step_s"] / path_base["median_step_s"])
    return rows


def unavailable(impl: str, device) -> str | None:
    """Why our backend `impl` cannot run on `device` (None: it can): the backend table's answer."""
    from lrattn_lightning.model.routing.attnres.backends import availability

    return availability(impl, device)

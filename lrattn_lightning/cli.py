"""The `lrattn` entry point."""

from __future__ import annotations

import argparse
import sys
import time


def _list(argv: list[str]) -> int:
    from lrattn_lightning.accounting import added_flops_percent, count_params
    from lrattn_lightning.registry import load_registry

    parser = argparse.ArgumentParser(prog="lrattn list", description="List the registry's sizes and ablations.")
    parser.add_argument("--registry", default=None)
    parser.add_argument("--size", default="paper-0.5b", help="size used for the parameter/FLOPs columns")
    args = parser.parse_args(argv)
    reg = load_registry(args.registry)
    size = reg.size(args.size)
    print(f"sizes: {', '.join(reg.sizes)}")
    print(f"{'ablation':40s} {'params':>13s} {'added FLOPs %':>13s}  control")
    for name, abl in reg.ablations.items():
        try:
            params, flops = f"{count_params(size, abl):,}", f"{added_flops_percent(size, abl):.3f}"
        except ValueError:
            params, flops = "n/a", "n/a"
        print(f"{name:40s} {params:>13s} {flops:>13s}  {abl.control or '-'}")
    return 0


def _smoke(argv: list[str]) -> int:
    import torch

    from lrattn_lightning.decoder import build_decoder
    from lrattn_lightning.registry import load_registry

    parser = argparse.ArgumentParser(prog="lrattn demo", description="Forward/backward smoke run of a small model.")
    parser.add_argument("--size", default="small")
    parser.add_argument("--ablations", default="baseline,attnres-block-n8,p-lr-block-n8-r32,s-lr-block-n8-r64")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    reg = load_registry()
    size = reg.size(args.size)
    pairs = [reg.model(args.size, name) for name in args.ablations.split(",")]  # validate all first
    times = {}
    for cfg in pairs:
        torch.manual_seed(0)
        model = build_decoder(cfg)
        idx = torch.randint(0, size.vocab_size, (args.batch_size, size.seq_len + 1))
        steps = []
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            steps.append(time.perf_counter() - t0)
        times[cfg.ablation.name] = sorted(steps[1:])[len(steps[1:]) // 2]
        print(f"{cfg.ablation.name:24s} loss {loss.item():.4f}  fwd+bwd {times[cfg.ablation.name] * 1e3:7.1f} ms")
    base = times.get("baseline")
    if base:
        for name, t in times.items():
            print(f"{name:24s} ratio to baseline {t / base:.3f}")
    return 0


def _bench(argv: list[str]) -> int:
    from lrattn_lightning.bench import main as bench_main  # argument parsing lives in bench.py

    return bench_main(argv)


COMMANDS = {"list": _list, "demo": _smoke, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: lrattn {{{','.join(COMMANDS)}}} [...]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

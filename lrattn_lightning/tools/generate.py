"""`lrattn generate` and `lrattn chat`: text from a checkpoint, streamed to the terminal.

    lrattn generate --checkpoint CKPT --prompt "def parse(" [--max_new_tokens 200 --temperature 0.8
                    --top_k 50 --top_p 0.95 --seed 0 --cache auto|dynamic|static --compile auto|true|false]
    lrattn chat --checkpoint CKPT        an interactive loop: each line you type continues the text

Both decode with the KV cache (`generate.generate_stream`; on CUDA by default the static cache and its decode
step compiled with CUDA graphs, where the routing allows it) and the tokenizer stored in the checkpoint,
and print each piece of text as soon as it is complete (a multi-byte character waits for its last byte).
The model is a language model of its corpus, not an instruction-tuned assistant: `chat` keeps one
running text (your lines and its continuations), trimmed on the left to fit the model's window, and a
reply ends at EOS, at a blank line, or after --max_new_tokens. In chat: /reset forgets the text, /quit
(or Ctrl-D) leaves.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TextIO

import torch

from lrattn_lightning.core.errors import InputError, UsageError, one_line
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.model.generate import generate_stream, supports_static
from lrattn_lightning.train.checkpoint.load import (
    LoadedCheckpoint,
    add_trust_flags,
    load_checkpoint,
    trust_routers,
)


class TextStream:
    """Turns a growing list of token ids into the text to print next (whole characters only)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for its next byte
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece


def _add_sampling(parser: argparse.ArgumentParser, max_new: int) -> None:
    parser.add_argument("--checkpoint", required=True, help="a last.ckpt / step*.ckpt written by `lrattn fit`")
    parser.add_argument("--max_new_tokens", type=int, default=max_new)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache", choices=("auto", "dynamic", "static"), default="auto",
                        help="the KV cache: static (preallocated, a fixed-shape step) or dynamic; auto: static on "
                             "CUDA where the routing allows it (not the gated residual), else dynamic")
    parser.add_argument("--compile", choices=("auto", "true", "false"), default="auto",
                        help="compile the static cache's decode step (CUDA graphs on CUDA); auto: on CUDA only")
    add_trust_flags(parser)


def _check_sampling(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top_k must be a positive integer, got {args.top_k}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")


def stream_reply(ckpt: LoadedCheckpoint, ids: list[int], args: argparse.Namespace, out: TextIO,
                 stop_at_blank_line: bool = False, generator: torch.Generator | None = None,
                 keep_prompt: bool = False) -> list[int]:
    """Decode a continuation of `ids`, writing it to `out` piece by piece; returns the new ids.

    The model sees at most its trained window, and the last new token is never fed back: prompt + new <=
    seq_len + 1. The prompt is kept whole as far as it leaves room for min(--max_new_tokens, seq_len / 2) new
    tokens (chat: older text is trimmed on the left beyond that; keep_prompt: always whole, `generate` checked
    it fits); the reply then ends where the window is full."""
    seq_len = ckpt.seq_len  # the trained window
    room = 1 if keep_prompt else min(args.max_new_tokens, max(1, seq_len // 2))
    ids = ids[-(seq_len + 1 - room):] or [ckpt.tokenizer.eos_id]
    max_new = min(args.max_new_tokens, seq_len + 1 - len(ids))
    device = next(ckpt.model.parameters()).device
    prompt = torch.tensor([ids], device=device)
    text = TextStream(ckpt.tokenizer)
    new: list[int] = []
    cache, compile = getattr(args, "decoding", None) or decoding_choice(ckpt, args, device)
    for token in generate_stream(ckpt.model, prompt, max_new, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, generator=generator, eos_id=ckpt.tokenizer.eos_id,
                                 cache=cache, compile=compile):
        t = int(token[0])
        if t == ckpt.tokenizer.eos_id:
            break
        new.append(t)
        out.write(text.push(t))
        out.flush()
        if stop_at_blank_line and text.shown.endswith("\n\n"):
            break
    return new


def decoding_choice(ckpt: LoadedCheckpoint, args: argparse.Namespace, device: torch.device) -> tuple[str, bool]:
    """--cache and --compile resolved: (cache, compile). The static cache where asked, or by default on CUDA
    where the router keeps no decoding state of its own; its step compiled where asked, or by default on CUDA."""
    cuda = device.type == "cuda"
    cache = getattr(args, "cache", "auto")
    if cache == "auto":
        cache = "static" if cuda and supports_static(ckpt.model) else "dynamic"
    elif cache == "static" and not supports_static(ckpt.model):
        raise UsageError(f"--cache static: routing '{ckpt.cfg.ablation.routing}' keeps a decoding cache of its "
                         "own; use --cache dynamic")
    compile = getattr(args, "compile", "auto")
    if compile == "true" and cache != "static":
        raise UsageError("--compile true compiles the static cache's decode step: use it with --cache static")
    return cache, cache == "static" and (compile == "true" or (compile == "auto" and cuda))


def _load(args: argparse.Namespace) -> tuple[LoadedCheckpoint, torch.Generator]:
    _check_sampling(args)
    trust_routers(args)  # the router classes the user names, before a checkpoint names one
    ckpt = load_checkpoint(args.checkpoint)
    ckpt.model.to(args.device)
    args.decoding = decoding_choice(ckpt, args, torch.device(args.device))
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    return ckpt, generator


def generate_main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="lrattn generate", description="Continue a prompt, streaming the text.")
    parser.add_argument("--prompt", required=True)
    _add_sampling(parser, max_new=200)
    args = parser.parse_args(argv)
    try:
        ckpt, generator = _load(args)
        ids = ckpt.tokenizer.encode(args.prompt)
        if len(ids) > ckpt.seq_len:
            raise UsageError(f"--prompt is {len(ids)} tokens; the model's trained window is {ckpt.seq_len}")
    except InputError as err:
        print(f"lrattn generate: error: {one_line(err)}", file=sys.stderr)
        return 2
    sys.stdout.write(args.prompt)
    new = stream_reply(ckpt, ids, args, sys.stdout, generator=generator, keep_prompt=True)
    sys.stdout.write("\n")
    if len(new) == ckpt.seq_len + 1 - len(ids) < args.max_new_tokens:
        print(f"[lrattn generate] stopped after {len(new)} new tokens: the model's trained window is "
              f"{ckpt.seq_len} tokens", file=sys.stderr)
    return 0


def chat_main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    parser = Parser(prog="lrattn chat", description="An interactive loop over a checkpoint.")
    _add_sampling(parser, max_new=120)
    args = parser.parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        ckpt, generator = _load(args)
    except InputError as err:
        print(f"lrattn chat: error: {one_line(err)}", file=sys.stderr)
        return 2
    stdout.write(f"lrattn chat: {ckpt.cfg.ablation.name} @ {ckpt.cfg.size.name}, step {ckpt.global_step}. "
                 "Each line continues the text; /reset forgets it, /quit leaves.\n")
    history: list[int] = []
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/quit":
            stdout.write("\n")
            return 0
        if line.strip() == "/reset":
            history = []
            stdout.write("(text forgotten)\n")
            continue
        history += ckpt.tokenizer.encode(line if line.endswith("\n") else line + "\n")
        history += stream_reply(ckpt, history, args, stdout, stop_at_blank_line=True, generator=generator)
        stdout.write("\n")

"""The lm-eval model `lrattn`: `LRAttnLM` scores and generates with the Decoder's own forward.

`LRAttnLM` (registered in lm-eval as `lrattn`) scores requests with the forward training uses.
loglikelihood: requests sorted by length, right-padded into batches (causal, so padding never
reaches a scored position), contexts left-truncated to seq_len; a continuation longer than seq_len
is scored in consecutive windows. loglikelihood_rolling: lm-eval's disjoint windows of seq_len
predictions, batched. generate_until: greedy or sampled, KV cache (model/generate.py), stop strings.

Data parallel: with `collectives` (a Fabric or a Lightning Strategy) each rank is one of lm-eval's
`rank`/`world_size` shards; lm-eval gathers the per-sample metrics through `all_gather` /
`gather_object`. The launcher and the MLflow logging are in `eval/run.py`.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lrattn_lightning.core.errors import UsageError
from lrattn_lightning.data.tokenizer import Tokenizer
from lrattn_lightning.model.decoder import Decoder
from lrattn_lightning.model.generate import generate
from lrattn_lightning.train.checkpoint.load import load_checkpoint


class _Progress:
    """One line on stderr, rewritten at most every 2 s: how many requests are scored, of how many."""

    def __init__(self, what: str, total: int, quiet: bool = False) -> None:
        self.what, self.total, self.quiet = what, total, quiet or total == 0
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.quiet and now - self.last >= 2.0:
            self.last = now
            print(f"[lrattn eval] {done:,}/{self.total:,} {self.what} scored ({now - self.start:.0f} s)",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        if not self.quiet:
            print(f"[lrattn eval] {self.total:,}/{self.total:,} {self.what} scored "
                  f"({time.monotonic() - self.start:.0f} s)", file=sys.stderr, flush=True)


@register_model("lrattn")
class LRAttnLM(TemplateLM):
    """lm-eval model over a Decoder. `LRAttnLM(checkpoint=PATH)` or `LRAttnLM(model=..., tokenizer=...)`.

    `collectives` (a Fabric or a Lightning Strategy: global_rank, world_size, all_gather, barrier)
    makes it one rank of a data-parallel evaluation.
    """

    def __init__(self, checkpoint: str | None = None, *, model: Decoder | None = None, tokenizer: Tokenizer | None = None,
                 batch_size: int | str = 16, max_gen_toks: int = 256, device: str | torch.device | None = None,
                 seed: int = 1234, collectives: Any = None, max_length: int | None = None, **_ignored: Any):
        """max_length: the window contexts are truncated to, the trained one (`--data.seq_len`); default the
        checkpoint's, else the model size's seq_len."""
        super().__init__()
        self.checkpoint = None
        if checkpoint is not None:
            self.checkpoint = load_checkpoint(checkpoint)
            model, tokenizer = self.checkpoint.model, self.checkpoint.tokenizer
            max_length = max_length or self.checkpoint.seq_len
        if model is None or tokenizer is None:
            raise UsageError("LRAttnLM needs checkpoint=PATH, or model= and tokenizer=")
        self.model, self.tok = model, tokenizer
        self._max_length = min(int(max_length or model.cfg.size.seq_len), model.cfg.size.seq_len)
        self._device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self._device)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = seed
        self._coll = collectives
        self._warned: set[str] = set()

    # ---- identity and tokens --------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(list(tokens))

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.model.cfg
        info = {"size": cfg.size.name, "ablation": cfg.ablation.name, "tokenizer": self.tok.spec().get("kind")}
        if self.checkpoint is not None:
            info["checkpoint"] = str(self.checkpoint.path)
        return info

    # ---- data parallel: lm-eval calls these when world_size > 1 ---------------------------------
    @property
    def rank(self) -> int:
        return self._coll.global_rank if self._coll is not None else 0

    @property
    def world_size(self) -> int:
        return self._coll.world_size if self._coll is not None else 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        gathered = self._coll.all_gather(tensor)  # (world, *shape)
        return gathered if tensor.dim() == 0 else gathered.flatten(0, 1)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            self._coll.barrier()

    # ---- scoring --------------------------------------------------------------------------------
    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's own: tokenise, then _loglikelihood_tokens; without its tqdm bar over the (instant) tokenising,
        which would stand beside the scoring's progress lines."""
        self._quiet = disable_tqdm
        try:
            return super().loglikelihood(requests, disable_tqdm=True)
        finally:
            self._quiet = None

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids) -> (sum log p, greedy?) each."""
        pieces = []  # (request index, input ids, continuation ids); long continuations become windows
        for i, (_, context, continuation) in enumerate(requests):
            for start in range(0, len(continuation), self.max_length):
                cont = continuation[start:start + self.max_length]
                whole = (list(context) + list(continuation[:start + len(cont)]))[-(self.max_length + 1):]
                pieces.append((i, whole[:-1], cont))
        totals = [0.0] * len(requests)
        greedy = [True] * len(requests)
        order = sorted(range(len(pieces)), key=lambda k: (-len(pieces[k][1]), pieces[k][1]))
        quiet = disable_tqdm if getattr(self, "_quiet", None) is None else self._quiet  # (loglikelihood's caller's)
        progress = _Progress("loglikelihood requests", len(requests), quiet=quiet or self.rank != 0)
        with torch.no_grad():
            for first in range(0, len(order), self.batch_size):
                progress.update(len({pieces[k][0] for k in order[:first + self.batch_size]}))
                batch = [pieces[k] for k in order[first:first + self.batch_size]]
                width = len(batch[0][1])  # longest first
                ids = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
                for row, (_, inp, _) in enumerate(batch):
                    ids[row, :len(inp)] = torch.tensor(inp, dtype=torch.long)
                logits = self.model(ids.to(self._device))  # (B, T, V)
                for row, (i, inp, cont) in enumerate(batch):
                    n, c = len(inp), len(cont)
                    scored = F.log_softmax(logits[row, n - c:n].float(), dim=-1)  # the positions predicting cont
                    target = torch.tensor(cont, dtype=torch.long, device=scored.device)
                    totals[i] += float(scored.gather(-1, target[:, None]).sum())
                    greedy[i] = greedy[i] and bool((scored.argmax(-1) == target).all())
        progress.done()
        results = list(zip(totals, greedy, strict=True))
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in lm-eval's disjoint windows of seq_len predictions."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation -----------------------------------------------------------------------------
    def _gen_settings(self, gen_kwargs: dict[str, Any] | None) -> tuple:
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None)
        until = tuple(s for s in ([until] if isinstance(until, str) else (until or [])) if s)
        max_new = min(int(kw.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        do_sample, temperature = kw.pop("do_sample", None), kw.pop("temperature", None)
        if do_sample is None:
            do_sample = bool(temperature and float(temperature) > 0)
        temperature = (float(temperature) if temperature else 1.0) if do_sample else 0.0
        top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
        for key in kw:
            if key not in self._warned:
                self._warned.add(key)
                print(f"[lrattn eval] generation setting {key}={kw[key]!r} is not supported; ignored", file=sys.stderr)
        return until, max_new, temperature, top_k, top_p

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuation until a stop string, EOS or max_gen_toks; equal-length prompts batch."""
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            settings = self._gen_settings(gen_kwargs)
            ids = self.tok_encode(context)[-(self.max_length - settings[1]):] or [self.eot_token_id]
            groups[(len(ids), settings)].append((i, ids))
        out: list[str] = [""] * len(requests)
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        for (_, (until, max_new, temperature, top_k, top_p)), items in sorted(groups.items(), key=lambda g: -g[0][0]):
            for first in range(0, len(items), self.batch_size):
                batch = items[first:first + self.batch_size]
                prompt = torch.tensor([ids for _, ids in batch], dtype=torch.long, device=self._device)
                stop = None
                if until:
                    def stop(new_BN: torch.Tensor, until: tuple = until) -> torch.Tensor:
                        return torch.tensor([any(s in self.tok_decode(row.tolist()) for s in until) for row in new_BN],
                                            device=new_BN.device)
                new = generate(self.model, prompt, max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                               generator=generator, eos_id=self.eot_token_id, should_stop=stop)
                for (i, _), row in zip(batch, new.tolist(), strict=True):
                    if self.eot_token_id in row:
                        row = row[:row.index(self.eot_token_id)]
                    text = self.tok_decode(row)
                    for s in until:
                        text = text.split(s)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

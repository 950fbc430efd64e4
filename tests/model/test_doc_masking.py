"""Document masking (the paper's `use_doc_masking`): a token attends only within its own document."""

from __future__ import annotations

import pytest
import torch
from helpers.models import DEEPER, randomize_routing, tiny_config
from helpers.runs import slr_fit_args

from lrattn_lightning.model.attention import KVCache, document_segments
from lrattn_lightning.model.decoder import build_decoder

SEP = 5
ENTRIES = ["baseline", "attnres-block-n8", "s-lr-block-n8-r64", "p-lr-block-n8-r32", "vp-lr-block-n8-r32"]


def _model(registry, name, impl="fast"):
    model = build_decoder(tiny_config(registry, name, DEEPER), impl=impl)
    randomize_routing(model)
    model.doc_separator = SEP
    return model.eval()


def _doc(n, seed):
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(6, DEEPER.vocab_size, (1, n), generator=g)
    return torch.cat((torch.tensor([[SEP]]), body), dim=1)  # the separator opens the document


def reference_boundaries(row: list[int], separator: int) -> list[int]:
    """The paper's data loader, restated: cu_doc_len = 0, every separator position > 0, then T."""
    T = len(row)
    inner = [t for t, tok in enumerate(row) if tok == separator and 0 < t < T]
    return [0, *inner, T]


def test_segments_are_the_references_boundaries():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 8, (6, 16), generator=g)
    idx[0, 0] = SEP
    seg = document_segments(idx, SEP)
    for row, ids in zip(idx.tolist(), seg.tolist(), strict=True):
        bounds = reference_boundaries(row, SEP)
        expected = [k for k in range(len(bounds) - 1) for _ in range(bounds[k + 1] - bounds[k])]
        starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]]
        assert starts == bounds[:-1] and len(expected) == len(ids)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name", ENTRIES)
def test_a_document_does_not_see_the_one_packed_before_it(registry, name, impl):
    model = _model(registry, name, impl)
    a, b, c = _doc(5, 1), _doc(6, 2), _doc(3, 3)
    with torch.no_grad():
        alone = model(b)
        packed = model(torch.cat((a, b), dim=1))[:, a.shape[1]:]
        other = model(torch.cat((c, b), dim=1))[:, c.shape[1]:]
        model.doc_separator = None  # negative control: without masking the packed document leaks in
        leaked = model(torch.cat((a, b), dim=1))[:, a.shape[1]:]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other, alone, rtol=1e-5, atol=1e-5)
    assert (leaked - alone).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["baseline", "s-lr-block-n8-r64", "p-lr-block-n8-r32"])
def test_kv_cache_decoding_masks_like_the_full_forward(registry, name):
    """A cached prompt that spans a document boundary: every step masks as the full forward does."""
    model = _model(registry, name)
    idx = torch.cat((_doc(4, 4), _doc(5, 5), _doc(4, 6)), dim=1).repeat(2, 1)
    idx[1, 7] = SEP  # rows with different boundaries
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.empty(DEEPER.n_layers)
        steps = [model(idx[:, :7], cache=cache)]  # the prompt ends inside the second document
        steps += [model(idx[:, t : t + 1], cache=cache) for t in range(7, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.segments.shape == idx.shape


def test_a_changed_earlier_document_changes_nothing_later(registry):
    """Changing a token of the first document leaves the second document's logits unchanged."""
    model = _model(registry, "p-lr-block-n8-r32")
    a, b = _doc(5, 1), _doc(6, 2)
    idx = torch.cat((a, b), dim=1)
    changed = idx.clone()
    changed[0, 2] = (changed[0, 2] + 1) % DEEPER.vocab_size or 6
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, a.shape[1]:], model(idx)[:, a.shape[1]:], rtol=1e-5, atol=1e-5)


def test_fit_with_document_masking_keeps_the_separator_for_evaluation(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """`--model.document_masking true`: the EOS id of the data masks training, and the checkpoint carries
    it, so evaluation (checkpoints.load_checkpoint) masks alike."""
    from lrattn_lightning.cli import main
    from lrattn_lightning.train.checkpoint.load import load_checkpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(slr_fit_args(tiny_data, "--model.document_masking", "true", steps=2)) == 0
    ckpt = next((tmp_path / "runs").rglob("last.ckpt"))
    hp = torch.load(ckpt, weights_only=True)["hyper_parameters"]
    assert hp["document_masking"] is True and hp["doc_separator"] == 256  # the byte tokenizer's EOS
    assert load_checkpoint(ckpt).model.doc_separator == 256
    assert hp["attention"] == "sdpa" and load_checkpoint(ckpt).model.attention == "sdpa"
    # a checkpoint trained with --model.attention flex (on CUDA) evaluates through FlexAttention, same logits
    raw = torch.load(ckpt, weights_only=True)
    raw["hyper_parameters"]["attention"] = "flex"
    torch.save(raw, tmp_path / "flex.ckpt")
    flex, sdpa = load_checkpoint(tmp_path / "flex.ckpt").model, load_checkpoint(ckpt).model
    assert flex.attention == "flex"
    idx = torch.cat((_doc(9, 1), _doc(12, 2), _doc(6, 3)), dim=1) % 256
    with torch.no_grad():
        torch.testing.assert_close(flex(idx), sdpa(idx), rtol=1e-5, atol=1e-5)


def _dense_attention_float64(model, idx):
    """Document masking restated: per row, per position, a causal softmax over the same document's positions
    only (a [T, T] mask built from the separator positions in Python, independent of document_segments)."""
    T = idx.shape[1]
    allowed = torch.zeros(idx.shape[0], 1, T, T, dtype=torch.bool)
    for b, row in enumerate(idx.tolist()):
        starts = [t for t, tok in enumerate(row) if tok == SEP] or [0]
        for i in range(T):
            first = max([s for s in starts if s <= i], default=0)
            allowed[b, 0, i, first : i + 1] = True
    return allowed


@pytest.mark.parametrize("name", ENTRIES)
def test_flex_attention_equals_the_dense_mask(registry, name):
    """--model.attention flex (FlexAttention's block mask) computes what the dense SDPA mask does, in float64,
    on rows with several documents and different boundaries (FlexAttention's CPU path: forward only)."""
    from lrattn_lightning.model import attention as attention_module

    model = _model(registry, name).double()
    idx = torch.cat((_doc(3, 1), _doc(5, 2), _doc(5, 3)), dim=1).repeat(3, 1)
    idx[1, 6], idx[2, 1] = SEP, SEP  # rows whose documents differ
    seen = []
    real = attention_module.AttentionPass.attend

    def spy(self, *args, **kwargs):
        seen.append(type(self.mask).__name__)
        return real(self, *args, **kwargs)

    with torch.no_grad():
        dense = model(idx)
        model.attention = "flex"
        attention_module.AttentionPass.attend = spy
        try:
            flex = model(idx)
        finally:
            attention_module.AttentionPass.attend = real
    assert set(seen) == {"BlockMask"}  # the flex path ran, in every layer
    torch.testing.assert_close(flex, dense, rtol=1e-12, atol=1e-12)
    # and both are document masking itself: the mask from the separators, restated in Python
    same_doc, _ = attention_module.document_mask(idx, None, SEP, "flex")
    dense_mask, _ = attention_module.document_mask(idx, None, SEP, "sdpa")
    assert torch.equal(dense_mask & attention_module._prefix_causal_mask(idx.shape[1], idx.shape[1], idx.device),
                       _dense_attention_float64(model, idx))
    assert type(same_doc).__name__ == "BlockMask"


def test_flex_attention_decodes_like_its_full_forward(registry):
    """KV-cache decoding under attention flex (the cached steps take the dense path) equals the flex forward."""
    model = _model(registry, "p-lr-block-n8-r32")
    model.attention = "flex"
    idx = torch.cat((_doc(4, 4), _doc(5, 5), _doc(4, 6)), dim=1).repeat(2, 1)
    idx[1, 7] = SEP
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.empty(DEEPER.n_layers)
        steps = [model(idx[:, :7], cache=cache)]
        steps += [model(idx[:, t : t + 1], cache=cache) for t in range(7, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def _graph_breaks(model, idx) -> int:
    import torch._dynamo

    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(model)(idx).graph_break_count
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("name", ["baseline", "p-lr-block-n8-r32"])
def test_document_masking_under_torch_compile(registry, name):
    """--model.compile true with document masking: the dense mask is built inside one graph (the eager
    one-document shortcut is data-dependent, so it is skipped while compiling: no graph break), and the
    compiled decoder's logits equal eager ones, for both attention paths. FlexAttention runs as its own frame
    (a graph break per attention): traced inline, Dynamo lost the residual stream's update after each
    flex_attention call (compiled baseline logits off by 0.28 before attention._flex_outside)."""
    model = build_decoder(tiny_config(registry, name, DEEPER), impl="compiled")
    randomize_routing(model)
    model.doc_separator = SEP
    model.eval()
    idx = torch.cat((_doc(4, 1), _doc(5, 2), _doc(4, 3)), dim=1).repeat(2, 1)
    idx[1, 6] = SEP
    single = _doc(15, 4).repeat(2, 1)  # one document per row: the shortcut's case
    with torch.no_grad():
        for attention in ("sdpa", "flex"):
            model.attention = attention
            breaks = _graph_breaks(model, idx)
            assert breaks == 0 if attention == "sdpa" else breaks > 0, (attention, breaks)
            compiled = torch.compile(model, backend="aot_eager")
            for x in (idx, single):
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            torch._dynamo.reset()


def test_an_unknown_attention_is_one_line(registry):
    with pytest.raises(Exception, match=r"attention must be one of \['sdpa', 'flex'\], got 'flash'"):
        build_decoder(tiny_config(registry, "baseline", DEEPER), attention="flash")


def test_a_cpu_fit_with_flex_attention_is_refused_before_any_work(tiny_data, tmp_path, monkeypatch, capsys):  # noqa: F811
    from lrattn_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = slr_fit_args(tiny_data, "--model.document_masking", "true", "--model.attention", "flex", steps=2)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lrattn: error: --model.attention flex: FlexAttention has no backward on CPU"), err
    assert "--model.attention sdpa" in err[-1]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns.db").exists()


def _gated_model(registry, name="gated-residual"):
    """The gated residual with its gate matrices scaled up, so the gates depend strongly on the running means."""
    model = _model(registry, name)
    with torch.no_grad():
        for linear in (*model.router.gate_q, *model.router.gate_k):
            linear.weight.mul_(30.0)
    return model


def _segment_means_float64(x, segments, prefix_sum=None, prefix_count=None):
    """The running mean within each segment, one position at a time in float64 (independent of causal_mean)."""
    B, T, D = x.shape
    out = torch.empty(B, T, D, dtype=torch.float64)
    for b in range(B):
        total = torch.zeros(D, dtype=torch.float64) if prefix_sum is None else prefix_sum[b, 0].double().clone()
        count = 0.0 if prefix_count is None else float(prefix_count[b, 0, 0])
        for t in range(T):
            if t > 0 and segments[b, t] != segments[b, t - 1]:
                total, count = torch.zeros(D, dtype=torch.float64), 0.0
            total += x[b, t].double()
            count += 1
            out[b, t] = total / count
    return out


def test_causal_mean_restarts_at_every_document_against_a_loop():
    from lrattn_lightning.model.routing.gated import causal_mean, segment_starts

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 4, generator=g)
    idx = torch.randint(0, 7, (3, 11), generator=g)
    idx[0] = 1  # no boundary in this row
    segments = document_segments(idx, SEP)
    means, _ = causal_mean(x, None, segment_starts(segments))
    torch.testing.assert_close(means.double(), _segment_means_float64(x, segments), rtol=1e-6, atol=1e-6)
    # with a prefix (decoding): the first new position continues it, later segments drop it
    prefix = (torch.randn(3, 1, 4, generator=g), torch.tensor([4.0, 2.0, 7.0]).view(3, 1, 1))
    means, (last_sum, last_count) = causal_mean(x, prefix, segment_starts(segments))
    expected = _segment_means_float64(x, segments, *prefix)
    torch.testing.assert_close(means.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last_sum[:, 0] / last_count[:, 0], means[:, -1])


def test_gated_residual_gates_do_not_see_the_document_packed_before_it(registry):
    """The gate's running means restart at a document boundary: a packed document's gates and logits are
    its own (before, the means ran over the whole window and the earlier document leaked into the gates)."""
    model = _gated_model(registry)
    a, b = _doc(7, 1), _doc(6, 2)
    with torch.no_grad():
        alone = model(b, return_routing=True)
        packed = model(torch.cat((a, b), dim=1), return_routing=True)
    n = a.shape[1]
    for g_alone, g_packed in zip(alone.routing, packed.routing, strict=True):
        torch.testing.assert_close(g_packed[:, :, n:], g_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.logits[:, n:], alone.logits, rtol=1e-5, atol=1e-5)
    model.doc_separator = None  # negative control: one running mean over the window
    with torch.no_grad():
        leaked = model(torch.cat((a, b), dim=1), return_routing=True)
    assert max((lk[:, :, n:] - al).abs().max().item() for lk, al in zip(leaked.routing, alone.routing, strict=True)) > 1e-2


def test_gated_residual_kv_cache_decoding_masks_like_the_full_forward(registry):
    model = _gated_model(registry)
    idx = torch.cat((_doc(4, 4), _doc(5, 5), _doc(4, 6)), dim=1).repeat(2, 1)
    idx[1, 7] = SEP  # rows with different boundaries; row 1 starts a document at the prompt's last token
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.empty(DEEPER.n_layers)
        steps = [model(idx[:, :7], cache=cache)]  # the prompt ends inside the second document
        steps += [model(idx[:, t : t + 2], cache=cache) for t in range(7, idx.shape[1], 2)]  # chunks of 2
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)

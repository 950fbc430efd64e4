"""Analytic parameter counts equal the built models; the FLOPs axis reproduces docs/method.md §4 and §6."""

from __future__ import annotations

import pytest
import torch
from helpers.models import ALL_ABLATIONS, ATTNRES_ABLATIONS, DEEPER, tiny_config, tokens, variant

from lrattn_lightning.model.accounting import added_flops_percent, core_flops, count_params, sources_per_site
from lrattn_lightning.model.config import ModelConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.routing.attnres.keys import key_source


def real_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- parameter counts (requirement 1) ----------------------------------------------------------


@pytest.mark.parametrize("name", ALL_ABLATIONS)
def test_every_entry_builds_at_tiny_and_counts_match(registry, name):
    cfg = tiny_config(registry, name)
    model = build_decoder(cfg)
    assert count_params(cfg) == real_params(model)
    assert count_params(cfg.size, cfg.ablation) == real_params(model)
    assert model(tokens(cfg.size.vocab_size, 1, 4)).shape == (1, 4, cfg.size.vocab_size)


def test_fit_to_size_clips_only_what_does_not_fit(registry, tiny):
    abl = registry.ablation("s-lr-block-n8-r64")
    with pytest.raises(ValueError, match="rank"):
        ModelConfig(tiny, abl)
    fitted = fit_to_size(abl, tiny)
    assert (fitted.options.rank, fitted.options.blocks, fitted.options.key_source) == (tiny.d_model, tiny.n_sublayers, "sliced")
    assert fitted.name != abl.name  # the clipped copy says so
    fits = registry.ablation("attnres-block-n4")
    assert fit_to_size(fits, tiny) == fits


@pytest.mark.parametrize("size", ["paper-0.5b", "d768"])
def test_every_entry_counts_match_on_meta(registry, size):
    for name in ALL_ABLATIONS:
        cfg = registry.model(size, name)  # no clipping: every entry fits the real sizes
        with torch.device("meta"):
            model = build_decoder(cfg)
        assert next(model.parameters()).is_meta
        assert count_params(cfg) == real_params(model), name


def spec_baseline_params(L: int, d: int, h: int, V: int) -> int:
    """Untied embedding and head, attention 4 d^2 and SwiGLU 3 d h per layer, no biases or norm weights."""
    return 2 * V * d + L * (4 * d * d + 3 * d * h)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("baseline", lambda L, d, h, r: 0),
        ("attnres-full", lambda L, d, h, r: 2 * L * d),  # docs/method.md §3: 2L d (the queries)
        ("attnres-block-n8", lambda L, d, h, r: 2 * L * d),
        ("s-lr-full-r64", lambda L, d, h, r: 2 * L * r),  # docs/method.md §3: 2L r
        ("s-lr-block-n8-r64", lambda L, d, h, r: 2 * L * r),
        ("p-lr-full-r32", lambda L, d, h, r: L * r * (d + h) + r * d + 2 * L * r),  # docs/method.md §3
        ("p-lr-block-n8-r32", lambda L, d, h, r: L * r * (d + h) + r * d + 2 * L * r),
        ("p-lr-block-n8-r32-static-embkey", lambda L, d, h, r: L * r * (d + h) + r + 2 * L * r),
        ("gated-residual", lambda L, d, h, r: 2 * L * 2 * d * d),  # W_q, W_k per sublayer
    ],
)
def test_paper_size_params_follow_the_spec(registry, name, extra):
    cfg = registry.model("paper-0.5b", name)
    s = cfg.size
    with torch.device("meta"):
        model = build_decoder(cfg)
    expected = spec_baseline_params(s.n_layers, s.d_model, s.d_mlp, s.vocab_size)
    expected += extra(s.n_layers, s.d_model, s.d_mlp, getattr(cfg.ablation.options, "rank", None))
    assert real_params(model) == expected


# ---- sources per site and block ends (requirement 11) ------------------------------------------


def test_sources_per_site_l12_n8(registry):
    cfg = ModelConfig(registry.size("d768"), variant(registry.ablation("attnres-block-n8")))
    assert cfg.size.n_layers == 12
    assert cfg.block_ends() == [3, 6, 9, 12, 15, 18, 21, 24]
    assert sources_per_site(cfg) == [k for k in range(2, 10) for _ in range(3)]  # 2,2,2,3,3,3,...,9,9,9


def test_sources_per_site_full_routing(registry):
    cfg = registry.model("d768", "attnres-full")
    assert cfg.block_ends() == []
    assert sources_per_site(cfg) == list(range(2, 26))  # |S_j| = j + 1


def test_uneven_block_ends_l12_n5(registry):
    cfg = ModelConfig(registry.size("d768"), variant(registry.ablation("s-lr-block-n8-r64"), blocks=5))
    assert cfg.block_ends() == [5, 10, 15, 20, 24]
    # j=1..5: embedding + partial (j=5 closes block 1: embedding + 1 summary), then one more per block
    expected = [2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 6, 6, 6, 6]
    assert sources_per_site(cfg) == expected


@pytest.mark.parametrize(
    "size, block_size, ends",
    [
        ("d768", 4, [4, 8, 12, 16, 20, 24]),
        ("paper-0.5b", 4, list(range(4, 49, 4))),
        ("d768", 5, [5, 10, 15, 20, 24]),  # the last block is short
        ("d768", 24, [24]),
        ("tiny", 3, [3, 4]),
    ],
)
def test_block_size_ends(registry, size, block_size, ends):
    abl = variant(registry.ablation("s-lr-block-size4-r64"), block_size=block_size, rank=16)
    cfg = ModelConfig(registry.size(size), abl)
    assert cfg.block_ends() == ends


def test_registry_block_size_entry(registry):
    cfg = registry.model("paper-0.5b", "s-lr-block-size4-r64")
    assert cfg.block_ends() == list(range(4, 49, 4))
    # every 4 sublayers a summary: sites 1..4 see 2 sources, 5..8 see 3, ... 45..48 see 13
    assert sources_per_site(cfg) == [k for k in range(2, 14) for _ in range(4)]


@pytest.mark.parametrize(
    "name, changes",
    [
        ("attnres-full", {}),
        ("attnres-block-n8", {"blocks": 4}),  # ends 2, 3, 5, 6 at 2L = 6
        ("attnres-block-n8", {"blocks": 6}),
        ("s-lr-block-n8-r64", {"blocks": 2, "rank": 8}),
        ("s-lr-block-size4-r64", {"block_size": 4, "rank": 8}),  # ends 4, 6
    ],
)
def test_sources_per_site_matches_the_forward_pass(registry, name, changes):
    """The accounting's |S_j| equals the number of sources the decoder actually routes over."""
    cfg = ModelConfig(DEEPER, variant(registry.ablation(name), **changes))
    out = build_decoder(cfg)(tokens(DEEPER.vocab_size, 1, 4), return_routing=True)
    assert [alpha.shape[0] for alpha in out.routing] == sources_per_site(cfg)


# ---- the FLOPs axis (requirement 11) -----------------------------------------------------------


def spec_added_percent(L: int, d: int, h: int, k: int, sites: list[int], p_lr: bool) -> float:
    """docs/method.md §4 written out: read = sum |S_j| (2k + 2d); proj = 2 (L r (d+h) + r d) for P-LR."""
    core = 2 * L * (4 * d * d + 3 * d * h)
    read = sum(sites) * (2 * k + 2 * d)
    proj = 2 * (L * k * (d + h) + k * d) if p_lr else 0
    return 100 * (read + proj) / core


def test_worked_example(registry):
    cfg = registry.model("paper-0.5b", "s-lr-block-n8-r64")
    assert core_flops(cfg.size) == 616_562_688
    assert sum(sources_per_site(cfg)) == 264
    assert added_flops_percent(cfg) == pytest.approx(100 * 264 * (128 + 2048) / 616_562_688, rel=1e-12)
    assert added_flops_percent(registry.size("paper-0.5b"), registry.ablation("s-lr-block-n8-r64")) == pytest.approx(
        0.0932, abs=5e-5
    )


@pytest.mark.parametrize(
    "name, published, digits",
    [
        ("baseline", 0.0, 3),
        ("attnres-full", 0.813, 3),
        ("attnres-block-n4", 0.112, 3),
        ("attnres-block-n8", 0.175, 3),
        ("attnres-block-n16", 0.303, 3),
        ("s-lr-block-n4-r64", 0.059, 3),
        ("s-lr-block-n8-r64", 0.093, 3),
        ("s-lr-block-n16-r64", 0.161, 3),
        ("p-lr-full-r16", 0.90, 2),
        ("p-lr-full-r32", 1.39, 2),
        ("p-lr-full-r64", 2.37, 2),
        ("p-lr-block-n4-r32", 1.025, 3),
        ("p-lr-block-n8-r32", 1.058, 3),
        ("p-lr-block-n16-r32", 1.123, 3),
    ],
)
def test_published_flops_column(registry, name, published, digits):
    value = added_flops_percent(registry.model("paper-0.5b", name))
    assert round(value, digits) == pytest.approx(published, abs=1e-12)


@pytest.mark.parametrize("rank", [16, 32, 64, 128, 256, 512])
def test_s_lr_full_flops_range(registry, rank):
    cfg = registry.model("paper-0.5b", f"s-lr-full-r{rank}")
    value = added_flops_percent(cfg)
    assert 0.41 <= round(value, 2) <= 0.61
    assert value == pytest.approx(spec_added_percent(24, 1024, 2816, rank, list(range(2, 50)), False), rel=1e-12)


def test_s_lr_full_flops_grow_with_rank(registry):
    values = [added_flops_percent(registry.model("paper-0.5b", f"s-lr-full-r{r}")) for r in (16, 32, 64, 128, 256, 512)]
    assert values == sorted(values) and values[0] < 0.42 and values[-1] > 0.60


@pytest.mark.parametrize(
    "name", ["attnres-full", "attnres-block-n4", "s-lr-block-n16-r64", "p-lr-full-r64", "p-lr-block-n8-r32"]
)
def test_flops_match_the_spec_formula(registry, name):
    cfg = registry.model("paper-0.5b", name)
    # independent |S_j|: full routing sees j + 1 outputs; block routing with ends every 48/N sublayers
    # sees the embedding, the completed blocks and a non-empty partial block
    N = cfg.ablation.options.blocks
    if N is None:
        sites = [j + 1 for j in range(1, 49)]
    else:
        size = 48 // N
        sites = [1 + j // size + (j % size != 0) for j in range(1, 49)]
    expected = spec_added_percent(24, 1024, 2816, cfg.kind.key_dim(cfg), sites, cfg.ablation.options.key_source == "projected")
    assert added_flops_percent(cfg) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ATTNRES_ABLATIONS)
def test_key_sources_count_their_parameters(registry, name):
    """KeySource.num_params (what accounting asks) = the router's key parameters + P-LR's key output rows."""
    cfg = tiny_config(registry, name)
    model = build_decoder(cfg, impl="reference")
    router = sum(p.numel() for n, p in model.router.named_parameters() if n not in ("queries", "query_gates"))
    a, s = cfg.ablation, cfg.size
    rows = s.n_layers * cfg.kind.key_dim(cfg) * (s.d_model + s.d_mlp) if a.options.key_source == "projected" else 0
    assert key_source(cfg).num_params() == router + rows

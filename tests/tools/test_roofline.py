"""The routing's minimal-traffic model (roofline.py): its counts against the registry's structure."""

from __future__ import annotations

import pytest
import torch

from lrattn_lightning.model.accounting import sources_per_site
from lrattn_lightning.model.config import ModelConfig, fit_to_size
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.bench.roofline import _cpu_side, _groups, measure_bandwidth, routing_traffic

REGISTRY = load_registry()
SMALL = REGISTRY.size("small")
ATTNRES = [n for n, a in REGISTRY.ablations.items() if a.routing == "attnres"]


def test_s_lr_block_by_hand():
    """L=8, N=8: groups see 1..9 completed sources (sum 45), 8 partial reads, 16 sites, 9 sources."""
    t = routing_traffic(REGISTRY.model("small", "s-lr-block-n8-r64"), tokens=2048, value_bytes=4)
    u = t.units
    assert (u["group_reads"], u["partials"], u["sites"], u["sources"], u["key_ratio"]) == (45, 8, 16, 9, 0.5)
    assert u["forward"] == 45 + 8 + 16 + 3 * 8
    assert u["backward"] == 16 + 3 * 45 - 9 + 2 * 8 + 3 * 8 + 3 * 0.5 * 9
    vector = 2048 * 128 * 4
    assert t.net_bytes == (u["forward"] + u["backward"] - 6 * 16) * vector
    assert t.matmul_flops == 0 and t.floor_s(1e10, 1e11) == pytest.approx(t.net_bytes / 1e10)


@pytest.mark.parametrize("name", ATTNRES)
def test_groups_cover_every_source_read(name):
    """Every source a site reads is a group read or a partial read: sum_k n_k S_k + P = sum_j |S_j|."""
    cfg = ModelConfig(SMALL, fit_to_size(REGISTRY.ablation(name), SMALL))
    sites, partials, counts = _groups(cfg)
    assert sum(n * (k + 1) for k, n in enumerate(sites)) + sum(partials) == sum(sources_per_site(cfg))
    assert sum(sites) == SMALL.n_sublayers and sum(counts) == SMALL.n_sublayers
    t = routing_traffic(cfg, tokens=64, value_bytes=2)
    assert t.net_bytes > 0 and t.forward_bytes > 0 and t.backward_bytes > t.forward_bytes
    inference = routing_traffic(cfg, tokens=64, value_bytes=2, training=False)
    assert inference.backward_bytes == 0 and inference.matmul_flops * 3 == pytest.approx(t.matmul_flops)


def test_full_routing_moves_more_than_block_and_plr_pays_key_rows():
    full = routing_traffic(REGISTRY.model("small", "attnres-full"), tokens=1, value_bytes=4)
    block = routing_traffic(REGISTRY.model("small", "attnres-block-n8"), tokens=1, value_bytes=4)
    plr = routing_traffic(REGISTRY.model("small", "p-lr-block-n8-r32"), tokens=1, value_bytes=4)
    assert full.net_bytes > 2 * block.net_bytes
    assert plr.matmul_flops > 0 and plr.net_bytes > block.net_bytes * 0.9
    base = routing_traffic(REGISTRY.model("small", "baseline"), tokens=1, value_bytes=4)
    assert base.net_bytes == 0 and base.floor_s(1e9, 1e9) == 0


def test_bandwidth_is_measured():
    bw = measure_bandwidth(torch.device("cpu"), mib=4)
    assert 1e8 < bw < 1e13


def test_the_cpu_peak_is_measured_on_a_product_sized_to_the_dtypes_speed():
    """A CPU measures its matmul peak on 1024-wide products unless one takes over the limit (bfloat16 emulated
    without AVX-512 BF16 or AMX: 2.4 s each, 85 s for the whole measurement); then on the largest from 256 up that
    fits. Limits at both ends pick the ends; the side is always a power of two in [256, largest]."""
    assert _cpu_side(torch.float32, limit_s=0.0) == 256
    assert _cpu_side(torch.float32, limit_s=1e9) == 1024
    assert _cpu_side(torch.float32, limit_s=1e9, largest=512) == 512
    assert _cpu_side(torch.bfloat16) in (256, 512, 1024)

"""How the `triton` backend's launches reach the device, checked without running a kernel: the launches are
recorded (tools/kernels/specs.py, recorded_launches) from a tiny model's forward and backward on CPU.

Each launch takes a table (launch.device_table: its sources' pointers and strides, priors and eps; the merge's
prior and eps). Built on the host, it must reach the device without blocking the host: a pageable
`.to(device)` is a copy plus a stream synchronisation on CUDA, so the host would wait for the GPU at every
launch. On CPU the copy is a no-op, but the call is the same: the test holds every `.to` the backend makes to
non_blocking=True (on CUDA device_table also pins the host tensor, so the copy is queued, not waited on).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from lrattn_lightning.model.config import ModelConfig, fit_to_size  # noqa: E402
from lrattn_lightning.model.decoder import build_decoder  # noqa: E402
from lrattn_lightning.model.registry import load_registry  # noqa: E402
from lrattn_lightning.model.routing.attnres.triton import launch  # noqa: E402
from lrattn_lightning.tools.kernels.specs import recorded_launches  # noqa: E402

PACKAGE = launch.__file__.rsplit("/", 1)[0]
# a two-phase block entry (group, merge and single reads) and per-token queries (single reads only)
ENTRIES = ("s-lr-block-size4-r64", "p-lr-block-n8-r32-dynquery")


def _step(name: str, monkeypatch) -> tuple[list[dict], list[bool]]:
    """One forward and backward of the tiny triton decoder, recorded: the launches, and per `.to(device)` that
    the triton package called (casts to a dtype aside), whether it was non_blocking."""
    import sys

    reg = load_registry()
    tiny = reg.size("tiny")
    cfg = ModelConfig(tiny, fit_to_size(reg.ablation(name), tiny))
    calls: list[bool] = []
    to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        to_device = "device" in kwargs or (args and isinstance(args[0], torch.device | str))
        if to_device and sys._getframe(1).f_code.co_filename.startswith(PACKAGE):
            calls.append(bool(kwargs.get("non_blocking", False)))
        return to(self, *args, **kwargs)

    torch.manual_seed(0)
    with recorded_launches() as records:
        model = build_decoder(cfg, impl="triton")
        idx = torch.randint(0, cfg.size.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        monkeypatch.setattr(torch.Tensor, "to", spy)
        model(idx).float().square().mean().backward()
        monkeypatch.setattr(torch.Tensor, "to", to)
    return records, calls


@pytest.mark.parametrize("name", ENTRIES)
def test_each_launch_copies_its_table_without_blocking(name, monkeypatch):
    records, calls = _step(name, monkeypatch)
    kernels = {r["kernel"] for r in records}
    assert {"read_fwd", "read_bwd"} <= kernels
    if name == "s-lr-block-size4-r64":
        assert {"group_fwd", "group_bwd", "merge_fwd", "merge_bwd"} <= kernels
    assert len(calls) == len(records)  # one table a launch, no other copy to a device
    assert all(calls), f"{calls.count(False)} of {len(calls)} tables copied with a blocking .to"


def test_the_table_holds_the_float_bits():
    words = launch.float_words([0.5, -1.0, 1e-300])
    table = launch.device_table([7, *words], torch.device("cpu"))
    assert table.dtype == torch.int64 and table[0] == 7
    assert table[1:].view(torch.float64).tolist() == [0.5, -1.0, 1e-300]

"""The registry is data, loaded strictly: grids, `extends`, and errors that name the entry and field."""

from __future__ import annotations

import pytest
import yaml
from helpers.paths import REGISTRY_PATH

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.registry import load_registry, parse_registry


def raises_naming(raw: dict, *parts: str) -> str:
    """parse_registry(raw) must raise ValueError whose message contains every one of `parts`."""
    with pytest.raises(ValueError) as info:
        parse_registry(raw)
    message = str(info.value)
    for part in parts:
        assert part in message, f"{part!r} not in error message: {message}"
    return message


# ---- the shipped registry ---------------------------------------------------------------------


def test_shipped_registry_names_the_paper_rows(registry):
    for name in [
        "baseline", "attnres-full", "attnres-block-n4", "attnres-block-n8", "attnres-block-n16",
        *[f"s-lr-full-r{r}" for r in (16, 32, 64, 128, 256, 512)],
        *[f"s-lr-block-n{n}-r64" for n in (4, 8, 16)],
        *[f"p-lr-full-r{r}" for r in (16, 32, 64)],
        *[f"p-lr-block-n{n}-r32" for n in (4, 8, 16)],
        "gated-residual",
    ]:
        assert name in registry.ablations
    for size in ("tiny", "d768", "paper-0.5b"):
        assert size in registry.sizes
    paper = registry.size("paper-0.5b")
    assert (paper.n_layers, paper.d_model, paper.n_heads, paper.d_mlp, paper.vocab_size) == (24, 1024, 16, 2816, 100277)
    assert paper.rope_theta == 500000.0 and paper.init_std == 0.02


def test_every_entry_states_doc_and_a_known_control(registry):
    for name, abl in registry.ablations.items():
        assert abl.name == name
        assert isinstance(abl.doc, str) and abl.doc.strip()
        assert abl.control is None or abl.control in registry.ablations


def test_registry_records_its_hash():
    reg = load_registry(REGISTRY_PATH)
    assert len(reg.sha256) == 64 and reg.short_hash == reg.sha256[:12]


# ---- grids and extends (requirement 12) --------------------------------------------------------


def test_grid_expands_into_named_entries(registry):
    names = {f"s-lr-grid-n{n}-r{r}" for n in (4, 8, 16) for r in (16, 32, 64, 128)}
    grid_entries = {n for n, a in registry.ablations.items() if "grid:s-lr-rank-blocks" in a.tags}
    assert grid_entries == names
    for n in (4, 8, 16):
        for r in (16, 32, 64, 128):
            a = registry.ablation(f"s-lr-grid-n{n}-r{r}")
            assert (a.options.blocks, a.options.rank) == (n, r)
            # inherited through extends: s-lr-block-n8-r64 -> s-lr-full-r64 -> attnres-full
            assert (a.routing, a.options.key_source, a.options.embedding_key) == ("attnres", "sliced", "sliced")
            assert a.control == "attnres-block-n8"
            assert a.doc.startswith("S-LR rank x block-count grid")


def test_grid_point_equals_the_hand_written_entry(registry):
    grid, hand = registry.ablation("s-lr-grid-n8-r64"), registry.ablation("s-lr-block-n8-r64")
    assert grid.routing == hand.routing and grid.options == hand.options


def test_extends_overrides_fields(registry):
    parent, child = registry.ablation("s-lr-block-n8-r64"), registry.ablation("s-lr-block-n4-r64")
    assert (parent.options.blocks, child.options.blocks) == (8, 4)
    assert (parent.control, child.control) == ("attnres-block-n8", "attnres-block-n4")
    assert child.options.rank == parent.options.rank == 64 and child.options.key_source == "sliced"
    assert child.doc != parent.doc  # doc describes the entry itself, it is not inherited
    size4 = registry.ablation("s-lr-block-size4-r64")
    assert (size4.options.blocks, size4.options.block_size) == (None, 4)  # an override to null
    refdefault = registry.ablation("s-lr-block-n8-r64-refdefault")
    assert (refdefault.options.block_summary, refdefault.options.count_prior, refdefault.options.logit_scale) == ("mean", 1.0, "inv_sqrt_head_dim")
    assert (refdefault.options.rank, refdefault.options.blocks, refdefault.options.key_source) == (64, 8, "sliced")


def test_extends_chain_in_a_dict_registry(raw_registry):
    reg = parse_registry(raw_registry)
    slr, block = reg.ablation("slr"), reg.ablation("slr-block")
    assert (slr.routing, slr.options.key_source, slr.options.rank, slr.options.blocks) == ("attnres", "sliced", 8, None)
    assert (block.routing, block.options.key_source, block.options.rank, block.options.blocks) == ("attnres", "sliced", 8, 2)
    assert block.control == "full"  # inherited from slr
    assert reg.model("t", "slr-block").block_ends() == [2, 4]


def test_size_extends(raw_registry):
    raw_registry["sizes"]["wide"] = {"extends": "t", "doc": "wider", "d_model": 64, "n_heads": 4}
    wide = parse_registry(raw_registry).size("wide")
    assert (wide.d_model, wide.n_heads, wide.n_layers, wide.d_mlp) == (64, 4, 2, 64)


def test_grid_in_a_dict_registry(raw_registry):
    raw_registry["grids"] = {
        "g": {"extends": "slr", "doc": "grid", "control": "full", "name": "g-r{rank}-n{blocks}",
              "axes": {"rank": [4, 8], "blocks": [1, 2, 4]}},
    }
    reg = parse_registry(raw_registry)
    names = sorted(n for n in reg.ablations if n.startswith("g-"))
    assert names == sorted(f"g-r{r}-n{b}" for r in (4, 8) for b in (1, 2, 4))
    assert reg.ablation("g-r4-n2").options.rank == 4 and reg.ablation("g-r4-n2").options.blocks == 2
    assert reg.model("t", "g-r8-n4").block_ends() == [1, 2, 3, 4]


def test_load_registry_from_a_yaml_file(tmp_path, raw_registry):
    path = tmp_path / "registry.yaml"
    path.write_text(yaml.safe_dump(raw_registry))
    reg = load_registry(path)
    assert set(reg.ablations) == {"baseline", "full", "slr", "slr-block"}
    assert reg.path == str(path) and len(reg.sha256) == 64

    raw_registry["ablations"]["slr"]["block_summary"] = "avg"
    path.write_text(yaml.safe_dump(raw_registry))
    with pytest.raises(ValueError, match=r"ablations\.slr.*block_summary.*avg"):
        load_registry(path)


# ---- bad input (requirement 9) -----------------------------------------------------------------


def test_unknown_ablation_name_lists_closest(registry):
    with pytest.raises(ValueError) as info:
        registry.ablation("s-lr-blok-n8-r64")
    assert "s-lr-blok-n8-r64" in str(info.value) and "s-lr-block-n8-r64" in str(info.value)


def test_unknown_size_name_lists_closest(registry):
    with pytest.raises(ValueError) as info:
        registry.size("paper-05b")
    assert "paper-05b" in str(info.value) and "paper-0.5b" in str(info.value)
    with pytest.raises(ValueError, match="tiny"):
        registry.model("tiyn", "baseline")


def test_unknown_field(raw_registry):
    raw_registry["ablations"]["slr"]["blokcs"] = 4
    raises_naming(raw_registry, "ablations.slr", "blokcs", "blocks")  # the hint names the real field


def test_unknown_size_field(raw_registry):
    raw_registry["sizes"]["t"]["n_layer"] = 3
    raises_naming(raw_registry, "sizes.t", "n_layer")


def test_unknown_section(raw_registry):
    raw_registry["ablation"] = {}
    raises_naming(raw_registry, "ablation", "section")


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_summary", "avg"),
        ("routing", "attention"),
        ("key_source", "keys"),
        ("key_norm", "layer"),
        ("query_init", "ones"),
        ("embedding_key", "learned"),
        ("logit_scale", -1.0),
        ("logit_scale", "sqrt"),
        ("query_norm", "yes"),
        ("blocks", 0),
        ("blocks", 2.5),
        ("rank", -8),
        ("depth_heads", 0),
        ("count_prior", "one"),
        ("count_prior", float("nan")),
        ("count_prior", float("inf")),
        ("logit_scale", float("inf")),
        ("doc", None),
        ("doc", 5),
        ("control", 5),
        ("control", "slr"),  # itself
        ("tags", "abc"),
        ("tags", 5),
        ("extends", ["full"]),
    ],
)
def test_bad_value(raw_registry, field, value):
    raw_registry["ablations"]["slr"][field] = value
    raises_naming(raw_registry, "ablations.slr", field)


def test_bad_value_names_the_value(raw_registry):
    raw_registry["ablations"]["slr"]["block_summary"] = "avg"
    raises_naming(raw_registry, "ablations.slr", "block_summary", "avg", "mean")


def test_rank_larger_than_d(raw_registry, registry):
    raw_registry["ablations"]["slr"]["rank"] = 64  # d_model = 32: fine without a size ...
    reg = parse_registry(raw_registry)
    with pytest.raises(ValueError) as info:  # ... an error for the (size, ablation) pair
        reg.model("t", "slr")
    assert "slr" in str(info.value) and "rank" in str(info.value)
    with pytest.raises(ValueError, match=r"s-lr-full-r64.*rank"):
        registry.model("tiny", "s-lr-full-r64")
    with pytest.raises(ValueError, match=r"s-lr-full-r512.*rank"):
        ModelConfig(registry.size("tiny"), registry.ablation("s-lr-full-r512"))


def test_rank_not_divisible_by_depth_heads(raw_registry):
    raw_registry["ablations"]["slr"]["depth_heads"] = 3
    raises_naming(raw_registry, "ablations.slr", "rank", "depth_heads")


def test_d_not_divisible_by_depth_heads(raw_registry):
    raw_registry["ablations"]["slr"].update(rank=6, depth_heads=3)  # rank fine, d=32 is not
    reg = parse_registry(raw_registry)
    with pytest.raises(ValueError, match=r"slr.*depth_heads"):
        reg.model("t", "slr")


def test_d_not_divisible_by_n_heads(raw_registry):
    raw_registry["sizes"]["t"]["n_heads"] = 3
    raises_naming(raw_registry, "sizes.t", "n_heads")


def test_odd_attention_head_size(raw_registry):
    raw_registry["sizes"]["t"].update(d_model=30, n_heads=2)  # head size 15 cannot be rotated in pairs
    raises_naming(raw_registry, "sizes.t", "n_heads")


def test_non_positive_size_field(raw_registry):
    raw_registry["sizes"]["t"]["n_layers"] = 0
    raises_naming(raw_registry, "sizes.t", "n_layers")


def test_blocks_more_than_sublayers(raw_registry):
    raw_registry["ablations"]["slr-block"]["blocks"] = 5  # 2L = 4
    reg = parse_registry(raw_registry)
    with pytest.raises(ValueError) as info:
        reg.model("t", "slr-block")
    assert "slr-block" in str(info.value) and "blocks" in str(info.value)
    raw_registry["ablations"]["slr-block"]["blocks"] = 4  # exactly 2L is fine
    assert parse_registry(raw_registry).model("t", "slr-block").block_ends() == [1, 2, 3, 4]


def test_block_size_more_than_sublayers(raw_registry):
    raw_registry["ablations"]["slr-block"].update(blocks=None, block_size=5)
    with pytest.raises(ValueError, match=r"slr-block.*block_size"):
        parse_registry(raw_registry).model("t", "slr-block")


def test_blocks_and_block_size_together(raw_registry):
    raw_registry["ablations"]["slr-block"]["block_size"] = 2
    raises_naming(raw_registry, "ablations.slr-block", "blocks")


def test_sliced_keys_with_static_embedding_key(raw_registry):
    raw_registry["ablations"]["slr"]["embedding_key"] = "static"
    raises_naming(raw_registry, "ablations.slr", "embedding_key", "sliced")


def test_value_key_source_with_a_rank(raw_registry):
    raw_registry["ablations"]["full"]["rank"] = 8
    raises_naming(raw_registry, "ablations.full", "rank")


def test_low_rank_key_source_without_rank(raw_registry):
    raw_registry["ablations"]["slr"]["rank"] = None
    raises_naming(raw_registry, "ablations.slr", "rank")


def test_cycle_in_extends(raw_registry):
    raw_registry["ablations"]["full"]["extends"] = "slr-block"  # full -> slr-block -> slr -> full
    message = raises_naming(raw_registry, "extends", "cycle")
    assert "full" in message and "slr" in message


def test_self_extends(raw_registry):
    raw_registry["ablations"]["full"]["extends"] = "full"
    raises_naming(raw_registry, "ablations.full", "extends", "cycle")


def test_unknown_parent(raw_registry):
    raw_registry["ablations"]["slr"]["extends"] = "fulll"
    raises_naming(raw_registry, "ablations.slr", "extends", "fulll", "full")


@pytest.mark.parametrize("field", ["doc", "control"])
def test_missing_doc_or_control(raw_registry, field):
    del raw_registry["ablations"]["full"][field]
    raises_naming(raw_registry, "ablations.full", field)


def test_doc_is_not_inherited(raw_registry):
    del raw_registry["ablations"]["slr-block"]["doc"]  # its parent has one, but it describes the parent
    raises_naming(raw_registry, "ablations.slr-block", "doc")


def test_missing_size_field(raw_registry):
    del raw_registry["sizes"]["t"]["d_mlp"]
    raises_naming(raw_registry, "sizes.t", "d_mlp")


def test_unknown_control(raw_registry):
    raw_registry["ablations"]["slr"]["control"] = "basline"
    raises_naming(raw_registry, "ablations.slr", "control", "basline", "baseline")


def test_grid_name_collides_with_an_ablation(raw_registry):
    raw_registry["ablations"]["slr-n2"] = {"doc": "hand-written", "extends": "slr", "blocks": 2}
    raw_registry["grids"] = {
        "g": {"extends": "slr", "doc": "grid", "name": "slr-n{blocks}", "axes": {"blocks": [1, 2]}},
    }
    raises_naming(raw_registry, "grids.g", "name", "slr-n2")


def test_grid_names_collide_between_grids(raw_registry):
    raw_registry["grids"] = {
        "g1": {"extends": "slr", "doc": "one", "name": "slr-n{blocks}", "axes": {"blocks": [1, 2]}},
        "g2": {"extends": "slr", "doc": "two", "name": "slr-n{blocks}", "axes": {"blocks": [2, 4]}},
    }
    raises_naming(raw_registry, "grids.g2", "name", "slr-n2")


def test_grid_template_must_name_every_axis(raw_registry):
    raw_registry["grids"] = {
        "g": {"extends": "slr", "doc": "grid", "name": "g-n{blocks}", "axes": {"blocks": [1, 2], "rank": [4, 8]}},
    }
    raises_naming(raw_registry, "grids.g", "name", "{rank}")


def test_grid_point_with_a_bad_value(raw_registry):
    raw_registry["grids"] = {
        "g": {"extends": "slr", "doc": "grid", "name": "g-{block_summary}", "axes": {"block_summary": ["sum", "avg"]}},
    }
    raises_naming(raw_registry, "ablations.g-avg", "block_summary")


@pytest.mark.parametrize("field, value", [("rank", 8), ("blocks", 2), ("key_source", "projected"), ("count_prior", 1.0),
                                          ("depth_heads", 2)])
@pytest.mark.parametrize("routing", ["residual", "gated"])
def test_attnres_fields_on_other_routing_are_an_error_not_ignored(raw_registry, routing, field, value):
    raw_registry["ablations"]["baseline"].update({"routing": routing, field: value})
    raises_naming(raw_registry, "ablations.baseline", field, "routing: attnres")


def test_extending_an_attnres_entry_with_other_routing_must_reset_its_fields(raw_registry):
    raw_registry["ablations"]["g"] = {"doc": "gated", "control": "baseline", "extends": "slr", "routing": "gated"}
    raises_naming(raw_registry, "ablations.g", "key_source")


@pytest.mark.parametrize("field, value", [("rope_theta", float("nan")), ("rope_theta", "big"), ("init_std", True),
                                          ("init_std", -0.1)])
def test_bad_size_number(raw_registry, field, value):
    raw_registry["sizes"]["t"][field] = value
    raises_naming(raw_registry, "sizes.t", field)


def test_grid_template_with_an_unknown_placeholder(raw_registry):
    raw_registry["grids"] = {"g": {"name": "x-{rank}-{foo}", "extends": "slr", "doc": "d", "control": "full",
                                   "axes": {"rank": [4, 8]}}}
    raises_naming(raw_registry, "grids.g", "name", "foo")

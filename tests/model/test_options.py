"""A kind's options: checked from their annotations (one line naming the option as written), nested under the kind
in the registry, and the older forms (flat registry entries, stored configs) resolving to the same models."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import pytest
import yaml
from helpers.models import DEEPER
from helpers.paths import GOLDEN_DIR

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.options import (
    FiniteFloat,
    KindOptions,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
)
from lrattn_lightning.model.registry import (
    PACKAGED_PATH,
    load_registry,
    model_config_from_dict,
    parse_registry,
)
from lrattn_lightning.model.routing.kinds import FLAT, KINDS
from lrattn_lightning.train.checkpoint.compat import architecture_differences

GOLDEN = GOLDEN_DIR
FLAT_REGISTRY = GOLDEN / "registry-flat.yaml"  # registry.yaml as it was before options nested (every option flat)
STORED = GOLDEN / "model-configs-flat.json"  # ModelConfig.to_dict() of every entry then, at BIG, by that code
BIG = "paper-0.5b"  # a size every entry fits


@dataclass(frozen=True)
class Demo(KindOptions):
    flat_names: ClassVar[dict[str, str]] = {"mode": "demo_mode"}
    flag: bool = False
    mode: Literal["rw", "lr", "rw_lr"] = "rw"
    rank: PositiveInt = 4
    steps: NonNegativeInt = 0
    blocks: PositiveInt | None = None
    alpha: Annotated[float, Range(0, 1, open_low=True, open_high=True)] | None = None
    scale: PositiveFloat | Literal["none"] = "none"
    prior: FiniteFloat = 0.0
    weight: Annotated[float, Range(0, 1, note="0: off")] = 0.5


GOOD = [("flag", True), ("flag", False), ("mode", "rw_lr"), ("rank", 1), ("rank", 10**6), ("steps", 0), ("blocks", None),
        ("blocks", 3), ("alpha", None), ("alpha", 0.5), ("scale", 2), ("scale", 0.5), ("scale", "none"), ("prior", -3),
        ("prior", 1.5), ("weight", 0), ("weight", 1.0)]
BAD = [
    ("flag", 1, "field 'flag': must be true or false, got 1"),
    ("flag", "yes", "field 'flag': must be true or false, got 'yes'"),
    ("mode", "rwlr", "field 'demo_mode': 'rwlr' is not one of ['rw', 'lr', 'rw_lr']; closest: rw_lr"),
    ("mode", True, "field 'demo_mode': True is not one of ['rw', 'lr', 'rw_lr']"),
    ("rank", 0, "field 'rank': must be a positive integer, got 0"),
    ("rank", True, "field 'rank': must be a positive integer, got True"),
    ("rank", 2.0, "field 'rank': must be a positive integer, got 2.0"),
    ("steps", -1, "field 'steps': must be an integer >= 0, got -1"),
    ("blocks", 0, "field 'blocks': must be a positive integer or null, got 0"),
    ("blocks", "4", "field 'blocks': must be a positive integer or null, got '4'"),
    ("alpha", 1, "field 'alpha': must be a number in (0, 1) or null, got 1"),
    ("alpha", 0.0, "field 'alpha': must be a number in (0, 1) or null, got 0.0"),
    ("alpha", False, "field 'alpha': must be a number in (0, 1) or null, got False"),
    ("scale", -1, "field 'scale': must be a positive number or one of ['none'], got -1"),
    ("scale", float("inf"), "field 'scale': must be a positive number or one of ['none'], got inf"),
    ("scale", "nonee", "field 'scale': 'nonee' is not one of ['none']; closest: none"),
    ("prior", float("nan"), "field 'prior': must be a finite number, got nan"),
    ("prior", "one", "field 'prior': must be a finite number, got 'one'"),
    ("weight", 1.5, "field 'weight': must be a number in [0, 1] (0: off), got 1.5"),
]


@pytest.mark.parametrize("option, value", GOOD)
def test_values_the_annotation_allows_pass(option, value):
    Demo(**{option: value}).validate("ablations.x")


@pytest.mark.parametrize("option, value, says", BAD)
def test_values_the_annotation_refuses_are_one_line(option, value, says):
    with pytest.raises(InputError) as err:
        Demo(**{option: value}).validate("ablations.x")
    assert str(err.value) == f"ablations.x: {says}"


def test_an_error_names_the_option_as_written():
    nested = Demo.written({"rank": 0}, {"rank": "demo.rank"})
    with pytest.raises(InputError, match=r"^ablations\.x: field 'demo\.rank': must be a positive integer, got 0$"):
        nested.validate("ablations.x")
    assert (nested.label("mode"), nested.name_of("rank"), Demo().label("mode")) == ("demo_mode", "rank", "demo_mode")
    assert Demo(rank=5).as_dict()["demo_mode"] == "rw" and Demo(rank=5).nested()["mode"] == "rw"
    assert nested == Demo(rank=0)  # how it was written is no part of the value


def undocumented(x):
    """x without its `doc` texts (sizes, ablations, model configs and their stored dicts): the docs may cite other
    documents than when the golden data was written; everything else must be equal."""
    if isinstance(x, dict):
        return {k: undocumented(v) for k, v in x.items() if k != "doc"}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name for f in dataclasses.fields(x)}
        if "doc" in fields:
            x = dataclasses.replace(x, doc="")
        return dataclasses.replace(x, **{f: undocumented(getattr(x, f)) for f in ("size", "ablation") if f in fields})
    return x


# ---- the registry: nested, flat, and the two resolving alike ------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    return load_registry(PACKAGED_PATH)


def test_the_shipped_registry_writes_every_option_nested():
    raw = yaml.safe_load(PACKAGED_PATH.read_text())
    flat = {(name, key) for name, entry in raw["ablations"].items() for key in entry if key in FLAT}
    assert not flat, f"options written flat: {sorted(flat)[:5]}"
    assert any(isinstance(entry.get("laurel"), dict) for entry in raw["ablations"].values())


def test_every_entry_of_the_flat_registry_resolves_as_before(shipped):
    """registry.yaml as it was before nesting (every option a plain field) loads, every entry equal to today's."""
    old = load_registry(FLAT_REGISTRY)
    assert undocumented(old.sizes) == {name: undocumented(shipped.sizes[name]) for name in old.sizes}
    assert len(old.ablations) > 60
    for name, ablation in old.ablations.items():
        assert undocumented(shipped.ablation(name)) == undocumented(ablation), name
        assert undocumented(shipped.model(BIG, name).to_dict()) == undocumented(old.model(BIG, name).to_dict()), name


def test_every_entry_written_nested_or_flat_is_the_same(shipped):
    """Each resolved entry written back both ways (nested under its kind; flat, as stored) parses to itself."""
    for name, ablation in shipped.ablations.items():
        common = {"doc": ablation.doc, "control": None, "routing": ablation.routing, "tags": list(ablation.tags)}
        nested = {**common, ablation.routing: ablation.options.nested()}
        flat = {**common, **ablation.options.as_dict()}
        for form in (nested, flat):
            again = parse_registry({"ablations": {name: form}}).ablation(name)
            assert again.options == ablation.options and again.kind is ablation.kind, name


def test_extends_merges_options_one_by_one_across_forms(raw_registry):
    full = {"doc": "d", "control": None, "routing": "attnres",
            "attnres": {"key_source": "sliced", "rank": 64, "embedding_key": "sliced", "blocks": 8}}
    raw_registry["ablations"] = {
        "full": full,
        "nested": {"extends": "full", "doc": "d", "attnres": {"rank": 16}},
        "flat": {"extends": "full", "doc": "d", "rank": 16},
        "flat-parent": {"doc": "d", "control": None, "routing": "attnres", "key_source": "sliced", "rank": 64,
                        "embedding_key": "sliced", "blocks": 8},
        "nested-child": {"extends": "flat-parent", "doc": "d", "attnres": {"rank": 16}},
    }
    reg = parse_registry(raw_registry)
    options = {reg.ablation(n).options for n in ("nested", "flat", "nested-child")}
    assert len(options) == 1
    (merged,) = options
    assert (merged.key_source, merged.rank, merged.blocks) == ("sliced", 16, 8)


# ---- stored configs (checkpoints, exports) ------------------------------------------------------------------------


def test_stored_configs_of_every_entry_load_as_the_same_architecture(shipped):
    """ModelConfig.to_dict() of every entry as the code before nesting wrote it (a checkpoint's model_config)."""
    stored = json.loads(STORED.read_text())
    assert len(stored) > 60
    for name, old in stored.items():
        cfg = shipped.model(BIG, name)
        assert undocumented(model_config_from_dict(old)) == undocumented(cfg), name
        assert architecture_differences(old, cfg) == [], name
        assert undocumented(cfg.to_dict()) == undocumented(old), name  # the stored form did not change


def test_a_stored_config_with_nested_options_is_the_same_architecture(shipped):
    cfg = shipped.model(BIG, "laurel-rw")
    stored = cfg.to_dict()
    nested = {**stored, "ablation": {k: v for k, v in stored["ablation"].items() if k not in ("laurel_mode", "laurel_rank")}
              | {"laurel": {"mode": "rw"}}}
    assert model_config_from_dict(nested) == cfg and architecture_differences(nested, cfg) == []
    other = {**stored, "ablation": {**stored["ablation"], "laurel_mode": "lr"}}
    assert architecture_differences(other, cfg) == ["ablation.laurel_mode: checkpoint 'lr' vs now 'rw'"]


# ---- unknown options, foreign options, errors naming the option as written ---------------------------------------


def entry(**fields) -> dict:
    return {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, **fields}}}


@pytest.mark.parametrize("fields, says", [
    ({"routing": "laurel", "laurel": {"rnak": 8}},
     "ablations.x: field 'laurel.rnak': routing laurel has no option 'rnak'; closest: rank (its options: mode, rank)"),
    ({"routing": "muddformer", "muddformer": {"prepost": True}},
     "field 'muddformer.prepost': routing muddformer has no option 'prepost'; closest: prepost_norm"),
    ({"routing": "laurel", "laurel_rnak": 8}, "ablations.x: field 'laurel_rnak': unknown field; closest: laurel_rank"),
    ({"routing": "laurel", "laurel": 8}, "field 'laurel': must be a mapping of routing laurel's options"),
    ({"routing": "residual", "residual": {"rank": 8}}, "field 'residual.rank': routing residual has no options"),
    ({"routing": "laurel", "laurel": {"rank": 0}}, "field 'laurel.rank': must be a positive integer, got 0"),
    ({"routing": "laurel", "laurel": {"mode": "rw", "rank": 4}},
     "field 'laurel.rank': mode rw has no low-rank term; remove rank=4"),
    ({"routing": "laurel", "laurel": {"mode": "rwlr"}}, "field 'laurel.mode': 'rwlr' is not one of ['rw', 'lr', "
                                                        "'rw_lr']; closest: rw_lr"),
    ({"routing": "laurel", "laurel": {"rank": 8}, "laurel_rank": 8}, "field 'laurel_rank': given twice (laurel.rank "
                                                                     "and laurel_rank); keep one"),
    ({"routing": "residual", "laurel": {"rank": 8}},
     "field 'laurel.rank': only routing laurel reads it; routing is 'residual'"),
    ({"routing": "hyper_connections", "hyper_connections": {"norm": "ln"}},
     "field 'hyper_connections.norm': 'ln' is not one of ['rms', 'layer']"),
    ({"routing": "delta_attnres", "delta_attnres": {"block_layers": 2}},
     "field 'delta_attnres.block_layers': only mode: delta_block reads it; set mode: delta_block"),
    ({"routing": "denseformer", "options": {"dilation": 2}}, "field 'options': write a kind's options under its name"),
])
def test_a_bad_option_is_one_line_naming_it_as_written(fields, says):
    with pytest.raises(InputError) as err:
        parse_registry(entry(**fields))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_size_check_names_the_option_as_written():
    ablation = parse_registry(entry(routing="laurel", laurel={"rank": 40})).ablation("x")
    with pytest.raises(InputError, match=r"field 'laurel\.rank': rank=40 exceeds d_model=32; choose rank <= 32$"):
        ModelConfig(DEEPER, ablation)


def test_replace_takes_option_names_and_flat_names():
    ablation = parse_registry(entry(routing="laurel")).ablation("x")
    assert ablation.replace(rank=4).options == ablation.replace(laurel_rank=4).options
    assert ablation.replace(rank=4).options.rank == 4
    with pytest.raises(InputError, match="routing laurel has no option 'rnak'; closest: rank"):
        ablation.replace(rnak=4)


def test_flat_names_are_unique_and_name_their_kind():
    assert FLAT["laurel_rank"] == ("laurel", "rank") and FLAT["rank"] == ("attnres", "rank")
    assert FLAT["hc_norm"] == ("hyper_connections", "norm") and FLAT["mudd_dynamic"] == ("muddformer", "dynamic")
    assert len(FLAT) == sum(len(kind.Options.names()) for kind in KINDS.values())

"""Issue 52 (2): the settings dataclasses are the one source of what the recipe fingerprint holds, what a resume
compares and what `lrattn fit` checks. Every field of train/settings.py's groups carries a mark for each reader or a
reason it has none; the readers' lists are derived from the marks. Before, `OPTIMIZER_SETTINGS` was written by hand
and left out `betas`: two fits that differed only in --model.betas shared one fingerprint, one row, one mean.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from types import SimpleNamespace

import pytest

from lrattn_lightning.cli.checks import check_training_numbers
from lrattn_lightning.core.errors import InputError, UsageError
from lrattn_lightning.train import fingerprint as fp
from lrattn_lightning.train import settings
from lrattn_lightning.train.checkpoint import compat
from lrattn_lightning.train.settings import RECIPE_MARKS, RESUME_MARKS, Check, Not, Typed

FIELDS = {f.name: (group, f) for group in settings.SETTING_GROUPS for f in dataclasses.fields(group)}
DEFAULTS = {name: f.default for name, (_, f) in FIELDS.items()}


def unmarked(group: type) -> list[str]:
    """`reader: field` for each mark a field of `group` lacks (a mark, or Not with a reason)."""
    allowed = {"recipe": RECIPE_MARKS, "resume": RESUME_MARKS}
    missing = []
    for f in dataclasses.fields(group):
        for reader in ("recipe", "resume", "check"):
            mark = f.metadata.get(reader)
            given = (isinstance(mark, Check | Typed) if reader == "check" else mark in allowed[reader])
            if not given and not (isinstance(mark, Not) and mark.why.strip()):
                missing.append(f"{reader}: {f.name}")
    return missing


def test_every_setting_is_marked_for_each_reader():
    assert settings.SETTING_GROUPS == (settings.OptimiserSettings, settings.RuntimeSettings)
    for group in settings.SETTING_GROUPS:
        assert unmarked(group) == [], group.__name__
    # every --model.* flag is a field of a marked group or a routing kind's option (the method, tagged apart)
    assert set(settings.FLAGS) == set(FIELDS) | set(settings.ROUTING)


def test_a_new_field_with_neither_mark_fails_the_rule():
    @dataclasses.dataclass(frozen=True)
    class Grown:
        lr: float = settings.setting(1e-3, recipe="optimizer", resume="checkpoint", check=settings.AT_LEAST_0)
        new_knob: float = 0.5  # added without saying what it is to the recipe, a resume or the command line
        half: float = dataclasses.field(default=0.1, metadata={"recipe": Not(""), "resume": "checkpoint",
                                                               "check": Not("why")})  # a reason must say something

    assert unmarked(Grown) == ["recipe: new_knob", "resume: new_knob", "check: new_knob", "recipe: half"]


def _other(name: str):
    """A valid value of setting `name` other than its default."""
    group, f = FIELDS[name]
    kind, value = typing.get_type_hints(group)[name], DEFAULTS[name]
    if typing.get_origin(kind) is typing.Literal:
        return next(v for v in reversed(typing.get_args(kind)) if v != value)  # muon_dtype: float32
    if isinstance(value, bool):
        return not value
    if isinstance(value, tuple):
        return (0.8, 0.9)
    if isinstance(value, float):
        return value * 0.9 if value else 0.01
    if isinstance(value, int):
        return value + 1
    if value is None:
        return 7
    return "reference" if value != "reference" else "fast"  # impl


def _parts(**changed):
    """The recipe of a fit with these settings, as train/callbacks/description.py builds it (max_steps 10; the
    Muon dtype resolved as on a GPU, the schedule's length as schedule_steps(trainer, hp))."""
    flat = {**DEFAULTS, **changed}
    settings.module_settings(**flat)  # a valid combination
    return fp.recipe_parts(size="tiny", max_steps=10, tokens_per_step=64, seq_len=32, data="d", settings=flat,
                           gradient_clip_val=1.0, precision="32-true", init_from="none",
                           schedule_steps=flat["schedule_steps"] or 10,
                           muon_dtype={"auto": "bfloat16"}.get(flat["muon_dtype"], flat["muon_dtype"]))


def test_two_fits_that_differ_only_in_betas_get_different_fingerprints():
    a, b = _parts(), _parts(betas=(0.9, 0.99))
    assert fp.fingerprint(a) != fp.fingerprint(b)
    assert fp.differences(b, a) == [("optimizer.betas", [0.9, 0.99], [0.9, 0.95])]


@pytest.mark.parametrize("name", [n for n, (_, f) in FIELDS.items() if f.metadata["recipe"] in RECIPE_MARKS])
def test_every_recipe_setting_changes_the_fingerprint(name):
    assert fp.fingerprint(_parts(**{name: _other(name)})) != fp.fingerprint(_parts()), name


@pytest.mark.parametrize("name", [n for n, (_, f) in FIELDS.items() if isinstance(f.metadata["recipe"], Not)])
def test_a_setting_marked_outside_the_recipe_keeps_the_fingerprint(name):
    assert fp.fingerprint(_parts(**{name: _other(name)})) == fp.fingerprint(_parts()), name


def test_the_fingerprint_names_its_rule_and_rule_1_parts_predate_it():
    parts = _parts()
    assert parts["version"] == fp.RECIPE_VERSION == 2 and not fp.predates_rule(parts)
    rule_1 = {k: v for k, v in parts.items() if k != "version"}
    rule_1["optimizer"] = {k: v for k, v in parts["optimizer"].items() if k != "betas"}
    assert fp.predates_rule(rule_1) and fp.predates_rule(fp.legacy_parts({"size": "tiny"}))
    assert fp.fingerprint(rule_1) != fp.fingerprint(parts)


# ---- what a resume compares ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(registry):
    cfg = registry.model("tiny", "baseline")
    return cfg, {"hyper_parameters": {"model_config": cfg.to_dict(), **DEFAULTS}}


def test_a_resume_compares_the_settings_marked_checkpoint(tiny_checkpoint):
    assert compat.RESTORED_WITH_OPTIMIZER == settings.marked("resume", "checkpoint") == (
        "optimizer", "lr", "weight_decay", "betas", "muon_lr", "muon_weight_decay")
    cfg, checkpoint = tiny_checkpoint
    for name in compat.RESTORED_WITH_OPTIMIZER:
        with pytest.raises(InputError, match=f"--model.{name}: the checkpoint was trained with"):
            compat.check_loaded(checkpoint, cfg, {**DEFAULTS, name: _other(name)})
    for name in (n for n, (_, f) in FIELDS.items() if isinstance(f.metadata["resume"], Not)):
        compat.check_loaded(checkpoint, cfg, {**DEFAULTS, name: _other(name)})  # a resume may change it


# ---- what the command line checks ----------------------------------------------------------------------------
def _fit(**model):
    return SimpleNamespace(model={**DEFAULTS, **model}, trainer={})


def test_the_command_line_checks_every_setting_with_a_check():
    checked = dict(settings.checks())
    assert set(checked) == {"lr", "muon_lr", "weight_decay", "muon_weight_decay", "z_loss", "warmup_steps",
                            "muon_momentum_warmup_steps", "muon_momentum_cooldown_steps", "decay_fraction",
                            "final_lr_fraction", "betas", "schedule_steps",  # and those whose type is their range:
                            "optimizer", "muon_variant", "muon_dtype", "allow_schedule_change", "compile",
                            "document_masking", "attention", "loss_impl", "routing_diagnostics"}
    check_training_numbers("fit", _fit())  # the defaults pass
    bad = {"betas": [0.9, 1.0], "schedule_steps": 0, "decay_fraction": 1.5, "final_lr_fraction": -0.1}
    for name, check in checked.items():
        value = bad.get(name, -1)
        assert not check.ok(value)
        with pytest.raises(UsageError, match=rf"--model\.{name} .*: must be {check.what[:12]}"):
            check_training_numbers("fit", _fit(**{name: value}))
    check_training_numbers("validate", _fit(lr=-1))  # fit's settings only


# ---- a field added to a group reaches every reader ------------------------------------------------------------
def test_a_field_added_to_a_group_reaches_the_checks_the_fingerprint_and_a_resume_without_edits(tiny_checkpoint):
    """Each reader derives its list from the groups' fields: a group grown by one field (as a new optimiser setting
    would be) is checked, fingerprinted and compared on resume by the readers as they are, handed the grown groups."""
    grown = dataclasses.make_dataclass("Grown", [("aux_lr", float, settings.setting(
        0.5, recipe="optimizer", resume="checkpoint", check=Check(settings.AT_LEAST_0.ok, "a number >= 0 (aux)")))],
        bases=(settings.OptimiserSettings,), frozen=True)
    groups = (grown, settings.RuntimeSettings)
    assert settings.marked("recipe", "optimizer", groups)[-1] == "aux_lr" and "aux_lr" not in fp.OPTIMIZER_SETTINGS
    # checked where the others are: by the command line before any work, and by the group as it is built
    assert dict(settings.checks(groups))["aux_lr"].what == "a number >= 0 (aux)"
    with pytest.raises(UsageError, match=r"^--model\.aux_lr -1: must be a number >= 0 \(aux\)$"):
        check_training_numbers("fit", _fit(aux_lr=-1), groups)
    with pytest.raises(InputError, match=r"^--model\.aux_lr -1: must be a number >= 0 \(aux\)$"):
        grown(aux_lr=-1)
    assert grown().aux_lr == 0.5 and grown().momentum_schedule() == settings.OptimiserSettings().momentum_schedule()
    # the recipe: a key of the optimizer part, which changes the fingerprint
    def parts(value):
        return fp.recipe_parts(size="tiny", max_steps=10, tokens_per_step=64, seq_len=32, data="d", precision="32",
                               settings={**DEFAULTS, "aux_lr": value}, gradient_clip_val=1.0, init_from="none",
                               groups=groups)
    assert parts(0.5)["optimizer"]["aux_lr"] == 0.5
    assert fp.differences(parts(0.25), parts(0.5)) == [("optimizer.aux_lr", 0.25, 0.5)]
    # a resume: the optimizer state would restore the checkpoint's value, so another one is refused
    cfg, checkpoint = tiny_checkpoint
    stored = {"hyper_parameters": {**checkpoint["hyper_parameters"], "aux_lr": 0.5}}
    compat.check_loaded(stored, cfg, {**DEFAULTS, "aux_lr": 0.5}, groups)
    with pytest.raises(InputError, match=r"^--model\.aux_lr: the checkpoint was trained with 0\.5, this run passes "
                                         r"0\.25; resuming restores"):
        compat.check_loaded(stored, cfg, {**DEFAULTS, "aux_lr": 0.25}, groups)
    compat.check_loaded(stored, cfg, {**DEFAULTS, "aux_lr": 0.25})  # the groups as they are: no such setting


def test_a_group_checks_its_ranges_as_it_is_built_with_the_command_lines_words():
    """bad_setting is the one check: the Python API (LRAttnModule.from_config's groups) gets the line `lrattn fit`
    prints; before, only the command line checked the ranges."""
    line = settings.bad_setting({**DEFAULTS, "warmup_steps": -3})
    assert line == "--model.warmup_steps -3: must be an integer >= 0"
    with pytest.raises(InputError, match=f"^{re.escape(line)}$"):
        settings.OptimiserSettings(warmup_steps=-3)
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        check_training_numbers("fit", _fit(warmup_steps=-3))
    with pytest.raises(InputError, match=r"^--model\.schedule_steps 0: must be an integer >= 1 \(or null"):
        settings.module_settings(schedule_steps=0)


@pytest.mark.parametrize("name, bad, what", [
    ("muon_variant", "keller", "one of reference, torch"), ("muon_dtype", "float16", "one of auto, bfloat16, float32"),
    ("loss_impl", "fused", "one of auto, logits, chunked"), ("compile", "yes", "true or false"),
    ("optimizer", "sgd", "one of muon_adamw, adamw")])
def test_a_typed_setting_is_checked_by_its_annotation(name, bad, what):
    """A Literal's or a bool's range is its type, checked by bad_setting as every other range: no hand-written test
    of its values beside the annotation (muon_variant and muon_dtype had their own)."""
    group = next(g for g in settings.SETTING_GROUPS if name in {f.name for f in dataclasses.fields(g)})
    with pytest.raises(InputError, match=rf"^--model\.{name} {bad}: must be {what}$"):
        group(**{name: bad})
    assert settings.bad_setting({**DEFAULTS, name: bad}) == f"--model.{name} {bad}: must be {what}"
    assert group(**{name: DEFAULTS[name]}) is not None  # the default passes
    check = dict(settings.checks())[name]
    assert not check.ok(1 if what == "true or false" else None)  # (1 == True, but not a bool)


def test_the_muon_variants_literal_names_the_variants_optim_builds():
    from lrattn_lightning.train.optim import MUON_VARIANTS, MuonVariant

    assert typing.get_args(MuonVariant) == tuple(MUON_VARIANTS)


def test_typed_is_only_for_a_literal_or_a_bool():
    with pytest.raises(TypeError, match="Literal or a bool"):
        settings.type_check(float)

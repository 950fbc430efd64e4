"""Whether a checkpoint fits the module it is loaded into: the same architecture (descriptive fields aside), and for a
resumed fit the same optimizer settings (its state carries them; torch would restore them over the command line's).
"""

from __future__ import annotations

from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.registry import model_config_from_dict
from lrattn_lightning.train.settings import marked

# Optimizer settings a resumed fit takes from the checkpoint's optimizer state, not from the command line: the
# settings marked resume="checkpoint" (train/settings.py; each other one says who compares it, or why none does)
RESTORED_WITH_OPTIMIZER = marked("resume", "checkpoint")

# What describes an entry rather than builds it: editing these in registry.yaml keeps checkpoints loadable.
DESCRIPTIVE_FIELDS = frozenset({"doc", "control", "tags"})


def architecture_differences(stored: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """Architecture fields (not doc/control/tags) where a checkpoint's model_config differs from `cfg`."""
    mine = cfg.to_dict()
    if stored == mine:  # the config itself (a module built from this checkpoint, a resume of the same entry)
        return []
    # read as any stored config (fields newer than the checkpoint take their defaults), written back the same way
    theirs = model_config_from_dict(stored, "checkpoint model_config").to_dict()
    return [
        f"{part}.{key}: checkpoint {theirs[part].get(key)!r} vs now {mine[part].get(key)!r}"
        for part in ("size", "ablation") for key in dict.fromkeys([*theirs[part], *mine[part]])
        if key not in DESCRIPTIVE_FIELDS and _plain(theirs[part].get(key)) != _plain(mine[part].get(key))
    ]


def check_loaded(checkpoint: dict[str, Any], cfg: ModelConfig, hparams: Any = None,
                 groups: tuple[type, ...] | None = None) -> None:
    """A checkpoint loaded into a module built for `cfg`: same architecture, and (a resumed fit: `hparams` given) the
    same optimizer settings, which torch's load_state_dict would restore over the command line's silently (the
    fields of `groups` marked resume="checkpoint": train/settings.py's, unless given)."""
    stored = checkpoint.get("hyper_parameters", {}).get("model_config")
    if stored is None:
        raise InputError("checkpoint has no 'model_config' hyper-parameter: it was not written by lrattn_lightning")
    diffs = architecture_differences(stored, cfg)
    if diffs:
        raise InputError(
            "checkpoint was trained with a different architecture; pass the same --size/--ablation "
            f"({stored['size']['name']} / {stored['ablation']['name']}). Differences: " + "; ".join(diffs)
        )
    if hparams is None:
        return
    old = checkpoint.get("hyper_parameters", {})
    for key in marked("resume", "checkpoint", groups):
        if key in old and _plain(old[key]) != _plain(hparams[key]):
            raise InputError(
                f"--model.{key}: the checkpoint was trained with {_plain(old[key])!r}, this run passes "
                f"{_plain(hparams[key])!r}; resuming restores the optimizer's settings from the checkpoint, "
                "so resume with the same value (or start a new run)")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value

"""A trained checkpoint, rebuilt for inference: the Decoder, its tokenizer and where it came from.

Checkpoints written by `lrattn fit` describe themselves with plain values (lit_module.py, callbacks/contents.py):
`hyper_parameters.model_config` (size + ablation), `state_dict` (`model.*` is the Decoder),
`tokenizer` (the spec, with a file-backed tokenizer's text under `content`), `data` (the prepared
folder) and `mlflow` (the training run). Errors name the file and the fix.
"""

from __future__ import annotations

import pickle
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lrattn_lightning.core.errors import CheckpointError, InputError, first_line
from lrattn_lightning.data.tokenizer import Tokenizer, load_tokenizer
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import Decoder, build_decoder
from lrattn_lightning.model.registry import model_config_from_dict


@dataclass
class LoadedCheckpoint:
    path: Path
    model: Decoder
    tokenizer: Tokenizer
    tokenizer_spec: dict[str, Any]
    cfg: ModelConfig
    global_step: int
    mlflow: dict[str, Any] | None  # the training run: run_id, experiment_id, tracking_uri
    data_dir: str | None
    seq_len: int  # the window it was trained on (`--data.seq_len`, at most the size's seq_len)


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Rebuild the Decoder and its tokenizer from a checkpoint written by `lrattn fit` (on CPU, eval mode)."""
    path = Path(path)
    ckpt = read_checkpoint_file(path)
    stored = ckpt.get("hyper_parameters", {}).get("model_config")
    if not isinstance(stored, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"checkpoint {path} was not written by lrattn_lightning (no hyper_parameters.model_config "
                        "and state_dict); evaluate a last.ckpt / step*.ckpt from `lrattn fit`")
    state = {k[len("model."):].replace("_orig_mod.", ""): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    check_finite(state, path)
    try:  # the stored config is data: checked field by field; a router class it names is imported only if trusted
        cfg = model_config_from_dict(stored, where=f"checkpoint {path}: model_config")
        model = build_decoder(cfg)
    except CheckpointError:
        raise
    except InputError as err:  # (a config field, an untrusted router: one line as they are, one error class)
        raise CheckpointError(str(err)) from None
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {path}: weights do not fit size '{cfg.size.name}' / ablation "
                        f"'{cfg.ablation.name}': {str(err)[:400]}") from err
    with torch.no_grad():  # weights that are finite but huge (a diverged state) give NaN logits: refused as such
        if not bool(torch.isfinite(model.eval()(torch.zeros(1, 1, dtype=torch.long))).all()):
            raise CheckpointError(f"checkpoint {path} gives non-finite logits (a diverged state); use a checkpoint from before "
                            "the divergence")
    hparams = ckpt.get("hyper_parameters", {})
    if hparams.get("document_masking"):  # evaluate as trained: attend only within documents
        model.doc_separator = hparams.get("doc_separator")
        model.attention = hparams.get("attention") or "sdpa"  # (checkpoints before the choice: sdpa)
    data = ckpt.get("data") or {}
    spec = ckpt.get("tokenizer")
    if spec is None:
        raise CheckpointError(f"checkpoint {path} records no tokenizer; it predates tokenizers in checkpoints. "
                        "Resume it for one step with `lrattn fit --ckpt_path` to write a new one")
    tokenizer = tokenizer_from_spec(spec, path)
    if tokenizer.vocab_size > cfg.size.vocab_size:
        raise CheckpointError(f"tokenizer mismatch: checkpoint {path} holds a {spec.get('kind')} tokenizer of "
                        f"{tokenizer.vocab_size} ids but its model has vocab_size {cfg.size.vocab_size}")
    seq_len = data.get("seq_len") or cfg.size.seq_len  # (checkpoints before it was recorded: the size's)
    return LoadedCheckpoint(path, model.eval(), tokenizer, spec, cfg, int(ckpt.get("global_step", 0)),
                            ckpt.get("mlflow"), data.get("data_dir"), min(int(seq_len), cfg.size.seq_len))


def _cause(err: BaseException) -> str:
    """The cause in a few words: torch's first line, without its advice about weights_only."""
    return first_line(err, limit=160, skip=("weights_only", "Weights only load failed"), typed=True)


# torch.save writes a zip archive (since torch 1.6); its older format opens with this pickle
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)


def read_checkpoint_file(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """torch.load(weights_only=True) of a checkpoint file; anything else is a one-line CheckpointError naming it.

    The file's first bytes tell a torch.save file from anything else (random bytes, a plain pickle) before
    torch reads it; a file that asks to unpickle Python objects is refused, never retried unsafely."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder; pass a checkpoint file such as {path / 'last.ckpt'}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        with open(path, "rb") as file:
            head = file.read(len(_LEGACY_MAGIC))
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({err.strerror or err})") from err
    if not head:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes); use an older checkpoint or start a new run")
    zipped = head.startswith(_ZIP_MAGIC)
    if not zipped and head != _LEGACY_MAGIC:
        raise CheckpointError(f"checkpoint {path} cannot be read: it is not a checkpoint (not a torch.save file); "
                    "pass a last.ckpt / step*.ckpt written by `lrattn fit`")
    try:  # mmap reads only the zip format
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and zipped)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+?)\.?(?:\s|$)", str(err))
        if found is not None:
            raise CheckpointError(f"checkpoint {path} was not loaded: it asks to unpickle {found.group(1)}, which a checkpoint "
                        "of `lrattn fit` (plain values and tensors) never holds; use a checkpoint you trained") from None
        raise CheckpointError(f"checkpoint {path} cannot be read ({_cause(err)}): it is corrupt; use another checkpoint") from None
    except Exception as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({_cause(err)}): it is truncated or corrupt; use another "
                    "checkpoint") from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a checkpoint written by `lrattn fit`")
    return ckpt


def check_finite(state: dict[str, torch.Tensor], path: Path | str) -> None:
    """Weights with NaN or inf (a diverged state) score and generate nothing meaningful: one line naming them."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CheckpointError(f"checkpoint {path} holds non-finite weights ({shown}): a diverged state; use a checkpoint "
                        "from before the divergence")


def tokenizer_from_spec(spec: dict[str, Any], where: Path | str) -> Tokenizer:
    """The checkpoint's tokenizer: byte, or a file-backed one whose file text travels in `content`. A checkpoint
    never names a file to read: a file-backed spec without its content is refused."""
    if not isinstance(spec, dict):
        raise CheckpointError(f"checkpoint {where}: its tokenizer record is a {type(spec).__name__}, not a tokenizer spec")
    spec = dict(spec)
    content = spec.pop("content", None)
    if spec.get("kind") != "byte" and not isinstance(content, str):
        raise CheckpointError(f"checkpoint {where}: its {spec.get('kind')!r} tokenizer carries no file content (a checkpoint "
                        "names no file to read); use a checkpoint written by `lrattn fit`")
    try:
        if content is None:
            return load_tokenizer(spec)
        with tempfile.TemporaryDirectory(prefix="lrattn-tok-") as tmp:
            file = Path(tmp) / Path(spec["file"]).name
            file.write_text(content, encoding="utf-8")
            return load_tokenizer({**spec, "file": str(file)})
    except (ValueError, KeyError, OSError) as err:
        raise CheckpointError(f"checkpoint {where}: its tokenizer {spec.get('kind')!r} cannot be rebuilt ({err})") from err


def check_data_dir(ckpt: LoadedCheckpoint, data_dir: str | Path, flag: str = "--data_dir") -> dict[str, Any]:
    """The prepared folder must use the checkpoint's tokenizer; returns its meta.json."""
    return check_tokenizer(ckpt.tokenizer_spec, ckpt.path, data_dir, flag)


def check_tokenizer(spec: dict[str, Any], path: Path | str, data_dir: str | Path, flag: str) -> dict[str, Any]:
    """Tokens of a folder prepared with another tokenizer are other text to the model: scoring them is noise.
    One line naming both tokenizers; returns the folder's meta.json."""
    from lrattn_lightning.data.shards import read_meta

    meta = read_meta(data_dir)
    theirs, mine = meta["tokenizer"], dict(spec or {})
    differs = theirs.get("kind") != mine.get("kind") or theirs.get("vocab_size") != mine.get("vocab_size")
    if not differs and "content" in mine and theirs.get("file"):
        from lrattn_lightning.data.remote import local_file

        file = local_file(data_dir, theirs["file"], missing_ok=True)  # an s3:// folder's: fetched into the cache
        differs = not file.is_file() or file.read_text(encoding="utf-8") != mine["content"]
    if differs:
        show = {k: v for k, v in mine.items() if k != "content"}
        raise CheckpointError(f"tokenizer mismatch: checkpoint {path} was trained with tokenizer {show}, but "
                        f"{Path(data_dir) / 'meta.json'} was prepared with {theirs}; pass {flag} of the folder "
                        "the checkpoint was trained on")
    return meta


def add_trust_flags(parser: Any) -> None:
    """--registry and --trust_router: the user's word on which router classes a checkpoint may use."""
    parser.add_argument("--registry", default=None,
                        help="registry.yaml whose `routing: external` entries name the router classes a checkpoint may "
                             "import (default: ./registry.yaml, else the shipped one)")
    parser.add_argument("--trust_router", action="append", default=[], metavar="MODULE:CLASS",
                        help="import this router class when a checkpoint names it (repeatable); only for code you trust")


def trust_routers(args: Any) -> None:
    """Make the classes the user named importable (model/routing/trust.py); before any checkpoint is read."""
    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.model.routing.trust import trust

    load_registry(args.registry)
    for path in args.trust_router or ():
        trust(path)


@dataclass
class Upcycling:
    """What `lrattn fit --init_from CKPT` takes from another run's checkpoint (init_weights_from)."""

    path: Path
    step: int
    source: str  # SIZE/ABLATION of the checkpoint
    loaded: dict[str, torch.Tensor]  # our Decoder's names -> the checkpoint's tensors (same shape)
    new: list[str]  # our tensors the checkpoint lacks: they keep this run's initialisation
    unused: list[str]  # the checkpoint's tensors this model lacks
    mlflow_run: str | None

    def summary(self) -> list[str]:
        def names(keys: list[str]) -> str:
            shown = ", ".join(keys[:6])
            return shown + (f", ... ({len(keys)} in all)" if len(keys) > 6 else "")

        lines = [f"--init_from {self.path} (step {self.step}, {self.source}): loaded {len(self.loaded)} tensors "
                 f"({sum(t.numel() for t in self.loaded.values()):,} values) where names and shapes match"]
        lines.append(f"new (this run's initialisation): {names(self.new)}" if self.new else "new: none")
        if self.unused:
            lines.append(f"not used (not in this model): {names(self.unused)}")
        return lines


def init_weights_from(path: str | Path, cfg: ModelConfig) -> Upcycling:
    """The tensors of checkpoint `path` that model `cfg` takes by name and shape; one line on a shape conflict
    (a tensor of the same name and another shape) or a checkpoint that shares no tensor with it."""
    try:
        ckpt = read_checkpoint_file(path)
    except InputError as err:
        raise InputError(f"--init_from: {err}") from None
    stored = ckpt.get("hyper_parameters", {}).get("model_config")
    if not isinstance(stored, dict) or "state_dict" not in ckpt:
        raise InputError(f"--init_from {path}: not a checkpoint of `lrattn fit` (no model_config and state_dict)")
    theirs = {k[len("model."):].replace("_orig_mod.", ""): v for k, v in ckpt["state_dict"].items()
              if k.startswith("model.")}
    with torch.device("meta"):
        ours = {k: v.shape for k, v in build_decoder(cfg).state_dict().items()}
    source = f"{stored['size']['name']}/{stored['ablation']['name']}"
    for name, shape in ours.items():
        if name in theirs and tuple(theirs[name].shape) != tuple(shape):
            raise InputError(f"--init_from {path}: tensor '{name}' is {list(theirs[name].shape)} in {source} and "
                             f"{list(shape)} in {cfg.size.name}/{cfg.ablation.name}; upcycle between entries whose "
                             "shared tensors have one shape (same size; P-LR's extra key rows differ from a baseline's)")
    loaded = {k: theirs[k] for k in ours if k in theirs}
    if not loaded:
        raise InputError(f"--init_from {path}: {source} shares no tensor with {cfg.size.name}/{cfg.ablation.name}")
    return Upcycling(Path(path), int(ckpt.get("global_step", 0)), source, loaded, [k for k in ours if k not in theirs],
                     [k for k in theirs if k not in ours], (ckpt.get("mlflow") or {}).get("run_id"))

"""`lrattn export`: a checkpoint as a Hugging Face transformers model folder.

    lrattn export --checkpoint runs/.../last.ckpt --out hf/my-model
    AutoModelForCausalLM.from_pretrained("hf/my-model", trust_remote_code=True)
    AutoTokenizer.from_pretrained("hf/my-model", trust_remote_code=True)   # or PreTrainedTokenizerFast's
    lrattn eval --checkpoint runs/.../last.ckpt --write_tasks tasks/my-model   # the offline tasks, for:
    lm_eval --model hf --model_args pretrained=hf/my-model,trust_remote_code=True --include_path tasks/my-model ...

The folder holds config.json (the resolved size and ablation as plain values, plus `auto_map` to the
modeling file), model.safetensors (the Decoder's weights), tokenizer files (tokenizer.json for the stock
PreTrainedTokenizerFast, named in tokenizer_config.json with no auto_map: the byte tokenizer is written as
an exact byte-level BPE with no merges; AutoTokenizer still wants trust_remote_code=True, as it resolves
config.json's AutoConfig first), generation_config.json (no max_length: generate(max_new_tokens=...)
would warn that both are set; the window is max_position_embeddings), and modeling_lrattn.py: a thin
wrapper whose model *is* our `Decoder` (it imports lrattn_lightning, so the package must be installed
where the folder is loaded; no second copy of the model). Document masking travels in the config. Generation through `generate()` recomputes the
window at every step (the wrapper keeps no cache); `lrattn generate` uses our KV cache. A `routing: external`
model's folder names its router class in config.json; loading imports it only when the caller names it too:
`from_pretrained(folder, trust_remote_code=True, trust_router="my_pkg.routers:MyRouter")` (the package must be
importable there as well).

--out is written whole into a temporary folder beside it and swapped in; an existing --out is replaced only
when it is a previous export (its `.lrattn-export` marker names every file in it), never the working folder,
a parent of it, home, / or the folder holding the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError, one_line
from lrattn_lightning.core.files import refuse_link
from lrattn_lightning.core.flags import Parser

MODEL_TYPE = "lrattn"
MODELING_FILE = "modeling_lrattn.py"

# The modeling file written into every export. It is ours (not transformers' code): a config holding our
# resolved model config, and a PreTrainedModel around lrattn_lightning's Decoder.
MODELING_SOURCE = '''"""Hugging Face wrapper of an lrattn_lightning Decoder (written by `lrattn export`).

The model is lrattn_lightning's own Decoder (install lrattn-lightning where this folder is loaded).
attention_mask: rows with padding are run one by one without their padding (the decoder has no
padding mask), so left-padded batches in generate() and right-padded scoring batches both work.
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class LRAttnConfig(PretrainedConfig):
    model_type = "lrattn"

    def __init__(self, model_config=None, doc_separator=None, **kwargs):
        self.model_config = model_config or {}
        self.doc_separator = doc_separator
        size = self.model_config.get("size", {})
        kwargs.setdefault("vocab_size", size.get("vocab_size"))
        kwargs.setdefault("hidden_size", size.get("d_model"))
        kwargs.setdefault("num_hidden_layers", size.get("n_layers"))
        kwargs.setdefault("num_attention_heads", size.get("n_heads"))
        kwargs.setdefault("max_position_embeddings", size.get("seq_len"))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class LRAttnForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LRAttnConfig
    base_model_prefix = "model"
    _supports_cache_class = False

    def __init__(self, config, trust_router=None):
        """trust_router: "package.module:Class" (or a list) of a `routing: external` model's router class: config.json
        names it, but only the caller's word lets it be imported (from_pretrained(..., trust_router=...))."""
        super().__init__(config)
        from lrattn_lightning.model.registry import model_config_from_dict
        from lrattn_lightning.model.decoder import build_decoder
        from lrattn_lightning.model.routing.trust import trust

        for path in [trust_router] if isinstance(trust_router, str) else (trust_router or []):
            trust(path, "trust_router")
        self.model = build_decoder(model_config_from_dict(config.model_config, where="config.json: model_config"))
        self.model.doc_separator = config.doc_separator
        self.post_init()

    def _init_weights(self, module):
        pass  # the weights come from model.safetensors

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.head

    def forward(self, input_ids=None, attention_mask=None, labels=None, past_key_values=None,
                use_cache=None, return_dict=None, **kwargs):
        if attention_mask is None or bool(attention_mask.all()):
            logits = self.model(input_ids)
        else:
            logits = input_ids.new_zeros(*input_ids.shape, self.config.vocab_size, dtype=self.model.head.weight.dtype)
            for row in range(input_ids.shape[0]):
                keep = attention_mask[row].bool()
                logits[row, keep] = self.model(input_ids[row, keep][None])[0]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
'''


class ExportError(InputError):
    """A checkpoint or an --out that cannot be exported, said in one line (exit 2, before any work)."""


class ExportFailed(RuntimeError):
    """Writing the export failed midway (a full disk, a file-size limit); nothing of --out was changed."""


# Written into every export: the names of the files it wrote. --overwrite replaces only a folder holding this
# marker and nothing but the files it names, so a mistyped --out never deletes anything an export did not write.
MARKER = ".lrattn-export"


def export_hf(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the Hugging Face folder for `checkpoint` to `out`.

    The export is written whole into a temporary folder beside `out` (same parent: the renames stay on one
    filesystem, so each is atomic), then swapped in: the old export renamed aside, the new one renamed in, the
    old one removed. A failure at any point leaves the previous export (or nothing) and no temporary folder.
    """
    from safetensors import SafetensorError

    from lrattn_lightning.train.checkpoint.load import load_checkpoint

    target = check_out(out, checkpoint, overwrite=overwrite)
    ckpt = load_checkpoint(checkpoint)
    hf_tokenizer = _hf_tokenizer(ckpt.tokenizer, ckpt.tokenizer_spec)
    existed = target.exists()
    created = _make_parents(target.parent)
    staging = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-export-", dir=target.parent))
        _write_export(staging, ckpt, hf_tokenizer, checkpoint)
        _swap_in(staging, target)
    except BaseException as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(created):  # the parents this export made, if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(err, (OSError, SafetensorError)):
            kept = "the previous export is unchanged" if existed else "nothing was written"
            raise ExportFailed(f"--out {out}: writing the export failed ({one_line(err)}); {kept}") from err
        raise
    return Path(out)


def check_out(out: str | Path, checkpoint: str | Path, *, overwrite: bool) -> Path:
    """The resolved --out folder, or an ExportError if writing there could destroy anything not an export's."""
    if os.path.islink(os.path.abspath(out)):  # a link planted as --out is never followed (core/files.py)
        refuse_link(os.path.abspath(out), "--out", folder=True)
    target = Path(os.path.abspath(out)).resolve()  # symlinks and `..` resolved: compare real folders
    out = out if str(out) else "''"  # `--out ""` is the working folder: show it as given
    danger = _protected(target, checkpoint)
    if danger:
        raise ExportError(f"--out {out} is {danger}; an export replaces its --out folder whole, "
                          "choose a new folder (e.g. --out hf/my-model)")
    ancestor = next(p for p in (target, *target.parents) if p.exists() or p.is_symlink())
    if not ancestor.is_dir():
        what = "is a file" if ancestor == target else f"is under {ancestor}, which is a file"
        raise ExportError(f"--out {out} {what}, not a folder; choose a new folder")
    writable = target.parent if ancestor == target else ancestor
    if not os.access(writable, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: cannot create files in {writable} (permission denied); "
                          "choose a folder you can write")
    if ancestor != target or not any(target.iterdir()):
        return target
    foreign = _foreign_entry(target)
    if foreign is not None:
        raise ExportError(f"--out {out} holds {foreign!r}, which no lrattn export wrote; choose a new or empty "
                          f"folder (--overwrite replaces only a previous export, a folder with {MARKER})")
    if not overwrite:
        raise ExportError(f"--out {out} holds a previous export; pass --overwrite to replace it "
                          "or choose a new folder")
    return target


def _protected(target: Path, checkpoint: str | Path) -> str | None:
    """Why `target` must never be replaced (the working folder, a parent of it, home, /, the checkpoint's)."""
    cwd = Path.cwd().resolve()
    if target == Path(target.anchor):
        return "the filesystem root"
    if target == cwd:
        return "the working folder"
    if cwd.is_relative_to(target):
        return f"a parent of the working folder ({cwd})"
    with contextlib.suppress(RuntimeError, KeyError):  # no home folder known: nothing to protect
        home = Path.home().resolve()
        if home.is_relative_to(target):
            return "the home folder" if home == target else f"a parent of the home folder ({home})"
    ckpt = Path(os.path.abspath(checkpoint))
    if ckpt.resolve().is_relative_to(target) or ckpt.is_relative_to(target):
        return f"the folder holding the checkpoint being exported ({checkpoint})"
    return None


def _foreign_entry(folder: Path) -> str | None:
    """The first entry of `folder` that no export wrote (not named by its marker, or not a plain file)."""
    try:
        listed = set(json.loads((folder / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = None  # no marker (or not one an export wrote): every entry is foreign
    for name in sorted(os.listdir(folder)):
        path = folder / name
        plain = path.is_file() and not path.is_symlink()
        if listed is None or not plain or (name != MARKER and name not in listed):
            return name
    return None


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; the folders it created, outermost first (removed again if the export fails)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    for path in missing:
        path.mkdir()
    return missing


def _swap_in(staging: Path, target: Path) -> None:
    """Replace `target` (if any) by `staging`: each rename is atomic; a failed rename-in puts the old one back."""
    aside = None
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        try:
            os.rename(target, aside)  # onto the empty folder mkdtemp reserved
        except BaseException:
            aside.rmdir()
            raise
    try:
        os.rename(staging, target)
    except BaseException:
        if aside is not None:
            os.rename(aside, target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    """The process umask (read by setting and restoring it: os has no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_export(staging: Path, ckpt: Any, hf_tokenizer: Any, checkpoint: str | Path) -> None:
    """Every file of the export into `staging`, the marker last, with the modes the umask gives."""
    from safetensors.torch import save_file

    cfg = ckpt.cfg
    state = {f"model.{k}": v.detach().contiguous() for k, v in ckpt.model.state_dict().items()}
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    eos = ckpt.tokenizer.eos_id
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["LRAttnForCausalLM"],
        "auto_map": {"AutoConfig": "modeling_lrattn.LRAttnConfig",
                     "AutoModelForCausalLM": "modeling_lrattn.LRAttnForCausalLM"},
        "model_config": cfg.to_dict(),
        "doc_separator": ckpt.model.doc_separator,
        "vocab_size": cfg.size.vocab_size,
        "hidden_size": cfg.size.d_model,
        "num_hidden_layers": cfg.size.n_layers,
        "num_attention_heads": cfg.size.n_heads,
        "max_position_embeddings": ckpt.seq_len,  # the trained window: lm-eval's HF model truncates to it
        "eos_token_id": eos,
        "bos_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": str(next(ckpt.model.parameters()).dtype).removeprefix("torch."),
        "lrattn": {"checkpoint": str(Path(checkpoint).resolve()), "global_step": ckpt.global_step},
    }
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # no max_length: transformers warns on every generate(max_new_tokens=...) when both are set; the trained
    # window is config.json's max_position_embeddings
    generation = {"eos_token_id": eos, "bos_token_id": eos, "pad_token_id": eos, "do_sample": False}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (staging / MODELING_FILE).write_text(MODELING_SOURCE)
    hf_tokenizer.save_pretrained(str(staging))
    _stock_tokenizer_class(staging / "tokenizer_config.json")
    files = sorted(os.listdir(staging))
    (staging / MARKER).write_text(json.dumps({"written_by": "lrattn export", "files": files}, indent=2) + "\n")
    # mkdtemp makes a 0700 folder and safetensors 0600 files: give what the umask gives (0755/0644 under 022),
    # or other users cannot load the model
    mask = _umask()
    for name in (*files, MARKER):
        os.chmod(staging / name, 0o666 & ~mask)
    os.chmod(staging, 0o777 & ~mask)


def _stock_tokenizer_class(path: Path) -> None:
    """Name the stock PreTrainedTokenizerFast in tokenizer_config.json (transformers 5 writes its alias
    TokenizersBackend, unknown to 4.x), with no auto_map: the tokenizer needs no code of ours."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("auto_map", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _hf_tokenizer(tokenizer: Any, spec: dict[str, Any]) -> Any:
    """A transformers PreTrainedTokenizerFast that encodes exactly as our tokenizer does."""
    from transformers import PreTrainedTokenizerFast

    from lrattn_lightning.data.tokenizer import EOS_TOKEN

    kind = spec.get("kind")
    if kind == "byte":
        tok = _byte_level_tokenizer()
        eos_token = EOS_TOKEN
    elif kind in ("bpe", "hf"):
        tok = tokenizer._tok
        eos_token = tok.id_to_token(tokenizer.eos_id)
    else:
        raise ExportError(f"checkpoint tokenizer {kind!r}: export writes byte, bpe and hf (tokenizer.json) "
                          "tokenizers; convert the tokenizer to a tokenizer.json first")
    # split_special_tokens: the EOS token's text inside a document is text, as our tokenizers read it
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=eos_token,
                                   model_max_length=None, split_special_tokens=True)
    fast.padding_side = "left"  # generation pads on the left; the wrapper drops padding row by row
    return fast


def _byte_level_tokenizer() -> Any:
    """Ids 0..255 = UTF-8 bytes, 256 = EOS, as `tokenizers` byte-level BPE with no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from lrattn_lightning.data.tokenizer import EOS_TOKEN

    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    if tok.token_to_id(EOS_TOKEN) != 256:
        raise ExportError("byte tokenizer export: EOS did not land on id 256")
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable bytes map to themselves, the rest to code points 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def exported_router(folder: Path) -> str | None:
    """The router class an exported folder's model imports (routing external's `router`, the only kind with one), else
    None."""
    ablation = json.loads((Path(folder) / "config.json").read_text())["model_config"]["ablation"]
    return ablation.get("router") or None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="lrattn export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a last.ckpt / step*.ckpt written by `lrattn fit`")
    parser.add_argument("--out", required=True, help="the folder to write (new, empty, or a previous export)")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace a previous export (a folder holding {MARKER} and only the files it names)")
    from lrattn_lightning.train.checkpoint.load import add_trust_flags, trust_routers

    add_trust_flags(parser)
    args = parser.parse_args(argv)
    try:
        trust_routers(args)  # the router classes the user names, before the checkpoint names one
        out = export_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    except InputError as err:
        print(f"lrattn export: error: {err}", file=sys.stderr)
        return 2
    except ExportFailed as err:  # the work failed (disk full, ...), not the input: exit 1, still one line
        print(f"lrattn export: error: {err}", file=sys.stderr)
        return 1
    router = exported_router(out)
    trust = f", trust_router={router!r}" if router else ""
    print(f"wrote {out}: load with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True{trust}) "
          f"and AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)")
    if router:
        print(f"note: the folder's model imports router class {router}: its package must be installed where the "
              "folder is loaded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

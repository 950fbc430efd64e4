"""Tokenizers: one small protocol, four kinds, each recreated from a plain-dict spec.

    byte                 UTF-8 bytes 0..255 plus EOS = 256 (vocab 257); needs nothing
    bpe:<vocab_size>     byte-level BPE trained with `tokenizers` on the training split at prepare time
    hf:<tokenizer.json>  a `tokenizers` file the user has
    tiktoken:<file>      a `.tiktoken` rank file; only if the optional `tiktoken` package is importable

`spec()` is what `meta.json` stores. File-backed kinds keep their file next to the prepared data
(`tokenizer.json` / `tokenizer.tiktoken`), so a spec names the file relative to the data folder and
`load_tokenizer(spec, base_dir=data_dir)` rebuilds the same tokenizer anywhere.

A user's file is hostile until shown otherwise: its vocabulary is counted before the file is loaded
(`check_vocabulary`: the file's size first, then its entries, against the largest vocabulary of the registry's
sizes or `--max_vocab`), and a failure inside the `tokenizers` library (a Rust panic, e.g. a pre-tokenizer regex
that backtracks past Oniguruma's retry limit) is one line, `TokenizerFailed`, not a Rust backtrace.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lrattn_lightning.core.errors import InputError, first_line

EOS_TOKEN = "<|endoftext|>"
# Special tokens accepted as end-of-sequence in a user's tokenizer.json, in order of preference.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|eos|>", "[SEP]")
# The pre-tokenisation pattern of OpenAI's cl100k_base: a .tiktoken file holds only the ranks.
# A vocabulary entry of a tokenizer.json takes at most this many bytes of its file, merges and tables included
# (GPT-2's 50k entries: 1.4 MB; Llama 3's 128k: 9 MB): a larger file is refused by its size, before it is parsed.
BYTES_PER_ENTRY = 1024
SLACK_BYTES = 16 << 20
_CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[Any]: ...

    def decode(self, ids: list[int]) -> str: ...

    def spec(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; EOS = 256. Decoding drops EOS and replaces broken UTF-8."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[Any]:
        import numpy as np

        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def spec(self) -> dict[str, Any]:
        return {"kind": "byte"}


class HFTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json (trained here for `bpe`, or the user's for `hf`)."""

    def __init__(self, path: str | Path, kind: str = "hf", spec_file: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        self.path = Path(path)
        self.kind = kind
        self.spec_file = spec_file or str(self.path)
        try:
            self._tok = _rust_call(self.spec_file, "could not be loaded", _HF.from_file, str(self.path))
        except TokenizerFailed:
            raise
        except Exception as err:  # the library's own error for a file it cannot read: one line
            raise InputError(f"tokenizer {self.spec_file}: not a tokenizer.json the tokenizers library reads: "
                             f"{first_line(err)}") from None
        # the EOS token's text inside a document is text: only `prepare` puts EOS between documents
        self._tok.encode_special_tokens = True
        self.eos_id = _find_eos(self._tok, self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return _rust_call(self.spec_file, "failed on a text", self._tok.encode, text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[Any]:
        # one thread per process (TOKENIZERS_PARALLELISM=false in `prepare`): its workers are the parallelism
        encodings = _rust_call(self.spec_file, "failed on a text", self._tok.encode_batch, list(texts),
                               add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "file": self.spec_file, "vocab_size": self.vocab_size}


class TiktokenTokenizer:
    """A `.tiktoken` rank file with the cl100k pattern; EOS is the first id after the ranks."""

    def __init__(self, path: str | Path, spec_file: str | None = None) -> None:
        tiktoken = _import_tiktoken()
        from tiktoken.load import load_tiktoken_bpe

        self.path = Path(path)
        self.spec_file = spec_file or str(self.path)
        # tiktoken caches every file it reads under $TMPDIR/data-gym-cache, keyed by its path, and later returns
        # that copy: a file changed (or a prepared folder made again) at the same path would be read stale
        saved = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = ""  # "": no cache
        try:
            ranks = load_tiktoken_bpe(str(self.path))
        finally:
            if saved is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR", None)
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = saved
        self.eos_id = max(ranks.values()) + 1
        self.vocab_size = self.eos_id + 1
        self._enc = tiktoken.Encoding(
            name=self.path.stem, pat_str=_CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={EOS_TOKEN: self.eos_id}
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[Any]:
        return [self._enc.encode_ordinary(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < self.eos_id])  # EOS and ids the model's padded vocabulary adds

    def spec(self) -> dict[str, Any]:
        return {"kind": "tiktoken", "file": self.spec_file, "vocab_size": self.vocab_size}


class TokenizerFailed(InputError):
    """The tokenizers library failed inside (a Rust panic): one line, and picklable, so a worker can send it."""


def _is_panic(err: BaseException) -> bool:
    """pyo3's PanicException (a BaseException, from a module that cannot be imported, so known by its name)."""
    return type(err).__name__ == "PanicException" and type(err).__module__ == "pyo3_runtime"


def _rust_call(name: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) with file descriptor 2 held in an unnamed file: Rust's panic hook writes the panic's
    message and backtrace there before pyo3 raises, and they are dropped for one TokenizerFailed; anything else
    written meanwhile is passed on to stderr afterwards. Where no such file can be made, the call as it is."""
    held = _unnamed_file()
    if held is None:
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            if not _is_panic(err):
                raise
            raise _failed(name, what, err) from None
    sys.stderr.flush()
    saved = os.dup(2)
    panicked = None
    try:
        os.dup2(held, 2)
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            if not _is_panic(err):
                raise
            panicked = err
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if panicked is None and os.lseek(held, 0, os.SEEK_CUR):
            os.lseek(held, 0, os.SEEK_SET)
            with contextlib.suppress(OSError):
                os.write(2, os.read(held, 1 << 20))
        os.close(held)
    raise _failed(name, what, panicked) from None


def _unnamed_file() -> int | None:
    """A file descriptor of a file without a name (memfd; else an unlinked temporary file), or None."""
    with contextlib.suppress(AttributeError, OSError):
        return os.memfd_create("lrattn-tokenizer-stderr", os.MFD_CLOEXEC)
    with contextlib.suppress(OSError):
        with tempfile.TemporaryFile() as f:
            return os.dup(f.fileno())
    return None


def _failed(name: str, what: str, panic: BaseException) -> TokenizerFailed:
    return TokenizerFailed(
        f"tokenizer {name} {what}: the tokenizers library panicked: {first_line(panic, 200)} (a pre-tokenizer "
        "regex that backtracks without end on this text, say); fix the tokenizer file or use another tokenizer")


def check_vocabulary(kind: str, path: str | Path, limit: int, flag: str = "--max_vocab") -> int:
    """The vocabulary size of a user's tokenizer file (hf: tokenizer.json; tiktoken: one rank a line), counted
    without loading it into the tokenizer library; InputError, before any work, past `limit` entries: by the
    file's size first (BYTES_PER_ENTRY a entry, plus SLACK_BYTES), then by its entries."""
    path = Path(path)
    size = path.stat().st_size
    hint = f"pass {flag} N to allow N entries"
    if size > limit * BYTES_PER_ENTRY + SLACK_BYTES:
        raise InputError(f"tokenizer file {path} is {size / 1e6:,.0f} MB: more than a vocabulary of at most {limit:,} "
                         f"entries takes ({(limit * BYTES_PER_ENTRY + SLACK_BYTES) / 1e6:,.0f} MB), so it is not "
                         f"loaded; {hint}")
    if kind == "tiktoken":
        with open(path, "rb") as f:
            count = sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    else:
        count = _json_vocabulary(path)
    if count > limit:
        raise InputError(f"tokenizer file {path} has {count:,} vocabulary entries, more than {limit:,}; {hint}")
    return count


def _json_vocabulary(path: Path) -> int:
    """The number of ids of a tokenizer.json: its model's vocabulary and added tokens (the largest id + 1)."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
        ids += [t["id"] for t in data.get("added_tokens") or []]
        return max((int(i) + 1 for i in ids), default=0)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(f"tokenizer file {path} is not a tokenizer.json with a model vocabulary: "
                         f"{first_line(err, typed=True)}") from None


def parse_tokenizer_name(name: str) -> tuple[str, str | None]:
    """'byte' | 'bpe:4096' | 'hf:path' | 'tiktoken:path' -> (kind, argument)."""
    kind, _, arg = name.partition(":")
    if kind == "byte" and not arg:
        return "byte", None
    if kind in ("bpe", "hf", "tiktoken") and arg:
        if kind == "bpe" and (not arg.isdigit() or int(arg) < 258):
            raise InputError(f"tokenizer '{name}': bpe needs a vocabulary size >= 258 (256 bytes + EOS + merges), e.g. bpe:4096")
        return kind, arg
    raise InputError(f"unknown tokenizer '{name}'; use byte, bpe:<vocab_size>, hf:<tokenizer.json> or tiktoken:<file.tiktoken>")


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style, lossless round trip) on `texts` and save it to `path`."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return HFTokenizer(path, kind="bpe", spec_file=Path(path).name)


def load_tokenizer(spec: dict[str, Any] | str, base_dir: str | Path | None = None) -> Tokenizer:
    """Rebuild a tokenizer from its `spec()` (or from a name like 'byte' / 'hf:path').

    A relative `file` in the spec is resolved against `base_dir` (the prepared data folder).
    """
    if isinstance(spec, str):
        kind, arg = parse_tokenizer_name(spec)
        if kind == "bpe":
            raise InputError("a bpe tokenizer is trained by `prepare`; load it from the prepared folder's meta.json spec")
        spec = {"kind": kind} if arg is None else {"kind": kind, "file": arg}
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind not in ("bpe", "hf", "tiktoken") or not spec.get("file"):
        raise InputError(f"bad tokenizer spec {spec!r}: expected kind byte, or bpe/hf/tiktoken with a file")
    path = Path(spec["file"])
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise InputError(f"tokenizer file {path} not found (tokenizer spec {spec!r})")
    if kind == "tiktoken":
        return TiktokenTokenizer(path, spec_file=spec["file"])
    return HFTokenizer(path, kind=kind, spec_file=spec["file"])


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec_json: str, base_dir: str) -> Tokenizer:
    return load_tokenizer(json.loads(spec_json), base_dir=base_dir)


def encode_texts(texts: Sequence[str], ends: Sequence[bool] | None = None, *, spec_json: str, base_dir: str,
                 dtype: str) -> tuple[Any, Any, Any]:
    """`prepare`'s worker: texts -> (their token ids as one array, EOS after each text that ends a document (all,
    when `ends` is None; a long document comes as several texts); the number of ids of each text, EOS included;
    the UTF-8 bytes of each text)."""
    import numpy as np

    tok = _cached_tokenizer(spec_json, base_dir)
    ends = [True] * len(texts) if ends is None else ends
    pieces = tok.encode_batch(texts)
    eos = np.fromiter(ends, dtype=bool, count=len(texts))
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces)) + eos
    if pieces and isinstance(pieces[0], np.ndarray):  # the byte tokenizer: array copies
        ids = np.empty(int(lengths.sum()), dtype=dtype)
        starts = np.cumsum(lengths) - lengths
        for piece, start in zip(pieces, starts.tolist(), strict=True):
            ids[start : start + len(piece)] = piece
        ids[(starts + lengths - 1)[eos]] = tok.eos_id
        return ids, lengths, lengths - eos  # a byte is a token
    else:  # lists of ints: one flat list, converted once
        flat: list[int] = []
        for piece, end in zip(pieces, ends, strict=True):
            flat += piece
            if end:
                flat.append(tok.eos_id)
        ids = np.array(flat, dtype=dtype)
    n_bytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    return ids, lengths, n_bytes


def _find_eos(tok: Any, path: Path) -> int:
    for name in _EOS_CANDIDATES:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise InputError(f"{path}: no end-of-sequence token found; the tokenizer needs one of {list(_EOS_CANDIDATES)}")


def _import_tiktoken() -> Any:
    try:
        import tiktoken
    except ImportError as err:
        raise InputError(
            "tokenizer 'tiktoken:...' needs the optional package tiktoken, which is not installed "
            "(pip install tiktoken); or use byte, bpe:<vocab_size> or hf:<tokenizer.json>"
        ) from err
    return tiktoken

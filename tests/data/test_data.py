"""Data layer: tokenizers, built-in corpora, prepare (real litdata shards), the DataModule, resume.

Everything runs on a ~150 KB prefix of the stdlib-docs corpus, prepared once per module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lrattn_lightning.data import corpora
from lrattn_lightning.data import prepare as prepare_module
from lrattn_lightning.data.corpora import iter_documents
from lrattn_lightning.data.datamodule import TokenDataModule
from lrattn_lightning.data.documents import Document
from lrattn_lightning.data.formats import ReadOptions
from lrattn_lightning.data.prepare import prepare, split_of
from lrattn_lightning.data.shards import (
    FORMAT_VERSION,
    SPLITS,
    bits_per_byte,
    check_shards,
    read_meta,
    validate_data_dir,
)
from lrattn_lightning.data.sources import Corpus
from lrattn_lightning.data.split import sided
from lrattn_lightning.data.task_files import build_cloze_items
from lrattn_lightning.data.tokenizer import ByteTokenizer, load_tokenizer, parse_tokenizer_name, train_bpe
from lrattn_lightning.model.registry import load_registry

MAX_BYTES = 150_000
SAMPLE = "Attention over depth: h_j = Σ_i α_ij v_i — naïve café, 日本語.\n\tTabs and\nnewlines."
COMMON_WORDS = {"the", "a", "of", "to", "and", "is", "in", "that", "for", "be", "this", "if", "it", "are", "with"}


@pytest.fixture(scope="module")
def data_test_docs() -> list[Document]:
    return list(iter_documents("stdlib-docs", max_bytes=MAX_BYTES))


@pytest.fixture(scope="module")
def data_test_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "stdlib-byte"
    prepare(out_dir=out, max_bytes=MAX_BYTES, chunk_bytes="64KB", cloze_items=100)
    return out


def _tiny_size(**changes):
    return dataclasses.replace(load_registry().size("tiny"), **changes)  # vocab 512, seq_len 32


def _split_texts(docs: list[Document], split: str) -> list[str]:
    return [d.text for d in docs if split_of(d.key, 0.05) == split] or []


# ---------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256
    assert tok.decode([*ids, tok.eos_id]) == SAMPLE  # EOS is dropped
    again = load_tokenizer(json.loads(json.dumps(tok.spec())))
    assert again.encode(SAMPLE) == ids


def test_bpe_training_round_trip(tmp_path, data_test_docs):
    texts = [d.text for d in data_test_docs[:40]]
    tok = train_bpe(texts, 400, tmp_path / "tokenizer.json")
    assert 258 <= tok.vocab_size <= 400
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE  # byte-level: lossless even for unseen characters
    assert tok.eos_id not in ids and tok.decode([*ids, tok.eos_id]) == SAMPLE
    assert len(tok.encode(texts[0])) < len(texts[0].encode())  # merges compress the training text
    spec = tok.spec()
    assert spec["file"] == "tokenizer.json"  # relative: the prepared folder carries it
    again = load_tokenizer(spec, base_dir=tmp_path)
    assert again.encode(texts[1]) == tok.encode(texts[1]) and again.eos_id == tok.eos_id
    # the EOS token's text inside a document is text, not a document boundary (as for byte and tiktoken)
    quoted = "a file ends with <|endoftext|> here"
    for t in (tok, again):
        ids = t.encode(quoted)
        assert t.eos_id not in ids and t.decode(ids) == quoted


def test_tokenizer_name_errors(tmp_path, monkeypatch):
    assert parse_tokenizer_name("bpe:4096") == ("bpe", "4096")
    for bad in ("bpe:100", "bpe:x", "word", "hf:"):
        with pytest.raises(ValueError, match="tokenizer"):
            parse_tokenizer_name(bad)
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer(f"hf:{tmp_path / 'missing.json'}")
    (tmp_path / "x.tiktoken").write_text("")
    with monkeypatch.context() as m:  # optional for users: without it the kind fails with the fix
        m.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise ImportError
        with pytest.raises(ValueError, match="pip install tiktoken"):
            load_tokenizer(f"tiktoken:{tmp_path / 'x.tiktoken'}")


# ---------------------------------------------------------------------------------------------- corpora


def test_stdlib_corpus_is_real_english():
    docs = list(iter_documents("stdlib-docs", max_bytes=600_000))
    text = "\n".join(d.text for d in docs)
    assert len(text.encode()) >= 600_000
    words = text.lower().split()
    assert sum(w in COMMON_WORDS for w in words) / len(words) > 0.15  # prose, not code
    for phrase in ("the function", "return", "exception", "module"):
        assert phrase in text.lower()
    kinds = {d.key.split(":")[0] for d in docs}
    assert kinds == {"pydoc", "stdlib"}  # reference docs and module docstrings
    assert len({d.text for d in docs}) == len(docs)  # deduplicated
    assert min(len(d.text) for d in docs) >= corpora.MIN_FRAGMENT_CHARS
    assert not any("  " in line.strip() for d in docs for line in d.text.splitlines())  # runs collapsed


def _sides(docs, fraction=0.05, seed=0) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {"train": [], "val": []}
    for doc, side in sided(docs, fraction, seed):
        out[side].append(doc)
    return out


def test_split_is_deterministic_and_disjoint(data_test_docs):
    first = _sides(data_test_docs)
    second = _sides(list(iter_documents("stdlib-docs", max_bytes=MAX_BYTES)))
    assert [d.key for d in first["val"]] == [d.key for d in second["val"]]
    train_keys, val_keys = {d.key for d in first["train"]}, {d.key for d in first["val"]}
    assert val_keys and train_keys and not train_keys & val_keys
    assert len(first["train"]) + len(first["val"]) == len(data_test_docs)
    keys = [f"doc-{i}" for i in range(4000)]
    frac = sum(split_of(k, 0.05) == "val" for k in keys) / len(keys)
    assert 0.04 < frac < 0.06


def _corpus_documents(spec, **options) -> list[Document]:
    corpus = Corpus(spec, ReadOptions(**options))
    corpus.check()
    return list(corpus.documents())


def test_text_folder_and_jsonl_sources(tmp_path):
    """A user's files are read as they are: a .txt file is one document, a JSONL line is one; no key (the split
    goes by content); an empty document is skipped; a line without the field is one line naming it."""
    para = "This paragraph is long enough to be kept as prose, it has many words in it."
    (tmp_path / "a.txt").write_text(f"{para}\n\nshort\n\n{para} Again.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": para + " From jsonl."}) + "\n\n"
                                      + json.dumps({"text": "  "}) + "\n")
    docs = _corpus_documents(str(tmp_path))
    assert [d.text for d in docs] == [(tmp_path / "a.txt").read_text(), para + " From jsonl."]
    assert [d.key for d in docs] == [None, None] and [d.origin for d in docs] == ["a.txt", "b.jsonl:1"]
    (tmp_path / "c.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:1: no field 'text' \(fields: body\); pass --text_field"):
        _corpus_documents(str(tmp_path))
    assert [d.text for d in _corpus_documents(str(tmp_path / "c.jsonl"), text_field="body")] == ["no text field"]
    with pytest.raises(ValueError, match="not a built-in corpus"):
        Corpus(str(tmp_path / "nope"), ReadOptions())


def test_hf_source_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load Hugging Face dataset 'no-such-user/no-such-data'.*local cache"):
        Corpus("hf:no-such-user/no-such-data", ReadOptions()).check()


def test_debian_corpora_name_their_package(monkeypatch, tmp_path):
    monkeypatch.setattr(corpora, "JARGON_DIR", tmp_path / "none")
    with pytest.raises(ValueError, match="apt-get install jargon-text"):
        next(iter_documents("jargon"))
    monkeypatch.setattr(corpora.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="apt-get install bible-kjv"):
        next(iter_documents("bible-kjv"))


@pytest.mark.parametrize("source,word", [("jargon", "hacker"), ("bible-kjv", "LORD")])
def test_debian_corpora_when_installed(source, word):
    if (source == "jargon" and not (corpora.JARGON_DIR / "jargon.txt.gz").exists()) or (
        source == "bible-kjv" and shutil.which("bible") is None
    ):
        pytest.skip(f"Debian corpus {source} is not installed")
    docs = list(iter_documents(source, max_documents=300))
    assert len(docs) == 300 and word in "\n".join(d.text for d in docs)


# ---------------------------------------------------------------------------------------------- prepare


def test_prepare_writes_shards_meta_and_tasks(data_test_dir, data_test_docs):
    meta = read_meta(data_test_dir)
    assert meta["format_version"] == FORMAT_VERSION and meta["source"] == "stdlib-docs"
    assert meta["tokenizer"] == {"kind": "byte"} and meta["vocab_size"] == 257 and meta["dtype"] == "uint16"
    for split in SPLITS:
        counts = meta["splits"][split]
        assert counts["tokens"] == counts["bytes"] + counts["documents"]  # bytes + one EOS per document
        assert counts["bytes_per_token"] == pytest.approx(counts["bytes"] / counts["tokens"])
        chunks = check_shards(data_test_dir, split)
        assert sum(c["dim"] for c in chunks) == counts["tokens"]
    assert len(check_shards(data_test_dir, "train")) > 1  # several chunks at 64KB
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(data_test_docs)
    assert not list(data_test_dir.parent.glob(".*"))  # no staging leftovers


def test_task_files_come_from_held_out_documents(data_test_dir, data_test_docs):
    val_flat = [" ".join(t.split()) for t in _split_texts(data_test_docs, "val")]
    rows = [json.loads(line) for line in (data_test_dir / "tasks" / "cloze.jsonl").read_text().splitlines()]
    assert rows and len(rows) == read_meta(data_test_dir)["tasks"]["cloze"]["items"]
    for row in rows:
        assert len(row["choices"]) == 4 and len(set(row["choices"])) == 4 and 0 <= row["gold"] < 4
        true = row["context"] + " " + row["choices"][row["gold"]]
        assert any(true in t for t in val_flat)
    ppl = [json.loads(line) for line in (data_test_dir / "tasks" / "perplexity.jsonl").read_text().splitlines()]
    assert ppl and all(any(r["text"] in t for t in _split_texts(data_test_docs, "val")) for r in ppl)
    val_docs = [d for d in data_test_docs if split_of(d.key, 0.05) == "val"]
    assert build_cloze_items(val_docs, 50, seed=7) == build_cloze_items(val_docs, 50, seed=7)
    assert build_cloze_items(val_docs, 50, seed=7) != build_cloze_items(val_docs, 50, seed=8)


def test_second_prepare_without_overwrite_fails(data_test_dir):
    before = sorted(p.name for p in data_test_dir.parent.iterdir())
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare(out_dir=data_test_dir, max_bytes=MAX_BYTES)
    assert sorted(p.name for p in data_test_dir.parent.iterdir()) == before


def test_failed_prepare_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure after the shards were written")

    monkeypatch.setattr(prepare_module, "write_task_files", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        prepare(out_dir=tmp_path / "new", max_bytes=20_000)
    assert list(tmp_path.iterdir()) == []  # neither the output nor the staging folder
    old = tmp_path / "old"
    old.mkdir()
    (old / "marker").write_text("kept")
    (old / "meta.json").write_text("{}")  # a prepared folder: --overwrite may replace it
    with pytest.raises(RuntimeError, match="simulated"):
        prepare(out_dir=old, max_bytes=20_000, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and (old / "marker").read_text() == "kept"


def test_prepare_with_bpe(tmp_path):
    meta = prepare(out_dir=tmp_path / "bpe", tokenizer="bpe:300", max_bytes=30_000, cloze_items=10)
    assert (tmp_path / "bpe" / "tokenizer.json").is_file() and meta["tokenizer"]["kind"] == "bpe"
    assert meta["vocab_size"] <= 300 and meta["splits"]["train"]["bytes_per_token"] > 1.2
    dm = TokenDataModule(str(tmp_path / "bpe"), batch_size=2, seq_len=16)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 17) and int(batch.max()) < meta["vocab_size"]
    assert dm.tokenizer().decode(batch[0].tolist())
    # hf:<tokenizer.json>: the user's file is copied in, so the prepared folder stands alone
    user_file = shutil.copy(tmp_path / "bpe" / "tokenizer.json", tmp_path / "mine.json")
    meta_hf = prepare(out_dir=tmp_path / "hf", tokenizer=f"hf:{user_file}", max_bytes=30_000, cloze_items=10)
    assert meta_hf["tokenizer"]["file"] == "tokenizer.json" and meta_hf["splits"] == meta["splits"]


# ---------------------------------------------------------------------------------------------- DataModule


def _windows(loader) -> list[tuple[int, ...]]:
    return [tuple(row) for batch in loader for row in batch.tolist()]


def test_streaming_windows_are_corpus_substrings(data_test_dir, data_test_docs):
    dm = TokenDataModule(str(data_test_dir), batch_size=4, seq_len=32)
    tok = dm.tokenizer()
    assert dm.vocab_size == 257 and dm.bytes_per_token("val") < 1.0  # EOS tokens carry no bytes
    for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
        corpus = "\n".join(_split_texts(data_test_docs, split))
        batch = next(iter(loader))
        assert batch.dtype == torch.int64 and batch.shape == (4, 33)
        for row in batch.tolist():
            for piece in bytes(t if t != tok.eos_id else 0 for t in row).split(b"\0"):  # EOS ends a document
                assert piece in corpus.encode()
                assert tok.decode(list(piece)).strip("\ufffd") in corpus  # a window may cut a UTF-8 character


def test_two_ranks_see_disjoint_data(data_test_dir, monkeypatch):
    everything = _windows(TokenDataModule(str(data_test_dir), batch_size=4, seq_len=64).train_dataloader())
    assert len(set(everything)) == len(everything)  # windows are unique, so content identifies them
    per_rank = []
    for rank in (0, 1):  # litdata's _DistributedEnv.detect() reads these when iteration starts
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        per_rank.append(set(_windows(TokenDataModule(str(data_test_dir), batch_size=4, seq_len=64).train_dataloader())))
    assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1]
    assert abs(len(per_rank[0]) - len(per_rank[1])) <= 4  # drop_last: equal batches per rank
    assert per_rank[0] | per_rank[1] <= set(everything)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_resumes_at_the_same_batch(data_test_dir, num_workers):
    def make() -> TokenDataModule:
        return TokenDataModule(str(data_test_dir), batch_size=4, seq_len=32, num_workers=num_workers)

    dm = make()
    it = iter(dm.train_dataloader())
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(dm.state_dict()))  # plain values, as in a checkpoint
    expected = [next(it) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(state)  # before the loader exists: applied when it is built
    it2 = iter(resumed.train_dataloader())
    for want in expected:
        assert torch.equal(next(it2), want)


def test_trainer_checkpoint_resumes_data_position(data_test_dir, tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(257, 2)
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch.clone())
            return self.emb(batch).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps: int, ckpt_path=None, callbacks=()) -> list[torch.Tensor]:
        model = Recorder()
        trainer = L.Trainer(
            max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, callbacks=list(callbacks), enable_checkpointing=bool(callbacks), default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule=TokenDataModule(str(data_test_dir), batch_size=2, seq_len=16), ckpt_path=ckpt_path)
        return model.seen

    full = fit(6)
    fit(3, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)])
    ckpt = next((tmp_path / "ck").glob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    assert saved["TokenDataModule"]["train_loader"]["num_samples_yielded"] == 3 * 2
    rest = fit(6, ckpt_path=ckpt)
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, full[3:], strict=True))


# ---------------------------------------------------------------------------------------------- validation


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_validate_for_accepts_and_fills_seq_len(data_test_dir):
    dm = TokenDataModule(str(data_test_dir))
    with pytest.raises(ValueError, match="seq_len is unset"):
        dm.train_dataloader()
    dm.validate_for(_tiny_size())
    assert dm.seq_len == 32 and next(iter(dm.train_dataloader())).shape == (8, 33)


def test_validate_missing_or_empty_dir(tmp_path):
    size = _tiny_size()
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(ValueError, match="missing or empty.*lrattn prepare"):
            TokenDataModule(str(path)).validate_for(size)
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(ValueError, match=r"meta\.json is missing.*lrattn prepare"):
        validate_data_dir(tmp_path, size)


def test_validate_corrupt_meta_and_shards(data_test_dir, tmp_path):
    size = _tiny_size()
    bad = _copy(data_test_dir, tmp_path / "meta")
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"meta\.json is corrupt"):
        validate_data_dir(bad, size)
    (bad / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    with pytest.raises(ValueError, match="corrupt: missing"):
        validate_data_dir(bad, size)

    bad = _copy(data_test_dir, tmp_path / "truncated")
    chunk = sorted((bad / "train").glob("chunk-*.bin"))[0]
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"shard .*{chunk.name} is corrupt: expected \\d+ bytes, found"):
        validate_data_dir(bad, size)
    chunk.unlink()
    with pytest.raises(ValueError, match="found missing"):
        TokenDataModule(str(bad), seq_len=8).train_dataloader()
    (bad / "val" / "index.json").unlink()
    with pytest.raises(ValueError, match=r"val/index\.json is missing or unreadable"):
        check_shards(bad, "val")


def test_validate_vocab_and_seq_len_against_size(data_test_dir):
    with pytest.raises(ValueError, match="data vocab_size 257 .* exceeds model vocab_size 200 .*byte"):
        validate_data_dir(data_test_dir, _tiny_size(vocab_size=200))
    with pytest.raises(ValueError, match="seq_len 64 exceeds the 32 positions"):
        TokenDataModule(str(data_test_dir), seq_len=64).validate_for(_tiny_size())


def test_validate_val_split_shorter_than_a_window(data_test_dir):
    val_tokens = read_meta(data_test_dir)["splits"]["val"]["tokens"]
    size = _tiny_size(seq_len=val_tokens)
    with pytest.raises(ValueError, match=f"val split .* has {val_tokens} tokens .* fewer than one window"):
        validate_data_dir(data_test_dir, size)


def test_bits_per_byte():
    assert bits_per_byte(2 * 0.6931471805599453, 2.0) == pytest.approx(1.0)


@pytest.mark.parametrize("source, tokenizer, out", [
    ("stdlib-docs", "byte", "data/stdlib-docs-byte"),
    ("stdlib-docs", "bpe:4096", "data/stdlib-docs-bpe4096"),
    ("stdlib-docs", "hf:/tmp/some/where/bpe600.json", "data/stdlib-docs-hf-bpe600"),  # was data/stdlib-docs-hf/tmp/...
    ("/home/u/corpus/", "tiktoken:/x/cl100k_base.tiktoken", "data/corpus-tiktoken-cl100k_base"),
])
def test_default_out_is_one_folder_under_data(source, tokenizer, out):
    from lrattn_lightning.data.prepare import default_out

    assert default_out(source, tokenizer) == out


def test_tiktoken_rank_file_round_trip_and_out_of_vocab_ids(tmp_path):
    """A `.tiktoken` rank file (here: the 256 bytes and two merges): lossless round trip, the EOS text inside
    a document is text, and ids the model's larger vocabulary can sample beyond EOS decode to nothing."""
    import base64

    pytest.importorskip("tiktoken")  # a dev dependency (pyproject), optional for users
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the"]
    (tmp_path / "mini.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    tok = load_tokenizer(f"tiktoken:{tmp_path / 'mini.tiktoken'}")
    assert (tok.eos_id, tok.vocab_size) == (258, 259)
    text = "the theory of <|endoftext|> — naïve"
    ids = tok.encode(text)
    assert 257 in ids and tok.eos_id not in ids and tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.eos_id + 1, tok.eos_id + 20]) == text
    # the file is read as it is now: tiktoken's own cache (by path, in $TMPDIR) would return the first version
    (tmp_path / "mini.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks[:257])))
    assert load_tokenizer(f"tiktoken:{tmp_path / 'mini.tiktoken'}").vocab_size == 258

"""The held-out data of the offline lm-eval tasks, written by `prepare` into `<data_dir>/tasks/`.

    tasks/cloze.jsonl       multiple-choice continuation items from held-out documents (lrattn_cloze)
    tasks/perplexity.jsonl  held-out documents for loglikelihood_rolling (lrattn_ppl)

The task YAMLs that read these files live in `lrattn_lightning/eval/task_configs/`. The items are
sized in words, for no particular model: an evaluation cuts each cloze context to the checkpoint's
trained window in its tokens (eval/tasks.py `fit_cloze_items`; `lrattn eval --write_tasks DIR` for
lm_eval's own command line).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lrattn_lightning.core.files import replacing
from lrattn_lightning.data.documents import Document

CLOZE_CONTEXT_WORDS = 48
CLOZE_CONTINUATION_WORDS = 12
CLOZE_PER_DOCUMENT = 16
CLOZE_CHOICES = 4
PERPLEXITY_MAX_CHARS = 4000


def write_task_files(
    docs: list[Document], out: Path, seed: int, cloze_items: int, perplexity_documents: int
) -> dict[str, Any]:
    """Write tasks/cloze.jsonl and tasks/perplexity.jsonl from held-out documents; deterministic in `seed`."""
    out.mkdir(parents=True, exist_ok=True)
    cloze = build_cloze_items(docs, cloze_items, seed)
    ppl = build_perplexity_documents(docs, perplexity_documents)
    for name, rows in (("cloze", cloze), ("perplexity", ppl)):
        with replacing(out / f"{name}.jsonl", what="task file") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {
        "cloze": {"file": "tasks/cloze.jsonl", "items": len(cloze), "choices": CLOZE_CHOICES, "target_delimiter": " "},
        "perplexity": {"file": "tasks/perplexity.jsonl", "items": len(ppl)},
        "seed": seed,
    }


def build_cloze_items(docs: list[Document], n_items: int, seed: int) -> list[dict[str, Any]]:
    """Items {id, context, choices, gold, source}: choose the true next words of a passage among 4.

    Passages are disjoint word windows of held-out documents; distractors are the continuations of
    other passages. Context and choices are joined by one space (lm-eval's target_delimiter).
    """
    span = CLOZE_CONTEXT_WORDS + CLOZE_CONTINUATION_WORDS
    passages = []  # (context, continuation, key)
    for doc in docs:
        words = doc.text.split()
        for start in range(0, len(words) - span + 1, span)[:CLOZE_PER_DOCUMENT]:
            ctx = " ".join(words[start : start + CLOZE_CONTEXT_WORDS])
            cont = " ".join(words[start + CLOZE_CONTEXT_WORDS : start + span])
            passages.append((ctx, cont, doc.key))
    rng = random.Random(seed)
    rng.shuffle(passages)
    continuations = sorted({c for _, c, _ in passages})
    items = []
    for ctx, cont, key in passages[:n_items]:
        others = [c for c in continuations if c != cont]
        if len(others) < CLOZE_CHOICES - 1:
            break
        choices = [cont, *rng.sample(others, CLOZE_CHOICES - 1)]
        rng.shuffle(choices)
        items.append({"id": len(items), "context": ctx, "choices": choices, "gold": choices.index(cont), "source": key})
    return items


def build_perplexity_documents(docs: list[Document], n_docs: int) -> list[dict[str, Any]]:
    """Rows {id, text, source}: held-out documents, cut at a word boundary after PERPLEXITY_MAX_CHARS."""
    rows = []
    for doc in docs[:n_docs]:
        text = doc.text
        if len(text) > PERPLEXITY_MAX_CHARS:
            cut = text.rfind(" ", 0, PERPLEXITY_MAX_CHARS)
            text = text[: cut if cut > 0 else PERPLEXITY_MAX_CHARS]
        rows.append({"id": len(rows), "text": text, "source": doc.key})
    return rows

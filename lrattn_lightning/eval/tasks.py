"""Which lm-eval tasks an evaluation runs: presets, the offline local tasks, and loading with clear errors.

    --tasks local              lrattn_cloze + lrattn_ppl, offline, data from the prepared folder
    --tasks paper              the LR-AttnRes paper's list at 5 shots (needs the Hugging Face datasets)
    --tasks hellaswag,arc_easy any lm-eval task, group or tag; presets and names can be mixed

The local task YAMLs ship in `lrattn_lightning/eval/task_configs/`. Their data files are not
committed: `lrattn prepare` writes them from the held-out split (`<data_dir>/tasks/*.jsonl`,
data/task_files.py), so an evaluation copies
the YAMLs into a temporary include folder with `data_files` pointing at that folder (lm-eval's
`dataset_path: json`). Only when a name is not local or in `--include-path` is lm-eval's default
task index built (about 14 s).

The cloze items are written in words at prepare time (48 words of context, 12 per choice), not for any one
model: given the checkpoint's trained window, the materialised copy cuts each item's context from the left, at
a word boundary, so that context + its longest choice fit the window in the checkpoint's tokens (lm-eval's HF
model otherwise truncates each such request from the left with a warning). `lrattn eval --write_tasks DIR`
writes that copy for `lm_eval --model hf ... --include_path DIR`, so both score the same items.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import load_yaml_strict, read_yaml_text, replacing, write_file
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.train.schema import Tag

TASKS_DIR = Path(__file__).resolve().parent / "task_configs"
# local task name -> the key of its data file in the prepared folder's meta.json["tasks"]
LOCAL_TASKS = {"lrattn_cloze": "cloze", "lrattn_ppl": "perplexity"}


class TaskError(InputError):
    """A task that cannot be found or loaded; the message names the task and what to do."""


@dataclass(frozen=True)
class Preset:
    tasks: tuple[str, ...]
    num_fewshot: int | None  # None: each task's own default (0 unless its YAML says otherwise)
    doc: str


PRESETS = {
    "local": Preset(tuple(LOCAL_TASKS), None, "offline cloze accuracy and perplexity on the held-out split"),
    "paper": Preset(("mmlu", "arc_challenge", "arc_easy", "commonsense_qa", "hellaswag", "openbookqa", "piqa",
                     "winogrande"), 5, "the LR-AttnRes paper's downstream list at 5 shots"),
}


def expand_tasks(spec: str | list[str]) -> tuple[list[str], int | None]:
    """'local,hellaswag' -> (task names without duplicates, the few-shot count a named preset implies)."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    shots: int | None = None
    for part in (p.strip() for p in parts):
        if not part:
            continue
        preset = PRESETS.get(part)
        if preset is not None:
            names.extend(preset.tasks)
            if preset.num_fewshot is not None:
                shots = preset.num_fewshot if shots is None else max(shots, preset.num_fewshot)
        else:
            names.append(part)
    return list(dict.fromkeys(names)), shots


def materialise_local_tasks(names: list[str], data_dir: str | Path | None, out_dir: Path, *,
                            window: int | None = None, encode: Callable[[str], list[int]] | None = None) -> list[str]:
    """Write the YAMLs of the local tasks among `names` into `out_dir`, pointing at `data_dir`'s files.

    With the trained `window` and the checkpoint's `encode`, the cloze items are first cut to fit it
    (`fit_cloze_items`) into `out_dir/lrattn_cloze.jsonl`, which its YAML reads instead.
    """
    wanted = [n for n in names if n in LOCAL_TASKS]
    if not wanted:
        return []
    if data_dir is None:
        raise TaskError(f"tasks {wanted} read the prepared data folder, but none is known: the checkpoint records "
                        "no data_dir; pass --data-dir DIR (a folder written by `lrattn prepare`)")
    from lrattn_lightning.data import remote
    from lrattn_lightning.data.shards import read_meta

    root = str(data_dir) if remote.is_remote(data_dir) else Path(data_dir).resolve()
    meta = read_meta(root)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        key = LOCAL_TASKS[name]
        rel = (meta.get("tasks") or {}).get(key, {}).get("file", f"tasks/{key}.jsonl")
        path = remote.local_file(root, rel, missing_ok=True)  # an s3:// folder's file: fetched into the cache
        if not path.is_file() or path.stat().st_size == 0:
            raise TaskError(f"task '{name}': its data file {path} is missing or empty; prepare the folder again with "
                            f"`lrattn prepare --out {root} --overwrite` (it writes tasks/*.jsonl from the held-out split)")
        source = TASKS_DIR / f"{name}.yaml"
        config = load_yaml_strict(read_yaml_text(source, "task"), source)
        header = f"# {name}: written by lrattn_lightning.eval.tasks from {path}\n"
        if name == "lrattn_cloze" and window is not None and encode is not None:
            path, header = _write_fitted_cloze(path, out_dir / f"{name}.jsonl", window, encode)
        # the datasets library's cache of this file goes into out_dir (removed after the run), not ~/.cache
        config["dataset_kwargs"] = {"data_files": {"test": str(path)}, "cache_dir": str(out_dir / "hf-datasets")}
        write_file(out_dir / f"{name}.yaml", header + yaml.safe_dump(config, sort_keys=False), "task file")
    return wanted


def fit_cloze_items(items: list[dict[str, Any]], window: int,
                    encode: Callable[[str], list[int]]) -> tuple[list[dict[str, Any]], int, int]:
    """Each item with its context cut from the left at a word boundary so that, for every choice, the tokens
    of `context + " " + choice` (lm-eval's target_delimiter) number at most window + 1: the model reads all
    but the last of them, so the whole request fits the window and lm-eval never truncates it.

    -> (items, how many were cut, how many cannot fit even with one context word: those stay whole, and
    lm-eval truncates them from the left as it would any long request). The fewest words are dropped.
    """
    limit = window + 1
    out, cut, unfit = [], 0, 0
    for item in items:
        words = item["context"].split(" ")

        def tokens(first: int, words: list[str] = words, choices: list[str] = item["choices"]) -> int:
            context = " ".join(words[first:])
            return max(len(encode(f"{context} {choice}")) for choice in choices)

        if tokens(0) <= limit:
            out.append(item)
            continue
        if tokens(len(words) - 1) > limit:
            out.append(item)
            unfit += 1
            continue
        # binary search for the first kept word: tokens(hi) always fits, tokens(lo) does not
        lo, hi = 0, len(words) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if tokens(mid) <= limit else (mid, hi)
        out.append({**item, "context": " ".join(words[hi:])})
        cut += 1
    return out, cut, unfit


def _write_fitted_cloze(src: Path, dst: Path, window: int, encode: Callable[[str], list[int]]) -> tuple[Path, str]:
    """`src`'s cloze items cut to `window` (fit_cloze_items) into `dst` -> (dst, the YAML's header comment)."""
    items = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    fitted, cut, unfit = fit_cloze_items(items, window, encode)
    with replacing(dst, what="task file") as f:
        for item in fitted:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    said = (f"{cut} of {len(items)} items had their context cut from the left (at a word boundary) so that context "
            f"+ longest choice fit the trained window of {window} tokens")
    if unfit:
        said += f"; {unfit} do not fit even with one context word and stay whole (lm-eval truncates them)"
        print(f"[lrattn eval] lrattn_cloze: {unfit} of {len(items)} items do not fit the trained window of {window} "
              "tokens even with one word of context; lm-eval truncates them from the left", file=sys.stderr)
    return dst, f"# lrattn_cloze: written by lrattn_lightning.eval.tasks from {src}\n# {said}\n"


# what `write_tasks` puts into its folder: only a folder holding nothing else is replaced
WRITTEN = {*(f"{n}.yaml" for n in LOCAL_TASKS), "lrattn_cloze.jsonl", "hf-datasets"}


def write_tasks(names: list[str], data_dir: str | Path | None, out: Path, *, window: int,
                encode: Callable[[str], list[int]]) -> str:
    """`lrattn eval --write_tasks DIR`: the local tasks for one checkpoint into DIR (new, empty, or a previous
    --write_tasks folder); -> what to print: the folder and the lm_eval command that reads it."""
    wanted = [n for n in names if n in LOCAL_TASKS]
    if not wanted:
        raise TaskError(f"--write_tasks writes the local tasks ({', '.join(LOCAL_TASKS)}), but --tasks names none "
                        "of them; pass --tasks local")
    if out.exists() and not out.is_dir():
        raise TaskError(f"--write_tasks {out} is a file, not a folder; choose a new folder")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in WRITTEN) if out.is_dir() else []
    if foreign:
        raise TaskError(f"--write_tasks {out} holds {foreign[0]!r}, which --write_tasks did not write; "
                        "choose a new or empty folder")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in WRITTEN:  # a previous write's files (and their datasets cache): none left stale
            if (out / name).is_dir():
                shutil.rmtree(out / name)
            else:
                (out / name).unlink(missing_ok=True)
        materialise_local_tasks(wanted, data_dir, out.resolve(), window=window, encode=encode)  # absolute paths
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    cut = f" (cloze contexts cut to the trained window of {window} tokens)" if "lrattn_cloze" in wanted else ""
    return (f"wrote {', '.join(wanted)} to {out}{cut}; score an export of this checkpoint with:\n"
            f"  lm_eval --model hf --model_args "
            f"pretrained=DIR,trust_remote_code=True --tasks {','.join(wanted)} --include_path {shlex.quote(str(out))}")


def build_task_manager(names: list[str], include_paths: list[str | Path]) -> tuple[Any, list[str]]:
    """A TaskManager that knows every name (globs expanded) -> (manager, resolved names).

    The default lm-eval index is only built when a name is not in `include_paths`.
    """
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise TaskError(f"--include-path {path}: no such folder (it should hold lm-eval task YAMLs)")
    paths = [str(p) for p in include_paths] or None
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    unknown = names if manager is None else _unknown(manager, names)
    if unknown:
        manager = TaskManager(include_path=paths, include_defaults=True)
        unknown = _unknown(manager, names)
    if unknown:
        hints = []
        for name in unknown:
            close = closest_names(name, [*manager.all_tasks, *LOCAL_TASKS, *PRESETS], n=4, cutoff=0.6, fill=False)
            hints.append(f"'{name}'" + (f" (closest: {', '.join(close)})" if close else ""))
        raise TaskError(
            f"unknown task(s) {', '.join(hints)}: not an lm-eval task, group or tag, nor in --include-path. "
            f"Local tasks: {', '.join(LOCAL_TASKS)}; presets: {', '.join(PRESETS)}"
        )
    resolved: list[str] = []
    for name in names:
        resolved.extend([name] if _is_direct(manager, name) else manager.match_tasks([name]))
    return manager, list(dict.fromkeys(resolved))


def _is_direct(manager: Any, name: str) -> bool:
    return name in manager.task_index or (name.endswith((".yaml", ".yml")) and Path(name).is_file())


def _unknown(manager: Any, names: list[str]) -> list[str]:
    return [n for n in names if not _is_direct(manager, n) and not manager.match_tasks([n])]


def load_tasks(manager: Any, names: list[str]) -> list[Any]:
    """Build each task (this loads its dataset); a failure names the task and its dataset."""
    built: list[Any] = []
    for name in names:
        try:
            obj = manager._load_spec(name)
        except Exception as err:  # datasets raises many kinds (ConnectionError, FileNotFoundError, hub errors)
            dataset = _dataset_path(manager, name)
            where = f" (dataset '{dataset}')" if dataset else ""
            raise TaskError(
                f"task '{name}'{where} could not be loaded: {type(err).__name__}: {str(err)[:300]}. "
                "Tasks from the Hugging Face hub need network access or a local datasets cache "
                "(HF_DATASETS_CACHE); the local tasks need `lrattn prepare` data"
            ) from err
        built.extend(obj if isinstance(obj, list) else [obj])
    return built


def _dataset_path(manager: Any, name: str) -> str | None:
    entry = manager.task_index.get(name)
    cfg = getattr(entry, "cfg", None) or {}
    if cfg.get("dataset_path"):
        return str(cfg["dataset_path"])
    path = getattr(entry, "yaml_path", None)
    if not path or not Path(path).is_file():
        return None
    found = re.search(r"^dataset_path:\s*(\S+)", Path(path).read_text(errors="replace"), re.MULTILINE)
    return found.group(1).strip("'\"") if found else None


# ---- what a score was measured under --------------------------------------------------------------
MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")  # what MLflow refuses in metric and tag names
# + task (as in its metrics' names): the configuration the run's eval/<task>/* metrics were last measured under
CONFIG_TAG = Tag.EVAL_CONFIG


def config_tags(results: dict[str, Any] | None, val: dict[str, float] | None,
                data_dir: str | Path | None) -> dict[str, str]:
    """The tags `lrattn eval` (and the fit's EvalCallback) set beside its metrics, one per task, JSON:
    limit (None: every item), num_fewshot (the task's own), data (the prepared folder a local task or the
    validation loss read; None: lm-eval's own dataset), tasks (what the evaluation ran together) and items
    (the documents scored). `lrattn compare` pools a task's scores across runs only where limit, num_fewshot
    and data agree (tools/compare/evals.py)."""
    from lrattn_lightning.data import remote

    folder = None if data_dir is None else str(data_dir) if remote.is_remote(data_dir) else str(Path(data_dir).resolve())
    config = (results or {}).get("config") or {}
    limit = config.get("limit")
    limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
    tags = {}
    for task in ((results or {}).get("results") or {}):
        shots = ((results.get("configs") or {}).get(task) or {}).get("num_fewshot", config.get("num_fewshot"))
        items = ((results.get("n-samples") or {}).get(task) or {}).get("effective")
        tags[task] = {"limit": limit, "num_fewshot": shots, "data": folder if task in LOCAL_TASKS else None,
                      "tasks": config.get("tasks"), "items": items}
    if val:
        tags["val"] = {"limit": None, "num_fewshot": None, "data": folder, "tasks": ["val"], "items": val.get("windows")}
    return {MLFLOW_UNSAFE.sub("_", f"{CONFIG_TAG}{task}"): json.dumps(value, sort_keys=True)
            for task, value in tags.items()}

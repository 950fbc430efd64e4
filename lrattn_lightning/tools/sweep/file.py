"""Sweep files (experiments/sweeps/*.yaml): a list or grid of (size, ablation, seed) runs with one recipe,
loaded strictly; every error names the file and the field.

    name: cpu-study                      # default: the file's stem; every run is tagged sweep=<name>
    doc: what the sweep is for           # required
    recipe: ../cpu-study.yaml            # required: the --config of every run, relative to the sweep file
    experiment: cpu-study                # MLflow experiment (default: the sweep name)
    registry: my-registry.yaml           # optional --registry, relative to the sweep file (as recipe is)
    sizes: [cpu-study]                   # a grid: sizes x ablations x seeds ...
    ablations: [baseline, s-lr-block-n8-r64]
    seeds: [0, 1, 2]
    runs:                                # ... and/or an explicit list; a run may add fit flags of its own
      - {size: small, ablation: attnres-full, seed: 0}       # under a `variant` label (training-time
      - {size: small, ablation: gated-last09, seed: 0,       # variants of one entry: the label joins
         variant: freeze50, args: {model.gate_freeze_steps: 50}}   # the run name and the tags)
    args: {trainer.max_steps: 200}       # extra `lrattn fit` flags for every run (--trainer.max_steps 200)
    size_args:                           # ... and for every run of one size, after `args` (a ladder's token
      small: {trainer.max_steps: 400}    # budget per size); a run's own args come last
    env: {OMP_NUM_THREADS: "1"}          # environment of every run (local runs and emitted scripts); a
                                         # PYTHONPATH is appended to the environment's own, its relative
                                         # folders relative to the sweep file
    slurm: {time: "48:00:00", partition: gpu, account: null, cpus_per_task: 8, max_parallel: 4}

Every (size, ablation) pair is validated against the registry before anything runs. A `Sweep` knows
each run's name, its `lrattn fit` arguments and where its last checkpoint would be.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError, UsageError
from lrattn_lightning.core.files import load_yaml_strict, read_yaml_text
from lrattn_lightning.core.names import NAME_MAX, check_name, closest_names
from lrattn_lightning.model.registry import Registry, UnknownNameError, load_registry
from lrattn_lightning.train.schema import Tag

_FIELDS = ("name", "doc", "recipe", "experiment", "registry", "sizes", "ablations", "seeds", "runs", "args",
           "size_args", "env", "slurm")
_RUN_FIELDS = {"size", "ablation", "seed", "variant", "args"}
_SLURM_FIELDS = ("time", "partition", "account", "cpus_per_task", "max_parallel", "max_array_size", "extra")
MAX_ARRAY_SIZE = 1001  # SLURM's default MaxArraySize: array indices 0..1000


class SweepError(InputError):
    """A bad sweep file or sweep invocation, reported before any run starts."""


@dataclass(frozen=True)
class SweepRun:
    size: str
    ablation: str
    seed: int
    variant: str = ""  # a label for the run's own fit flags (training-time variants of one entry)
    args: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:  # the same default run name `lrattn fit` uses, with the variant label
        return f"{self.size}-{self.ablation}{'-' + self.variant if self.variant else ''}-seed{self.seed}"


@dataclass(frozen=True)
class Sweep:
    name: str
    doc: str
    path: str
    recipe: str
    experiment: str
    runs: tuple[SweepRun, ...]
    registry: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)
    size_args: dict[str, dict[str, Any]] = field(default_factory=dict)  # size -> its runs' extra fit flags

    def run_args(self, run: SweepRun) -> list[tuple[str, Any]]:
        """The run's extra fit flags in the order they apply (a later one wins): the sweep's, its size's, its own."""
        return [*self.args.items(), *self.size_args.get(run.size, {}).items(), *run.args]

    @functools.cached_property
    def recipe_settings(self) -> Any:
        """The recipe as read once per Sweep (an emitted SLURM script asks for runs_dir once per run)."""
        return load_yaml_strict(read_yaml_text(Path(self.recipe), "recipe"), self.recipe) or {}

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A fit setting as the runs will see it: the sweep's `args`, else the recipe, else `default`."""
        if dotted in self.args:
            return self.args[dotted]
        node: Any = self.recipe_settings
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @functools.cached_property
    def experiment_dir(self) -> Path:
        """RUNS_DIR/EXPERIMENT: the run folders' folder."""
        return Path(self.setting("runs_dir", "runs")) / self.experiment

    def checkpoint(self, run: SweepRun) -> Path:
        return self.experiment_dir / run.name / "checkpoints" / "last.ckpt"

    def fit_args(self, run: SweepRun, tracking_uri: str | None = None) -> list[str]:
        """The `lrattn fit` arguments of one run (without --ckpt_path)."""
        tags = {Tag.SWEEP: self.name, Tag.SEED: str(run.seed), **({Tag.VARIANT: run.variant} if run.variant else {})}
        args = ["fit", "--config", self.recipe, "--size", run.size, "--ablation", run.ablation,
                "--seed_everything", str(run.seed), "--experiment", self.experiment, "--run_name", run.name,
                "--run_tags", json.dumps(tags)]
        if self.registry:
            args += ["--registry", self.registry]
        if tracking_uri:
            args += ["--tracking_uri", tracking_uri]
        for key, value in self.run_args(run):  # the run's own flags come last and win
            args += [f"--{key}", _flag_value(value)]
        return args


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


# ---- loading ---------------------------------------------------------------------------------------
def load_sweep(path: str | Path, registry: Registry | None = None) -> tuple[Sweep, Registry]:
    """Load a sweep file strictly and validate every (size, ablation) pair against the registry."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {path} not found (sweeps live in experiments/sweeps/)")
    try:
        raw = load_yaml_strict(read_yaml_text(path, "sweep"), path) or {}
    except ValueError as err:
        raise SweepError(str(err)) from err
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: the top level must be a mapping with fields {list(_FIELDS)}")

    def fail(name: str, message: str) -> SweepError:
        return SweepError(f"{path}: field '{name}': {message}")

    for key in raw:
        if key not in _FIELDS:
            raise fail(key, f"unknown field; closest: {', '.join(closest_names(str(key), list(_FIELDS)))}")
    name = raw.get("name", path.stem)
    for key, value in (("name", name), ("doc", raw.get("doc")), ("recipe", raw.get("recipe"))):
        if not isinstance(value, str) or not value.strip():
            raise fail(key, "required, a non-empty string")
    experiment = raw.get("experiment", name)
    for key, value in (("name", name), ("experiment", experiment)):  # both name folders under runs_dir
        _check_label(value, key if key in raw else f"{key} (by default the file's stem)", fail)
    recipe = _resolve_path(raw["recipe"], path)
    if recipe is None:
        raise fail("recipe", f"{raw['recipe']} not found (a path relative to the sweep file, e.g. ../cpu-study.yaml)")
    reg_path = raw.get("registry")
    if reg_path is not None:
        if not isinstance(reg_path, str) or not reg_path.strip():
            raise fail("registry", "must be a path to a registry.yaml")
        found = _resolve_path(reg_path, path)
        if found is None:
            raise fail("registry", f"{reg_path} not found (a path relative to the sweep file, as `recipe` is)")
        reg_path = str(found)
    try:
        reg = registry or load_registry(reg_path)
    except ValueError as err:  # a bad registry names its own field
        raise SweepError(f"{path}: registry {reg_path}: {err}") from err

    grid, listed = _grid_runs(raw, fail), _list_runs(raw.get("runs"), fail)
    _check_runs(reg, grid, listed, fail)
    args, env, slurm = _options(raw, fail, path)
    size_args = _size_args(raw.get("size_args"), {run.size for run in grid + listed}, fail)
    return Sweep(name=name, doc=raw["doc"].strip(), path=str(path), recipe=str(recipe), experiment=experiment,
                 runs=tuple(grid + listed), registry=reg_path, args=args, env=env, slurm=slurm,
                 size_args=size_args), reg


def _resolve_path(recipe: str, sweep_file: Path) -> Path | None:
    """A file a sweep names (its recipe, its registry): relative to the sweep file (so `lrattn sweep PATH` works
    from any folder), else relative to the working folder (older sweep files), else shipped in the package
    (`experiments/...`)."""
    from lrattn_lightning.core.files import packaged

    given = Path(recipe)
    if given.is_absolute():
        return given if given.is_file() else None
    for candidate in (sweep_file.parent / given, given):
        if candidate.is_file():
            here = os.path.relpath(candidate.resolve(), Path.cwd())  # short in commands when under the cwd
            return Path(here) if not here.startswith("..") else candidate.resolve()
    return packaged(recipe)


def _check_runs(reg: Registry, grid: list[SweepRun], listed: list[SweepRun], fail) -> None:
    """Every run once, every name known, every (size, ablation) pair buildable."""
    if not grid and not listed:
        raise fail("runs", "the sweep names no runs: give sizes + ablations + seeds (a grid) and/or runs (a list)")
    seen: set[SweepRun] = set()
    pairs: set[tuple[str, str]] = set()  # (size, ablation) pairs built once each: a lab's sweep repeats them
    # (size, ablation, variant) -> the characters of its runs' names are a folder name's: a run's name adds only
    # '-seed' and the seed's digits (and '-'), so it is checked whole only when that is not so or it is long
    prefixes: dict[tuple[str, str, str], bool] = {}
    for where, run in [("sizes x ablations", r) for r in grid] + [(f"runs[{i}]", r) for i, r in enumerate(listed)]:
        if run in seen:
            raise fail(where, f"run {run.name} appears twice in the sweep")
        seen.add(run)
        if (run.size, run.ablation) not in pairs:
            for kind, entry in (("size", run.size), ("ablation", run.ablation)):
                try:
                    getattr(reg, kind)(entry)  # unknown names list the closest ones
                except UnknownNameError as err:
                    raise fail(f"{kind}s" if where.startswith("sizes") else where, str(err)) from err
            try:
                reg.model(run.size, run.ablation)  # impossible pairs (rank > d, blocks > 2L) name the field
            except ValueError as err:
                raise fail(where, f"size '{run.size}' x ablation '{run.ablation}': {err}") from err
            pairs.add((run.size, run.ablation))
        key = (run.size, run.ablation, run.variant)
        chars_ok = prefixes.get(key)
        if chars_ok is None:
            try:
                chars_ok = prefixes[key] = bool(check_name(SweepRun(*key[:2], 0, key[2]).name, "name"))
            except UsageError:
                chars_ok = prefixes[key] = False
        if not chars_ok or len(run.size) + len(run.ablation) + len(run.variant) + len(str(run.seed)) + 8 > NAME_MAX:
            _check_label(run.name, f"{where} (the run name)", fail)  # its folder: e.g. not too long


def _options(raw: dict[str, Any], fail, sweep_file: Path) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """The optional sections: args (extra fit flags), env and slurm."""
    args = _check_args(raw.get("args") or {}, "args", fail)
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str | int | float) for k, v in env.items()):
        raise fail("env", "must be a mapping NAME: value (strings or numbers)")
    if "PYTHONPATH" in env:  # appended to the environment's own; a relative folder is relative to the sweep file
        env = {**env, "PYTHONPATH": os.pathsep.join(
            str(Path(p) if Path(p).is_absolute() else (Path(sweep_file).parent / p).resolve())
            for p in str(env["PYTHONPATH"]).split(os.pathsep) if p)}
    slurm = raw.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise fail("slurm", f"must be a mapping with fields {list(_SLURM_FIELDS)}")
    for key in slurm:
        if key not in _SLURM_FIELDS:
            raise fail(f"slurm.{key}", f"unknown field; closest: {', '.join(closest_names(str(key), list(_SLURM_FIELDS)))}")
    size = slurm.get("max_array_size", MAX_ARRAY_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise fail("slurm.max_array_size", f"{size!r}: the cluster's MaxArraySize, a positive integer "
                   f"(`scontrol show config | grep MaxArraySize`; SLURM's default {MAX_ARRAY_SIZE})")
    if "extra" in slurm and not (isinstance(slurm["extra"], list) and all(isinstance(x, str) for x in slurm["extra"])):
        raise fail("slurm.extra", "must be a list of '#SBATCH' option strings such as '--qos=high'")
    return dict(args), {k: str(v) for k, v in env.items()}, dict(slurm)


def _check_args(args: Any, where: str, fail) -> dict[str, Any]:
    """Extra `lrattn fit` flags (the sweep's `args`, or one run's)."""
    if not isinstance(args, dict):
        raise fail(where, "must be a mapping of fit flags without dashes, e.g. {trainer.max_steps: 200}")
    for key, value in args.items():
        if not isinstance(key, str) or key.startswith("-") or not key:
            raise fail(where, f"key {key!r}: write fit flags without dashes, e.g. trainer.max_steps")
        if key in ("config", "size", "ablation", "seed_everything", "experiment", "run_name", "run_tags",
                   "registry", "ckpt_path", "tracking_uri"):
            raise fail(where, f"'{key}' is set by the sweep itself (use recipe/sizes/ablations/seeds/experiment/registry)")
        if isinstance(value, dict | list) and key.split(".")[0] not in ("trainer", "model", "data"):
            raise fail(where, f"key '{key}': a structured value must belong to trainer/model/data")
    return dict(args)


def _size_args(raw: Any, sizes: set[str], fail) -> dict[str, dict[str, Any]]:
    """`size_args`: size -> fit flags of that size's runs; every size one the sweep runs."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise fail("size_args", "must be a mapping SIZE: {fit flags}, e.g. {small: {trainer.max_steps: 400}}")
    for size in raw:
        if size not in sizes:
            hint = ", ".join(closest_names(str(size), sorted(sizes)))
            raise fail(f"size_args.{size}", f"the sweep runs no size {size!r}; its sizes: {hint}")
    return {size: _check_args(args, f"size_args.{size}", fail) for size, args in raw.items()}


def _grid_runs(raw: dict[str, Any], fail) -> list[SweepRun]:
    axes = {key: raw.get(key) for key in ("sizes", "ablations", "seeds")}
    if all(v is None for v in axes.values()):
        return []
    for key, values in axes.items():
        if values is None:
            given = [k for k, v in axes.items() if v is not None]
            raise fail(key, f"a grid needs sizes, ablations and seeds (given: {', '.join(given)})")
        if not isinstance(values, list) or not values:
            raise fail(key, "must be a non-empty list")
        kind = int if key == "seeds" else str
        for value in values:
            if not isinstance(value, kind) or isinstance(value, bool):
                raise fail(key, f"{value!r} is not {'an integer' if kind is int else 'a name'}")
        if len(set(values)) != len(values):
            raise fail(key, "has duplicates")
    # seed-major order: an interrupted sweep has every ablation at the first seeds
    return [SweepRun(size, abl, seed) for seed, size, abl in itertools.product(axes["seeds"], axes["sizes"], axes["ablations"])]


def _check_label(value: Any, where: str, fail, lower: bool = False) -> None:
    """A name that becomes a path (the sweep's name and experiment, a variant label): one safe folder name."""
    if not isinstance(value, str):
        raise fail(where, f"{value!r} is not a string (a name)")
    try:
        check_name(value, "value", lower=lower)
    except UsageError as err:
        raise fail(where, str(err)) from err


def _list_runs(entries: Any, fail) -> list[SweepRun]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise fail("runs", "must be a list of {size, ablation, seed}")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not {"size", "ablation", "seed"} <= set(entry) <= _RUN_FIELDS:
            raise fail(f"runs[{i}]", "each run is a mapping with size, ablation and seed (and optionally variant "
                       "with args)")
        if not isinstance(entry["seed"], int) or isinstance(entry["seed"], bool):
            raise fail(f"runs[{i}].seed", f"{entry['seed']!r} is not an integer")
        if not isinstance(entry["size"], str) or not isinstance(entry["ablation"], str):
            raise fail(f"runs[{i}]", "size and ablation are registry names (strings)")
        variant = entry.get("variant", "")
        if variant != "":
            _check_label(variant, f"runs[{i}].variant", fail, lower=True)
        args = _check_args(entry.get("args") or {}, f"runs[{i}].args", fail)
        if args and not variant:
            raise fail(f"runs[{i}].variant", "a run with its own args needs a variant label (it names the run)")
        out.append(SweepRun(entry["size"], entry["ablation"], entry["seed"], variant, tuple(args.items())))
    return out

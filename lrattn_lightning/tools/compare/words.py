"""The report's counted nouns and its order of sizes, one rule each for every table, line and figure of
`lrattn compare`.

    (counted nouns: core/words.py's plural and count, the same rule as every command's)
    ladder(sizes, params) -> the sizes smallest model first (parameters; a size without a count after the
                             others, by name): the order of a size ladder, never the alphabet's
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lrattn_lightning.core.words import count, plural


def ladder(sizes: Iterable[str], params: Mapping[str, float] | None = None) -> list[str]:
    """The distinct sizes in ladder order: by the model's parameters (`params`: size -> a count, e.g. the
    smallest run's), a size with none after the others; ties and unknowns by name."""
    params = params or {}
    unique = list(dict.fromkeys(sizes))
    return sorted(unique, key=lambda s: (s not in params, params.get(s, 0), s))


def row_params(rows: Iterable) -> dict[str, float]:
    """size -> the smallest parameter count among the rows (or runs) of that size that know one."""
    out: dict[str, float] = {}
    for r in rows:
        try:
            n = r.params
        except Exception:  # a row without runs
            continue
        if n and n == n:
            out[r.size] = min(n, out.get(r.size, n))
    return out


def size_list(rows: Iterable) -> list[str]:
    """The sizes of rows (table.Row or RunRecord: .size, .params) in ladder order."""
    rows = list(rows)
    return ladder((r.size for r in rows), row_params(rows))


def ablation_names(rows: Iterable) -> list[str]:
    """The distinct ablations of the rows (each row's label: an `ablation+variant` is its own), in first-seen
    order: an ablation run at three sizes is one ablation, not three."""
    return list(dict.fromkeys(getattr(r, "label", "") or r.ablation for r in rows))


def title(experiment: str, rows: list) -> str:
    """The figures' title: the experiment, its sizes in ladder order, the seeds per (size, ablation)."""
    sizes = size_list(rows)
    seeds = sorted({len(row.runs) for row in rows})
    seed_text = "/".join(map(str, seeds)) + " " + plural(max(seeds) if seeds else 0, "seed")
    return f"{experiment}: {plural(len(sizes), 'size')} {', '.join(sizes)}, {seed_text} per ablation"


def summary(rows: list) -> str:
    """'2 ablations at 3 sizes (6 rows)': what the report counts, each noun counted right."""
    sizes, names = size_list(rows), ablation_names(rows)
    text = count(len(names), "ablation") + (f" at {count(len(sizes), 'size')}" if len(sizes) > 1 else "")
    return text + (f" ({count(len(rows), 'row')})" if len(rows) != len(names) else "")

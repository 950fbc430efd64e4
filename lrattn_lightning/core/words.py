"""Counted nouns: one rule for every line a command prints ("1 document", "2 documents", "0 runs").

    plural(1, "run") -> "run"; plural(3, "run") -> "runs"; plural(2, "bus", "buses") -> "buses"
    count(1, "ablation") -> "1 ablation"; count(12345, "token") -> "12,345 tokens"
"""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """`noun` as counted by n: singular for exactly 1, else `many` (default noun + "s")."""
    return noun if n == 1 else (many or noun + "s")


def count(n: int, noun: str, many: str | None = None) -> str:
    """"1 ablation", "2 ablations", "0 runs" (thousands grouped)."""
    return f"{n:,} {plural(n, noun, many)}"

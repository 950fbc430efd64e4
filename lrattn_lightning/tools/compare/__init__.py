"""`lrattn compare`: compare.py (the command), table.py (rows per recipe, Welch's t-test, CSV/markdown), notes.py
(what was left apart and why), figures.py (Figure 1, heatmaps, curves), significance.py, runs.py (the paged search)."""

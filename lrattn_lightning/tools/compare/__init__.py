"""`lrattn compare`: compare.py (the command), table.py (rows per recipe, Welch's t-test, CSV/markdown), power.py (Welch's
t-test, seeds needed, pairwise tests with Holm's correction), evals.py (downstream scores pooled per task configuration), notes.py
(what was left apart and why), figures.py, heatmaps.py and labels.py (Figure 1, curves; the routing heatmaps), scaling.py, scaling_report.py
and scaling_figure.py (compute multipliers over a size ladder), runs.py."""

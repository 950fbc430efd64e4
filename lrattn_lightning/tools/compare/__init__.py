"""`lrattn compare`: compare.py (the command), table.py (rows per recipe, CSV/markdown), power.py (Welch's t-test,
seeds needed, pairwise tests with Holm's correction), evals.py (downstream scores per task configuration), notes.py
(what was left apart), figures.py, heatmaps.py and labels.py (Figure 1, curves, routing heatmaps), scaling.py (compute
multipliers over a size ladder), scaling_report.py (their section and figure), runs.py."""

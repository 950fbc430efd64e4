"""`lrattn sweep`: file.py (sweep files, strictly read), sweep.py (the command, fit-argument checks, launch scripts),
local.py (which runs are finished or diverged, claiming a run, running the rest one after another)."""

"""Checkpoints: save.py (atomic writes, the one last.ckpt and its fallback), load.py (weights-only reads, rebuilding
a model for evaluation, upcycling), compat.py (a checkpoint against the module it is loaded into), stop.py (signals
and divergences: how a fit stops), lock.py (one live fit per run folder)."""

"""`lrattn bench`: bench.py (the command), steps.py (the module's own train/forward/decode steps), runner.py
(interleaved timing in a child process), roofline.py (the routing's minimal traffic and floor), profiling.py."""

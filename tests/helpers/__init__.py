"""What more than one test module uses, one module per job; a test module imports these, never another test module
(tests/test_layers.py checks it). Fixtures are tests/conftest.py's.

paths.py       where things are (TESTS_DIR, REPO_ROOT, GOLDEN_DIR, REGISTRY_PATH), and what a planted link's victim
               holds (PRECIOUS)
cli.py         `lrattn ARGS` in the test process (main(argv), the process left as found) or as a real process
runs.py        `lrattn fit` and sweeps as the tests run them (arguments, the command in process or as a process) and
               what they leave (the MLflow run, its metric histories, checkpoints)
prepare.py     `lrattn prepare` as the process tests run it (in small parts), and corpora built for a fit: prepared
               corpora, their splits read back, `lrattn prepare` in this process
models.py      models built for tests: the test sizes and the registry's entry names, an entry clipped to a size, a
               routing kind's config from its options, token batches, randomised routers, a checkpoint in fit's format
checks.py      checks every routing kind's tests make: what flows between a model's parts, causality and KV-cache
               decoding, a router's float64 gradcheck, bf16 autocast
references.py  float64 references written out (RMSNorm, the fused loss's formula, Polar Express) and their bounds
tracking.py    MLflow for tests: a real `mlflow server` on a free port, an experiment in a new sqlite store, and an
               empty store made by MLflow once per process and copied where a test's commands would create one
"""

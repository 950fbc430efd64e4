"""What more than one test module uses, one module per job; a test module imports these, never another test module
(tests/test_layers.py checks it). Fixtures shared across folders are tests/conftest.py's, as are, for now, the paths,
the test sizes and the small model, corpus and server helpers many modules import from it.

cli.py         `lrattn ARGS` in the test process (main(argv), the process left as found) or as a real process
runs.py        `lrattn fit` and sweeps as the tests run them (arguments, the command in process or as a process) and
               what they leave (the MLflow run, its metric histories, checkpoints)
prepare.py     `lrattn prepare` as the process tests run it (in small parts), and corpora built for a fit
models.py      models built for tests: a routing kind's config from its options, randomised routers, a checkpoint in
               fit's format
references.py  float64 references written out (the fused loss's formula, Polar Express) and their bounds
"""

"""New MLflow sqlite stores in the tests: copied from a template instead of built by MLflow's migrations.

MLflow makes a new sqlite store by creating its first tables and running its alembic migrations (about 60) on
them: 3 s on a slow CPU, and the suite makes about 110 stores (a fit in a fresh folder, a sweep, a test's own
store). `install(template)` wraps `mlflow.store.db.utils._initialize_tables` so that an *empty* sqlite file gets
the pages of a template that MLflow itself initialised once (sqlite's backup API: the same schema, the same
alembic revision, the same rows the migrations seed); anything else (a non-empty file, another database, an
in-memory store) goes to MLflow's own function. It is installed by the warm command server (tests/warm_cli.py)
and in the pytest processes (conftest.py); a command started cold (LRATTN_TESTS_COLD=1, tests/e2e/test_packaging.py's
installed wheel) builds its stores as a user's `lrattn` does. tests/e2e/test_store_template.py holds the copy to
MLflow's own result.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path


def _database(engine) -> str | None:
    """The file of a sqlite engine, or None (another database, or in memory)."""
    if engine.dialect.name != "sqlite":
        return None
    name = engine.url.database
    return None if not name or name == ":memory:" or name.startswith("file:") else name


ENV = "LRATTN_TESTS_STORE_TEMPLATE"  # the template conftest.py made, for the warm servers of that pytest process


def make_template(path: Path, initialize=None, keep: bool = False) -> Path:
    """A store MLflow initialised itself (its own `_initialize_tables` on an empty file) at `path` (with keep, a
    template already there is kept: xdist workers share one)."""
    import sqlalchemy
    from mlflow.store.db import utils

    if keep and path.exists():
        return path

    initialize = initialize or getattr(utils._initialize_tables, "mlflow_own", utils._initialize_tables)
    partial = path.with_name(path.name + f".{os.getpid()}.part")
    engine = sqlalchemy.create_engine(f"sqlite:///{partial}")
    try:
        initialize(engine)
    finally:
        engine.dispose()
    os.replace(partial, path)  # whole or absent, if processes race to make it
    return path


def install(template: Path) -> None:
    """From now on in this process (and the processes it forks), a new sqlite store is a copy of `template`
    (made on first use)."""
    from mlflow.store.db import utils

    own = getattr(utils._initialize_tables, "mlflow_own", utils._initialize_tables)

    def initialize(engine) -> None:
        target = _database(engine)
        if target is None or not utils._is_empty_database(engine):
            return own(engine)
        if not template.exists():
            make_template(template, own)
        engine.dispose()  # no pooled connection holds the empty file while its pages are written
        with sqlite3.connect(template) as source, sqlite3.connect(target) as copy:
            source.backup(copy)

    initialize.mlflow_own = own
    utils._initialize_tables = initialize

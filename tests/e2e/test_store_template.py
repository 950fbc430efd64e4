"""tests/store_template.py: a new sqlite store copied from the template is the store MLflow itself builds."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap

import store_template
import warm_cli
from mlflow.store.db import utils
from mlflow.tracking import MlflowClient


def shape(path) -> tuple:
    """A store's schema (each object's SQL as a set of lines: MLflow's migrations write a table's constraints in
    an order that varies from run to run), its alembic revision and each table's row count."""
    with sqlite3.connect(path) as con:
        objects = con.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
        schema = {(kind, name): frozenset(line.strip().rstrip(",") for line in (sql or "").splitlines())
                  for kind, name, sql in objects}
        revision = con.execute("SELECT version_num FROM alembic_version").fetchall()
        rows = {name: con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
                for kind, name, _ in objects if kind == "table"}
    return schema, revision, rows


def test_a_copied_store_is_the_store_mlflow_builds_and_works(tmp_path):
    own = getattr(utils._initialize_tables, "mlflow_own", None)
    assert own is not None  # conftest installed the template in this process
    by_mlflow = store_template.make_template(tmp_path / "own.db", own)
    MlflowClient(f"sqlite:///{by_mlflow}").search_experiments()  # MLflow's own store opened as a user's is
    copied = tmp_path / "copied.db"
    client = MlflowClient(f"sqlite:///{copied}")
    experiment = client.create_experiment("x", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment, run_name="r")
    client.log_metric(run.info.run_id, "val/loss", 1.5, step=3)
    client.set_terminated(run.info.run_id)
    assert client.get_metric_history(run.info.run_id, "val/loss")[0].value == 1.5
    fresh = tmp_path / "fresh.db"
    MlflowClient(f"sqlite:///{fresh}").search_experiments()
    assert shape(fresh) == shape(by_mlflow)
    assert len(shape(fresh)[0]) > 50 and shape(fresh)[1]  # the whole schema, at a revision


def test_a_store_that_is_not_empty_goes_to_mlflows_own_upgrade(tmp_path):
    """A file with tables in it is not overwritten: MLflow's own function sees it (here: a store made by an older
    schema would be upgraded, not replaced)."""
    store = tmp_path / "kept.db"
    with sqlite3.connect(store) as con:
        con.execute("CREATE TABLE mine (x INTEGER)")
        con.execute("INSERT INTO mine VALUES (7)")
    MlflowClient(f"sqlite:///{store}").search_experiments()
    with sqlite3.connect(store) as con:
        assert con.execute("SELECT x FROM mine").fetchall() == [(7,)]
        assert con.execute("SELECT count(*) FROM experiments").fetchone()[0] == 1  # MLflow's default experiment


def test_the_warm_server_holds_a_template_and_a_cold_process_builds_as_mlflow_does(tmp_path):
    """The warm server installs conftest.py's template before it forks commands (each new store a copy of it);
    a cold process (an installed user's `lrattn`) runs MLflow's own initialisation."""
    probe = textwrap.dedent("""
        from mlflow.store.db import utils
        print(hasattr(utils._initialize_tables, "mlflow_own"))
    """)
    env = warm_cli.cli_env()
    cold = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert cold.stdout.split() == ["False"], cold.stderr[-2000:]
    server = warm_cli._server(env)
    assert server is not None
    template = os.environ[store_template.ENV]  # conftest.py's, which the server was given
    assert server.env[store_template.ENV] == template
    fresh = tmp_path / "fresh.db"
    MlflowClient(f"sqlite:///{fresh}").search_experiments()
    assert shape(template)[:2] == shape(fresh)[:2]

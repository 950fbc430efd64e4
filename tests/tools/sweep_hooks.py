"""Callbacks the sweep tests put in a sweep's recipe: what each fit process saw (test_sweep_parallel.py), a run
another process finishes meanwhile (test_sweep.py)."""

import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class SweepProbe(Callback):
    """Writes FOLDER/PID.json when training starts (the process's OMP_NUM_THREADS, torch's intra-op threads, pid, the
    time). With `hold_step`, touches FOLDER/PID.ready before that step and waits (two minutes at most) for
    FOLDER/release, then writes FOLDER/PID.held: whether the wait ended so."""

    def __init__(self, folder: str, hold_step: int | None = None):
        self.folder, self.hold_step = Path(folder), hold_step

    def on_train_start(self, trainer, pl_module):
        record = {"pid": os.getpid(), "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
                  "start": time.time(), "step": trainer.global_step}
        with (self.folder / f"{os.getpid()}.json").open("w") as f:
            json.dump(record, f)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.hold_step:
            return
        (self.folder / f"{os.getpid()}.ready").touch()
        deadline, met = time.time() + 120, False
        while not met and time.time() < deadline:
            met = (self.folder / "release").exists()
            time.sleep(0.05)
        (self.folder / f"{os.getpid()}.held").write_text(json.dumps(met))


class FinishRun(Callback):
    """Sets the MLflow run `run_id` in the store at `uri` FINISHED as the fit starts (also a fit resumed from a
    last.ckpt at its last step, which trains no step): as another process finishing that run while this fit's
    sweep runs (test_sweep.py)."""

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id

    def on_fit_start(self, trainer, pl_module):
        from mlflow.tracking import MlflowClient

        MlflowClient(self.uri).set_terminated(self.run_id, "FINISHED")

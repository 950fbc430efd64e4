"""`EvalCallback`: the evaluation of `lrattn eval` at the end of `lrattn fit`, on the in-memory model (eval/evaluate.py
holds the evaluation, eval/run.py the command)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lrattn_lightning.eval.evaluate import eval_metrics, log_eval, run_lm_eval, validation_loss
from lrattn_lightning.eval.lm import LRAttnLM
from lrattn_lightning.model.decoder import Decoder


class EvalCallback(Callback):
    """Evaluate the in-memory model when training ends and log to the training's MLflow run.

        lrattn fit ... --trainer.callbacks+=lrattn_lightning.eval.callback.EvalCallback --trainer.callbacks.tasks=local

    Every rank evaluates its shard (through the trainer's strategy); rank 0 logs.
    """

    def __init__(self, tasks: str = "local", limit: float | None = None, num_fewshot: int | None = None,
                 batch_size: int = 16, include_path: str | None = None, val_loss: bool = False,
                 bootstrap_iters: int = 100_000):
        self.tasks, self.limit, self.num_fewshot = tasks, limit, num_fewshot
        self.batch_size, self.include_path, self.val_loss = batch_size, include_path, val_loss
        self.bootstrap_iters = bootstrap_iters
        self.metrics: dict[str, float] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from lightning.pytorch.loggers import MLFlowLogger

        datamodule = trainer.datamodule
        model: Decoder = pl_module.model
        was_training = model.training
        model.eval()
        strategy = trainer.strategy if trainer.world_size > 1 else None
        lm = LRAttnLM(model=model, tokenizer=datamodule.tokenizer(), batch_size=self.batch_size,
                      device=pl_module.device, collectives=strategy, max_length=datamodule.seq_len)
        limit = int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit
        try:
            results = run_lm_eval(lm, self.tasks, data_dir=datamodule.data_dir,
                                  include_paths=[self.include_path] if self.include_path else [],
                                  num_fewshot=self.num_fewshot, limit=limit, bootstrap_iters=self.bootstrap_iters)
            val = None
            if self.val_loss:
                val = validation_loss(model, datamodule.data_dir, batch_size=self.batch_size,
                                      rank=trainer.global_rank, world_size=trainer.world_size,
                                      all_reduce=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
                                      seq_len=datamodule.seq_len)
        finally:
            model.train(was_training)
        if not trainer.is_global_zero:
            return
        self.metrics = eval_metrics(results, val)
        logger = trainer.logger
        if isinstance(logger, MLFlowLogger):
            self.metrics = log_eval(logger.experiment, logger.run_id, trainer.global_step, results, val,
                                    datamodule.data_dir)
        print("[lrattn eval] " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(self.metrics.items())))

"""The LightningDataModule: fixed token windows from a prepared folder (`lrattn prepare`).

Each batch is a LongTensor (B, seq_len + 1): inputs x[:-1], targets x[1:]. Windows never cross a
chunk boundary (litdata's TokensLoader). The folder is checked by `data/shards.py`. `data_dir` may be
an s3:// prefix: litdata streams the chunks into a local cache (`data/remote.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data import remote
from lrattn_lightning.data.shards import check_shards, read_meta, training_window, validate_data_dir
from lrattn_lightning.data.tokenizer import load_tokenizer
from lrattn_lightning.model.config import SizeConfig


def collate_windows(items: list[np.ndarray]) -> torch.Tensor:
    """Windows of seq_len + 1 token ids (uint16/uint32) -> LongTensor (B, seq_len + 1)."""
    return torch.from_numpy(np.stack(items).astype(np.int64))


class TokenDataModule(L.LightningDataModule):
    """Fixed token windows from a prepared folder; each batch is a LongTensor (B, seq_len + 1).

    Sharding over ranks and dataloader workers is litdata's own (it reads the torch.distributed
    world, or WORLD_SIZE / GLOBAL_RANK, when iteration starts). The train loader's position is
    `state_dict()`; a resumed run continues with the next unseen batch (see `load_state_dict`).
    """

    def __init__(
        self,
        data_dir: str = "data/stdlib-docs-byte",
        batch_size: int = 8,
        seq_len: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 42,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self._meta: dict[str, Any] | None = None
        self._train_loader: Any = None
        self._pending_state: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = read_meta(self.data_dir)
        return self._meta

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def bytes_per_token(self, split: str = "val") -> float:
        return float(self.meta["splits"][split]["bytes_per_token"])

    def tokenizer(self) -> Any:
        spec = self.meta["tokenizer"]
        base = self.local_file(spec["file"]).parent if "file" in spec else self.data_dir
        return load_tokenizer(spec, base_dir=base)

    def local_file(self, name: str) -> Path:
        """A file of the prepared folder on this machine (fetched into the cache from an s3:// prefix)."""
        return remote.local_file(self.data_dir, name)

    def location(self) -> str:
        """Where the data is, as a checkpoint records it: an absolute path, or the s3:// URL."""
        return self.data_dir if remote.is_remote(self.data_dir) else str(Path(self.data_dir).resolve())

    def validate_for(self, size: SizeConfig) -> dict[str, Any]:
        """Check the data against a model size (see `validate_data_dir`); fills in seq_len if unset."""
        meta = validate_data_dir(self.data_dir, size, self.seq_len)
        self.seq_len = training_window(self.seq_len, size)
        self._meta = meta
        return meta

    def _dataset(self, split: str) -> Any:
        if self.seq_len is None:
            raise InputError("TokenDataModule.seq_len is unset: pass seq_len or call validate_for(size) first")
        _ = self.meta  # a missing or corrupt folder fails here, with its fix
        check_shards(self.data_dir, split)
        # equal train batches on every rank; keep every val window
        return split_dataset(self.data_dir, split, self.seq_len + 1, shuffle=self.shuffle if split == "train" else False,
                             drop_last=split == "train", seed=self.seed)

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        loader = StreamingDataLoader(
            self._dataset("train"), batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_windows
        )
        if self._pending_state is not None:
            loader.load_state_dict(self._pending_state)
            self._pending_state = None
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        return StreamingDataLoader(
            self._dataset("val"), batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_windows
        )

    def test_dataloader(self) -> Any:
        """`lrattn test` scores the held-out split (there is no third split)."""
        return self.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """The train loader's position (litdata's own state dict): {'train_loader': ...} or {}."""
        if self._train_loader is not None:
            return {"train_loader": self._train_loader.state_dict()}
        return {"train_loader": self._pending_state} if self._pending_state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the train loader at a saved position (applied now, or when the loader is built).

        Under a Trainer this is skipped: Lightning's fit loop already saves every stateful train
        loader in the checkpoint (loops.fit_loop.state_dict.combined_loader) and loads it into the
        new loader before iterating; loading it twice would advance litdata's worker cycle twice.
        """
        state = state_dict.get("train_loader")
        if state is None or self.trainer is not None:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._pending_state = state


def split_dataset(data_dir: str | Path, split: str, window: int, **kwargs: Any) -> Any:
    """litdata's StreamingDataset of a split's windows of `window` tokens, from a folder or an s3:// prefix
    (whose chunks litdata streams into the local cache)."""
    from litdata import StreamingDataset, TokensLoader

    where: dict[str, Any] = {"input_dir": str(Path(data_dir) / split)}
    if remote.is_remote(data_dir):
        remote.allow_plain_http()
        # litdata keeps a folder per index.json (its timestamp) inside: a prefix prepared again is not mixed
        where = {"input_dir": f"{str(data_dir).rstrip('/')}/{split}",
                 "cache_dir": str(remote.local_dir(str(data_dir)) / "chunks" / split)}
    return StreamingDataset(**where, item_loader=TokensLoader(block_size=window), **kwargs)

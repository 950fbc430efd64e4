"""Write tests/golden/loss-tiny.json: 20 training steps of size `tiny` for four entries.

    python tests/golden/make_loss_golden.py

Only when the math is meant to change (and say so in the commit); a refactor must reproduce the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lrattn_lightning.model.config import ModelConfig, fit_to_size
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.fidelity import golden

torch.set_num_threads(1)
reg = load_registry()
size = reg.size("tiny")
out = {"size": "tiny", "steps": 20, "losses": {}}
for name in golden.LOSS_ENTRIES:
    out["losses"][name] = golden.train_losses(ModelConfig(size, fit_to_size(reg.ablation(name), size)))
    print(name, " ".join(f"{x:.4f}" for x in out["losses"][name]))
path = Path(__file__).with_name("loss-tiny.json")
path.write_text(json.dumps(out, indent=1) + "\n")
print(f"wrote {path}")

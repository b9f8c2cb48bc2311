"""A short Fabric job launched the way users launch one (Fabric starts the other process), for the tests of what the
user sees when a rank stops: ``python tests/helpers/fabric_job.py OUT_DIR [--watchdog JSON]``.

Each rank writes ``OUT_DIR/rank<N>.pid`` once it has made two optimizer steps, so a test can stop or kill it; a
job left alone ends after two minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_galvatron import GalvatronFabricStrategy
from tests.helpers.training import dataset, tiny_gpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--watchdog", type=json.loads, default=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan = {"world_size": 2, "layers": [{}] * 4}
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=GalvatronFabricStrategy(plan=plan, watchdog=args.watchdog))
    fabric.launch()
    model = fabric.setup(tiny_gpt().model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(dataset(64), batch_size=2, shuffle=True))
    step, deadline = 0, time.monotonic() + 120
    while time.monotonic() < deadline:
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == 2:
                Path(args.out, f"rank{fabric.global_rank}.pid").write_text(str(os.getpid()))


if __name__ == "__main__":
    main()

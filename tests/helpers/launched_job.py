"""A short training job launched the way users launch one (Lightning starts the other processes), for the tests of
what the user sees when something goes wrong: ``python tests/helpers/launched_job.py OUT_DIR [options]``.

Each rank writes ``OUT_DIR/rank<N>.pid`` once it has trained a step, so a test can stop or kill it mid-training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from lightning_galvatron import GalvatronStrategy
from tests.helpers.training import dataset, tiny_gpt


class _WritePid(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            (self.directory / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--plan", default="auto", help="'auto', a JSON file, or 'ddp' for plain DDP on every block")
    parser.add_argument("--watchdog", type=json.loads, default=True)
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--ckpt-path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    plan = {"world_size": args.devices, "layers": [{}] * 4} if args.plan == "ddp" else args.plan
    strategy = GalvatronStrategy(plan=plan, watchdog=args.watchdog, save_plan=False, profile_cache=str(out / "cache"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_WritePid(out)],
        default_root_dir=str(out),
    )
    loader = DataLoader(dataset(64), batch_size=2, shuffle=True)
    trainer.fit(tiny_gpt(), loader, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()

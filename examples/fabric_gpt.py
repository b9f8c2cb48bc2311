"""The example GPT in a hand-written Lightning Fabric loop, with ``strategy="galvatron"``.

Run it (4 CPU processes; the plan searched in ``fabric.setup``, or given)::

    python examples/fabric_gpt.py
    python examples/fabric_gpt.py --plan configs/gpt_tiny_plan.json

The loop is a plain Fabric loop -- ``fabric.setup``, ``setup_optimizers``, ``setup_dataloaders``, gradient
accumulation under ``no_backward_sync``, ``clip_gradients``, ``fabric.save`` -- and runs unchanged under
``strategy="ddp"``. Only the strategy knows about the plan; with ``plan="auto"`` it needs one example of what the
loop gives the model (``example_input``), because Fabric sets the model up before the loop has seen a batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from examples.gpt import GPT, ArithmeticText, GPTConfig
from lightning_galvatron import GalvatronFabricStrategy


def train(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    loader: Any,
    steps: int,
    accumulate: int = 2,
    max_norm: float = 1.0,
    state: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    save_at: int | None = None,
) -> list[tuple[float, float]]:
    """``steps`` optimizer steps of ``accumulate`` micro-batches each, from ``state["step"]`` on (batches of the
    steps before are skipped). Saves ``state`` to ``checkpoint`` after step ``save_at``. Returns each step's loss (the
    mean over the ranks) and gradient norm before clipping."""
    state = state if state is not None else {"model": model, "optimizer": optimizer, "step": 0}
    batches = iter(loader)
    for _ in range(state["step"] * accumulate):
        next(batches)
    history = []
    while state["step"] < steps:
        loss_sum = torch.zeros((), device=fabric.device)
        for micro_step in range(accumulate):
            inputs, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro_step < accumulate - 1):
                output = model(inputs)
                logits = getattr(output, "logits", output)  # a Hugging Face model returns a ModelOutput
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                fabric.backward(loss / accumulate)
            loss_sum += loss.detach() / accumulate
        norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        history.append((float(fabric.all_reduce(loss_sum, reduce_op="mean")), float(norm)))
        fabric.print(f"step {state['step']}: loss {history[-1][0]:.4f}")
        if checkpoint is not None and state["step"] == save_at:
            fabric.save(checkpoint, state)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default="auto", help='"auto" or a plan file (pp=1, micro_batches=1)')
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4, help="per device and micro-step, as under DDP")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # several processes share this machine's cores

    config = GPTConfig(vocab_size=16, seq_length=32, n_layer=4, n_head=4, n_embd=64)
    example_input = torch.zeros(args.batch_size, config.seq_length, dtype=torch.long)
    strategy = GalvatronFabricStrategy(plan=args.plan, example_input=example_input)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)

    model = fabric.setup(GPT(config))  # the plan is resolved and applied here
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    data = ArithmeticText(args.steps * 2 * args.batch_size * args.devices, config.seq_length)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True))
    train(fabric, model, optimizer, loader, args.steps)
    fabric.save("checkpoints/fabric_gpt", {"model": model, "optimizer": optimizer, "step": args.steps})


if __name__ == "__main__":
    main()

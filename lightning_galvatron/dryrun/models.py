"""The model a dry run simulates: built on the meta device, once, before the ranks fork.

Three sources, as ``lightning-galvatron estimate`` takes them:

* a Hugging Face ``config.json`` (or its dict): ``AutoModelForCausalLM.from_config`` inside
  :class:`CausalLMModule`, a LightningModule with a next-token loss and AdamW;
* a LightningModule class (``MODULE:CLASS`` or ``module.Class``) and its init arguments: its own
  ``training_step``, ``validation_step`` and ``configure_optimizers`` run;
* a module given in Python: a LightningModule is used as it is, any other ``nn.Module`` (a causal LM
  returning logits, or a ``transformers`` output with ``.logits``) is wrapped in :class:`CausalLMModule`.

Batches are token batches ``(inputs, targets)``, both ``[batch, seq]`` int64 (what the examples'
modules and :class:`CausalLMModule` take); pass ``make_batch`` to :func:`~lightning_galvatron.dryrun.dry_run`
for other inputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_galvatron.producers.analytic import ArchitectureShape


class CausalLMModule(L.LightningModule):
    """Next-token prediction around a causal language model: the training a dry run of a bare model simulates."""

    def __init__(self, model: nn.Module, learning_rate: float = 1e-4) -> None:
        super().__init__()
        self.model = model
        self.learning_rate = learning_rate

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        out = self.model(input_ids=inputs) if _takes_input_ids(self.model) else self.model(inputs)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def _takes_input_ids(model: nn.Module) -> bool:
    import inspect

    try:
        return "input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def token_batch(local_batch: int, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of token ids (zeros: a dry run's values do not matter, its shapes do)."""
    tokens = torch.zeros(local_batch, seq_length, dtype=torch.long)
    return tokens, tokens.clone()


@dataclass(frozen=True)
class ModelSource:
    """How to build the model on the meta device and describe its shape for the cost model.

    Attributes:
        label: what the report calls the model.
        build: makes the LightningModule (called under ``torch.device("meta")``).
        architecture: its :class:`ArchitectureShape` (the cost model's view), or ``None`` if unknown.
        layers: dotted path(s) of the block container(s), ``None`` to detect them.
    """

    label: str
    build: Callable[[], L.LightningModule]
    architecture: Callable[[], ArchitectureShape | None]
    layers: str | Sequence[str] | None = None

    @classmethod
    def from_hf_config(
        cls, config: str | Path | Mapping[str, Any], layers: str | Sequence[str] | None = None
    ) -> ModelSource:
        from lightning_galvatron.model.sources import architecture_from_config_file
        from lightning_galvatron.producers.analytic import architecture_from_hf_config

        if isinstance(config, Mapping):
            data, label = dict(config), str(config.get("_name_or_path") or config.get("model_type", "model"))

            def architecture() -> ArchitectureShape | None:
                return architecture_from_hf_config(data)
        else:
            path = Path(config)
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise ValueError(f"config file {str(path)!r} does not exist") from None
            label = str(path)

            def architecture() -> ArchitectureShape | None:
                return architecture_from_config_file(path)

        def build() -> L.LightningModule:
            return CausalLMModule(hf_causal_lm(data))

        return cls(label, build, architecture, layers)

    @classmethod
    def from_class(
        cls, path: str, init_args: Mapping[str, Any] | None = None, layers: str | Sequence[str] | None = None
    ) -> ModelSource:
        from lightning_galvatron.model.sources import architecture_from_class, load_class

        module_cls = load_class(path)
        args = dict(init_args or {})

        def build() -> L.LightningModule:
            module = module_cls(**args)
            return module if isinstance(module, L.LightningModule) else CausalLMModule(module)

        return cls(path, build, lambda: architecture_from_class(path, args, layers), layers)

    @classmethod
    def from_module(cls, module: nn.Module, layers: str | Sequence[str] | None = None) -> ModelSource:
        from lightning_galvatron.model.shapes import architecture_of_module

        if any(not p.is_meta for p in module.parameters()):
            raise ValueError(
                "dry_run needs the model on the meta device (with torch.device('meta'): model = ...): every simulated "
                "rank gets its own copy, and real weights would be copied into every one of them"
            )
        wrapped = module if isinstance(module, L.LightningModule) else CausalLMModule(module)
        return cls(
            type(module).__name__, lambda: wrapped, lambda: architecture_of_module(wrapped, layers=layers), layers
        )


def hf_causal_lm(config: Mapping[str, Any]) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of a ``config.json`` dict (at the model's defaults)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("a Hugging Face config needs `transformers` (pip install transformers)") from None
    data = {
        k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
    }
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError("the config has no 'model_type'")
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # untyped
        transformers.AutoConfig.for_model(model_type, **data)
    )
    return model

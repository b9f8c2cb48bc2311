"""Precision for the Galvatron strategy: Lightning's plugins plus clipping across meshes.

Lightning only validates precision for ``ModelParallelStrategy`` instances given directly, and its
norm clipping stacks per-parameter norms, which fails for parameters on different meshes. Each
supported precision therefore reuses Lightning's own plugin (autocast for ``bf16-mixed``, a bf16
module for ``bf16-true``) with norm clipping replaced by the global norm across meshes and stages
(and value clipping done on local shards: one foreach call fails on a mix of DTensors and tensors);
the FSDP2 policy and pipeline dtype each maps onto live in :mod:`lightning_galvatron.runtime.precision`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_galvatron._compat import override
from lightning_galvatron.runtime.step import NormScope, clip_gradients, optimizer_parameters

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


class GlobalNormClipping(Precision):
    """Mixin: clip as the runtime's step clips (:func:`~lightning_galvatron.runtime.step.clip_gradients`): by the norm
    over every mesh and pipeline stage of the applied plan (``norm_scope``, set where a plan is applied), by value on
    each rank's shards."""

    norm_scope: NormScope = NormScope()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_gradients(optimizer_parameters(optimizer), clip_val, "norm", self.norm_scope)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_gradients(optimizer_parameters(optimizer), clip_val, "value", self.norm_scope)


class GalvatronFullPrecision(GlobalNormClipping, Precision):
    """``32-true``."""


class GalvatronMixedPrecision(GlobalNormClipping, MixedPrecision):
    """``bf16-mixed``: fp32 parameters and optimizer states, bf16 compute (FSDP2 casts, autocast guards)."""


class GalvatronHalfPrecision(GlobalNormClipping, HalfPrecision):
    """``bf16-true``: everything in bf16."""


def check_precision(precision: Any) -> None:
    """Refuse a precision flag the strategy does not run, saying which it does (Lightning's own message for
    ``ModelParallelStrategy`` suggests ``16-true`` and speaks of ``Fabric``)."""
    if str(precision) in SUPPORTED_PRECISION:
        return
    hint = (
        " fp16 needs a gradient scaler, which this strategy does not provide; bf16 has fp32's range and needs none."
        if "16" in str(precision) and "bf16" not in str(precision)
        else ""
    )
    raise ValueError(
        f"GalvatronStrategy does not support precision={precision!r}; choose one of {', '.join(SUPPORTED_PRECISION)}."
        + hint
    )


def precision_plugin_for(precision: str, device_type: str) -> Precision:
    """The plugin for a Lightning precision flag; unsupported flags get an error saying what to use."""
    check_precision(precision)
    if precision == "32-true":
        return GalvatronFullPrecision()
    if precision == "bf16-mixed":
        return GalvatronMixedPrecision("bf16-mixed", device="cuda" if device_type == "cuda" else device_type)
    return GalvatronHalfPrecision("bf16-true")


def precision_flag(plugin: Any) -> str:
    return str(getattr(plugin, "precision", "32-true"))


def check_precision_first(connector: type, strategy: type) -> None:
    """Have the Trainer refuse a precision we do not run with our message, before Lightning's own check (which, for
    any ``ModelParallelStrategy``, speaks of ``Fabric(...)`` and suggests ``16-true``). Only our strategy's checks
    change; the connector validates every other strategy as before."""
    original = connector._validate_precision_choice
    if getattr(original, "_galvatron_strategy", None) is strategy:
        return

    def validate_precision_choice(self: Any) -> None:
        if isinstance(getattr(self, "strategy", None), strategy) or isinstance(self._strategy_flag, strategy):
            check_precision(self._precision_flag)
        original(self)

    validate_precision_choice._galvatron_strategy = strategy  # type: ignore[attr-defined]
    connector._validate_precision_choice = validate_precision_choice

"""What a Lightning precision flag means to the runtime: the FSDP2 policy per block and the dtype between stages.

The flags themselves (which exist, which plugin runs each) are the strategy's
(:mod:`lightning_galvatron.strategy.precision`); the runtime and the profiler only need the dtypes, without Lightning.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2 policy per precision: ``bf16-mixed`` gathers bf16 weights and reduces gradients in fp32."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # 32-true: fp32 throughout; bf16-true: the module itself is bf16


def boundary_dtype(precision: str) -> torch.dtype:
    """Dtype of activations sent between pipeline stages: bf16 only when everything is bf16."""
    return torch.bfloat16 if precision == "bf16-true" else torch.float32

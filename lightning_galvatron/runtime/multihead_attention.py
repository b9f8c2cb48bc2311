"""Tensor parallelism for PyTorch's ``nn.MultiheadAttention``.

The module (inside ``nn.TransformerEncoderLayer`` / ``DecoderLayer``) keeps q/k/v in one fused ``in_proj_weight``
``[3E, E]`` and runs ``F.multi_head_attention_forward``, which needs the global head count.
:class:`ParallelMultiheadAttention` shards the fused weight by heads the strided way of
:mod:`~lightning_galvatron.runtime.tensor_parallel` (each rank its heads' rows of q, k and v), the output projection
by inputs, and replaces the module's forward with attention over the local heads through
``F.scaled_dot_product_attention``, with the masks and the ``is_causal`` hint handled as
``F.multi_head_attention_forward`` handles them. FSDP2 then shards that weight along its second dimension
(:func:`~lightning_galvatron.runtime.sharding.shard_placement`): it cannot shard a dimension that is already
strided-sharded.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_galvatron.runtime.tensor_parallel import _CopyToGroup, _distribute_parameter, _ReduceFromGroup


class ParallelMultiheadAttention(ParallelStyle):
    """Split an ``nn.MultiheadAttention`` by heads over the tensor-parallel group (see the module docstring).

    Exact for what ``F.multi_head_attention_forward`` computes with ``need_weights=False`` (how
    ``nn.Transformer*Layer`` call it): self- and cross-attention, batch-first or not, ``attn_mask``
    (2-D, or 3-D per batch x head), ``key_padding_mask``, the ``is_causal`` hint and dropout. Refused
    with an error: attention weights (``need_weights=True``), unbatched inputs, separate q/k/v
    weights (``kdim``/``vdim`` != ``embed_dim``), ``add_bias_kv`` and ``add_zero_attn``.
    """

    reduces_output = True  # the output projection's partial sums are reduced over the group

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.MultiheadAttention)  # what this style splits
        reason = multihead_attention_unsupported(module)
        if reason is not None:
            raise ValueError(f"cannot split this nn.MultiheadAttention: {reason}")
        group = device_mesh.get_group()
        tp, tp_rank = device_mesh.size(), device_mesh.get_local_rank()
        heads, head_dim, embed = module.num_heads, module.head_dim, module.embed_dim
        if heads % tp:
            raise ValueError(f"tensor-parallel degree {tp} does not divide the {heads} attention heads")
        local_heads, local_width = heads // tp, embed // tp
        _distribute_parameter(module, "in_proj_weight", device_mesh, _StridedShard(0, split_factor=3))
        _distribute_parameter(module.out_proj, "weight", device_mesh, Shard(1))
        _distribute_parameter(module.out_proj, "bias", device_mesh, Replicate())

        def projections() -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = cast(DTensor, module.in_proj_weight).to_local()  # [q_r; k_r; v_r] rows of this rank's heads
            if module.in_proj_bias is None:
                return weight, None
            # The fused bias stays whole (as ColwiseFused's): this rank's slices, gradient summed over the group.
            return weight, _CopyToGroup.apply(module.in_proj_bias, group).view(3, tp, -1)[:, tp_rank].reshape(-1)

        def forward(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            key_padding_mask: torch.Tensor | None = None,
            need_weights: bool = True,
            attn_mask: torch.Tensor | None = None,
            average_attn_weights: bool = True,
            is_causal: bool = False,
        ) -> tuple[torch.Tensor, None]:
            if need_weights:
                raise ValueError(
                    "a tensor-parallel nn.MultiheadAttention does not return attention weights: call it with "
                    "need_weights=False (as nn.TransformerEncoderLayer/DecoderLayer do), or run this block with tp=1"
                )
            if query.dim() != 3:
                raise ValueError("a tensor-parallel nn.MultiheadAttention needs batched (3-D) inputs")
            self_attention, shared_kv = query is key and key is value, key is value
            if not module.batch_first:  # [seq, batch, E] -> [batch, seq, E]
                query, key, value = (x.transpose(0, 1) for x in (query, key, value))
            batch, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]

            key_padding_mask = F._canonical_mask(
                mask=key_padding_mask,
                mask_name="key_padding_mask",
                other_type=F._none_or_dtype(attn_mask),
                other_name="attn_mask",
                target_type=query.dtype,
            )
            if is_causal and attn_mask is None:
                raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
            if is_causal and key_padding_mask is None:
                attn_mask = None  # the hint stands for the mask, as in F.multi_head_attention_forward
            else:
                attn_mask = F._canonical_mask(
                    mask=attn_mask,
                    mask_name="attn_mask",
                    other_type=None,
                    other_name="",
                    target_type=query.dtype,
                    check_other=False,
                )
                if key_padding_mask is not None:
                    is_causal = False
            if attn_mask is not None:
                attn_mask = _local_heads_mask(attn_mask, batch, heads, tgt_len, src_len, tp_rank, local_heads)
            if key_padding_mask is not None:
                padding = key_padding_mask.view(batch, 1, 1, src_len)
                attn_mask = padding if attn_mask is None else attn_mask + padding

            weight, bias = projections()
            bias_q, bias_kv = (None, None) if bias is None else (bias[:local_width], bias[local_width:])
            query = _CopyToGroup.apply(query, group)
            if self_attention:
                q, k, v = F.linear(query, weight, bias).split(local_width, dim=-1)
            else:
                q = F.linear(query, weight[:local_width], bias_q)
                key = _CopyToGroup.apply(key, group)
                if shared_kv:
                    k, v = F.linear(key, weight[local_width:], bias_kv).split(local_width, dim=-1)
                else:
                    value = _CopyToGroup.apply(value, group)
                    bias_k, bias_v = (None, None) if bias_kv is None else bias_kv.split(local_width)
                    k = F.linear(key, weight[local_width : 2 * local_width], bias_k)
                    v = F.linear(value, weight[2 * local_width :], bias_v)
            q, k, v = (x.view(batch, -1, local_heads, head_dim).transpose(1, 2) for x in (q, k, v))
            dropout = module.dropout if module.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout, is_causal)
            out = out.transpose(1, 2).reshape(batch, tgt_len, local_width)
            out = _ReduceFromGroup.apply(F.linear(out, cast(DTensor, module.out_proj.weight).to_local()), group)
            if module.out_proj.bias is not None:
                out = out + cast(DTensor, module.out_proj.bias).to_local()
            return (out if module.batch_first else out.transpose(0, 1)), None

        module.forward = forward  # type: ignore[method-assign]
        return module


def multihead_attention_unsupported(module: nn.MultiheadAttention) -> str | None:
    """Why :class:`ParallelMultiheadAttention` cannot split ``module``, or ``None``."""
    if not module._qkv_same_embed_dim:
        return "separate q/k/v weights (kdim or vdim != embed_dim) are not supported"
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True is not supported"
    if module.add_zero_attn:
        return "add_zero_attn=True is not supported"
    return None


def _local_heads_mask(
    mask: torch.Tensor, batch: int, heads: int, tgt_len: int, src_len: int, tp_rank: int, local_heads: int
) -> torch.Tensor:
    """An ``nn.MultiheadAttention`` attention mask as ``[batch or 1, local heads or 1, tgt, src]``."""
    if mask.dim() == 2 and mask.shape == (tgt_len, src_len):
        return mask.view(1, 1, tgt_len, src_len)
    if mask.dim() == 3 and mask.shape == (1, tgt_len, src_len):
        return mask.unsqueeze(0)
    if mask.dim() == 3 and mask.shape == (batch * heads, tgt_len, src_len):
        start = tp_rank * local_heads
        return mask.view(batch, heads, tgt_len, src_len)[:, start : start + local_heads]
    raise ValueError(
        f"attn_mask of shape {tuple(mask.shape)} does not fit ({tgt_len}, {src_len}) or "
        f"({batch} x {heads}, {tgt_len}, {src_len}) (a per-sample mask must follow its samples when the plan "
        "moves them between ranks: pass key_padding_mask instead, or run this block with tp=1)"
    )

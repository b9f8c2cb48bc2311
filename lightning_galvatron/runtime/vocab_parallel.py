"""Vocabulary parallelism: split the token embedding and the LM head by vocabulary rows.

The embedding table is sharded by rows (each rank looks up the ids it owns, the partial results
are summed) and the head by output rows. By default the head's logits are gathered, so the user's
own loss code sees ordinary full logits. With ``parallel_loss=True`` the logits stay sharded by
vocabulary and the cross-entropy is computed without gathering them (``loss_parallel``); the step
must then only feed the logits to ``F.cross_entropy``. Vocabulary sizes that the degree does not
divide are fine: DTensor shards unevenly (earlier ranks get one more row) and masks accordingly.

Tied embedding and head weights stay tied: both modules are split with the same row placement and
the head's parameter is pointed back at the embedding's; so are other modules holding the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.overrides import TorchFunctionMode

from lightning_galvatron.plan import PlanError
from lightning_galvatron.runtime.structure import ModelStructure


@dataclass(frozen=True)
class VocabularyLayers:
    embedding: nn.Embedding | None
    head: nn.Linear | None
    tied: bool = False

    def present_in(self, root: nn.Module) -> VocabularyLayers:
        """The layers this rank still holds (a pipeline keeps the embedding first, the head last)."""
        held = {id(m) for m in root.modules()}
        return VocabularyLayers(
            self.embedding if id(self.embedding) in held else None,
            self.head if id(self.head) in held else None,
            self.tied,
        )


def find_vocabulary_layers(structure: ModelStructure) -> VocabularyLayers:
    """The token embedding (the largest ``nn.Embedding`` outside the blocks) and the LM head (a ``Linear``
    from the embedding's width to as many outputs as it has rows), if there is one.

    Smaller tables (positions, token types) and heads of other sizes (a classifier) stay whole.
    """
    in_blocks = {id(m) for block in structure.blocks for m in block.modules()}
    outside = [m for _, m in structure.root.named_modules() if id(m) not in in_blocks]
    embeddings = [m for m in outside if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise PlanError(
            "vocabulary parallelism (vocab tp > 1) needs an nn.Embedding token table outside the blocks; none was "
            "found, use vocab tp=1"
        )
    embedding = max(embeddings, key=lambda m: m.num_embeddings)
    heads = [
        m
        for m in outside
        if isinstance(m, nn.Linear)
        and m.out_features == embedding.num_embeddings
        and m.in_features == embedding.embedding_dim
    ]
    head = heads[0] if heads else None
    return VocabularyLayers(embedding, head, tied=head is not None and head.weight is embedding.weight)


def apply_vocab_parallel(
    layers: VocabularyLayers, tp_mesh: DeviceMesh, parallel_loss: bool = False, root: nn.Module | None = None
) -> None:
    """Split embedding and head rows over ``tp_mesh`` (either may be absent on a pipeline stage).

    With ``root``, every other module of it that holds the same tensors keeps holding them: embeddings that
    share the token table (BART's encoder and decoder ``embed_tokens`` share ``shared``) are split the same
    way, and other references (BERT's ``cls.predictions.bias`` is its decoder's bias) point at the split
    parameters -- a stale copy would train apart from the rest, silently.
    """
    split: dict[int, nn.Parameter] = {}  # id of a parameter before splitting -> the split one

    def parallelize(module: nn.Module, style: ParallelStyle) -> None:
        before = dict(module.named_parameters(recurse=False))
        parallelize_module(module, tp_mesh, style)
        for name, param in before.items():
            if id(param) in split:  # tied to one split already (a head tied to the embedding)
                module.register_parameter(name, split[id(param)])
            else:
                split[id(param)] = getattr(module, name)

    if layers.embedding is not None:
        table = layers.embedding.weight
        sharing = [
            m for m in (root.modules() if root is not None else ()) if isinstance(m, nn.Embedding) and m.weight is table
        ]
        for embedding in dict.fromkeys([layers.embedding, *sharing]):
            parallelize(embedding, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if layers.head is not None:
        output = Shard(-1) if parallel_loss else Replicate()
        parallelize(layers.head, ColwiseParallel(output_layouts=output, use_local_output=not parallel_loss))
    for module in root.modules() if root is not None else ():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in split and split[id(param)] is not param:
                module.register_parameter(name, split[id(param)])


class _LossAsLocalTensor(TorchFunctionMode):
    """Hand the (replicated) loss of a vocabulary-parallel cross-entropy back as a plain tensor."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (F.cross_entropy, F.nll_loss) and isinstance(out, DTensor):
            return out.to_local()  # replicated: the local value is the loss; backward re-wraps the gradient
        return out


@contextmanager
def parallel_cross_entropy() -> Iterator[None]:
    """Run a step whose ``F.cross_entropy`` gets vocabulary-sharded logits, without gathering them."""
    with loss_parallel(), _LossAsLocalTensor():
        yield

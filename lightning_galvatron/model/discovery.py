"""Find the repeated Transformer blocks of a model.

A plan assigns one strategy per block, so the runtime first has to know which modules the blocks
are. Transformer implementations keep them in one container -- ``nn.ModuleList`` or
``nn.Sequential`` of modules of one class (``model.blocks``, ``transformer.h``, ``model.layers``,
``encoder.layer``). Everything else with parameters (embeddings, final norm, head) belongs to the
"vocabulary" part that the plan's ``vocab`` strategy covers.

When several such containers exist, the one holding the most parameters wins (attention heads kept
in a small list inside each block never beat the block list itself). Encoder-decoder models keep
their blocks in two containers (``encoder.layers`` and ``decoder.layers`` of ``nn.Transformer``,
BART, T5, ...): every other container outside the winner -- neither inside it nor holding it --
with at least :data:`COMPANION_SHARE` of its parameters is a block list too, in registration order
(the encoder is registered first in these models). A list of lists (Funnel's encoder) is never a block list: its
model iterates it and calls the blocks in the lists inside, which are the block lists (hooks on a list that is never
called would never run). Users can name the list(s) explicitly, e.g.
``layers="model.blocks"`` or ``layers=["encoder.layers", "decoder.layers"]``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

# The runtime defines what it needs to know of a model; discovery fills it in (model/ -> runtime/).
from lightning_galvatron.runtime.structure import BlockList, ModelStructure, model_class

__all__ = ["COMPANION_SHARE", "BlockDiscoveryError", "BlockList", "ModelStructure", "find_blocks", "model_class"]


#: A second block container counts as another block list (an encoder's or a decoder's) when it holds at
#: least this share of the largest one's parameters; smaller ones (output heads, adapters) do not.
COMPANION_SHARE = 0.25


#: Containers a model iterates instead of calling: never blocks themselves (Funnel's encoder keeps a list of lists).
_UNCALLED = (nn.ModuleList, nn.ModuleDict)


class BlockDiscoveryError(ValueError):
    """The model's Transformer blocks could not be found; the message says what to pass."""


def find_blocks(model: nn.Module, layers: str | Sequence[str] | None = None) -> ModelStructure:
    """Locate the Transformer blocks of ``model``.

    Args:
        model: the LightningModule (or any ``nn.Module``) that owns the network.
        layers: dotted path(s) of the block container(s) relative to ``model``; ``None`` detects it.
    """
    if layers is not None:
        paths = [layers] if isinstance(layers, str) else list(layers)
        return ModelStructure(model, tuple(_named_block_list(model, path) for path in paths))

    candidates = _block_lists(model, min_blocks=2) or _block_lists(model, min_blocks=1)  # one block: a list of one
    if not candidates:
        raise BlockDiscoveryError(
            f"could not find the Transformer blocks of {type(model).__name__}: expected an nn.ModuleList or "
            "nn.Sequential holding modules of one class, each with parameters and submodules (lists seen: "
            f"{_container_names(model) or 'none'}). Put the blocks in such a list, or tell the strategy where "
            "they are: GalvatronStrategy(layers='path.to.blocks')"
        )
    best = max(candidates, key=lambda c: (_num_params(c.container), -c.path.count(".")))
    chosen = [c for c in candidates if c is best or _is_companion(c, best, candidates)]
    return ModelStructure(model, tuple(chosen))


def _is_companion(candidate: BlockList, best: BlockList, candidates: Sequence[BlockList]) -> bool:
    """Another top-level block list next to ``best`` (see the module docstring)."""

    def nested(inner: str, outer: str) -> bool:
        return inner.startswith(outer + ".")

    if nested(candidate.path, best.path) or nested(best.path, candidate.path):
        return False
    if any(nested(candidate.path, other.path) for other in candidates if other is not candidate):
        return False  # a list inside another list's blocks (attention heads, experts)
    return _num_params(candidate.container) >= COMPANION_SHARE * _num_params(best.container)


def _named_block_list(model: nn.Module, path: str) -> BlockList:
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise BlockDiscoveryError(
            f"layers={path!r}: {type(model).__name__} has no submodule at that path; "
            f"containers that hold several blocks: {_container_names(model) or 'none'}"
        ) from None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) == 0:
        raise BlockDiscoveryError(
            f"layers={path!r} is a {type(container).__name__}, not a non-empty nn.ModuleList or nn.Sequential of blocks"
        )
    classes = {model_class(m).__name__ for m in container.children()}
    if len(classes) > 1:
        raise BlockDiscoveryError(
            f"layers={path!r} mixes block classes {sorted(classes)}; every block in one list must have the same "
            "class. Name one list per block type, e.g. layers=['encoder.layers', 'decoder.layers']"
        )
    first = next(container.children())
    if isinstance(first, _UNCALLED):  # recomputation, sharding and relocation hook the calls of blocks
        inner = [f"{path}.{name}" for name, _ in container.named_children()]
        raise BlockDiscoveryError(
            f"layers={path!r} holds {type(first).__name__}s, which the model never calls (it calls what they hold): "
            f"name the lists of blocks inside them, e.g. layers={inner!r}"
        )
    return BlockList(path, container)


def _block_lists(model: nn.Module, min_blocks: int) -> list[BlockList]:
    return [BlockList(name, m) for name, m in model.named_modules() if name and _is_block_container(m, min_blocks)]


def _is_block_container(module: nn.Module, min_blocks: int) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    if len(children) < min_blocks:
        return False
    first = model_class(children[0])
    return (
        all(model_class(c) is first for c in children)
        and _num_params(children[0]) > 0
        and len(list(children[0].children())) > 0
        and not issubclass(first, _UNCALLED)  # a list of lists is never called: the blocks in its lists are
    )


def _container_names(model: nn.Module) -> str:
    return ", ".join(
        repr(name) for name, m in model.named_modules() if name and isinstance(m, (nn.ModuleList, nn.Sequential))
    )


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

"""Phase 2, embedding and head: the step with every block stood in for, timed and counted per part.

Hooks on the first and last block split the forward (and gradient hooks on the hidden states the
backward) into "before the blocks" and "after them, including the loss".
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_galvatron.model.call_state import hidden_states_of
from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.profiler.model.capture import _Captured, _skipping
from lightning_galvatron.profiler.model.saved import SavedTensorCounter, _per_sample, _storage_key
from lightning_galvatron.profiler.model.setup import (
    MIN_REPEATS,
    Step,
    _BlockType,
    _PrecisionConfig,
    _resize_batch,
    _synchronize,
    _to_device,
    quiet_over_ranks,
)
from lightning_galvatron.profiles import DegreeTable, LinearFit, VocabProfile


def _profile_vocab(
    module: nn.Module,
    structure: ModelStructure,
    types: Sequence[_BlockType],
    captured: _Captured,
    batch: Any,
    step: Step,
    prec: _PrecisionConfig,
    device: torch.device,
    sizes: Sequence[int],
    degrees: Sequence[int],
) -> VocabProfile:
    """Time and count everything outside the blocks, with every block stood in for by the identity."""
    blocks = structure.blocks
    params = {id(p): p for p in module.parameters()}
    fixed = [*params.values(), *module.buffers()]
    times: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[tuple[int, float]]] = defaultdict(list)
    used: dict[str, set[tuple]] = defaultdict(set)
    repeats = MIN_REPEATS
    with _skipping(blocks, captured.inputs, types, set(range(len(blocks)))):
        for b in sizes:
            local_batch = _to_device(_resize_batch(batch, b), device, prec)
            counter = SavedTensorCounter([*fixed, *tree_flatten(local_batch)[0]])
            with counter:  # the counting run doubles as the warm-up
                _PhaseTimer(blocks, device, counter).run(module, local_batch, step, prec)
            for phase in ("embedding", "head"):
                counts[phase].append((b, float(counter.bytes[phase])))
                used[phase] |= counter.used[phase]
            trial = [_PhaseTimer(blocks, device).run(module, local_batch, step, prec) for _ in range(repeats)]
            keys = sorted(trial[0])
            for key, quiet in zip(keys, quiet_over_ranks([[t[k] for k in keys] for t in trial])):
                times[key].append(quiet)
            _zero_grads(params.values())

    # Which part uses which parameter: those its ops saved (a linear head saves its weight), else,
    # for parameters no op saved (an embedding saves only the indices), where they are registered;
    # a head tied to the token embedding uses the embedding's table.
    key_of = {_storage_key(p): id(p) for p in params.values()}
    saved_by = {phase: {key_of[k] for k in used[phase] if k in key_of} for phase in ("embedding", "head")}
    unseen = set(params) - saved_by["embedding"] - saved_by["head"]
    vocab_size, vocab_parallel, tied_table = _vocabulary(structure)
    in_embedding = saved_by["embedding"] | (_modules_params(module, blocks, "before") & unseen)
    in_head = saved_by["head"] | (_modules_params(module, blocks, "after") & unseen)
    if tied_table is not None:
        in_embedding.add(id(tied_table))
        in_head.add(id(tied_table))
    block_params = structure.block_parameter_ids()
    outside = {pid for pid in params if pid not in block_params}
    tied = bool(in_embedding & in_head & outside)
    # With tied weights the format has no room for the head's own parameters (a final norm, say):
    # they go with the embedding, so the model's total is exact.
    head_only = set() if tied else (in_head - in_embedding) & outside
    embedding_parameters = sum(params[pid].numel() for pid in outside - head_only)
    head_parameters = sum(params[pid].numel() for pid in head_only)
    fw = sum(times["embedding_forward"]) + sum(times["head_forward"])
    bw = sum(times["embedding_backward"]) + sum(times["head_backward"])
    # The runtime gathers the logits for the user's loss, so a vocabulary-parallel group does not
    # split what the head keeps: the same bytes at every degree.
    constant = lambda v: DegreeTable(tuple((g, v) for g in degrees))  # noqa: E731
    return VocabProfile(
        vocab_size=vocab_size,
        embedding_parameters=embedding_parameters,
        head_parameters=head_parameters,
        embedding_forward_time=LinearFit.fit(sizes, times["embedding_forward"]),
        head_forward_time=LinearFit.fit(sizes, times["head_forward"]),
        embedding_activation_bytes_per_sample=constant(_per_sample(counts["embedding"])),
        head_activation_bytes_per_sample=constant(_per_sample(counts["head"])),
        tied=tied,
        backward_to_forward=bw / fw if fw > 0 else 2.0,
        supports_tensor_parallel=vocab_parallel,
        supports_sequence_split=False,  # the runtime runs the embedding and head on whole sequences
    )


class _PhaseTimer:
    """One step (forward + backward) split into embedding and head time by hooks on the first and last block.

    Forward: start -> first block's input (embedding) ... last block's output -> loss (head).
    Backward: loss -> gradient of the last block's output (head) ... gradient of the first
    block's input -> end (embedding). With a counter, saved tensors are attributed to the phases.
    """

    def __init__(
        self, blocks: Sequence[nn.Module], device: torch.device, counter: SavedTensorCounter | None = None
    ) -> None:
        self.blocks, self.device, self.counter = blocks, device, counter
        self.marks: dict[str, float] = {}

    def _mark(self, name: str) -> None:
        _synchronize(self.device)
        self.marks.setdefault(name, time.perf_counter())

    def _phase(self, name: str) -> None:
        if self.counter is not None:
            self.counter.phase = name

    def run(self, module: nn.Module, batch: Any, step: Step, prec: _PrecisionConfig) -> dict[str, float]:
        def first_in(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if "blocks_start" in self.marks:
                return
            self._mark("blocks_start")
            self._phase("blocks")
            hidden = hidden_states_of(args, kwargs)[1]
            if hidden.requires_grad:
                hidden.register_hook(lambda g: self._mark("embedding_backward_start"))

        def last_out(mod: nn.Module, args: tuple, output: Any) -> None:
            self._mark("blocks_end")
            self._phase("head")
            hidden = _with_hidden_leaf(output)
            if hidden.requires_grad:
                hidden.register_hook(lambda g: self._mark("head_backward_end"))

        handles = [
            self.blocks[0].register_forward_pre_hook(first_in, with_kwargs=True),
            self.blocks[-1].register_forward_hook(last_out),
        ]
        self._phase("embedding")
        try:
            self._mark("start")
            with prec.autocast(self.device):
                loss = step(module, batch)
            self._mark("loss")
            self._phase("backward")
            self._mark("backward_start")
            loss.backward()
            self._mark("end")
        finally:
            for h in handles:
                h.remove()
        m = self.marks
        return {
            "embedding_forward": m["blocks_start"] - m["start"],
            "head_forward": m["loss"] - m["blocks_end"],
            "head_backward": m.get("head_backward_end", m["end"]) - m["backward_start"],
            "embedding_backward": m["end"] - m.get("embedding_backward_start", m["end"]),
        }


def _with_hidden_leaf(output: Any) -> torch.Tensor:
    leaves, _ = tree_flatten(output)
    return next(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _modules_params(module: nn.Module, blocks: Sequence[nn.Module], where: str) -> set[int]:
    """Parameters of the modules registered before (``"before"``) or after the blocks: a fallback for
    parameters no saved tensor revealed (e.g. an embedding table, which saves only the indices)."""
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    first_block = next(i for i, m in enumerate(module.modules()) if m is blocks[0])
    last_block = next(i for i, m in enumerate(module.modules()) if m is blocks[-1])
    out = set()
    for i, m in enumerate(module.modules()):
        if id(m) in in_blocks or not any(True for _ in m.parameters(recurse=False)):
            continue
        if (where == "before" and i < first_block) or (where == "after" and i > last_block):
            out |= {id(p) for p in m.parameters(recurse=False)}
    return out


def _vocabulary(structure: ModelStructure) -> tuple[int, bool, nn.Parameter | None]:
    """(vocabulary size, whether the runtime can split it, the table a tied head shares with the embedding)."""
    from lightning_galvatron.plan import PlanError
    from lightning_galvatron.runtime.vocab_parallel import find_vocabulary_layers

    try:
        layers = find_vocabulary_layers(structure)
    except PlanError:
        layers = None
    if layers is None or layers.embedding is None:
        return 1, False, None  # no token table: nothing to split by vocabulary
    return layers.embedding.num_embeddings, True, layers.embedding.weight if layers.tied else None


def _zero_grads(params: Any) -> None:
    for p in params:
        p.grad = None

"""Prove a guessed tensor-parallel plan on its block before anything trains with it.

A plan inferred from layer names (:mod:`lightning_galvatron.model.tensor_parallel_plans`) is a guess: that the
layers named like projections are split where the code expects, that the fused ``[q | k | v]`` is laid out as
guessed, that the head counts and widths the forward reads are the attributes the plan divides. A wrong guess can
run without an error and train something else (a head count hidden in an attribute nobody divides gives heads of
half the width). So the guess is checked on the block itself, in one process, with no process group:

- every rank of a ``tp``-way split is simulated by running the block with that rank's slices of the weights
  (its rows of a column-parallel layer, its columns of a row-parallel one, per-head weights as the styles keep
  them) and the plan's ``localize`` applied;
- the collectives are replayed: the ranks run until the next one, what they hand it is combined (the partial
  outputs of a row-parallel layer summed and the bias added once; the parts of a width or a sequence joined), and
  the ranks run again with the results of the calls before (a few tiny forwards: one round per collective);
- every rank's output must be the whole block's output on the same inputs; under Megatron-SP
  (``sequence_parallel=True``: each rank receives its part of the sequence, its norms run on it, its sub-layers
  gather the sequence, its row-parallel layers keep their part of the sum) the rank's part of that output.

The weights are random and of unit scale (with the model's own small initial weights attention is nearly uniform,
and a wrong grouping of heads would differ only in rounding), in float64 where the block runs in it; the hidden
states are random, the block's other inputs those of a real call where it takes any (:func:`example_calls`).
Only the forward is proven: the styles' backward is its exact adjoint. Ulysses, which splits no weight, is not
simulated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils._pytree import tree_flatten, tree_map

from lightning_galvatron.model.families._common import GatherWidth, NarrowedInput, narrow_input
from lightning_galvatron.model.outside_layers import _recording_logs, _untouched
from lightning_galvatron.runtime.structure import hidden_states_of, model_class, with_hidden_states, without_kv_caches
from lightning_galvatron.runtime.tensor_parallel import (
    BlockTensorParallelPlan,
    ColwiseFused,
    GatherSequence,
    PerHeadWeights,
    RowwiseFused,
    SplitPerHead,
    fused_rows,
)

__all__ = ["example_calls", "prove_split", "proof_degrees"]

#: Largest error of a split output, relative to the largest output, that is rounding: float64 sums in another
#: order differ by ~1e-15, float32 by ~1e-6; a wrong guess differs by ~1e-1 with unit-scale weights.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
#: Hidden states made up for a block whose forward takes nothing else: samples x positions.
_SYNTHETIC = (2, 4)
_SEED = 20240543
_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})
#: What a split that runs but computes something else is told apart by (the guess closest to the block's code).
ANOTHER_FUNCTION = "it computes another function than the whole block"


class _Stop(BaseException):
    """A simulated rank reached an all-reduce whose sum is not known yet (``BaseException``: user code that catches
    ``Exception`` does not swallow it)."""


class Unprovable(Exception):
    """The proof cannot run (no inputs, weights on the meta device): the message says why."""


def proof_degrees(plan: BlockTensorParallelPlan, largest: int = 8) -> list[int]:
    """The degrees the proof runs: the smallest and the largest (up to ``largest``) the plan allows."""
    allowed = [d for d in range(2, largest + 1) if plan.unsupported(d, "none") is None]
    return sorted({allowed[0], allowed[-1]}) if allowed else []


def prove_split(
    block: nn.Module,
    plan: BlockTensorParallelPlan,
    degrees: Sequence[int],
    call: tuple[tuple, dict] | None,
    sequence_parallel: bool = False,
) -> str | None:
    """``None`` if ``block`` split by ``plan`` at each of ``degrees`` computes what the whole block computes, else
    what differs. ``call``: the inputs of a real call of a block of this type, or ``None`` for a block whose forward
    takes only its hidden states. With ``sequence_parallel``, the plan's Megatron-SP variant: each rank receives and
    returns its part of the sequence (the degrees that divide it). Raises :class:`Unprovable` where no proof can run.
    Nothing of ``block`` changes."""
    failure: str | None = None
    for dtype in (torch.float64, torch.float32):
        with _restored(block):
            generator = torch.Generator().manual_seed(_SEED)
            _randomize(block, dtype, generator)
            args, kwargs = _inputs(block, call, dtype, generator)
            block.train(False)  # dropout off: one function to compare
            try:
                with torch.no_grad():
                    whole = block(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - reported as why nothing is proven
                failure = f"{type(error).__name__}: {error}"
                continue  # a block that casts to float32 itself gets a float32 proof
            hidden = hidden_states_of(args, kwargs)[1]
            if sequence_parallel:
                unsummed = _weights_on_positions(block, plan.styles(True))
                if unsummed:
                    return (
                        f"with Megatron-SP, {', '.join(unsummed)} would see only each rank's positions and no style "
                        "of the plan sums their weights' gradient over the group"
                    )
                degrees = [tp for tp in degrees if hidden.dim() > 1 and hidden.shape[1] % tp == 0]
                if not degrees:
                    raise Unprovable(f"no degree it allows divides the sequence of {tuple(hidden.shape)}")
            for tp in degrees:

                def run(
                    rank: int,
                    replay: _Replay,
                    tp: int = tp,
                    args: tuple = args,
                    kwargs: dict = kwargs,
                    x: torch.Tensor = hidden,
                ) -> Any:
                    if sequence_parallel:  # this rank's positions
                        args, kwargs = with_hidden_states(args, kwargs, x.chunk(tp, 1)[rank])
                    return _run_as_rank(block, plan, tp, rank, replay, args, kwargs, sequence_parallel)

                problem = _compare(whole, run, tp, dtype, sequence_parallel)
                if problem is not None:
                    return f"split {tp} ways{' with Megatron-SP' if sequence_parallel else ''}, {problem}"
            return None
    raise Unprovable(f"the whole block does not run on the proof's inputs ({failure})")


def _weights_on_positions(block: nn.Module, styles: dict[str, ParallelStyle]) -> list[str]:
    """Modules of ``block`` with weights of their own that Megatron-SP runs on each rank's part of the sequence (not
    inside a sub-layer that gathers it) with no style of the plan: their gradient would cover that part only. The
    forward cannot show it: a norm computes the same on part of the positions."""
    gathered = [name for name, style in styles.items() if _gathers(style)]
    return [
        name or type(block).__name__
        for name, module in block.named_modules()
        if any(True for _ in module.parameters(recurse=False))
        and name not in styles
        and not any(name.startswith(f"{g}.") for g in gathered)
    ]


def _gathers(style: ParallelStyle) -> bool:
    """Whether ``style`` gives its module the whole sequence (Megatron-SP's gathering styles)."""
    if hasattr(style, "styles"):  # Compose
        return any(_gathers(inner) for inner in style.styles)
    if isinstance(style, (GatherSequence, NarrowedInput)):
        return isinstance(style, GatherSequence) or style.sequence_parallel
    layouts = getattr(style, "input_layouts", None) if isinstance(style, PrepareModuleInput) else None
    return bool(layouts) and isinstance(layouts[0], Shard)


# ---------------------------------------------------------------------------------------------- simulated ranks
class _Replay:
    """One simulated rank's collectives (the all-reduce behind a row-parallel layer, the all-gather of a width): the
    results of the calls before, and where it stopped."""

    def __init__(self, results: list[tuple[nn.Module, torch.Size, torch.Tensor]]) -> None:
        self.results = results
        self.calls = 0
        self.stopped: tuple[nn.Module, torch.Tensor, Callable[[list[torch.Tensor]], torch.Tensor]] | None = None

    def collective(
        self, module: nn.Module, part: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        """What ``combine`` makes of every rank's ``part`` at this call (known once every rank reached it)."""
        index, self.calls = self.calls, self.calls + 1
        if index < len(self.results):
            owner, shape, result = self.results[index]
            if owner is not module or shape != part.shape:
                raise RuntimeError("the ranks call their collectives in different orders or shapes")
            return result
        self.stopped = (module, part, combine)
        raise _Stop


def _compare(
    whole: Any, run: Callable[[int, _Replay], Any], tp: int, dtype: torch.dtype, sequence_parallel: bool = False
) -> str | None:
    """Run every rank of ``tp``, replaying collectives, and compare each rank's output with ``whole`` (with
    ``sequence_parallel``, its hidden states with the rank's part of the sequence of ``whole``'s)."""
    results: list[tuple[nn.Module, torch.Size, torch.Tensor]] = []
    while True:
        outputs, stops = [], []
        for rank in range(tp):
            replay = _Replay(results)
            try:
                outputs.append(run(rank, replay))
            except _Stop:
                stops.append(replay.stopped)
            except Unprovable:
                raise
            except Exception as error:  # noqa: BLE001 - the guess does not run: reported
                return (
                    f"its forward raises {type(error).__name__}: {error} (a split attention reshapes with -1 heads, or "
                    "with the sizes its own attributes hold, which the plan divides; never with the input's width)"
                )
        if not stops:
            break
        if len(stops) < tp or any(m is not stops[0][0] or p.shape != stops[0][1].shape for m, p, _ in stops):
            return "its ranks do not reach the same collective"
        module, part, combine = stops[0]
        results.append((module, part.shape, combine([p for _, p, _ in stops])))
        if len(results) > 256:
            return "its ranks call collectives more than 256 times"
    for rank, output in enumerate(outputs):
        expected = [t for t in tree_flatten(whole)[0] if isinstance(t, torch.Tensor)]
        if sequence_parallel:  # besides the hidden states, outputs are compared where their shapes agree
            expected[0] = expected[0].chunk(tp, 1)[rank]
        got = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if len(got) != len(expected) or got[0].shape != expected[0].shape:
            return "it returns hidden states of another shape than the whole block"
        for a, b in zip(got, expected):
            if not b.is_floating_point() or a.shape != b.shape:
                continue  # besides the hidden states, outputs per head (attention weights) are the rank's heads'
            error, scale = float((a - b).abs().max()), float(b.abs().max())
            if error > _TOLERANCE[dtype] * max(scale, 1e-30):
                return (
                    f"{ANOTHER_FUNCTION} (outputs differ by up to {error:.2g} where they reach {scale:.2g}): its "
                    "forward reads a head count or width the plan does not divide, splits its projections otherwise "
                    "than the plan guessed, or uses its input's values besides its projections where it reads its "
                    "width from the input"
                )
    return None


def _run_as_rank(
    block: nn.Module,
    plan: BlockTensorParallelPlan,
    tp: int,
    rank: int,
    replay: _Replay,
    args: tuple,
    kwargs: dict,
    sequence_parallel: bool = False,
) -> Any:
    hooks: list[Any] = []
    with _restored(block), torch.no_grad():
        try:
            for name, style in plan.styles(sequence_parallel).items():
                _split(block.get_submodule(name), style, tp, rank, replay, hooks)
            plan.localize(block, tp)
            return block(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()


def _split(module: nn.Module, style: ParallelStyle, tp: int, rank: int, replay: _Replay, hooks: list[Any]) -> None:
    """``module`` as rank ``rank`` of ``tp`` holds it under ``style`` (the styles of plain tensor parallelism and of
    Megatron-SP); hooks it adds go to ``hooks``, to be removed."""
    params = module._parameters

    def gather(dim: int) -> Callable[[torch.Tensor], torch.Tensor]:  # the sequence, from every rank's part
        return lambda x: replay.collective(module, x, partial(torch.cat, dim=dim))

    if hasattr(style, "styles"):  # Compose
        for inner in style.styles:
            _split(module, inner, tp, rank, replay, hooks)
    elif isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear):
        rows = _part(params["weight"].shape[0], tp, rank)
        _select(module, "weight", 0, rows)
        _select(module, "bias", 0, rows)
        if isinstance(style.input_layouts[0], Shard):  # Megatron-SP: it gathers the sequence itself
            hooks.append(_on_input(module, gather(style.input_layouts[0].dim)))
    elif isinstance(style, SequenceParallel):
        pass  # a norm on this rank's positions: what the module computes on them
    elif isinstance(style, GatherSequence):
        hooks.append(_on_input(module, gather(1)))
    elif isinstance(style, PrepareModuleInput):
        layouts = style.input_layouts
        if style.input_kwarg_layouts or len(layouts) != 1 or not isinstance(layouts[0], Shard):
            raise Unprovable(f"the proof cannot simulate PrepareModuleInput with {layouts}")
        hooks.append(_on_input(module, gather(layouts[0].dim), positional=1))
    elif isinstance(style, ColwiseFused):
        rows = torch.tensor(fused_rows(style.sections, style.split, tp, rank))
        _select(module, "weight", 1 if style.conv1d else 0, rows)
        _select(module, "bias", 0, rows)
        if style.conv1d:
            module.nf = len(rows)  # Hugging Face's Conv1D shapes its output with it
    elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear):
        layout = style.output_layouts[0]
        scatter = layout.dim if isinstance(layout, Shard) else None  # Megatron-SP: reduce-scatter the sequence
        _row_parallel(module, _part(params["weight"].shape[1], tp, rank), False, replay, scatter, tp, rank)
    elif isinstance(style, RowwiseFused):
        in_dim = 0 if style.conv1d else 1
        width = params["weight"].shape[in_dim]
        sections = (width // style.sections,) * style.sections
        columns = torch.tensor(fused_rows(sections, (True,) * style.sections, tp, rank))
        scatter = 1 if style.sequence_parallel else None
        _row_parallel(module, columns, style.conv1d, replay, scatter, tp, rank)
    elif isinstance(style, PerHeadWeights):
        pass  # whole on every rank, applied to the rank's heads
    elif isinstance(style, NarrowedInput):
        hooks += narrow_input(module, style.columns, tp, rank, gather(1) if style.sequence_parallel else None)
    elif isinstance(style, GatherWidth):
        gather = partial(torch.cat, dim=-1)
        hooks.append(module.register_forward_pre_hook(lambda m, a: (replay.collective(m, a[0], gather), *a[1:])))
        hooks.append(module.register_forward_hook(lambda m, a, out: out.chunk(tp, dim=-1)[rank]))
    elif isinstance(style, SplitPerHead):
        for name, p in list(params.items()):
            if p is not None:
                params[name] = p.index_select(0, _part(p.shape[0], tp, rank))
    else:
        raise Unprovable(f"the proof cannot simulate {type(style).__name__} on {type(module).__name__}")


def _on_input(module: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor], positional: int | None = None) -> Any:
    """Run ``gather`` on ``module``'s hidden-states input before it runs (as the Megatron-SP styles do); with
    ``positional``, only where the module is called with that many positional arguments (PrepareModuleInput's
    layouts must match them)."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if positional is not None and len(args) != positional:
            raise ValueError("module inputs and input_layouts should have same length!")  # as PrepareModuleInput
        return with_hidden_states(args, kwargs, gather(hidden_states_of(args, kwargs)[1]))

    return module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def _part(size: int, tp: int, rank: int) -> torch.Tensor:
    return torch.arange(size).chunk(tp)[rank]


def _select(module: nn.Module, name: str, dim: int, index: torch.Tensor) -> None:
    p = module._parameters.get(name)
    if p is not None:
        module._parameters[name] = p.index_select(dim, index)


def _row_parallel(
    module: nn.Module,
    columns: torch.Tensor,
    conv1d: bool,
    replay: _Replay,
    scatter: int | None = None,
    tp: int = 1,
    rank: int = 0,
) -> None:
    """A row-parallel layer: partial outputs summed (the bias added once); with ``scatter``, this rank's part of the
    sum along that dimension (Megatron-SP's reduce-scatter)."""
    weight = module._parameters["weight"].index_select(0 if conv1d else 1, columns)
    bias = module._parameters.get("bias")

    def summed(parts: list[torch.Tensor]) -> torch.Tensor:
        total = torch.stack(parts).sum(0)
        return total + bias if bias is not None else total

    def forward(x: torch.Tensor) -> torch.Tensor:
        total = replay.collective(module, x @ weight if conv1d else F.linear(x, weight), summed)
        return total if scatter is None else total.chunk(tp, scatter)[rank]

    module.forward = forward  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------- the block's state
@contextlib.contextmanager
def _restored(block: nn.Module) -> Iterator[None]:
    """Whatever the proof swaps into ``block`` (weights, buffers, attributes, forwards, modes) put back."""
    saved = [
        (m, dict(m._parameters), dict(m._buffers), {k: v for k, v in vars(m).items() if k not in _INTERNALS})
        for m in block.modules()
    ]
    try:
        yield
    finally:
        for m, params, buffers, attributes in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            for key in [k for k in vars(m) if k not in _INTERNALS and k not in attributes]:
                del vars(m)[key]
            vars(m).update(attributes)


def _randomize(block: nn.Module, dtype: torch.dtype, generator: torch.Generator) -> None:
    """Unit-scale random weights (a tied weight stays one tensor) and the buffers in ``dtype``, on the CPU."""
    made: dict[int, torch.Tensor] = {}
    for module_name, m in block.named_modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in made:
                noise = torch.randn(tuple(p.shape), generator=generator, dtype=dtype)
                fan_in = math.prod(p.shape[1:])
                made[id(p)] = noise / math.sqrt(fan_in) if p.dim() > 1 else noise / 2 + (0.0 if "bias" in name else 1.0)
            m._parameters[name] = made[id(p)]
        for name, b in m._buffers.items():
            if b is None:
                continue
            if b.is_meta:
                raise Unprovable(f"its buffer {module_name or 'block'}.{name} is on the meta device")
            m._buffers[name] = _converted(b, dtype)


def _converted(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach().to("cpu")
    if t.is_floating_point():
        return t.to(dtype)
    if t.is_complex():
        return t.to(torch.complex128 if dtype == torch.float64 else torch.complex64)
    return t


def _inputs(
    block: nn.Module, call: tuple[tuple, dict] | None, dtype: torch.dtype, generator: torch.Generator
) -> tuple[tuple, dict]:
    """The call's inputs on the CPU in ``dtype``, with random unit-scale hidden states; made-up hidden states of the
    block's width where it takes nothing else."""
    if call is None:
        width = _input_width(block)
        return (torch.randn((*_SYNTHETIC, width), generator=generator, dtype=dtype),), {}
    args, kwargs = call
    hidden = hidden_states_of(args, kwargs)[1]

    def convert(value: Any) -> Any:
        if value is hidden:
            return torch.randn(tuple(hidden.shape), generator=generator, dtype=dtype)
        return _converted(value, dtype) if isinstance(value, torch.Tensor) else value

    return tree_map(convert, args), tree_map(convert, kwargs)


def _input_width(block: nn.Module) -> int:
    for m in block.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, nn.LayerNorm) and m.normalized_shape:
            return m.normalized_shape[-1]
    raise Unprovable("its width is not known")


# ---------------------------------------------------------------------------------------------- real inputs
def example_calls(
    module: nn.Module, blocks: Sequence[nn.Module], step: str, batch: Any
) -> dict[type, tuple[tuple, dict]]:
    """The inputs of the first call of the first block of each class, from ``module.<step>`` run on one sample of
    ``batch`` without gradients (stopped there; nothing of ``module`` changes). Raises what the step raises."""
    firsts: dict[type, nn.Module] = {}
    for block in blocks:
        firsts.setdefault(model_class(block), block)
    calls: dict[type, tuple[tuple, dict]] = {}
    if any(p.is_meta for p in module.parameters()):
        raise Unprovable("the model's weights are on the meta device: no call of its blocks can be observed")

    def record(cls: type) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
            calls.setdefault(cls, without_kv_caches(tree_map(detach, args), tree_map(detach, kwargs)))
            if len(calls) == len(firsts):
                raise _Stop

        return hook

    handles = [b.register_forward_pre_hook(record(cls), with_kwargs=True) for cls, b in firsts.items()]
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    sample = tree_map(lambda t: t[:1].to(device) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)
    try:
        with _untouched(module, train=step == "training_step"), _recording_logs(module), torch.no_grad():
            getattr(module, step)(sample, 0)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return calls

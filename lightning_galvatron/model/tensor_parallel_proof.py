"""Prove a guessed tensor-parallel plan on its block before anything trains with it.

A plan inferred from layer names (:mod:`lightning_galvatron.model.tensor_parallel_plans`) is a guess: that the
layers named like projections are split where the code expects, that the fused ``[q | k | v]`` is laid out as
guessed, that the head counts and widths the forward reads are the attributes the plan divides. A wrong guess can
run without an error and train something else (a head count hidden in an attribute nobody divides gives heads of
half the width). So the guess is checked on the block itself, in one process, with no process group:

- every rank of a ``tp``-way split is simulated by running the block with that rank's slices of the weights
  (its rows of a column-parallel layer, its columns of a row-parallel one, per-head weights as the styles keep
  them) and the plan's ``localize`` applied;
- the all-reduce behind each row-parallel layer is replayed: the ranks run until that call, their partial outputs
  are summed (and the bias added once), and the ranks run again with the sums of the calls before (a few tiny
  forwards: one round per row-parallel call);
- every rank's output must be the whole block's output on the same inputs.

The weights are random and of unit scale (with the model's own small initial weights attention is nearly uniform,
and a wrong grouping of heads would differ only in rounding), in float64 where the block runs in it; the hidden
states are random, the block's other inputs those of a real call where it takes any (:func:`example_calls`).
Only the forward is proven: the styles' backward is its exact adjoint. Megatron-SP and Ulysses, which move the
same split weights, are not simulated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils._pytree import tree_flatten, tree_map

from lightning_galvatron.model.outside_layers import _recording_logs, _untouched
from lightning_galvatron.runtime.structure import hidden_states_of, model_class, without_kv_caches
from lightning_galvatron.runtime.tensor_parallel import (
    BlockTensorParallelPlan,
    ColwiseFused,
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
    block: nn.Module, plan: BlockTensorParallelPlan, degrees: Sequence[int], call: tuple[tuple, dict] | None
) -> str | None:
    """``None`` if ``block`` split by ``plan`` at each of ``degrees`` computes what the whole block computes, else
    what differs. ``call``: the inputs of a real call of a block of this type, or ``None`` for a block whose forward
    takes only its hidden states. Raises :class:`Unprovable` where no proof can run. Nothing of ``block`` changes."""
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
            for tp in degrees:

                def run(rank: int, replay: _Replay, tp: int = tp, args: tuple = args, kwargs: dict = kwargs) -> Any:
                    return _run_as_rank(block, plan, tp, rank, replay, args, kwargs)

                problem = _compare(whole, run, tp, dtype)
                if problem is not None:
                    return f"split {tp} ways, {problem}"
            return None
    raise Unprovable(f"the whole block does not run on the proof's inputs ({failure})")


# ---------------------------------------------------------------------------------------------- simulated ranks
class _Replay:
    """One simulated rank's row-parallel calls: the sums of the calls before, and where it stopped."""

    def __init__(self, sums: list[tuple[nn.Module, torch.Tensor]]) -> None:
        self.sums = sums
        self.calls = 0
        self.stopped: tuple[nn.Module, torch.Tensor, torch.Tensor | None] | None = None

    def reduce(self, module: nn.Module, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        index, self.calls = self.calls, self.calls + 1
        if index < len(self.sums):
            owner, total = self.sums[index]
            if owner is not module or total.shape != partial.shape:
                raise RuntimeError("the ranks call their row-parallel layers in different orders or shapes")
            return total
        self.stopped = (module, partial, bias)
        raise _Stop


def _compare(whole: Any, run: Callable[[int, _Replay], Any], tp: int, dtype: torch.dtype) -> str | None:
    """Run every rank of ``tp``, replaying all-reduces, and compare each rank's output with ``whole``."""
    sums: list[tuple[nn.Module, torch.Tensor]] = []
    while True:
        outputs, stops = [], []
        for rank in range(tp):
            replay = _Replay(sums)
            try:
                outputs.append(run(rank, replay))
            except _Stop:
                stops.append(replay.stopped)
            except Exception as error:  # noqa: BLE001 - the guess does not run: reported
                return (
                    f"its forward raises {type(error).__name__}: {error} (a split attention reshapes with -1 heads, or "
                    "with the sizes its own attributes hold, which the plan divides; never with the input's width)"
                )
        if not stops:
            break
        if len(stops) < tp or any(m is not stops[0][0] or p.shape != stops[0][1].shape for m, p, _ in stops):
            return "its ranks do not reach the same all-reduce"
        total = sum(partial for _, partial, _ in stops)
        bias = stops[0][2]
        sums.append((stops[0][0], total + bias if bias is not None else total))
        if len(sums) > 256:
            return "its ranks call row-parallel layers more than 256 times"
    expected = [t for t in tree_flatten(whole)[0] if isinstance(t, torch.Tensor)]
    for output in outputs:
        got = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if len(got) != len(expected) or got[0].shape != expected[0].shape:
            return "it returns hidden states of another shape than the whole block"
        for a, b in zip(got, expected):
            if not b.is_floating_point() or a.shape != b.shape:
                continue  # besides the hidden states, outputs per head (attention weights) are the rank's heads'
            error, scale = float((a - b).abs().max()), float(b.abs().max())
            if error > _TOLERANCE[dtype] * max(scale, 1e-30):
                return (
                    f"it computes another function than the whole block (outputs differ by up to {error:.2g} where "
                    f"they reach {scale:.2g}): its forward reads a head count or width the plan does not divide, or "
                    "splits its projections otherwise than the plan guessed"
                )
    return None


def _run_as_rank(
    block: nn.Module, plan: BlockTensorParallelPlan, tp: int, rank: int, replay: _Replay, args: tuple, kwargs: dict
) -> Any:
    with _restored(block), torch.no_grad():
        for name, style in plan.styles(False).items():
            _split(block.get_submodule(name), style, tp, rank, replay)
        plan.localize(block, tp)
        return block(*args, **kwargs)


def _split(module: nn.Module, style: ParallelStyle, tp: int, rank: int, replay: _Replay) -> None:
    """``module`` as rank ``rank`` of ``tp`` holds it under ``style`` (the styles inferred plans use)."""
    params = module._parameters
    if hasattr(style, "styles"):  # Compose
        for inner in style.styles:
            _split(module, inner, tp, rank, replay)
    elif isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear):
        rows = _part(params["weight"].shape[0], tp, rank)
        _select(module, "weight", 0, rows)
        _select(module, "bias", 0, rows)
    elif isinstance(style, ColwiseFused):
        rows = torch.tensor(fused_rows(style.sections, style.split, tp, rank))
        _select(module, "weight", 1 if style.conv1d else 0, rows)
        _select(module, "bias", 0, rows)
    elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear):
        _row_parallel(module, _part(params["weight"].shape[1], tp, rank), False, replay)
    elif isinstance(style, RowwiseFused):
        in_dim = 0 if style.conv1d else 1
        width = params["weight"].shape[in_dim]
        sections = (width // style.sections,) * style.sections
        columns = torch.tensor(fused_rows(sections, (True,) * style.sections, tp, rank))
        _row_parallel(module, columns, style.conv1d, replay)
    elif isinstance(style, PerHeadWeights):
        pass  # whole on every rank, applied to the rank's heads
    elif isinstance(style, SplitPerHead):
        for name, p in list(params.items()):
            if p is not None:
                params[name] = p.index_select(0, _part(p.shape[0], tp, rank))
    else:
        raise RuntimeError(f"the proof cannot simulate {type(style).__name__} on {type(module).__name__}")


def _part(size: int, tp: int, rank: int) -> torch.Tensor:
    return torch.arange(size).chunk(tp)[rank]


def _select(module: nn.Module, name: str, dim: int, index: torch.Tensor) -> None:
    p = module._parameters.get(name)
    if p is not None:
        module._parameters[name] = p.index_select(dim, index)


def _row_parallel(module: nn.Module, columns: torch.Tensor, conv1d: bool, replay: _Replay) -> None:
    weight = module._parameters["weight"].index_select(0 if conv1d else 1, columns)
    bias = module._parameters.get("bias")

    def forward(x: torch.Tensor) -> torch.Tensor:
        partial = x @ weight if conv1d else F.linear(x, weight)
        return replay.reduce(module, partial, bias)

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

"""A checkpoint survives a kill at any moment (issue 44).

A job that saves ``ModelCheckpoint(every_n_train_steps=1, save_last=True)`` is killed -- every rank at once, with
SIGKILL, as a scheduler or a node failure ends a job -- at a random point of a random save: before it, while the
ranks write their shards, while DCP writes its index or rank 0 ``meta.pt``, around the rename that puts the new
checkpoint in place, or while ``save_top_k`` deletes the checkpoint it replaces. Then ``fit(ckpt_path="last")``
resumes, and must train exactly what the uninterrupted run trained from the newest complete ``last.ckpt`` on:
the same losses and, at the end, the same parameters, bit for bit -- under a DDP plan, a ZeRO-3 plan and a
pipeline plan. The kill points are drawn from ``GALVATRON_KILL_SEED`` (random when unset; the seed is in every
failure message).

The kills are injected in the pool's workers: the rank at the chosen point SIGKILLs every rank of the job
(itself last). What a kill leaves on disk is what the code had written when it stopped, whatever it was. Also: one
rank killed while the others live on (and fail), and Fabric's one-file checkpoint killed while it is written.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_galvatron.strategy.checkpoint_files as files
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.strategy.checkpoint import CheckpointError, check_sharded_checkpoint, load_checkpoint
from tests.helpers.pool import WorkerDied
from tests.helpers.training import _LossRecorder, dataset, gather_full_state, tiny_gpt

pytestmark = pytest.mark.timeout(600)

SEED = int(os.environ.get("GALVATRON_KILL_SEED", random.randrange(2**32)))
STEPS = 3
PLANS = {
    "ddp": ParallelPlan.uniform(2, 4, S()),
    "zero3": ParallelPlan.uniform(2, 4, S(dp_type="zero3"), vocab=S(dp_type="zero3")),
    "pipeline": ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2),
}
#: Where a save can be killed: what the kill's count counts ("save": every save, two per step -- the step's own
#: checkpoint, then last.ckpt; "replace": saves that replace a last.ckpt, from step 2 on; "deletion": save_top_k
#: deleting the previous step's checkpoint, from step 2 on) and which ranks get there (None: every rank).
PHASES = {
    "before the save": ("save", None),
    "while the shards are written": ("save", None),
    "while DCP writes its index": ("save", 0),
    "while meta.pt is written": ("save", 0),
    "before the rename": ("save", 0),
    "after the rename, while the replaced checkpoint is deleted": ("replace", 0),
    "between the two renames (a file system without an atomic exchange)": ("replace", 0),
    "while save_top_k deletes the previous checkpoint": ("deletion", 0),
}
WITHOUT_EXCHANGE = "between the two renames (a file system without an atomic exchange)"


def _kill_job(pids: list[int]) -> None:
    """SIGKILL every rank of the job, this one last."""
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _kill_at(phase: str, call: int, killer: int, pids: list[int], alone: bool = False):
    """Kill the job (or, ``alone``, rank ``killer`` only) at ``phase`` of the ``call``-th save, replace or deletion
    (see :data:`PHASES`) on rank ``killer``; the patches are undone after (when the point was never reached)."""
    from torch.distributed.checkpoint import filesystem

    calls = [0]

    def reached(partial: Any = None, *args: Any) -> None:
        """One more call of the phase; at the chosen one, leave what ``partial`` writes and kill the job."""
        calls[0] += 1
        if calls[0] == call and dist.get_rank() == killer:
            if partial is not None:
                partial(*args)
            _kill_job([os.getpid()] if alone else pids)

    def before(real: Any, partial: Any = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            reached(partial, *args)
            return real(*args, **kwargs)

        return wrapper

    patches: list[Any] = []
    if phase == "before the save":
        patches.append(
            mock.patch("lightning_galvatron.strategy.trainer_strategy.save_sharded", before(files.save_sharded))
        )
    elif phase == "while the shards are written":
        real_write_item, real_write_data = filesystem._write_item, filesystem.FileSystemWriter.write_data
        written = [0]

        def write_item(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
            result = real_write_item(transforms, stream, *args, **kwargs)
            written[0] += 1
            if written[0] == 1:  # the first tensor of this rank's shard is written, the others are not
                stream.flush()
                reached()
            return result

        def write_data(*args: Any, **kwargs: Any) -> Any:
            written[0] = 0
            return real_write_data(*args, **kwargs)

        patches.append(mock.patch.object(filesystem, "_write_item", write_item))
        patches.append(mock.patch.object(filesystem.FileSystemWriter, "write_data", write_data))
    elif phase == "while DCP writes its index":

        def half_index(writer: Any, *_: Any) -> None:
            (Path(writer.path) / ".metadata.tmp").write_bytes(b"\x80\x04half an index")

        finish = before(filesystem.FileSystemWriter.finish, half_index)
        patches.append(mock.patch.object(filesystem.FileSystemWriter, "finish", finish))
    elif phase == "while meta.pt is written":

        def half_loop_state(_: Any, directory: Path) -> None:
            (directory / files.METADATA_FILE).write_bytes(b"PK\x03\x04half")

        patches.append(mock.patch.object(files, "write_loop_state", before(files.write_loop_state, half_loop_state)))
    elif phase == "before the rename":
        patches.append(mock.patch.object(files, "commit", before(files.commit)))
    elif phase == "after the rename, while the replaced checkpoint is deleted":
        real_exchange = files.exchange

        def exchange(first: Path, second: Path) -> bool:
            done = real_exchange(first, second)
            (first / files.METADATA_FILE).unlink()  # the deletion of the replaced checkpoint has begun
            reached()
            return done

        patches.append(mock.patch.object(files, "exchange", exchange))
    elif phase == WITHOUT_EXCHANGE:
        real_rename = os.rename

        def rename(source: Any, destination: Any) -> None:
            real_rename(source, destination)
            if str(destination).endswith(files.REPLACED_SUFFIX):
                reached()

        patches.append(mock.patch.object(files, "exchange", lambda first, second: False))
        patches.append(mock.patch.object(files.os, "rename", rename))
    else:  # while save_top_k deletes the previous checkpoint
        real_remove = files.remove_path

        def half_deleted(path: Path) -> None:
            for shard in sorted(path.glob("*.distcp"))[:1]:
                shard.unlink()

        def remove_path(path: Path) -> None:
            if path.name.endswith(files.REMOVING_SUFFIX) and path.exists():
                reached(half_deleted, path)
            real_remove(path)

        patches.append(mock.patch.object(files, "remove_path", remove_path))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _fit(plan: ParallelPlan, directory: str | None, ckpt_path: str | None = None, kill: tuple | None = None) -> dict:
    """The tiny GPT for ``STEPS`` steps, a checkpoint in ``directory`` after each (none when resuming)."""
    world = dist.get_world_size()
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    module = tiny_gpt()
    loader = DataLoader(dataset(8), batch_size=4, shuffle=True)  # one step per epoch: each save ends an epoch
    recorder = _LossRecorder()
    callbacks: list[Any] = [recorder]
    if directory is not None:
        every = 1 if ckpt_path is None else 1000  # the resumed run saves nothing
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=every, save_last=True))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=GalvatronStrategy(plan=plan, save_plan=False, watchdog=False),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=directory is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    with _kill_at(*kill, pids) if kill is not None else contextlib.nullcontext():
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    losses = torch.tensor(recorder.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    start = trainer.global_step - len(recorder.losses)  # the step it resumed from
    return dict(losses=(losses / world).tolist(), start=start, state=gather_full_state(trainer.lightning_module))


def _fit_noting_errors(notes: str, *args: Any, **kwargs: Any) -> dict:
    """:func:`_fit`, leaving the Python error a rank ends with in ``notes/rank<N>.txt`` (the pool reports only the
    rank that died)."""
    try:
        return _fit(*args, **kwargs)
    except BaseException as error:
        Path(notes, f"rank{dist.get_rank()}.txt").write_text(repr(error))
        raise


def _newest_last(phase: str, call: int) -> int:
    """The step of the newest complete ``last.ckpt`` after a kill at ``phase`` of the ``call``-th save, replace or
    deletion (:data:`PHASES`)."""
    counted, _ = PHASES[phase]
    if counted == "save":
        return (call + 1) // 2 - 1  # the step's own checkpoint or its last.ckpt: last.ckpt holds the step before
    if phase == "after the rename, while the replaced checkpoint is deleted":
        return call + 1  # the call-th replace is step call + 1's last.ckpt, in place when the kill came
    return call  # the replace or the deletion of step call + 1, last.ckpt still holds step call


def _draw(rng: random.Random) -> list[tuple[str, str, int, int]]:
    """Every phase once, dealt to the plans in a random order, at a random save (replace, deletion) and rank."""
    phases = list(PHASES)
    rng.shuffle(phases)
    cases = []
    for index, phase in enumerate(phases):
        counted, rank = PHASES[phase]
        call = rng.randint(1, 2 * STEPS) if counted == "save" else rng.randint(1, STEPS - 1)
        killer = rng.randrange(2) if rank is None else rank
        cases.append((list(PLANS)[index % len(PLANS)], phase, call, killer))
    return cases


def test_a_save_killed_at_any_point_resumes_the_newest_complete_checkpoint(pools, tmp_path):
    cases = _draw(random.Random(SEED))
    uninterrupted = {name: pools(2).run(_fit, PLANS[name], None)[0] for name in sorted({c[0] for c in cases})}
    for number, (name, phase, call, killer) in enumerate(cases):
        where = f"{name} plan, killed by rank {killer} {phase} (call {call}; GALVATRON_KILL_SEED={SEED})"
        directory = tmp_path / f"case{number}"
        with pytest.raises(WorkerDied):
            pools.live(2).run(_fit, PLANS[name], str(directory), kill=(phase, call, killer))
        ckpt_path = "last"
        if phase == WITHOUT_EXCHANGE:  # "last" lists last*.ckpt only; the name finds the checkpoint left aside
            ckpt_path = str(directory / "last.ckpt")
        expected = _newest_last(phase, call)
        _resumes_the_newest_complete_checkpoint(pools, directory, name, expected, uninterrupted[name], where, ckpt_path)


def _resumes_the_newest_complete_checkpoint(
    pools, directory: Path, name: str, expected: int, reference: dict, where: str, ckpt_path: str = "last"
) -> None:
    """Whatever has a checkpoint's name in ``directory`` is whole, and ``fit(ckpt_path=...)`` continues the
    uninterrupted run ``reference`` from step ``expected``, bit for bit."""
    for checkpoint in directory.glob("*.ckpt"):
        try:
            check_sharded_checkpoint(checkpoint)
        except CheckpointError as error:
            raise AssertionError(f"{where}: {error}") from None
        assert (checkpoint / files.METADATA_FILE).is_file(), where
    resumed = pools(2).run(_fit, PLANS[name], str(directory), ckpt_path=ckpt_path)[0]
    assert resumed["start"] == expected, where
    assert resumed["losses"] == reference["losses"][expected:], where
    for key, value in reference["state"].items():
        assert torch.equal(resumed["state"][key], value), f"{where}: {key}"


def test_a_save_whose_one_rank_is_killed_leaves_the_previous_checkpoint(pools, tmp_path):
    """Rank 1 alone is killed -- before a save or while it writes its shards -- and rank 0 lives on: it fails in
    the save's next collective (gloo sees the peer gone), and nothing it does on the way out (Lightning's and this
    strategy's exception handling) commits the half-written save or removes the previous one."""
    rng = random.Random(SEED + 1)
    name = rng.choice(sorted(PLANS))
    uninterrupted = pools(2).run(_fit, PLANS[name], None)[0]
    for number, phase in enumerate(("before the save", "while the shards are written")):
        call = rng.randint(3, 2 * STEPS)  # a save after step 1's last.ckpt: there is a previous one to keep
        where = f"{name} plan, rank 1 alone killed {phase} (call {call}; GALVATRON_KILL_SEED={SEED})"
        directory, notes = tmp_path / f"alone{number}", tmp_path / f"alone{number}-errors"
        notes.mkdir()
        kill = (phase, call, 1, True)
        with pytest.raises(WorkerDied):
            pools.live(2).run(_fit_noting_errors, str(notes), PLANS[name], str(directory), kill=kill, timeout=60)
        assert "peer" in (notes / "rank0.txt").read_text(), where  # rank 0 lived on, and failed on rank 1's death
        _resumes_the_newest_complete_checkpoint(pools, directory, name, _newest_last(phase, call), uninterrupted, where)


def _fabric_full_saves(path: str, steps: int, kill_at: int | None = None) -> None:
    """``fabric.save`` of one full file (``save_distributed_checkpoint=False``) after each of ``steps`` steps of a
    ZeRO-3 plan; rank 0, which writes it, is killed halfway through writing save ``kill_at``."""
    from lightning.fabric import Fabric

    from examples.fabric_gpt import train
    from lightning_galvatron import GalvatronFabricStrategy

    strategy = GalvatronFabricStrategy(plan=PLANS["zero3"], save_distributed_checkpoint=False)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(tiny_gpt().model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(dataset(4 * steps), batch_size=2))
    real_save, saves = torch.save, [0]

    def half_then_killed(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
        """Write the first half of what ``torch.save`` writes (to the file object or path it is given), then die."""
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if hasattr(file, "write"):
            file.write(data)
            file.flush()
        else:
            Path(file).write_bytes(data)
        _kill_job([os.getpid()])

    def counted(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
        saves[0] += 1
        (half_then_killed if saves[0] == kill_at else real_save)(obj, file, *args, **kwargs)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    with mock.patch.object(torch, "save", counted):
        for step in range(1, steps + 1):
            train(fabric, model, optimizer, loader, steps=step, accumulate=1, state=state)
            fabric.save(path, state)


def test_a_full_checkpoint_file_killed_mid_write_keeps_the_previous_one(pools, tmp_path):
    """Fabric's one-file checkpoint is written under a hidden name and renamed into place when whole, as the
    sharded saves are: rank 0 killed halfway through writing the second save leaves the first, loadable; the next
    save clears what the killed one left."""
    path = tmp_path / "full.ckpt"
    with pytest.raises(WorkerDied):
        pools.live(2).run(_fabric_full_saves, str(path), steps=2, kill_at=2, timeout=120)
    assert torch.load(path, weights_only=False)["step"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".full.ckpt.partial"]
    pools(2).run(_fabric_full_saves, str(path), steps=2)
    assert torch.load(path, weights_only=False)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.ckpt"]


def test_a_full_checkpoint_file_replaced_without_an_atomic_exchange(tmp_path, monkeypatch):
    """Where two names cannot be exchanged, the previous file is renamed aside first: a save stopped between the two
    renames leaves it there, where a load finds it (``committed_path``) and the next save puts it back first."""
    path = tmp_path / "full.ckpt"
    files.save_file({"step": 1}, path)
    real_rename = os.rename

    def rename(source: Any, destination: Any) -> None:
        real_rename(source, destination)
        if str(destination).endswith(files.REPLACED_SUFFIX):
            raise KeyboardInterrupt  # the job ends here

    monkeypatch.setattr(files, "exchange", lambda first, second: False)
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(files.os, "rename", rename)
        files.save_file({"step": 2}, path)
    assert not path.exists() and torch.load(files.committed_path(path))["step"] == 1
    files.save_file({"step": 3}, path)
    assert torch.load(path)["step"] == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["full.ckpt"]


def test_a_directory_of_two_saves_is_refused_by_name(tmp_path):
    """What an in-place rewrite killed midway left (the issue: the previous index beside half-written shards), and
    a meta.pt from another save than the shards: refused, naming the directory and the file."""
    from torch.distributed.checkpoint import save as dcp_save

    model = torch.nn.Linear(4, 4)
    path = tmp_path / "last.ckpt"
    files.save_sharded({"state_dict": model.state_dict()}, path, 0, lambda: None)
    (shard,) = path.glob("*.distcp")
    intact = shard.read_bytes()
    shard.write_bytes(intact[: len(intact) // 3])
    with pytest.raises(CheckpointError, match=rf"'.*last\.ckpt' is incomplete: its shard file {shard.name} holds"):
        load_checkpoint(path, model)
    shard.write_bytes(intact)
    other = tmp_path / "other"
    dcp_save({"state_dict": model.state_dict()}, checkpoint_id=other, no_dist=True)
    (path / ".metadata").write_bytes((other / ".metadata").read_bytes())
    with pytest.raises(CheckpointError, match=r"'.*last\.ckpt' mixes two saves"):
        load_checkpoint(path, model)


def test_a_directory_that_is_no_checkpoint_is_not_replaced(tmp_path):
    """A save replaces its path whole: a directory of other files is refused, not deleted."""
    notes = tmp_path / "run" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("keep me")
    with pytest.raises(FileExistsError, match=r"cannot save a checkpoint to '.*run': it is a directory that holds"):
        files.save_sharded({"state_dict": torch.nn.Linear(2, 2).state_dict()}, notes.parent, 0, lambda: None)
    assert notes.read_text() == "keep me"

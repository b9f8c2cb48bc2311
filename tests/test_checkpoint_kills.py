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
(itself last). What a kill leaves on disk is what the code had written when it stopped, whatever it was.
"""

from __future__ import annotations

import contextlib
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

import lightning_galvatron.checkpoint_files as files
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.checkpoint import CheckpointError, check_sharded_checkpoint, load_checkpoint
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
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
def _kill_at(phase: str, call: int, killer: int, pids: list[int]):
    """Kill the job at ``phase`` of the ``call``-th save, replace or deletion (see :data:`PHASES`) on rank ``killer``;
    the patches are undone after (when the point was never reached)."""
    from torch.distributed.checkpoint import filesystem

    calls = [0]

    def reached(partial: Any = None, *args: Any) -> None:
        """One more call of the phase; at the chosen one, leave what ``partial`` writes and kill the job."""
        calls[0] += 1
        if calls[0] == call and dist.get_rank() == killer:
            if partial is not None:
                partial(*args)
            _kill_job(pids)

    def before(real: Any, partial: Any = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            reached(partial, *args)
            return real(*args, **kwargs)

        return wrapper

    patches: list[Any] = []
    if phase == "before the save":
        patches.append(mock.patch("lightning_galvatron.strategy.save_sharded", before(files.save_sharded)))
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
        for checkpoint in directory.glob("*.ckpt"):  # whatever has a checkpoint's name is whole
            try:
                check_sharded_checkpoint(checkpoint)
            except CheckpointError as error:
                raise AssertionError(f"{where}: {error}") from None
            assert (checkpoint / files.METADATA_FILE).is_file(), where
        expected = _newest_last(phase, call)
        ckpt_path = "last"
        if phase == WITHOUT_EXCHANGE:  # "last" lists last*.ckpt only; the name finds the checkpoint left aside
            ckpt_path = str(directory / "last.ckpt")
        resumed = pools(2).run(_fit, PLANS[name], str(directory), ckpt_path=ckpt_path)[0]
        assert resumed["start"] == expected, where
        reference = uninterrupted[name]
        assert resumed["losses"] == reference["losses"][expected:], where
        for key, value in reference["state"].items():
            assert torch.equal(resumed["state"][key], value), f"{where}: {key}"


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

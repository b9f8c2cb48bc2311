"""Every bad input is a clear error (issue 13): arguments refused when the strategy (or the Trainer) is made, before
anything is launched or profiled; malformed files named with what is wrong; the CLI's options by their names.

Each case checks the message names the argument or file and says what to give instead, and that nothing was
written.
"""

from __future__ import annotations

import json
import os
import re

import lightning.pytorch as L
import pytest
import torch

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.cli.app import main
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.profiles import Profile, ProfileError
from lightning_galvatron.search.calibration import Calibration
from lightning_galvatron.strategy.checkpoint import CheckpointError, consolidate, load_checkpoint
from tests.helpers.training import run_distributed
from tests.search_profiles import A100_PROFILE

PLAN4 = ParallelPlan.uniform(2, 4, S())


def _files(tmp_path) -> dict[str, str]:
    """Malformed JSON files of every kind a user hands us."""
    contents = {"list.json": "[1, 2]", "truncated.json": '{"world_size": 2, "layers": [', "empty.json": ""}
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    return {name: str(tmp_path / name) for name in contents} | {"missing.json": str(tmp_path / "missing.json")}


# ---------------------------------------------------------------------------------------------- the constructor
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(memory_budget=0), r"memory_budget must be a positive size such as '24GB', got 0"),
        (dict(memory_budget=-5), r"memory_budget: a byte size cannot be negative, got -5"),
        (dict(memory_budget="lots"), r"memory_budget: cannot read 'lots' as a byte size; write e.g. '36GB'"),
        (dict(memory_budget=1e400), r"memory_budget: inf is not a byte size a device can have"),
        (dict(memory_budget="1e400"), r"memory_budget: '1e400' is not a byte size a device can have"),
        (dict(memory_budget=True), r"memory_budget: expected a byte size"),
        (dict(max_tp=0), r"max_tp must be a positive integer or None, got 0"),
        (dict(max_pp=-1), r"max_pp must be a positive integer or None, got -1"),
        (dict(disable=["zero9"]), r"cannot disable \['zero9'\]; choose from \['ddp', .*'zero3'\]"),
        (dict(disable="zero9"), r"cannot disable \['zero9'\]"),
        (dict(disable=["ddp", "zero2", "zero3"]), r"leaves no way to hold the model states"),
        (
            dict(schedules=["zigzag"]),
            r"schedules must be a non-empty subset of \('gpipe', '1f1b', 'interleaved_1f1b'\)",
        ),
        (dict(max_global_batch_size=0), r"max_global_batch_size must be a positive integer"),
        (dict(global_batch_size=0), r"global_batch_size must be a positive integer, got 0"),
        (dict(layers=3), r"layers must be a dotted path such as 'model.blocks'"),
        (dict(profile_cache=3), r"profile_cache must be True, False or a directory"),
        (dict(watchdog={"setup_timeout_s": 0}), r"watchdog setup_timeout_s must be a positive number of seconds"),
        (dict(watchdog={"timeout": 5}), r"unknown watchdog settings \['timeout'\]"),
        (dict(plan=None), r'needs a plan: plan="auto"'),
        (dict(plan=42), r"plan must be 'auto', a ParallelPlan, a dict or a path to a JSON file, got 42"),
        (dict(plan={"world_size": 2, "layers": [{"tp": 3}]}), r"layers\[0\]: tp=3 does not divide the 2 devices"),
        (dict(plan={"world_size": 2, "layers": [5]}), r"layers\[0\] must be an object like"),
    ],
)
def test_arguments_are_refused_when_the_strategy_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GalvatronStrategy(**kwargs)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("missing.json", r"plan file '.*missing\.json' does not exist"),
        ("list.json", r"plan file '.*list\.json' must hold a JSON object \(\{...\}\), not a list"),
        ("truncated.json", r"plan file '.*truncated\.json' is not valid JSON"),
        ("empty.json", r"plan file '.*empty\.json' is not valid JSON"),
        ("directory", r"plan file '.*' is a directory, not a JSON file"),
    ],
)
def test_malformed_plan_files_are_named(tmp_path, what, message):
    path = str(tmp_path) if what == "directory" else _files(tmp_path)[what]
    with pytest.raises(PlanError, match=message):
        GalvatronStrategy(plan=path)


def test_malformed_calibration_file_is_named(tmp_path):
    files = _files(tmp_path)
    with pytest.raises(ValueError, match=r"calibration file '.*list\.json' must hold a JSON object"):
        GalvatronStrategy(calibration=files["list.json"])
    with pytest.raises(ValueError, match=r"calibration file '.*missing\.json' does not exist"):
        GalvatronStrategy(calibration=files["missing.json"])
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match=r"calibration file '.*other\.json': not a lightning_galvatron calibration"):
        Calibration.load(tmp_path / "other.json")


def test_malformed_profile_files_are_named(tmp_path):
    files = _files(tmp_path)
    for name, message in [
        ("list.json", "must hold a JSON object"),
        ("truncated.json", "is not valid JSON"),
        ("missing.json", "does not exist"),
    ]:
        with pytest.raises(ProfileError, match=rf"profile file '.*{name}' {message}"):
            Profile.load(files[name])


# ---------------------------------------------------------------------------------------------- the Trainer
def _trainer(strategy, precision="32-true", devices=2):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, logger=False)


@pytest.mark.parametrize("strategy", ["galvatron", "instance"])
@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "16"])
def test_fp16_is_refused_in_our_words(strategy, precision):
    strategy = GalvatronStrategy(plan=PLAN4) if strategy == "instance" else strategy
    with pytest.raises(
        ValueError,
        match=r"GalvatronStrategy does not support precision='?16.*'?; choose one of "
        r"32-true, bf16-mixed, bf16-true\. fp16 needs a gradient scaler",
    ) as error:
        _trainer(strategy, precision)
    assert "Fabric" not in str(error.value) and "ModelParallelStrategy" not in str(error.value)


def test_devices_are_checked_before_the_launch(tmp_path):
    """What depends on the devices is refused when the Trainer is made, before any process starts."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(
        ValueError,
        match=r"memory_budget=.* is more than a device has \(this machine's .* shared by 2 "
        r"processes is .* each\): a plan made for it would not fit; give at most",
    ):
        _trainer(GalvatronStrategy(memory_budget=physical))  # the machine's whole memory for each of 2 processes
    _trainer(GalvatronStrategy(memory_budget=physical // 4))  # within the share: fine
    with pytest.raises(PlanError, match=r"the plan is for world_size=2 but 4 devices are running"):
        _trainer(GalvatronStrategy(plan=PLAN4), devices=4)
    plan = ParallelPlan.uniform(2, 4, S(), micro_batches=2, global_batch_size=8)
    with pytest.raises(PlanError, match=r"global batch size 6 is not divisible by dp=2 x micro_batches=2"):
        _trainer(GalvatronStrategy(plan=plan, global_batch_size=6))
    assert not list(tmp_path.iterdir())


def test_a_plan_for_other_blocks_is_refused_before_it_is_printed(pools):
    """Six layer strategies for the example's four blocks: refused with the count, not an IndexError in the table."""
    six = ParallelPlan.uniform(2, 6, S())
    with pytest.raises(
        AssertionError,
        match=r"PlanError: the plan has 6 layer strategies but the model has 4 blocks "
        r"\(model\.blocks \(4 x Block\)\); give one strategy per block",
    ) as error:
        pools(2).run(run_distributed, six)
    assert "IndexError" not in str(error.value)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_directories_a_killed_save_leaves_are_named(tmp_path):
    model = torch.nn.Linear(2, 2)
    interrupted = tmp_path / "epoch=0-step=32.ckpt"
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"partial")
    for path, message in [
        (
            interrupted,
            (
                r"checkpoint directory '.*step=32\.ckpt' is incomplete: it holds 1 shard file\(s\) but has no "
                r"\.metadata file, which DCP writes last -- the save that wrote it was interrupted"
            ),
        ),
        (tmp_path / "nowhere.ckpt", r"checkpoint '.*nowhere\.ckpt' does not exist"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path, model)
        with pytest.raises(CheckpointError, match=message):
            consolidate(path, tmp_path / "model.pt")
    with pytest.raises(
        CheckpointError,
        match=r"'.*' is not a sharded \(DCP\) checkpoint directory: it has no "
        r"\.metadata, no shard files and no meta\.pt",
    ):
        load_checkpoint(tmp_path, model)  # a directory, but no checkpoint
    (interrupted / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"cannot read '.*step=32\.ckpt/\.metadata'"):
        load_checkpoint(interrupted, model)
    assert not (tmp_path / "model.pt").exists()


# ---------------------------------------------------------------------------------------------- the CLI
def _cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse refuses an option
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", r"argument --memory-budget/--memory-per-device: a device's memory must be more than 0 bytes, got '0'"),
        ("1e400GB", r"argument --memory-budget/--memory-per-device: '1e400GB' is not a byte size a device can have"),
        ("36", r"argument --memory-budget/--memory-per-device: '36' has no unit: write e.g. '36GB'"),
        ("-1GB", r"argument --memory-budget/--memory-per-device: cannot read '-1GB' as a byte size"),
    ],
)
def test_cli_memory_per_device(capsys, tmp_path, value, message):
    code, err = _cli(
        capsys,
        "search",
        str(A100_PROFILE),
        "--world-size",
        "8",
        f"--memory-per-device={value}",
        "-o",
        str(tmp_path / "plan.json"),
    )
    assert code == 2 and re.search(message, err), err
    assert not (tmp_path / "plan.json").exists()


def test_cli_evaluate_names_the_file_and_the_option(capsys, tmp_path):
    files = _files(tmp_path)
    ParallelPlan.uniform(8, 6, S()).save(tmp_path / "six.json")
    ParallelPlan.uniform(8, 32, S()).save(tmp_path / "no_batch.json")
    for argv, message in [
        (["--plan", files["list.json"]], r"plan file '.*list\.json' must hold a JSON object"),
        (
            ["--plan", str(tmp_path / "six.json"), "--global-batch-size", "8"],
            (
                r"plan file '.*six\.json' \(evaluated on the profile '.*'\): the plan has 6 layer strategies but the "
                r"profiled model has 32 blocks"
            ),
        ),
        (
            ["--plan", str(tmp_path / "no_batch.json")],
            r"plan file '.*no_batch\.json' .*: it does not fix its global batch size: pass --global-batch-size",
        ),
    ]:
        code, err = _cli(capsys, "evaluate", str(A100_PROFILE), *argv)
        assert code == 2 and re.search(message, err), err
    code, err = _cli(capsys, "evaluate", files["list.json"], "--plan", str(tmp_path / "six.json"))
    assert code == 2 and re.search(r"profile file '.*list\.json' must hold a JSON object", err), err

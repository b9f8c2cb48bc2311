"""GalvatronStrategy inside Lightning's loop: batch semantics, resume, clipping, validation, registration."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.training import assert_close_runs, run_distributed, run_single
from tests.test_parity_data_parallel import FP32_TOL, MIXED_DP_PLAN

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[1]


def test_same_loss_curve_as_ddp_on_the_same_dataloader(pools):
    pool = pools(4)
    ddp = pool.run(run_distributed, strategy="ddp", max_steps=4)[0]
    galvatron = pool.run(run_distributed, MIXED_DP_PLAN, max_steps=4)[0]
    assert_close_runs(galvatron, ddp, **FP32_TOL)


def test_input_shards_get_the_ddp_global_batch(pools):
    """With a global batch set, each step still trains on one contiguous block of the shuffled data."""
    expected = run_single(global_batch=16)
    result = pools(4).run(run_distributed, MIXED_DP_PLAN, global_batch=8, strategy_kwargs=dict(global_batch_size=16))[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_resume_from_a_sharded_checkpoint_matches_uninterrupted_training(pools, tmp_path):
    pool = pools(4)
    epochs = dict(max_steps=-1, num_samples=16)  # 2 steps per epoch
    uninterrupted = pool.run(run_distributed, MIXED_DP_PLAN, max_epochs=2, **epochs)[0]
    checkpoint = str(tmp_path / "epoch1.ckpt")
    first = pool.run(run_distributed, MIXED_DP_PLAN, max_epochs=1, save_path=checkpoint, **epochs)[0]
    assert (tmp_path / "epoch1.ckpt" / "meta.pt").is_file()  # a DCP directory, one shard file per rank
    assert len(list((tmp_path / "epoch1.ckpt").glob("*.distcp"))) == 4
    resumed = pool.run(run_distributed, MIXED_DP_PLAN, max_epochs=2, ckpt_path=checkpoint, **epochs)[0]
    resumed.losses = first.losses + resumed.losses
    assert len(resumed.losses) == 4
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(uninterrupted.losses), atol=1e-6, rtol=0)
    for name, value in uninterrupted.state.items():
        torch.testing.assert_close(resumed.state[name], value, atol=1e-6, rtol=0)


def test_gradient_clipping_by_global_norm(pools):
    clip = dict(gradient_clip_val=0.05)
    expected = run_single(**clip)
    total_norm = torch.cat([g.flatten() for g in expected.grads.values()]).norm()
    assert total_norm > 10 * 0.05  # clipping is active
    result = pools(4).run(run_distributed, MIXED_DP_PLAN, **clip)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_validation_loss_matches(pools):
    expected = run_single(validate=True)
    result = pools(4).run(run_distributed, MIXED_DP_PLAN, validate=True)[0]
    assert result.val_loss == pytest.approx(expected.val_loss, abs=1e-5)


def test_bf16_true_trains_in_bf16(pools):
    run = pools(4).run(run_distributed, MIXED_DP_PLAN, precision="bf16-true", max_steps=6)[0]
    assert run.param_dtypes == {torch.bfloat16}
    assert run.losses[-1] < run.losses[0]


# --------------------------------------------------------------------------- bad input, registration
@pytest.mark.parametrize(
    ("strategy", "precision"),
    [("galvatron", "16-true"), ("galvatron", "64-true"), (GalvatronStrategy(plan=MIXED_DP_PLAN), "16-true")],
)
def test_unsupported_precision_is_refused_before_launch(strategy, precision):
    with pytest.raises(
        ValueError, match=f"does not support precision='{precision}'; choose one of 32-true, bf16-mixed, bf16-true"
    ):
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision)


def test_plan_for_another_world_size_is_refused(pools):
    with pytest.raises(AssertionError, match="the plan is for world_size=4 but 2 devices are running"):
        pools(2).run(run_distributed, MIXED_DP_PLAN)


def test_plans_the_runtime_cannot_execute_yet_are_refused(pools):
    vocab_sequence_parallel = ParallelPlan(world_size=2, layers=(S(),) * 4, vocab=S(tp=2, sp="ulysses"))
    with pytest.raises(AssertionError, match=r"vocab: sp='ulysses': the embedding and head run on whole sequences"):
        pools(2).run(run_distributed, vocab_sequence_parallel)
    wrong_depth = ParallelPlan(world_size=2, layers=(S(),) * 3)
    with pytest.raises(
        AssertionError, match=r"3 layer strategies but the model has 4 blocks \(model.blocks \(4 x Block\)\)"
    ):
        pools(2).run(run_distributed, wrong_depth)


def _run_without_a_plan() -> None:
    run_distributed(strategy=GalvatronStrategy(plan=None))


def test_missing_plan_says_how_to_get_one(pools):
    with pytest.raises(AssertionError, match='GalvatronStrategy needs a plan: plan="auto" \\(the default\\)'):
        pools(2).run(_run_without_a_plan)


def test_registered_with_lightning_and_refused_with_the_reason_in_pytorch_lightning():
    trainer = L.Trainer(strategy="galvatron", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, GalvatronStrategy)
    # In fresh processes, in either import order (a twin class built by rewriting source hit a circular import).
    for first, then in (("pytorch_lightning", "lightning_galvatron"), ("lightning_galvatron", "pytorch_lightning")):
        code = f"import {first}, {then}, pytorch_lightning; pytorch_lightning.Trainer(strategy='galvatron')"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300, check=False
        )
        assert out.returncode == 1, out.stderr[-2000:]
        assert (
            'ValueError: strategy="galvatron" runs with the `lightning` package, not `pytorch_lightning`' in out.stderr
        )
        assert "`import lightning.pytorch as pl`" in out.stderr


# A Lightning project without Rich: Lightning checks for it by its distribution's version and its module,
# transformers (imported by torchmetrics) by importlib.util.find_spec, which answers None for a missing package.
_WITHOUT_RICH = """
import importlib.abc, importlib.metadata, importlib.util, sys
class NoRich(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "rich":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoRich())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] == "rich" else find_spec(name, package)
)
version = importlib.metadata.version
def version_without_rich(name):
    if name == "rich":
        raise importlib.metadata.PackageNotFoundError(name)
    return version(name)
importlib.metadata.version = version_without_rich
"""
_DEFAULT_CALLBACKS = """
import lightning.pytorch as L
def callbacks(**kwargs):
    return sorted(type(c).__name__ for c in L.Trainer(accelerator="cpu", devices=1, logger=False, **kwargs).callbacks)
before = callbacks()
import lightning_galvatron
print(json.dumps([before, callbacks(), callbacks(strategy="galvatron"), "rich" in sys.modules]))
"""


def test_importing_leaves_lightnings_default_progress_bar_and_model_summary():
    """In a fresh project without Rich (this environment has it: Lightning would pick Rich's bar and summary)."""
    code = "import json, sys\n" + _WITHOUT_RICH + _DEFAULT_CALLBACKS
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300, check=True
    )
    before, after, with_strategy, rich_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == after == with_strategy == ["ModelCheckpoint", "ModelSummary", "TQDMProgressBar"]
    assert not rich_imported


def test_offline_parts_do_not_load_lightning():
    code = "import sys, lightning_galvatron.plan; print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["False", "False"]


_FIRST_IMPORT = """
import lightning_galvatron.strategy.data
import lightning as L
trainer = L.Trainer(strategy="galvatron", accelerator="cpu", devices=1, logger=False, precision="16-true")
"""


def test_a_lightning_module_of_the_package_imported_first_still_registers_the_strategies():
    """``import lightning_galvatron.strategy.data`` alone imported Lightning, whose registration hook imported the
    strategies, which read names of the half-imported ``data`` module (a circular ImportError). The Trainer's precision
    check speaks our message, so the strategy's class and its connector patch are in place when the Trainer asks."""
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT], capture_output=True, text=True, cwd=REPO, timeout=300, check=False
    )
    assert "ImportError" not in out.stderr, out.stderr[-2000:]
    assert "GalvatronStrategy does not support precision='16-true'" in out.stderr, out.stderr[-2000:]


def test_lightning_cli_yaml_class_path_needs_no_import(tmp_path):
    """A project that never imports lightning_galvatron selects it from YAML by class path."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
        import sys
        import torch
        from lightning.pytorch.cli import LightningCLI
        from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

        class Blocks(BoringModel):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Sequential(
                    *(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(3)),
                    torch.nn.Linear(32, 2),
                )
                self.layer = torch.nn.Sequential(torch.nn.Sequential(*list(self.layer)[:3]), list(self.layer)[3])

        assert "lightning_galvatron" not in sys.modules
        cli = LightningCLI(Blocks, BoringDataModule, run=False)
        cli.trainer.fit(cli.model, cli.datamodule)
        print("strategy:", type(cli.trainer.strategy).__module__, type(cli.trainer.strategy).__name__)
        """
        )
    )
    config = tmp_path / "train.yaml"
    config.write_text(
        textwrap.dedent(
            """
        trainer:
          accelerator: cpu
          devices: 1
          max_steps: 2
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          strategy:
            class_path: lightning_galvatron.GalvatronStrategy
            init_args:
              layers: layer.0
              plan: {world_size: 1, layers: [{dp_type: zero3}, {dp_type: ddp, recompute: true}, {dp_type: zero2}]}
        """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script), "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strategy: lightning_galvatron.strategy.trainer_strategy GalvatronStrategy" in out.stdout


def _train_from_empty_init(plan: ParallelPlan) -> tuple[bool, list[float]]:
    """A model created on the meta device is materialised shard by shard, never whole on one rank."""
    from torch.utils.data import DataLoader

    from examples.gpt import GPTModule
    from tests.helpers.training import TINY_GPT, dataset

    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=GalvatronStrategy(plan=plan, save_plan=False),
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    L.seed_everything(0)  # every rank materialises whole (ddp) layers alike, as Lightning's users seed for it
    with trainer.init_module(empty_init=True):
        module = GPTModule(**TINY_GPT)
    was_meta = all(p.is_meta for p in module.parameters())
    losses: list[float] = []
    module.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(float(outputs["loss"]))
    trainer.fit(module, DataLoader(dataset(64), batch_size=2, shuffle=True))
    return was_meta, losses, [float(p.detach().double().sum()) for p in module.parameters() if p.ndim == 2]


def test_empty_init_model_is_materialised_sharded(pools):
    plan = ParallelPlan.uniform(4, 4, S(tp=2, dp_type="zero3"), vocab=S(dp_type="zero3"))
    was_meta, losses, _ = pools(4).run(_train_from_empty_init, plan)[0]
    assert was_meta
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_empty_init_model_under_ddp_layers_sums_their_gradients(pools):
    """Materialising meta weights made new parameter objects after the gradient reducer had registered the old ones:
    ddp layers trained each rank on its own samples and the replicas drifted apart."""
    plan = ParallelPlan.uniform(4, 4, S(), vocab=S())
    results = pools(4).run(_train_from_empty_init, plan)
    assert results[0][0]
    assert all(result[2] == results[0][2] for result in results), "the ddp replicas differ after training"


def test_ranks_that_disagree_on_a_mask_get_an_error_not_a_hang(pools):
    from tests.helpers.masked_model import sometimes_masked

    # Strided vocabulary groups read shards r % 2, the blocks' dp=4 needs quarter r: samples cross ranks.
    plan = ParallelPlan(world_size=4, layers=(S(), S()), vocab=S(tp=2, tp_consecutive=False))
    with pytest.raises(AssertionError, match="passed different inputs to MaskedBlock: some a per-sample tensor"):
        pools(4).run(run_distributed, plan, model=sometimes_masked)


def test_user_registered_tensor_parallel_plan(pools):
    from tests.helpers.masked_model import mixer_lm_with_registered_plan

    plan = ParallelPlan(world_size=4, layers=(S(tp=2), S(tp=4, dp_type="zero3"), S(), S(tp=2, recompute=True)))
    expected = run_single(model=mixer_lm_with_registered_plan)
    result = pools(4).run(run_distributed, plan, model=mixer_lm_with_registered_plan)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def _parameters_left_after_fit(strategy_kwargs: dict) -> tuple[list[str], int]:
    """Fit through the strategy keeping only weak references to the trained parameters: the names of those still
    alive once the Trainer, strategy and module are dropped, and how many more parameters the process holds than
    before (copies made for profiling or trials included)."""
    import gc
    import weakref

    from torch.utils.data import DataLoader

    from tests.helpers.training import _trainer, dataset, tiny_gpt

    def live_parameters() -> int:
        gc.collect()
        return sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())

    trained: list[tuple[str, weakref.ref]] = []

    class Remember(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            trained.extend((name, weakref.ref(p)) for name, p in pl_module.named_parameters())

    def fit() -> None:  # everything it makes goes out of scope when it returns
        trainer, _ = _trainer(GalvatronStrategy(save_plan=False, **strategy_kwargs), 4, "32-true", max_steps=2)
        trainer.callbacks.append(Remember())
        trainer.fit(tiny_gpt(), DataLoader(dataset(32), batch_size=2))

    before = live_parameters()
    fit()
    more = live_parameters() - before  # collects first
    return [name for name, ref in trained if ref() is not None], more


@pytest.mark.parametrize("automatic", [False, True], ids=["mixed_pipelined_plan", "automatic_plan"])
def test_a_fitted_model_is_freed_with_its_trainer(pools, profile_cache, automatic):
    """Sweeps and notebooks fit many models in one process. The ddp layers' gradient hooks once kept every fitted
    model alive, and the profiler every block copy it measured (cycles through objects held in C++, which the
    garbage collector cannot see). A plan with ddp, ZeRO-3, tensor-parallel and recomputed blocks over a pipeline,
    and the automatic plan (profile, search, trials), must leave nothing behind."""
    from tests.helpers.training import QUICK_TRIALS
    from tests.test_family_matrix import PP_1F1B_MIXED

    kwargs = (
        dict(memory_budget="2GB", profile_cache=str(profile_cache), trials=QUICK_TRIALS)
        if automatic
        else dict(plan=PP_1F1B_MIXED)
    )
    for alive, more in pools(4).run(_parameters_left_after_fit, kwargs):
        assert alive == [], f"{len(alive)} parameters outlived their Trainer, e.g. {alive[:3]}"
        assert more == 0, f"the process holds {more} more parameters than before the fit"

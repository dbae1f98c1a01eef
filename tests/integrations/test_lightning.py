"""LightningPlanCallback: a LightningModule trained under a plan gives eager's parameters, bit for bit."""

import atexit
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import udnn_lab as ul
from udnn_lab.units import parse_bytes

L = pytest.importorskip("lightning")
from udnn_lab.integrations import LightningPlanCallback  # noqa: E402

BATCH, FEATURES, BATCHES = 256, 64, 3


class Classifier(L.LightningModule):
    def __init__(self, fail_at: int | None = None, manual: bool = False):
        super().__init__()
        layers = [m for _ in range(4) for m in (torch.nn.Linear(FEATURES, FEATURES), torch.nn.GELU())]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(FEATURES, 10))
        self.fail_at = fail_at
        self.automatic_optimization = not manual

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("a failing batch")
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)  # the logger's copy of the loss is the trainer's, not the step's
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.getLogger("lightning.pytorch").level
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        yield
        logging.getLogger("lightning.pytorch").setLevel(level)


def _data(short_last: bool = True, batches: int = BATCHES):
    generator = torch.Generator().manual_seed(0)
    count = BATCH * batches + (40 if short_last else 0)
    x = torch.randn(count, FEATURES, generator=generator)
    y = torch.randint(0, 10, (count,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(callbacks, module=None, epochs=1, data=None, **options):
    torch.manual_seed(0)
    module = module or Classifier()
    trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", **options)
    trainer.fit(module, data or _data())
    return module, trainer


def _no_runtime_left():
    modules = torch.nn.modules.module
    return (not modules._global_forward_pre_hooks and not modules._global_forward_hooks
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


# budgets between each step's least under 'recompute' and its peak with everything kept
@pytest.mark.parametrize("options, budget", [({}, "760 KiB"),
                                             ({"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}, "800 KiB"),
                                             ({"precision": "bf16-mixed"}, "560 KiB")],
                         ids=["32-true", "accumulate-clip", "bf16-mixed"])
def test_parameters_equal_training_without_the_callback(options, budget):
    callback = LightningPlanCallback(budget, policy="recompute")
    planned, trainer = _fit([callback], epochs=2, **options)
    eager, _ = _fit([], epochs=2, **options)
    assert callback.plan is not None and callback.plan.recomputes
    for ours, theirs in zip(planned.parameters(), eager.parameters()):
        assert torch.equal(ours, theirs)
    rows = callback.frame()
    assert rows.planned.sum() >= 2 and not rows.planned.all()  # the short last batch ran without the plan
    assert "drop_last" in rows.why_unplanned[~rows.planned].iloc[0]
    assert "udnn/predicted_peak_bytes" in trainer.logged_metrics and _no_runtime_left()


@pytest.mark.parametrize("options", [{}, {"accumulate_grad_batches": 2}], ids=["one-micro-batch", "accumulate"])
def test_a_steady_step_measures_the_predicted_peak(options):
    """The count leaves out the data set, which the trainer reads between micro-batches (NOTE [trainer steps] 6)."""
    callback = LightningPlanCallback("760 KiB", policy="recompute")
    _fit([callback], epochs=2, data=_data(short_last=False, batches=4), **options)
    measured = [r for r in callback.reports if r.measured_peak_bytes is not None]
    assert len(measured) == 1 and measured[0].step > 0  # the first step makes the optimizer's state: not steady
    assert measured[0].measured_peak_bytes == pytest.approx(measured[0].predicted_peak_bytes, rel=0.01)
    assert measured[0].predicted_peak_bytes <= parse_bytes("760 KiB")


def test_an_error_in_a_step_leaves_the_module_as_eager_leaves_it():
    callback = LightningPlanCallback("760 KiB", policy="recompute")
    module = Classifier(fail_at=1)
    with pytest.raises(RuntimeError, match="a failing batch"):
        _fit([callback], module=module)
    assert _no_runtime_left()
    module.fail_at = None
    module(torch.randn(4, FEATURES)).sum().backward()  # still trains, without the runtime


def test_a_saved_plan_is_used_and_one_for_another_step_is_refused(tmp_path):
    first = LightningPlanCallback("760 KiB", policy="recompute")
    _fit([first])
    path = first.plan.save(tmp_path / "step.plan.json")
    again = LightningPlanCallback(plan=path)
    planned, _ = _fit([again])
    assert again.plan.recomputes == first.plan.recomputes
    other = LightningPlanCallback(plan=path)
    with pytest.raises(ul.PlanError, match="fingerprint"):
        _fit([other], accumulate_grad_batches=2)


def test_manual_optimization_is_refused_in_one_line():
    with pytest.raises(ValueError, match="automatic_optimization") as error:
        _fit([LightningPlanCallback("1 MiB")], module=Classifier(manual=True))
    assert "\n" not in str(error.value)


def _destroy_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _GroupTornDown(L.Callback):
    """Each spawned rank tears its gloo group down as it exits: Lightning does only for NCCL, and a rank left to the
    interpreter's exit has aborted there once ("terminate called without an active exception")."""

    def setup(self, trainer, pl_module, stage):
        atexit.register(_destroy_group)


class _Reported(L.Callback):
    """Each rank's callback reports, as the trainer's metrics rank 0 sends back to the launching process."""

    def __init__(self, planned: LightningPlanCallback):
        self.planned = planned

    def on_train_end(self, trainer, pl_module):
        measured = [r for r in self.planned.reports if r.measured_peak_bytes is not None]
        trainer.callback_metrics.update({
            "plan/recomputes": torch.tensor(float(len(self.planned.plan.recomputes))),
            "plan/planned_steps": torch.tensor(float(sum(r.planned for r in self.planned.reports))),
            "plan/measured_peak": torch.tensor(float(measured[0].measured_peak_bytes if measured else -1)),
            "plan/predicted_peak": torch.tensor(float(self.planned.steps.predicted_peak_bytes))})


@pytest.mark.parametrize("options", [{}, {"accumulate_grad_batches": 2}], ids=["one-micro-batch", "accumulate"])
def test_a_ddp_rank_is_planned_and_trains_as_ddp_does_without_the_callback(options):
    """Two CPU processes over gloo: each traces its rank of the step as Lightning's DDP runs it (DDP's forward,
    no_sync before the last micro-batch), and counts one steady step's bytes against the prediction."""
    callback = LightningPlanCallback("900 KiB", policy="recompute", hardware="cpu-amd-epyc-2cpu")  # gloo's links
    options = dict(devices=2, strategy="ddp_spawn", **options)
    data = _data(short_last=False, batches=4)  # each rank: two whole batches an epoch
    planned, trainer = _fit([callback, _Reported(callback), _GroupTornDown()], epochs=2, data=data, **options)
    eager, _ = _fit([_GroupTornDown()], epochs=2, data=data, **options)
    for ours, theirs in zip(planned.parameters(), eager.parameters()):
        assert torch.equal(ours, theirs)
    metrics = trainer.callback_metrics
    steps = 4 // options.get("accumulate_grad_batches", 1)
    assert metrics["plan/recomputes"] > 0 and metrics["plan/planned_steps"] == steps
    assert metrics["plan/predicted_peak"] <= parse_bytes("900 KiB")
    assert metrics["plan/measured_peak"] == pytest.approx(float(metrics["plan/predicted_peak"]), rel=0.01)


@pytest.mark.parametrize("module, budget, parameters", [("blocks", "1700 KiB", 18), ("gpt2", "3300 KiB", 28),
                                                        ("gpt2-bf16", "2300 KiB", 28)])
def test_an_fsdp2_rank_sharded_in_configure_model_is_planned_and_trains_as_without_the_callback(tmp_path, module,
                                                                                                budget, parameters):
    """Two CPU ranks of ModelParallelStrategy (gloo), each block sharded with fully_shard in configure_model:
    each rank traces its step from the sharded module (ul.FSDP.of), plans it, and trains under it; the parameters
    after four steps (two of two micro-batches in bf16) are eager's, bit for bit. GPT-2's plan re-runs a sharded
    block's forward, its parameters gathered by FSDP2's pre-backward hook; in bf16 the plan records recomputations
    that backward restores after that hook's gather, at the tensors' unpacks. gloo's reduce-scatter copies each
    block's gradients into a buffer of its own and lets go of it on its own thread (NOTE in
    tests/analysis/test_one_rank_gloo.py): the measured peak is the prediction plus, at most, one such copy per
    block."""
    out = tmp_path / "ranks.json"
    job = Path(__file__).with_name("lightning_fsdp_job.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, str(job), str(out), budget, "recompute", module], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert ranks["same_parameters"] and ranks["parameters"] == parameters
    assert ranks["recomputes"] > 0 and ranks["planned_steps"] == ranks["steps"] == (2 if "bf16" in module else 4)
    assert module != "gpt2" or ranks["reruns"] > 0
    assert ranks["note"].startswith("rank 0 of FSDP2 over 2 ranks (reshard after forward")  # the job's settings
    assert ("parameters gathered in bfloat16" in ranks["note"]) == module.endswith("bf16")
    assert ranks["predicted_peak"] <= parse_bytes(budget)
    (measured,) = ranks["measured_peaks"]
    assert ranks["predicted_peak"] <= measured <= ranks["predicted_peak"] + ranks["blocks"] * ranks["block_bytes"]

"""LightningPlanCallback: a LightningModule trained under a plan gives eager's parameters, bit for bit."""

import logging
import warnings

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


def _data(short_last: bool = True):
    generator = torch.Generator().manual_seed(0)
    count = BATCH * BATCHES + (40 if short_last else 0)
    x = torch.randn(count, FEATURES, generator=generator)
    y = torch.randint(0, 10, (count,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(callbacks, module=None, epochs=1, **options):
    torch.manual_seed(0)
    module = module or Classifier()
    trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", **options)
    trainer.fit(module, _data())
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


def test_a_steady_step_measures_the_predicted_peak():
    callback = LightningPlanCallback("760 KiB", policy="recompute")
    _fit([callback], epochs=2)
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

"""What both trainer callbacks share: the trainer's graph, the batch check, the figures they log."""

import pytest
import torch

import udnn_lab as ul
from udnn_lab.integrations import PlannedSteps, StepReport
from udnn_lab.integrations._planned import module_bound, shapes_of
from udnn_lab.workload import StepLoss


def _step_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    loss = StepLoss(lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1]))
    return ul.trace(ul.Workload(model, ((x, y),), loss_fn=loss, optimizer=torch.optim.SGD(model.parameters())))


def test_tensors_made_outside_every_module_call_are_never_planned():
    graph = _step_graph()
    bound = module_bound(graph)
    made_in_the_loss = [t for t in graph.tensors if t.category == "feature_map"
                        and not any(c.first_op <= t.producer <= c.last_op for c in graph.module_calls)]
    assert made_in_the_loss  # log_softmax's output, saved for its backward
    assert all(bound.tensors[t.id].category == "temporary" for t in made_in_the_loss)
    assert bound.fingerprint == graph.fingerprint and bound.peak_bytes == graph.peak_bytes
    assert not _acted_on(ul.plan(graph, None, "recompute")).isdisjoint(t.id for t in made_in_the_loss)
    planned = _acted_on(ul.plan(bound, None, "recompute"))
    assert planned and planned.isdisjoint(t.id for t in made_in_the_loss)


def _acted_on(plan: ul.Plan) -> set[int]:
    return {t for r in plan.recomputes for t in r.tensors} | {o.tensor for o in plan.offloads}


def test_a_batch_is_checked_by_its_shapes_and_dtypes():
    steps = PlannedSteps("1 MiB", policy="recompute")
    batch = (torch.zeros(4, 3), {"labels": torch.zeros(4, dtype=torch.long)})
    assert shapes_of(batch) == (((4, 3), torch.float32), ((4,), torch.int64))
    steps._batch_shapes = shapes_of(batch)
    assert steps.why_not(batch, 2, 2) == ""
    assert "micro-batches" in steps.why_not(batch, 1, 2)
    assert "drop_last" in steps.why_not((torch.zeros(2, 3), {"labels": torch.zeros(2, dtype=torch.long)}), 2, 2)


def test_the_logged_figures_are_numbers_under_one_prefix():
    report = StepReport(3, True, 1000, None, 0.5, 0.6)
    assert report.logs() == {"udnn/planned": 1.0, "udnn/predicted_peak_bytes": 1000.0,
                             "udnn/predicted_step_s": 0.5, "udnn/measured_step_s": 0.6}
    assert StepReport(3, True, 1000, 900, 0.5, 0.6).logs()["udnn/measured_peak_bytes"] == 900.0


def test_a_budget_or_a_plan_is_needed():
    with pytest.raises(ValueError, match="budget"):
        PlannedSteps(None)


def test_a_plan_only_a_dispatch_mode_can_follow_is_refused_naming_the_policies_hooks_can_follow(monkeypatch):
    """NOTE [trainer steps] 2. Which plans a runtime follows by hooks is the runtime's own business (an FSDP2 rank's
    recording windows can fall between hook points): here the recompute plan is made one it cannot, and the refusal
    names the quick policies whose plans for the budget it can, with their simulated step times."""
    from udnn_lab.errors import PlanError
    from udnn_lab.runtime import OffloadRuntime

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())])
    work = ul.Workload(model, torch.randn(256, 64), optimizer=torch.optim.SGD(model.parameters()))
    graph = ul.trace(work)
    budget = (ul.min_budget(graph, "recompute") + graph.peak_bytes) // 2
    followed = OffloadRuntime.hook_schedule
    monkeypatch.setattr(OffloadRuntime, "hook_schedule",
                        lambda self: None if self.plan.policy == "recompute" else followed(self))
    with pytest.raises(PlanError, match="followed by hooks, with their step times: .*'vdnn\\+\\+' \\(") as error:
        PlannedSteps(budget, policy="recompute").prepare(work, (torch.randn(256, 64),))
    assert "'recompute'" not in str(error.value).split(":", 2)[-1] and "\n" not in str(error.value)


def test_a_plan_followed_op_by_op_to_fit_its_budget_is_refused_naming_the_budget_hooks_can_follow():
    """At auto's least budget for a VoVNet, its plan on hook points would not fit, so the planner made one followed
    op by op: the refusal says so, and names the budget at which auto's plan is followed by hooks."""
    from udnn_lab.errors import PlanError

    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("ese_vovnet19b_dw", pretrained=False, num_classes=10)
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    work = ul.Workload(model, x, y, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.01))
    least = ul.min_budget(ul.trace(work), "auto", hardware="cpu-amd-epyc-2cpu")
    with pytest.raises(PlanError, match="this plan is followed op by op.*at a budget of [0-9.]+MiB its plan is "
                                        "followed by hooks alone") as error:
        PlannedSteps(least, policy="auto", hardware="cpu-amd-epyc-2cpu").prepare(work, (x, y))
    assert "\n" not in str(error.value)

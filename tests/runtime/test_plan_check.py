"""One check for every consumer of a Plan (graph/plan_ir.py check_plan): a plan for another step is refused by
simulate, measure, train and OffloadRuntime alike, with a first line that says the difference and what to do."""

import pytest

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.errors import PlanError, PlanForAnotherStep, PlanMismatch
from udnn_lab.graph.plan_ir import check_plan


@pytest.fixture(scope="module")
def steps():
    mlp3, mlp5 = zoo.get("mlp3", batch=4), zoo.get("mlp5", batch=4)
    graph3 = ul.trace(mlp3)
    nothing = ul.plan(ul.trace(mlp5), "10GB", hardware="h100-sxm")  # for mlp5, and it moves nothing
    assert not nothing.offloads and not nothing.recomputes
    return mlp3, graph3, nothing


def _consumers(mlp3, graph3, plan):
    def run_under_runtime():
        with ul.OffloadRuntime(plan):
            mlp3.loss_fn(mlp3.model(mlp3.example_input), mlp3.target).backward()

    return {
        "simulate": lambda: ul.simulate(graph3, plan, hardware="h100-sxm"),
        "measure with the graph": lambda: ul.measure(mlp3, plan=plan, graph=graph3, warmup=0),
        "measure": lambda: ul.measure(mlp3, plan=plan, warmup=0),
        "train": lambda: ul.train(mlp3.model, [(mlp3.example_input, mlp3.target)], mlp3.optimizer,
                                  loss_fn=mlp3.loss_fn, plan=plan, progress=False),
        "OffloadRuntime": run_under_runtime,
    }


@pytest.mark.parametrize("consumer", ["simulate", "measure with the graph", "measure", "train", "OffloadRuntime"])
def test_a_plan_for_another_step_that_moves_nothing_is_refused_by_every_consumer(steps, consumer):
    mlp3, graph3, nothing = steps
    with pytest.raises(PlanForAnotherStep) as refused:
        _consumers(mlp3, graph3, nothing)[consumer]()
    first, *details = str(refused.value).splitlines()
    assert "plan" in first and "another" in first or "not the one the plan was made for" in first
    assert "plan again" in first and len(first) < 240, first  # the difference and what to do, on one line
    assert details and all(line.startswith("  ") for line in details)  # the rest below it
    assert isinstance(refused.value, PlanError) and isinstance(refused.value, PlanMismatch)


def test_the_plan_for_this_step_that_moves_nothing_runs_everywhere(steps):
    mlp3, graph3, _ = steps
    own = ul.plan(graph3, "10GB", hardware="h100-sxm")
    for consume in _consumers(mlp3, graph3, own).values():
        consume()  # no error


def test_check_plan_refuses_what_is_not_a_plan_and_names_the_first_differing_op(steps):
    _, graph3, nothing = steps
    assert check_plan(None) is None and check_plan(nothing) is nothing
    with pytest.raises(TypeError, match="ul.plan"):
        check_plan("auto")  # type: ignore[arg-type]
    with pytest.raises(PlanForAnotherStep, match=r"another graph than mlp3's: op \d+ of this step is "):
        check_plan(nothing, graph3)

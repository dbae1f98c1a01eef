"""Plans as files (graph/plan_file.py, Plan.save and Plan.load)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.errors import PlanError, PlanForAnotherStep
from udnn_lab.graph import Plan
from udnn_lab.vocabulary import PACKAGE_VERSION

ROOT = Path(__file__).resolve().parents[2]
CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")


@pytest.fixture(scope="module")
def made():
    work = zoo.get("resnet18", batch=16, image_size=64)
    graph = ul.trace(work)
    low = ul.min_budget(graph, "auto", hardware=CPU)
    plan = ul.plan(graph, (low + graph.peak_bytes) // 2, "auto", hardware=CPU)
    assert plan.offloads or plan.recomputes
    return work, graph, plan


def test_a_plan_comes_back_from_its_file_as_it_was(made, tmp_path):
    _, graph, plan = made
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path, graph)
    assert loaded == plan and loaded.sites == plan.sites and loaded.hook_events == plan.hook_events
    assert json.loads(path.read_text())["step_fingerprint"] == graph.fingerprint


def test_a_loaded_plan_trains_as_eager_does_in_another_process(made, tmp_path):
    """What a training job does: load the file, run the step under the runtime, no graph at hand."""
    work, _, plan = made
    path = plan.save(tmp_path / "plan.json")
    code = ("import torch, udnn_lab as ul\n"
            "from udnn_lab import zoo\n"
            "from udnn_lab.analysis.step import run_step, split_input\n"
            "torch.manual_seed(0)\n"
            "work = zoo.get('resnet18', batch=16, image_size=64)\n"
            f"plan = ul.Plan.load(r'{path}')\n"
            "args, kwargs = split_input(work.example_input)\n"
            "with ul.OffloadRuntime(plan):\n"
            "    _, loss = run_step(work.model, args, kwargs, loss_fn=work.loss_fn, target=work.target)\n"
            f"torch.save([p.grad for p in work.model.parameters()], r'{tmp_path / 'grads.pt'}')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    torch.manual_seed(0)
    eager = zoo.get("resnet18", batch=16, image_size=64)
    args, kwargs = split_input(eager.example_input)
    run_step(eager.model, args, kwargs, loss_fn=eager.loss_fn, target=eager.target)
    grads = torch.load(tmp_path / "grads.pt")
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, eager.model.parameters()))


def test_a_plan_for_another_step_is_refused_saying_so(made, tmp_path):
    _, _, plan = made
    path = plan.save(tmp_path / "plan.json")
    other = ul.trace(zoo.get("resnet18", batch=8, image_size=32))
    with pytest.raises(PlanForAnotherStep, match="(?s)made for another graph.*fingerprint"):
        Plan.load(path, other)


def test_a_file_from_another_udnn_lab_is_refused_saying_which(made, tmp_path):
    _, _, plan = made
    path = plan.save(tmp_path / "plan.json")
    document = json.loads(path.read_text())
    document["udnn_lab"] = "0.0.1"
    path.write_text(json.dumps(document))
    with pytest.raises(PlanError, match=f"saved by udnn_lab 0.0.1, this is udnn_lab {PACKAGE_VERSION}: plan again"):
        Plan.load(path)


@pytest.mark.parametrize("text, says", [
    ("not json", "not a plan file \\(not JSON"),
    ('{"a": 1}', "not a plan file \\(it has no 'udnn_lab plan' format field"),
    ('{"format": "udnn_lab plan", "format_version": 99}', "format version 99"),
])
def test_what_is_not_a_plan_file_is_refused_in_one_line(tmp_path, text, says):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=says) as raised:
        Plan.load(path)
    assert "\n" not in str(raised.value)
    with pytest.raises(PlanError, match="no plan file at"):
        Plan.load(tmp_path / "missing.json")


def test_a_file_whose_plan_has_other_fields_is_refused(made, tmp_path):
    _, _, plan = made
    path = plan.save(tmp_path / "plan.json")
    document = json.loads(path.read_text())
    document["plan"]["speed"] = "fast"
    del document["plan"]["notes"]
    path.write_text(json.dumps(document))
    with pytest.raises(PlanError, match=r"missing: \['notes'\]; unknown: \['speed'\]"):
        Plan.load(path)


def test_an_unlocated_plan_is_not_saved(made, tmp_path):
    _, graph, plan = made
    bare = Plan(plan.policy, graph.fingerprint, plan.budget_bytes, plan.offloads, plan.recomputes)
    with pytest.raises(PlanError, match="only a located plan can be saved"):
        bare.save(tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()
    copy.deepcopy(Plan.keep_all(graph)).save(tmp_path / "keep.json")  # a plan that moves nothing needs no sites


def test_the_version_plan_files_carry_is_the_packages():
    assert PACKAGE_VERSION == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ul.__version__ == PACKAGE_VERSION

"""A plan made where there is no GPU (a CUDA step traced with CPU kernels standing in, the way a user plans a GPU run
from a laptop) run on the GPU: does the step it was made for match the one CUDA runs, and does it keep its budget?"""

import copy
from unittest import mock

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.workload import optimizer_like

HARDWARE = "nvidia-h200-measured"
SIZES = {"resnet18": {"batch": 16, "image_size": 64}, "hf:gpt2": {"batch": 4, "small": True, "seq_len": 128}}


@pytest.mark.gpu
@pytest.mark.parametrize("name, precision", [("resnet18", "32-true"), ("hf:gpt2", "bf16-mixed")])
def test_a_plan_made_without_a_gpu_runs_on_the_gpu_within_its_budget(name, precision):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    with mock.patch("torch.cuda.is_available", return_value=False):  # as on a machine without one
        graph = ul.trace(zoo.get(name, device="meta", precision=precision, **SIZES[name]), device="cuda")
    work = zoo.get(name, device="cuda", precision=precision, **SIZES[name])
    master = work.model.to("cpu")  # a copy per plan goes to the GPU; this one stays out of the peaks
    found = []
    for policy in ("vdnn++", "recompute", "auto"):
        budget = (ul.min_budget(graph, policy, hardware=HARDWARE) + graph.cuda_peak_bytes) // 2
        chosen = ul.plan(graph, budget, policy, hardware=HARDWARE)
        model = copy.deepcopy(master).to("cuda")
        try:
            run = ul.train(model, [(work.example_input, work.target)] * 2, optimizer_like(work.optimizer,
                           model.parameters()), loss_fn=work.loss_fn, plan=chosen, progress=False,
                           precision=precision)
            peak = int(run.steps["peak_bytes"].iloc[-1])  # the process's: the step and what libraries keep
            if peak > budget:
                found.append(f"{policy}: peak {peak} B over the budget {budget} B (simulated "
                             f"{ul.simulate(graph, chosen, hardware=HARDWARE).peak_bytes} B)")
        except Exception as err:
            found.append(f"{policy}: {type(err).__name__}: {str(err)[:600]}")
        finally:
            del model
            torch.cuda.empty_cache()
    assert not found, f"{name} {precision}: " + "\n".join(found)

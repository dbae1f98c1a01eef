"""Plans never promise more than the machine has: budgets within the device, offloads within the host budget."""

from dataclasses import replace

import pytest

import udnn_lab as ul
from udnn_lab.errors import BudgetOverDevice, HostBudgetExceeded
from udnn_lab.planning import host
from udnn_lab.planning.host import HostMemory

H100 = "h100-sxm"
GIB = 1 << 30


@pytest.fixture(scope="module")
def graph() -> ul.Graph:
    """A step whose activations outweigh its weights: under 80% of its peak it must offload or recompute."""
    return ul.trace(ul.zoo.get("resnet18", batch=128, image_size=64, device="meta"), device="cuda")


def test_a_budget_over_the_device_s_memory_names_both_sizes(graph):
    for call in (lambda: ul.plan(graph, 1e30, hardware=H100),
                 lambda: ul.plan(graph, "100 GiB", hardware="l4", host_budget=None),
                 lambda: ul.sweep(graph, ["1 GiB", "100 GiB"], hardware="l4")):
        with pytest.raises(BudgetOverDevice, match=r"the budget [\d.]+ [TG]iB is more than the [\d.]+ GiB of device "
                                                   r"memory .* has: give a budget up to") as error:
            call()
        assert "\n" not in str(error.value) and error.value.budget_bytes > error.value.memory_bytes


def test_min_budget_above_the_device_s_memory_says_no_budget_there_fits(graph):
    tiny = replace(ul.Hardware.load(H100), memory_bytes=64 << 20)  # an 80 GiB card's figures with 64 MiB
    with pytest.raises(BudgetOverDevice, match=r"needs at least [\d.]+ MiB .* more than the 64\.00 MiB"):
        ul.min_budget(graph, "vdnn-all", tiny, within_device=True)
    assert ul.min_budget(graph, "vdnn-all", tiny) > 64 << 20  # the figure, for a what-if across devices


def test_auto_chooses_a_plan_within_the_host_budget(graph):
    budget = int(0.8 * graph.cuda_peak_bytes)
    free = ul.plan(graph, budget, hardware=H100, host_budget=None)
    assert free.host_pool_bytes > 0  # unhindered, auto offloads
    held = ul.plan(graph, budget, hardware=H100, host_budget=free.host_pool_bytes // 2)
    assert held.host_pool_bytes <= free.host_pool_bytes // 2
    assert ul.simulate(graph, held, hardware=H100).peak_bytes <= budget
    assert ul.sweep(graph, [budget], ["auto"], hardware=H100, host_budget=0).iloc[0].host_bytes == 0


def test_a_policy_that_needs_more_host_memory_than_allowed_says_what_would_fit(graph):
    budget = int(0.8 * graph.cuda_peak_bytes)
    with pytest.raises(HostBudgetExceeded, match=r"only by offloading [\d.]+ MiB to host memory, more than the "
                                                 r"1\.00 MiB host budget: 'auto' fits both") as error:
        ul.plan(graph, budget, "vdnn++", hardware=H100, host_budget="1 MiB")
    assert error.value.host_bytes > error.value.host_budget_bytes == 1 << 20 and error.value.peak_bytes <= budget
    row = ul.sweep(graph, [budget], ["vdnn++"], hardware=H100, host_budget="1 MiB").iloc[0]
    assert not row.fits and row.host_bytes > row.host_budget_bytes


def test_auto_says_when_no_plan_within_the_host_budget_fits():
    mlp = ul.trace(ul.zoo.get("mlp5", batch=4096, device="meta"), device="cuda")
    budget = ul.min_budget(mlp, "auto", H100)  # auto's least budget, which it meets by offloading
    assert ul.plan(mlp, budget, hardware=H100, host_budget=None).host_pool_bytes > 0
    with pytest.raises(HostBudgetExceeded, match="more than the 0 B host budget: raise the budget"):
        ul.plan(mlp, budget, hardware=H100, host_budget=0)


def test_by_default_a_plan_may_take_half_of_the_available_host_memory(monkeypatch):
    monkeypatch.setattr(host, "host_memory", lambda: HostMemory(total_bytes=64 * GIB, available_bytes=10 * GIB))
    assert host.host_budget_bytes("local", "cuda", 8 * GIB) == 5 * GIB
    # a CPU's device budget comes out of the same memory: 10 GiB available less the 8 GiB budget
    assert host.host_budget_bytes("local", "cpu", 8 * GIB) == 2 * GIB
    assert host.host_budget_bytes("local", "cpu", 12 * GIB) == 0
    assert host.host_budget_bytes("64 GiB", "cpu", 12 * GIB) == 64 * GIB
    assert host.host_budget_bytes(None, "cuda", 1) is None  # not checked
    with pytest.raises(ValueError, match="cannot read the host budget 'lots'"):
        host.host_budget_bytes("lots", "cuda", 1)


def test_the_default_host_budget_holds_plans_to_this_machine(graph, monkeypatch):
    budget = int(0.8 * graph.cuda_peak_bytes)
    monkeypatch.setattr(host, "host_memory", lambda: HostMemory(total_bytes=GIB, available_bytes=0))
    assert ul.plan(graph, budget, hardware=H100).host_pool_bytes == 0  # nothing can be pinned here
    with pytest.raises(HostBudgetExceeded):
        ul.plan(graph, budget, "vdnn++", hardware=H100)

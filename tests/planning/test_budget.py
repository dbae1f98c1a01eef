"""plan() and min_budget() for one rank of several: priced on the links its collectives cross."""

from dataclasses import replace

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.planning import op_by_op
from udnn_lab.simulation.simulator import cost_model
from udnn_lab.units import parse_bytes

HARDWARE = "cpu-amd-epyc-2cpu"  # a fixed profile: the same plans on any machine
H100 = ul.Hardware.load("h100-sxm")  # 8 GPUs to a node: NVLink inside, one NIC per GPU between nodes


@pytest.fixture(scope="module")
def rank() -> ul.Graph:
    """Rank 0 of FSDP2 over 8: its all-gathers and reduce-scatters span 8 ranks."""
    return ul.trace(ul.zoo.get("transformer", batch=8, optimizer="adam", device="meta", parallel=ul.FSDP(8)),
                    device="cuda")


def test_a_plan_for_a_rank_of_a_multi_node_job_is_simulated_on_the_nodes_network(rank):
    budget = int(0.7 * rank.cuda_peak_bytes)
    one_node = ul.plan(rank, budget, hardware=H100, ranks_per_node=8)
    spread = ul.plan(rank, budget, hardware=H100, ranks_per_node=1)
    inside = ul.simulate(rank, one_node, H100, ranks_per_node=8)
    across = ul.simulate(rank, spread, H100, ranks_per_node=1)
    assert inside.fits and across.fits
    # the same bytes over the NIC (50 GB/s) instead of NVLink (450 GB/s)
    assert across.communication_time_s > 5 * inside.communication_time_s
    assert across.step_time_s > inside.step_time_s


def test_the_plan_itself_follows_the_ranks_per_node_it_is_priced_with(rank):
    # a node whose host memory feeds one PCIe link's worth of copies: its 8 ranks' offloads share it
    shared_host = replace(H100, host_memory_bytes_per_s=H100.bandwidth_bytes_per_s("h2d", True))
    budget = int(0.68 * rank.cuda_peak_bytes)
    alone, crowded = (ul.plan(rank, budget, hardware=shared_host, ranks_per_node=n) for n in (1, 8))
    assert (alone.offloads, alone.recomputes) != (crowded.offloads, crowded.recomputes)
    assert ul.plan(rank, budget, hardware=shared_host) == crowded  # the profile's 8 GPUs to a node by default
    for planned, per_node in ((alone, 1), (crowded, 8)):
        assert ul.simulate(rank, planned, shared_host, ranks_per_node=per_node).fits


def test_min_budget_takes_ranks_per_node_or_a_cost_model_that_carries_it(rank):
    assert ul.min_budget(rank, "vdnn-all", H100, ranks_per_node=1) == \
        ul.min_budget(rank, "vdnn-all", cost=cost_model(rank, H100, ranks_per_node=1))
    with pytest.raises(ValueError, match="ranks_per_node is how many ranks share a node"):
        ul.min_budget(rank, "vdnn-all", H100, ranks_per_node=0)
    with pytest.raises(ValueError, match="ranks_per_node is how many ranks share a node"):
        ul.plan(rank, None, "keep-all", H100, ranks_per_node=0)
    with pytest.raises(ValueError, match="either cost or ranks_per_node"):
        ul.min_budget(rank, "vdnn-all", cost=cost_model(rank, H100), ranks_per_node=8)


def test_a_floor_of_weights_gradients_and_optimizer_state_is_named_with_what_would_lower_it():
    """Issue: offload cannot help where the model's own state is the peak; say so, and what would."""
    graph = ul.trace(zoo.get("resnet18", batch=4, image_size=32))
    with pytest.raises(ul.PlanInfeasible) as raised:
        ul.plan(graph, "100 MiB", "auto", hardware="cpu-amd-epyc-2cpu")
    said = str(raised.value)
    assert "is weights" in said and "optimizer state" in said and "shard them (FSDP)" in said and "\n" not in said
    activations = ul.trace(zoo.get("resnet18", batch=64, image_size=224, device="meta"), device="cuda")
    with pytest.raises(ul.PlanInfeasible) as raised:
        ul.plan(activations, "300 MiB", "auto", hardware="h100-sxm")  # its floor is activations: no such clause
    assert "is weights" not in str(raised.value) and "lower the batch size" in str(raised.value)


def test_a_floor_set_by_one_op_s_working_set_names_the_op_and_what_would_lower_it():
    """Issue: a language model's logits (a long sequence times a large vocabulary) are read and written by one op
    at once; no plan goes below that, and the message says which op and that a smaller micro-batch would."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 20000))
    tokens = torch.randint(64, (4, 256))
    graph = ul.trace(model, tokens, loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
                     target=torch.randint(20000, (4, 256)), optimizer=None)
    with pytest.raises(ul.PlanInfeasible) as raised:
        ul.plan(graph, "1 MiB", "auto", hardware="cpu-amd-epyc-2cpu")
    said = str(raised.value)
    assert "alone reads and writes" in said and "smaller micro-batch" in said and "\n" not in said
    assert "is weights" not in said


def test_a_floor_set_by_one_optimizer_op_names_what_lowers_it_which_is_not_the_batch():
    """Adam's step on a layer that is most of the model: its temporaries, beside the weights and state, are the
    floor; a smaller batch does not lower them, a fused optimizer does."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    graph = ul.trace(model, torch.randn(2, 64), nn.functional.cross_entropy, torch.optim.Adam(model.parameters()),
                     target=torch.tensor([0, 3]))
    with pytest.raises(ul.PlanInfeasible) as raised:
        ul.plan(graph, int(graph.peak_bytes * 0.9), "auto", hardware="cpu-amd-epyc-2cpu")
    said = str(raised.value)
    assert "in <optimizer>" in said and "fused=True" in said and "not the batch" in said and "\n" not in said
    assert "smaller micro-batch" not in said
    fused = torch.optim.Adam(model.parameters(), fused=True)  # what the message names: no temporaries, a lower floor
    fused_graph = ul.trace(model, torch.randn(2, 64), nn.functional.cross_entropy, fused, target=torch.tensor([0, 3]))
    assert fused_graph.peak_bytes < int(graph.peak_bytes * 0.9)


def test_a_recompute_plan_whose_blocks_take_a_cache_says_so_and_what_lets_it_re_run_them():
    """A Hugging Face decoder with use_cache on hands each block a cache object, which a re-run could change: its
    recomputations are recorded, and the plan says why and what to set; with use_cache off its blocks re-run."""
    found = {}
    for use_cache in (True, False):
        work = zoo.get("hf:gpt2", batch=2, seq_len=64, small=True, optimizer="adam")
        work.model.config.use_cache = use_cache
        graph = ul.trace(work)
        chosen = ul.plan(graph, (ul.min_budget(graph, "recompute") + graph.peak_bytes) // 2, "recompute")
        found[use_cache] = (chosen.notes, [enter for enter in chosen.reruns_in(graph) if enter >= 0])
    (cached_notes, cached_reruns), (plain_notes, plain_reruns) = found[True], found[False]
    assert any("model.config.use_cache = False" in note and note.startswith("each GPT2Block call")
               for note in cached_notes) and not cached_reruns
    assert not any("use_cache" in note for note in plain_notes) and plain_reruns


def test_a_plan_followed_op_by_op_because_on_hook_points_it_would_not_fit_says_so_and_from_what_budget_it_would():
    """At a policy's least budget, moving a plan's offloads onto hook points can take it over (a VoVNet at 64 px:
    153 KiB over 65.48 MiB): the plan is followed op by op, says why, and names the budget at which the policy's
    plan is followed by hooks alone, as the trainer callbacks need (65.7 MiB: its step simulated 18% faster)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("ese_vovnet19b_dw", pretrained=False, num_classes=10)
    work = ul.Workload(model, torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,)), torch.nn.functional.cross_entropy,
                       torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), "vovnet")
    graph = ul.trace(work)
    least = ul.min_budget(graph, "auto", hardware=HARDWARE)
    chosen = ul.plan(graph, least, "auto", hardware=HARDWARE)
    assert chosen.followed_op_by_op(graph)
    note = op_by_op(chosen)
    assert "over the budget" in note and "at a budget of" in note, chosen.notes
    larger = note.split("at a budget of ")[1].split(" ")[0]
    assert parse_bytes(larger) > least
    assert not ul.plan(graph, larger, "auto", hardware=HARDWARE).followed_op_by_op(graph)
    on_hooks = ul.plan(graph, (least + graph.peak_bytes) // 2, "auto", hardware=HARDWARE)
    assert not on_hooks.followed_op_by_op(graph) and op_by_op(on_hooks) == ""

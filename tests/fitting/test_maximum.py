"""max_batch and max_seq_len on small models: each answer is checked by tracing it, and the next size, on their own."""

import math

import pytest
import torch

import udnn_lab as ul
from udnn_lab.errors import BudgetOverDevice, BudgetTooSmall, PlanInfeasible, UnknownModelError

H100 = "h100-sxm"  # the searches count CUDA's 512-byte blocks, whatever this machine has


def _peak(work: ul.Workload) -> int:
    """The step's traced peak for an H100 (CUDA: 512-byte blocks), traced independently of the search."""
    return ul.trace(work, device="cuda").cuda_peak_bytes


def _weights(graph: ul.Graph) -> int:
    return sum(t.cuda_nbytes for t in graph.tensors if t.category == "parameter")


def _mlp(batch: int) -> ul.Workload:
    return ul.zoo.get("mlp3", batch=batch, device="meta")


def test_the_largest_batch_fits_and_the_next_does_not():
    budget = _peak(_mlp(300))  # the budget batch 300 needs exactly
    found = ul.max_batch("mlp3", budget, progress=False, hardware=H100)
    assert found.size >= 300 and found.fits and found.failed_size == found.size + 1
    assert found.peak_bytes == _peak(_mlp(found.size)) <= budget < _peak(_mlp(found.size + 1)) == \
        found.failed_peak_bytes
    assert len(found.probes) <= 2 * math.ceil(math.log2(found.size + 1)) + 1
    assert found.budget_bytes == budget and found.policy == "keep-all" and found.hardware == "h100-sxm"
    assert found.device == "cuda" and found.dimension == "batch" and found.model_name == "mlp3"
    assert found.weights_bytes == _weights(ul.trace(_mlp(1), device="cuda"))
    assert f"largest batch {found.size}" in repr(found) and f"batch {found.size + 1} needs" in repr(found)


def test_the_frame_has_one_row_per_probe_by_size():
    found = ul.max_batch("mlp3", "24 MiB", progress=False, hardware=H100)
    frame = found.to_frame()
    assert len(frame) == len(found.probes) and frame["size"].is_monotonic_increasing
    assert (frame["fits"] == (frame["peak_bytes"] <= frame["budget_bytes"])).all()
    assert frame["peak_bytes"].is_monotonic_increasing  # the peak grows with the batch (NOTE [monotone peak])
    assert set(frame.loc[frame.fits, "size"]) == {p.size for p in found.probes if p.size <= found.size}


def test_a_policy_fits_a_larger_batch_than_keep_all_and_ul_plan_agrees():
    budget = "100 MiB"  # mlp8's weights, gradients and momentum take 81 MiB
    kept = ul.max_batch("mlp8", budget, multiple_of=64, progress=False, hardware=H100)
    planned = ul.max_batch("mlp8", budget, policy="vdnn-all", hardware="h100-sxm", start=kept.size,
                           multiple_of=64, progress=False)
    assert planned.size > kept.size > 0 and planned.policy == "vdnn-all" and planned.size % 64 == 0
    assert planned.failed_size == planned.size + 64
    graph = ul.trace(ul.zoo.get("mlp8", batch=planned.size, device="meta"), device="cuda")
    ul.plan(graph, budget, "vdnn-all", hardware="h100-sxm")  # feasible
    with pytest.raises(PlanInfeasible):
        ul.plan(ul.trace(ul.zoo.get("mlp8", batch=planned.size + 64, device="meta"), device="cuda"), budget,
                "vdnn-all", hardware="h100-sxm")
    answer = next(p for p in planned.probes if p.size == planned.size)
    assert answer.peak_bytes <= ul.parse_bytes(budget) < answer.traced_peak_bytes  # the plan made it fit


def test_a_plan_whose_offloads_do_not_fit_the_host_does_not_fit():
    budget = "100 MiB"
    free = ul.max_batch("mlp8", budget, policy="vdnn-all", multiple_of=64, host_budget=None, progress=False,
                        hardware=H100)
    answer = next(p for p in free.probes if p.size == free.size)
    assert answer.host_bytes > 0 and free.host_budget_bytes is None
    host_budget = answer.host_bytes - 1  # one byte less than the answer's offloads take
    held = ul.max_batch("mlp8", budget, policy="vdnn-all", multiple_of=64, host_budget=host_budget, progress=False,
                        hardware=H100)
    assert 0 < held.size < free.size and held.host_budget_bytes == host_budget
    assert all(p.fits == (p.peak_bytes <= held.budget_bytes and p.host_bytes <= host_budget) for p in held.probes)
    refused = next(p for p in held.probes if p.size == held.failed_size)
    assert refused.peak_bytes <= held.budget_bytes < refused.traced_peak_bytes  # the device would hold it
    assert "of host memory" in held.stopped
    frame = held.to_frame()
    assert (frame["host_budget_bytes"] == host_budget).all() and (frame["host_bytes"] > 0).any()


def test_by_default_offloads_may_take_half_of_this_machine_s_available_memory():
    found = ul.max_batch("mlp8", "100 MiB", policy="vdnn-all", limit=64, progress=False, hardware=H100)
    assert 0 < found.host_budget_bytes <= ul.devices.available_host_bytes()
    assert any("host memory" in note and "host_budget=" in note for note in found.notes)
    kept = ul.max_batch("mlp8", "100 MiB", limit=64, progress=False, hardware=H100)
    assert kept.host_budget_bytes is None  # keep-all: no offloads
    with pytest.raises(ValueError, match="host budget"):
        ul.max_batch("mlp8", "100 MiB", policy="vdnn-all", host_budget="lots", progress=False, hardware=H100)


def test_a_callable_builds_the_step_of_your_own_model():
    def step(batch: int) -> ul.Workload:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        return ul.Workload(model, torch.empty(batch, 64, device="meta"), name="own")

    budget = _peak(step(1000))
    found = ul.max_batch(step, budget, progress=False, hardware=H100)
    assert found.model_name == "own" and found.size >= 1000
    assert _peak(step(found.size)) <= budget < _peak(step(found.size + 1))


def test_a_callable_builds_the_step_at_each_sequence_length():
    def step(seq_len: int) -> ul.Workload:
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
        return ul.Workload(model, torch.zeros(2, seq_len, dtype=torch.long, device="meta"))

    budget = _peak(step(500))
    found = ul.max_seq_len(step, budget, multiple_of=10, progress=False, hardware=H100)
    assert found.model_name == "step" and found.dimension == "seq_len" and found.size >= 500
    assert _peak(step(found.size)) <= budget < _peak(step(found.size + 10))
    with pytest.raises(TypeError, match="batch is for a zoo name"):
        ul.max_seq_len(step, budget, batch=4, hardware=H100)


def test_the_longest_sequence_of_an_hf_model_fits_and_the_next_does_not():
    pytest.importorskip("transformers")

    def gpt2(seq_len: int) -> ul.Workload:
        return ul.zoo.get("hf:gpt2", batch=2, seq_len=seq_len, small=True, device="meta")

    budget = _peak(gpt2(100))
    found = ul.max_seq_len("hf:gpt2", budget, batch=2, start=64, multiple_of=4, small=True, progress=False,
                           hardware=H100)
    assert found.dimension == "seq_len" and found.model_name.startswith("hf:gpt2-small") and found.size >= 100
    assert found.size % 4 == 0 and found.failed_size == found.size + 4
    assert _peak(gpt2(found.size)) <= budget < _peak(gpt2(found.size + 4))
    assert "largest sequence length" in repr(found)


def test_the_search_stops_at_the_model_s_positions():
    pytest.importorskip("transformers")
    found = ul.max_seq_len("hf:gpt2", "1 GiB", small=True, config_overrides={"n_positions": 48}, start=32,
                            progress=False, hardware=H100)
    assert found.size == found.limit == 48 and found.failed_size is None
    assert "48 positions" in found.stopped and max(p.size for p in found.probes) == 48


def test_max_batch_passes_options_to_the_zoo():
    pytest.importorskip("transformers")
    def gpt2(batch: int) -> ul.Workload:
        return ul.zoo.get("hf:gpt2", batch=batch, seq_len=16, small=True, dtype=torch.bfloat16, device="meta")

    found = ul.max_batch("hf:gpt2", "4 MiB", seq_len=16, small=True, dtype=torch.bfloat16, progress=False,
                         hardware=H100)
    assert _peak(gpt2(found.size)) <= found.budget_bytes < _peak(gpt2(found.size + 1))
    float32 = ul.trace(ul.zoo.get("hf:gpt2", batch=1, seq_len=16, small=True, device="meta"), device="cuda")
    assert found.weights_bytes == _weights(ul.trace(gpt2(1), device="cuda")) < 0.6 * _weights(float32)


def test_a_limit_that_fits_is_the_answer():
    found = ul.max_batch("mlp3", "1 GiB", limit=10, progress=False, hardware=H100)
    assert found.size == 10 and found.failed_size is None and "the limit given" in found.stopped


def test_a_budget_above_the_hardware_s_memory_is_refused_naming_both():
    with pytest.raises(BudgetOverDevice, match=r"the budget 100\.00 GiB is more than the 24\.00 GiB .* l4 has"):
        ul.max_batch("mlp3", "100 GiB", hardware="l4", limit=2, progress=False)
    whole = ul.max_batch("mlp3", hardware="l4", limit=2, progress=False)  # the budget: all the L4 holds
    assert whole.budget_bytes == ul.Hardware.load("l4").memory_bytes and not any("holds" in n for n in whole.notes)


def test_when_even_the_smallest_batch_does_not_fit_it_says_what_it_needs():
    weights = 7_454_760  # mlp3's parameters, fp32
    found = ul.max_batch("mlp3", weights + (4 << 20), progress=False, hardware=H100)  # the weights fit, not the grads
    assert found.size == 0 and not found.fits and found.peak_bytes is None and found.failed_size == 1
    assert "not even batch 1 fits" in found.stopped and "no batch fits" in repr(found)


def test_a_budget_below_the_weights_says_what_they_take():
    with pytest.raises(BudgetTooSmall, match=r"weights of mlp3 alone take 7\.11 MiB, more than the 1\.00 MiB") as error:
        ul.max_batch("mlp3", "1 MiB", progress=False, hardware=H100)
    assert error.value.weights_bytes > 1 << 20


@pytest.mark.parametrize("budget, message", [(0, "more than 0 bytes"), (-5, "cannot read the budget"),
                                             ("lots", "cannot read the budget")])
def test_a_budget_that_is_not_positive_is_refused(budget, message):
    with pytest.raises(ValueError, match=message):
        ul.max_batch("mlp3", budget, hardware=H100)


def test_bad_requests_are_refused_with_what_to_do():
    with pytest.raises(UnknownModelError, match="the zoo knows"):
        ul.max_batch("resnet-9000x", "1 GiB", hardware=H100)
    with pytest.raises(UnknownModelError, match="unknown Hugging Face model"):
        ul.max_seq_len("hf:gpt-5", "1 GiB", hardware=H100)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        ul.max_batch("mlp3", "1 GiB", policy="fastest", hardware=H100)
    with pytest.raises(ValueError, match="max_seq_len searches the sequence length of 'hf:' text models"):
        ul.max_seq_len("mlp3", "1 GiB", hardware=H100)
    with pytest.raises(TypeError, match="leave batch out"):
        ul.max_batch("mlp3", "1 GiB", batch=4, hardware=H100)
    with pytest.raises(TypeError, match="options are for a zoo name"):
        ul.max_batch(_mlp, "1 GiB", seq_len=4, hardware=H100)
    with pytest.raises(ValueError, match="multiple_of must be a positive int"):
        ul.max_batch("mlp3", "1 GiB", multiple_of=0, hardware=H100)
    with pytest.raises(ValueError, match="limit 4 is below the first size to try, 8"):
        ul.max_batch("mlp3", "1 GiB", multiple_of=8, limit=4, hardware=H100)


def test_a_factory_that_ignores_the_size_is_refused():
    with pytest.raises(ValueError, match="same input .* for batch 1 and 2"):
        ul.max_batch(lambda batch: _mlp(1), "1 GiB", progress=False, hardware=H100)
    with pytest.raises(TypeError, match="gave a Sequential .* not a Workload"):
        ul.max_batch(lambda batch: torch.nn.Sequential(), "1 GiB", progress=False, hardware=H100)


def test_progress_shows_a_bar_when_asked(capsys):
    ul.max_batch("mlp3", "22 MiB", progress=True, hardware=H100)
    assert "largest batch of mlp3" in capsys.readouterr().err
    ul.max_batch("mlp3", "22 MiB", progress=False, hardware=H100)
    assert capsys.readouterr().err == ""


def test_without_hardware_a_search_predicts_gpu_memory_as_the_cli_and_memorylab_do(monkeypatch):
    from udnn_lab.fitting import maximum

    asked = []

    def resolve(hardware, device):
        asked.append((hardware, device))
        return ul.Hardware.load("h100-sxm")

    monkeypatch.setattr(maximum, "resolve_hardware", resolve)
    found = ul.max_batch("mlp3", "64MiB", limit=4)
    assert asked == [(None, "cuda")] and found.size >= 1


def _reserved(work: ul.Workload, chosen: ul.Plan | None = None) -> int:
    """The caching allocator model's reserved peak of the step (or its plan's), on its own."""
    from udnn_lab.planning.reserved import reserved_peak_bytes

    graph = ul.trace(work, device="cuda")
    chosen = chosen or ul.Plan.keep_all(graph)
    return reserved_peak_bytes(graph, chosen, ul.simulate(graph, chosen, hardware=H100))


def test_in_reserved_bytes_the_largest_batch_and_the_next_are_held_to_what_the_allocator_reserves():
    budget, outside = _peak(_mlp(6000)), 8 * 2**20
    found = ul.max_batch("mlp3", budget, progress=False, hardware=H100, counts="reserved", outside_bytes=outside)
    allocated = ul.max_batch("mlp3", budget, progress=False, hardware=H100)
    assert 0 < found.size < allocated.size  # the allocator reserves more than it hands out, and the context too
    assert found.peak_bytes == _reserved(_mlp(found.size)) + outside <= budget
    assert _reserved(_mlp(found.failed_size)) + outside > budget
    assert "counted as reserved bytes" in found.notes[-1]
    with pytest.raises(ValueError, match="needs a CUDA profile"):
        ul.max_batch("mlp3", "1 GiB", progress=False, hardware="cpu-amd-epyc-2cpu", counts="reserved")

"""MemoryLab's precision and Hugging Face controls (sequence length, LoRA rank, attention), set as a user sets them."""

import pytest

import udnn_lab as ul
from tests.widgets.test_widgets import categories, chart_title, peak_of, predicted_peak, rows
from udnn_lab.widgets.app import MemoryLab


def traced_peak(name: str, **options) -> int:
    return ul.trace(ul.zoo.get(name, device="meta", **options), device="cuda").cuda_peak_bytes


def title(lab: MemoryLab) -> str:
    return chart_title(lab)


def most(lab: MemoryLab, category: str) -> int:
    """The most bytes the memory chart shows in ``category`` over the step."""
    return max(r["bytes"] for r in rows(lab.memory_and_streams)
               if r.get("series") == "predicted" and r.get("category") == category)


@pytest.fixture
def llama():
    """The zoo's small Llama-3 (2 layers, hidden 64), a full fine-tune with AdamW."""
    return MemoryLab("hf:llama-3-8b-small", batch=2, seq_len=64, optimizer="adamw", policy="keep-all",
                     hardware="h100-sxm", debounce_s=0)


def test_bf16_mixed_changes_the_peak_adds_weight_casts_and_keeps_the_budget():
    lab = MemoryLab("mlp5", batch=8, policy="vdnn-all", hardware="h100-sxm", debounce_s=0)
    assert lab.precision.value == "32-true" and "weight_cast" not in categories(lab)
    before, shown = peak_of(lab), predicted_peak(lab)
    lab.budget.value = lab.budget.max  # above the peak
    chosen = lab.budget_bytes
    lab.precision.value = "bf16-mixed"
    assert lab.status.value == ""
    assert peak_of(lab) == traced_peak("mlp5", batch=8, optimizer="sgd", precision="bf16-mixed") != before
    assert predicted_peak(lab) != shown and "weight_cast" in categories(lab)
    assert lab.budget_bytes == chosen  # a larger peak: the user's budget is in range and stays
    assert ", bf16-mixed:" in title(lab)
    lab.precision.value = "32-true"
    assert peak_of(lab) == before and "weight_cast" not in categories(lab)


def test_the_small_hf_models_are_offered_and_the_hf_controls_follow_the_network():
    lab = MemoryLab("mlp5", batch=8, policy="keep-all", hardware="h100-sxm", debounce_s=0)
    offered = list(lab.network.options)
    assert {"hf:gpt2-small", "hf:llama-3-8b-small"} <= set(offered)
    assert offered.index("hf:gpt2-small") < offered.index("hf:gpt2")  # the ones a CPU runs come first
    assert lab.seq_len.disabled and lab.lora_rank.disabled and lab.attention.disabled
    traced = len(lab.session._graphs)
    lab.seq_len.value = 128  # disabled: no part of this step, nothing traced again
    assert lab.setting.seq_len is None and len(lab.session._graphs) == traced
    lab.network.value = "hf:llama-3-8b-small"
    assert not (lab.seq_len.disabled or lab.lora_rank.disabled or lab.attention.disabled)
    assert lab.status.value == ""
    assert lab.session.graph(lab.setting).model_name == "hf:llama-3-8b-small (sdpa attention)"
    assert peak_of(lab) == traced_peak("hf:llama-3-8b", small=True, batch=8, seq_len=128, optimizer="sgd",
                                       attn_implementation="sdpa")
    assert title(lab).startswith("hf:llama-3-8b-small (sdpa attention), batch 8, 128 tokens: keep-all")
    lab.network.value = "hf:vit-b-16-small"  # images: no sequence length
    assert lab.seq_len.disabled and not lab.lora_rank.disabled and lab.status.value == ""
    assert lab.setting.seq_len is None and "tokens" not in title(lab)


def test_lora_rank_8_holds_less_optimizer_state_than_a_full_fine_tune(llama):
    full = most(llama, "optimizer_state")
    assert full == llama.session.graph(llama.setting).breakdown().loc["optimizer_state", "max_bytes"]
    llama.lora_rank.value = 8
    assert llama.status.value == "" and llama.setting.lora_rank == 8
    assert "hf:llama-3-8b-small (sdpa attention, LoRA r=8)" in title(llama)
    lora = most(llama, "optimizer_state")
    assert 0 < lora < full / 10
    assert lora == ul.trace(ul.zoo.get("hf:llama-3-8b", small=True, batch=2, seq_len=64, optimizer="adamw",
                                       lora_rank=8, device="meta"), device="cuda").breakdown().loc[
        "optimizer_state", "max_bytes"]
    llama.lora_rank.value = 0  # a full fine-tune again
    assert most(llama, "optimizer_state") == full and llama.setting.lora_rank is None


def test_sequence_length_and_attention_trace_again_and_keep_the_budget(llama):
    llama.budget.value = llama.budget.max * 0.9
    chosen, short = llama.budget_bytes, peak_of(llama)
    llama.seq_len.value = 128
    longer = peak_of(llama)
    assert longer == traced_peak("hf:llama-3-8b", small=True, batch=2, seq_len=128, optimizer="adamw") > short
    assert llama.budget_bytes == chosen and ", 128 tokens" in title(llama)
    llama.attention.value = "eager"  # keeps the seq x seq scores for backward
    assert "(eager attention)" in title(llama)
    assert peak_of(llama) == traced_peak("hf:llama-3-8b", small=True, batch=2, seq_len=128, optimizer="adamw",
                                         attn_implementation="eager") > longer
    assert llama.budget_bytes == chosen


def test_a_sequence_longer_than_the_models_positions_is_an_error_in_the_app():
    lab = MemoryLab("hf:gpt2-small", batch=2, seq_len=64, policy="keep-all", debounce_s=0)
    spec = lab.memory_and_streams.spec
    lab.seq_len.value = 2048
    assert "seq_len must be between 1 and 1024" in lab.status.value
    assert lab.memory_and_streams.spec == spec
    lab.seq_len.value = 1024
    assert lab.status.value == ""


def test_measure_runs_a_small_hf_step_on_this_machine(llama):
    llama.measure()
    assert "measured on" in llama.status.value
    measured = [r for r in rows(llama.memory_and_streams) if r.get("series") == "measured"]
    assert measured and max(r["bytes"] for r in measured) > 0


@pytest.mark.parametrize("options, message", [
    ({"precision": "fp8"}, "unknown precision 'fp8': use one of 32-true, bf16-mixed"),
    ({"lora_rank": -1}, "an int of 0 or more, got -1"),
    ({"seq_len": 0}, "seq_len is the tokens per example of an hf: network: a positive int, got 0"),
    ({"attn_implementation": "flash"}, "unknown attn_implementation 'flash': use one of sdpa, eager"),
])
def test_bad_step_options_are_refused_with_what_to_give(options, message):
    with pytest.raises(ValueError, match=message):
        MemoryLab("mlp5", batch=8, debounce_s=0, **options)


def test_ranks_and_world_size_chart_one_rank_and_keep_the_budget():
    lab = MemoryLab("mlp5", batch=8, optimizer="adam", policy="keep-all", hardware="h100-sxm", debounce_s=0)
    assert lab.ranks.value == "one GPU" and lab.world_size.disabled
    one_gpu = peak_of(lab)
    lab.budget_entry.value = "2 MiB"  # below every rank's peak: in range whatever the world size
    chosen = lab.budget_bytes
    traced = len(lab.session._graphs)
    lab.world_size.value = 4  # disabled: no part of the step
    assert lab.setting.parallel is None and len(lab.session._graphs) == traced
    lab.ranks.value = "FSDP2"
    assert not lab.world_size.disabled and "Error" not in lab.status.value  # keep-all does not fit 2 MiB: said
    expected = ul.trace(ul.zoo.get("mlp5", batch=8, optimizer="adam", device="meta"), device="cuda",
                        parallel=ul.FSDP(4))
    assert peak_of(lab) == expected.cuda_peak_bytes < one_gpu
    assert "communication" in categories(lab) and ", one rank of FSDP2 x 4:" in title(lab)
    assert lab.budget_bytes == chosen
    lab.world_size.value = 16
    assert peak_of(lab) < expected.cuda_peak_bytes
    lab.measure()  # a rank of 16 is not a step this one process can run
    assert "set ranks to &#x27;one GPU&#x27;" in lab.status.value
    lab.ranks.value = "one GPU"
    assert peak_of(lab) == one_gpu


def test_an_hsdp_world_that_is_not_whole_nodes_is_an_error_in_the_app():
    lab = MemoryLab("mlp5", batch=8, policy="keep-all", hardware="h100-sxm", debounce_s=0, parallel="HSDP",
                    world_size=12)
    assert "not whole nodes" in lab.status.value
    with pytest.raises(ValueError, match="unknown parallel setup"):
        MemoryLab("mlp5", parallel="ZeRO")


def test_train_with_ranks_starts_them_here_and_charts_rank_0s_steps():
    lab = MemoryLab("mlp3", batch=4, optimizer="adam", policy="keep-all", hardware="h100-sxm", debounce_s=0,
                    parallel="DDP", world_size=2)
    lab.budget.value = lab.budget.max  # this machine's CPU step is a little larger than the CUDA one on screen
    lab.train(steps=2, wait=True)
    run = lab.training.run
    assert run is not None and len(run.steps) == 2, lab.status.value
    assert "on 2 ranks" in lab.status.value and (run.steps["peak_bytes_rank1"] > 0).all()
    assert lab.training.chart.chart is not None and "gloo" in run.notes[0]
    lab.world_size.value = 64
    lab.train(steps=1, wait=True)
    assert "lower the world size to train here" in lab.status.value


def test_fsdp_parameters_on_the_host_are_a_switch_of_sharded_ranks_and_the_summary_says_how_much():
    lab = MemoryLab("mlp5", batch=8, optimizer="adam", policy="keep-all", hardware="h100-sxm", debounce_s=0,
                    parallel="DDP", world_size=4)
    assert lab.offload_params.disabled and not lab.setting.offload_params
    lab.offload_params.value = True  # DDP has no such policy: the step is the same
    assert not lab.setting.offload_params and "host memory" not in lab.summary.value
    on_device = peak_of(lab)
    lab.ranks.value = "FSDP2"
    assert not lab.offload_params.disabled and lab.setting.offload_params
    work = ul.zoo.get("mlp5", batch=8, optimizer="adam", device="meta")
    expected = ul.trace(work, device="cuda", parallel=ul.FSDP(4, offload_params=True))
    assert peak_of(lab) == expected.cuda_peak_bytes < on_device
    assert f"host memory <b>{ul.format_bytes(expected.host_peak_bytes)}</b>" in lab.summary.value
    assert ", parameters on host" in title(lab)
    lab.world_size.value = 2
    lab.train(steps=1, wait=True)  # this machine's ranks run on its CPU, which is the host
    assert "train them without offload_params here" in lab.status.value
    lab.world_size.value = 4
    lab.offload_params.value = False
    assert peak_of(lab) == ul.trace(work, device="cuda", parallel=ul.FSDP(4)).cuda_peak_bytes
    assert "host memory" not in lab.summary.value
    with pytest.raises(ValueError, match="offload_params is True or False"):
        MemoryLab("mlp5", parallel="FSDP2", offload_params="yes")

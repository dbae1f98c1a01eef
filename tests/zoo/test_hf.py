"""Attention implementations of the Hugging Face zoo models: each traced exactly, and eager's cost in memory."""

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.vocabulary import ATTENTION_IMPLEMENTATIONS
from udnn_lab.zoo import hf_configs

transformers = pytest.importorskip("transformers", reason="Hugging Face models need udnn_lab[hf] (transformers)")

MOE = {"hf:qwen1.5-moe-a2.7b", "hf:mixtral-8x7b"}  # their experts trace in bfloat16 only (see test_zoo_hf.py)
FAMILIES = list({hf_configs.spec(name).model_class: name for name in reversed(hf_configs.names())}.values())[::-1]


def _small(name, **options):
    length = {} if "vit" in name else {"seq_len": 32}
    dtype = {"dtype": torch.bfloat16} if name in MOE else {}
    return {"batch": 2, "small": True, **length, **dtype, **options}


def _predicted_and_measured(name, **options):
    graph = ul.trace(zoo.get(name, device="meta", **_small(name, **options)))
    summary = ul.measure(zoo.get(name, **_small(name, **options)), repeats=0, graph=graph).summary(graph)
    return graph, summary


@pytest.mark.parametrize("name", FAMILIES)
def test_eager_attention_of_each_family_is_predicted_exactly_on_cpu(name):
    graph, summary = _predicted_and_measured(name, attn_implementation="eager")
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary
    assert graph.model_name.endswith("(eager attention)")


def test_eager_attention_at_a_longer_sequence_costs_more_than_sdpa_by_its_seq_by_seq_scores():
    # Llama has no attention dropout, so torch's CPU SDPA runs its flash kernel, which saves no seq x seq tensor;
    # eager attention saves its softmax (batch x heads x seq x seq, float32) in each layer for backward
    batch, heads, seq, layers = 2, 4, 512, 2
    peaks = {}
    for attention in ("sdpa", "eager"):
        graph, summary = _predicted_and_measured("hf:llama-3-8b", seq_len=seq, attn_implementation=attention)
        assert summary["peak_relative_error"] == 0, summary
        peaks[attention] = summary["measured_peak_bytes"]
        scores = [t for t in graph.tensors if t.saved and t.shape == (batch, heads, seq, seq)]
        assert (len(scores) >= layers) == (attention == "eager"), (attention, len(scores))
    scores_bytes = layers * batch * heads * seq * seq * 4
    # measured on CPU: peak 31,920,028 bytes with sdpa, 49,713,052 with eager (+17,793,024; the softmaxes: 16,777,216)
    assert peaks["eager"] - peaks["sdpa"] >= scores_bytes, peaks


def test_by_default_transformers_picks_and_the_name_says_which():
    work = zoo.get("hf:gpt2", batch=1, seq_len=8, small=True, device="meta")
    picked = work.model.config._attn_implementation
    assert picked in ATTENTION_IMPLEMENTATIONS and work.name == f"hf:gpt2-small ({picked} attention)"
    assert f"({picked} attention)" in repr(work)
    eager = zoo.get("hf:gpt2", batch=1, seq_len=8, small=True, device="meta", attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager" and eager.name == "hf:gpt2-small (eager attention)"
    same = zoo.get("hf:gpt2", batch=1, seq_len=8, small=True, device="meta", attn_implementation="eager",
                   config_overrides={"attn_implementation": "eager"})
    assert same.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("options, message", [
    ({"attn_implementation": "flash"}, "unknown attn_implementation 'flash': use one of sdpa, eager"),
    ({"attn_implementation": "sdpa", "config_overrides": {"attn_implementation": "eager"}}, "disagree"),
])
def test_a_bad_attention_request_says_what_to_give(options, message):
    with pytest.raises(ValueError, match=message):
        zoo.get("hf:llama-3-8b", batch=1, seq_len=8, small=True, device="meta", **options)
    with pytest.raises(ValueError, match="attn_implementation is for Hugging Face models"):
        zoo.get("mlp2", batch=1, attn_implementation="eager")

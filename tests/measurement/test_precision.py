"""Today's training steps predicted against measured on a CPU: each precision, each optimizer, clipping and
gradient accumulation, on a CNN of the zoo and a small config of each Hugging Face family."""

import pytest

import udnn_lab as ul
from udnn_lab import zoo

# (model, zoo options, step options): every precision and every optimizer at least once, hf families included
CASES = [
    ("resnet18", {"image_size": 32, "precision": "bf16-mixed", "optimizer": "sgd"}, {}),
    ("resnet20", {"precision": "bf16-true", "optimizer": "adamw-fused"}, {"clip_grad_norm": 1.0}),
    ("resnet20", {"precision": "16-mixed", "optimizer": "adamw-foreach"}, {"grad_accumulation": 2}),
    ("hf:gpt2", {"precision": "16-mixed", "optimizer": "adamw-fused"}, {"clip_grad_norm": 1.0}),
    ("hf:gpt2", {"precision": "32-true", "optimizer": "adamw-foreach"},
     {"grad_accumulation": 2, "clip_grad_norm": 0.5}),
    ("hf:llama-3-8b", {"precision": "bf16-mixed", "optimizer": "adamw-foreach"}, {"grad_accumulation": 2}),
    ("hf:mistral-7b", {"precision": "bf16-true", "optimizer": "adamw"}, {}),
    ("hf:qwen2.5-7b", {"precision": "16-mixed", "optimizer": "adafactor"}, {"grad_accumulation": 2}),
    ("hf:bert-base", {"precision": "bf16-mixed", "optimizer": "adafactor"}, {"clip_grad_norm": 1.0}),
    ("hf:vit-b-16", {"precision": "16-mixed", "optimizer": "sgd"}, {"grad_accumulation": 2, "clip_grad_norm": 1.0}),
]


def _options(name, options):
    size = {} if not name.startswith("hf:") else {"small": True} if "vit" in name else {"small": True, "seq_len": 32}
    return {"batch": 2, **size, **options}


@pytest.mark.parametrize("name, options, step", CASES,
                         ids=[f"{c[0]}-{c[1]['precision']}-{c[1]['optimizer']}-{'-'.join(c[2]) or 'plain'}"
                              for c in CASES])
def test_predicted_peak_is_the_measured_one(name, options, step):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    graph = ul.trace(zoo.get(name, device="meta", **_options(name, options)), **step)
    work = zoo.get(name, **_options(name, options))
    summary = ul.measure(work, graph=graph, **step).summary(graph)
    assert summary["ops"] == len(graph.ops)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary
    if options["precision"].endswith("-mixed"):
        assert graph.breakdown().loc["weight_cast", "max_bytes"] > 0

"""The trainer callbacks on models they were not written for: every hf: zoo config in Hugging Face's Trainer, and
torchvision and timm classifiers in Lightning, each in 32-true and bf16-mixed (on the CPU at small sizes, one
thread; with --device cuda at the sizes people train), under every quick policy that moves
something at a budget midway between its least and the keep-all peak.

For each run: the parameters after three steps against the same run without the callback (torch.equal), the
plan's actions, the budget, the predicted peak and the peak one steady step measured (on the CPU: counted op by
op), and the steps that ran planned. A keep-all callback's trace of the same trainer gives the peak the budget is
made from. Rows are written as they come (JSON lines beside the summary).

Target: every run's parameters equal; every measured peak within the budget plus the few bytes the trainers hold
outside the traced step (a scalar or two: Hugging Face's running loss is one), and within 1% of the predicted peak.

    python benchmarks/trainer_callbacks.py [--quick] [--device cuda] [--models hf:gpt2 resnet50]
                                           [--out data/benchmarks/trainer_callbacks.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

import udnn_lab as ul

HF_MODELS = [name for name in ul.zoo.names() if name.startswith("hf:")]
VISION_MODELS = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "swin_t", "densenet121",
                 "regnet_y_400mf", "timm:resnet26d", "timm:efficientvit_b0", "timm:mobilevitv2_050",
                 "timm:convnextv2_atto"]
PRECISIONS = ["32-true", "bf16-mixed"]
POLICIES = ["auto", "recompute", "vdnn++"]
STEPS = 3
SIZES = {"cpu": {"batch": 2, "seq_len": 32, "images": 4, "side": 64, "small": True},  # one CPU thread
         "cuda": {"batch": 8, "seq_len": 1024, "images": 64, "side": 224, "small": False}}  # the sizes people train


def _hf_run(name: str, precision: str, device: str):
    """A function (callback or None) -> the trained model, for an hf: zoo config in a Hugging Face Trainer."""
    import transformers  # the benchmark's own framework imports, loaded when a run needs them

    size = SIZES[device]
    text = {} if name == "hf:vit-b-16" else {"seq_len": size["seq_len"]}
    work = ul.zoo.get(name, small=size["small"], batch=size["batch"], **text)
    state = copy.deepcopy(work.model.state_dict())
    example = work.example_input

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return size["batch"] * STEPS

        def __getitem__(self, index):
            generator = torch.Generator().manual_seed(index)
            item = {key: value[0].clone() for key, value in example.items()}
            if "input_ids" in item:
                item["input_ids"] = torch.randint(0, 100, item["input_ids"].shape, generator=generator)
                if "labels" in item:
                    item["labels"] = item["input_ids"].clone()
            return item

    def run(callback):
        torch.manual_seed(0)
        model = type(work.model)(work.model.config)
        model.load_state_dict(state)
        args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=device == "cpu",
                                              bf16=precision != "32-true", per_device_train_batch_size=size["batch"],
                                              max_steps=STEPS, report_to=[], save_strategy="no", disable_tqdm=True,
                                              logging_steps=100)
        transformers.Trainer(model=model, args=args, train_dataset=Items(),
                             callbacks=[callback] if callback else []).train()
        return model
    return run, ul.integrations.HFPlanCallback


def _vision_run(name: str, precision: str, device: str):
    """The same for a torchvision or timm classifier in a Lightning Trainer."""
    import lightning as L  # the benchmark's own framework imports, loaded when a run needs them

    if name.startswith("timm:"):
        import timm

        base = timm.create_model(name.removeprefix("timm:"), num_classes=10, pretrained=False)
    else:
        import torchvision

        base = getattr(torchvision.models, name)(num_classes=10)

    class Classifier(L.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            images, labels = batch
            loss = torch.nn.functional.cross_entropy(self.net(images), labels)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    size = SIZES[device]
    count, side = size["images"] * STEPS, size["side"]
    images = torch.randn(count, 3, side, side, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (count,), generator=torch.Generator().manual_seed(2))
    data = torch.utils.data.TensorDataset(images, labels)

    def run(callback):
        torch.manual_seed(0)
        module = Classifier(copy.deepcopy(base))
        L.Trainer(max_steps=STEPS, accelerator=device, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, precision=precision,
                  callbacks=[callback] if callback else []).fit(module, torch.utils.data.DataLoader(data,
                                                                                 batch_size=size["images"]))
        return module
    return run, ul.integrations.LightningPlanCallback


def one_setup(name: str, precision: str, policies: list[str], device: str):
    """A row per policy for one model and precision."""
    made = _hf_run if name.startswith("hf:") else _vision_run
    run, callback_class = made(name, precision, device)
    room = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else "20 GiB"
    probe = callback_class(room, policy="keep-all")  # the trainer's step as it traces it
    run(probe)
    graph = probe.steps.graph
    for policy in policies:
        row = {"model": name, "precision": precision, "policy": policy,
               "trainer": "transformers.Trainer" if name.startswith("hf:") else "lightning.Trainer"}
        started = time.perf_counter()
        try:
            budget = (graph.peak_bytes + ul.min_budget(graph, policy)) // 2
            callback = callback_class(budget, policy=policy)
            planned, eager = run(callback), run(None)
            steady = [r for r in callback.reports if r.measured_peak_bytes is not None]
            row.update(equal=all(torch.equal(a, b) for a, b in zip(planned.parameters(), eager.parameters())),
                       offloads=len(callback.plan.offloads), recomputes=len(callback.plan.recomputes),
                       budget_bytes=budget, predicted_peak_bytes=callback.reports[0].predicted_peak_bytes,
                       measured_peak_bytes=steady[-1].measured_peak_bytes if steady else None,  # the last: steady
                       planned_steps=sum(r.planned for r in callback.reports), steps=len(callback.reports))
        except Exception as error:  # a row says what failed; the corpus goes on
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"
        row["seconds"] = round(time.perf_counter() - started, 2)
        yield row


def summary(rows: list[dict]) -> dict:
    done = [r for r in rows if "error" not in r]
    measured = [r for r in done if r["measured_peak_bytes"] is not None]
    return {"runs": len(rows), "errors": len(rows) - len(done), "parameters_equal": sum(r["equal"] for r in done),
            "acting": sum(bool(r["offloads"] or r["recomputes"]) for r in done),
            "largest_bytes_over_predicted": max((r["measured_peak_bytes"] - r["predicted_peak_bytes"]
                                                 for r in measured), default=None),
            "largest_bytes_over_budget": max((r["measured_peak_bytes"] - r["budget_bytes"] for r in measured),
                                             default=None),
            "largest_relative_error": max((abs(r["measured_peak_bytes"] / r["predicted_peak_bytes"] - 1)
                                           for r in measured), default=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one Hugging Face and one Lightning setup, one policy")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the sizes people train (1024 tokens, 224 px), every step's peak from CUDA")
    parser.add_argument("--models", nargs="+", help="these models only (hf: zoo names, torchvision or timm: names)")
    parser.add_argument("--out", type=Path, default=Path("data/benchmarks/trainer_callbacks.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    models = args.models or (["hf:gpt2", "resnet18"] if args.quick else HF_MODELS + VISION_MODELS)
    precisions = ["32-true"] if args.quick else PRECISIONS
    policies = ["recompute"] if args.quick else POLICIES
    lines = args.out.with_suffix(".jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines.write_text("")
    rows: list[dict] = []
    print(f"{'model':24} {'precision':10} {'policy':9} {'equal':>5} {'actions':>7} {'predicted':>12} {'measured':>12}")
    for name in models:
        for precision in precisions:
            for row in one_setup(name, precision, policies, args.device):
                rows.append(row)
                with lines.open("a") as out:
                    out.write(json.dumps(row) + "\n")
                if "error" in row:
                    print(f"{name:24} {precision:10} {row['policy']:9} {row['error']}")
                else:
                    print(f"{name:24} {precision:10} {row['policy']:9} {str(row['equal']):>5} "
                          f"{row['offloads'] + row['recomputes']:>7} {row['predicted_peak_bytes']:>12} "
                          f"{row['measured_peak_bytes'] if row['measured_peak_bytes'] is not None else '-':>12}",
                          flush=True)
    document = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"cpu": platform.processor() or platform.machine(), "python": sys.version.split()[0],
                            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                            "torch": torch.__version__, "udnn_lab": ul.__version__, "threads": 1},
                "summary": summary(rows), "rows": rows}
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print("targets: every run's parameters equal to eager's; measured peak within 1% of predicted:",
          json.dumps(document["summary"]))


if __name__ == "__main__":
    main()

"""A Lightning job of two CPU ranks under ModelParallelStrategy, its module sharded with fully_shard in
configure_model, fit with and without LightningPlanCallback; rank 0 writes what both runs gave to argv[1].
argv[2:5]: the budget, the policy, and the module ('blocks': an MLP of Sequential blocks; 'gpt2': a small GPT-2
trained as a language model, each GPT2Block sharded; 'gpt2-bf16': the same sharded with parameters gathered in
bf16 and gradients reduced in float32, two micro-batches a step and gradients clipped).

Run as a script (Lightning's launcher starts the second rank by running it again), by test_lightning.py.
"""

import json
import logging
import sys
import warnings

import torch

warnings.simplefilter("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from udnn_lab.graph.reruns import NOT_RERUN  # noqa: E402
from udnn_lab.integrations import LightningPlanCallback  # noqa: E402

FEATURES, BATCH, BATCHES = 64, 256, 8  # four steps a rank (two ranks)
BLOCKS = 4


class Blocks(L.LightningModule):
    def __init__(self):
        super().__init__()

        def block():
            return torch.nn.Sequential(torch.nn.Linear(FEATURES, 2 * FEATURES), torch.nn.GELU(),
                                       torch.nn.Linear(2 * FEATURES, FEATURES), torch.nn.GELU())

        self.net = torch.nn.Sequential(*[block() for _ in range(BLOCKS)], torch.nn.Linear(FEATURES, 10))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.net[:BLOCKS]:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SmallGPT2(L.LightningModule):
    def __init__(self, mp_policy: MixedPrecisionPolicy | None = None):
        super().__init__()
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                         use_cache=False)  # as in training: no cache object among a block's arguments
        self.gpt = transformers.GPT2LMHeadModel(config)

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.gpt.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=self.mp_policy)
        fully_shard(self.gpt, mesh=mesh, mp_policy=self.mp_policy)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.gpt(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data(module: str) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    if module.startswith("gpt2"):
        tensors = (torch.randint(0, 128, (4 * BATCHES, 32), generator=generator),)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*tensors), batch_size=4)
    x = torch.randn(BATCH * BATCHES, FEATURES, generator=generator)
    y = torch.randint(0, 10, (BATCH * BATCHES,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def fit(callbacks, module: str):
    torch.manual_seed(0)
    options = {}
    if module == "gpt2-bf16":
        model = SmallGPT2(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        options = dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
    else:
        model = SmallGPT2() if module == "gpt2" else Blocks()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=2, callbacks=callbacks, logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **options)
    trainer.fit(model, _data(module))
    return model, trainer


def main(out: str, budget: str, policy: str, module: str) -> None:
    callback = LightningPlanCallback(budget, policy=policy, hardware="cpu-amd-epyc-2cpu")
    planned, trainer = fit([callback], module)
    eager, _ = fit([], module)
    same = [torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(planned.parameters(), eager.parameters())]
    gpt = module.startswith("gpt2")
    block = planned.gpt.transformer.h[0] if gpt else planned.net[0]
    if trainer.global_rank == 0:
        reports, graph = callback.reports, callback.steps.graph
        measured = [r.measured_peak_bytes for r in reports if r.measured_peak_bytes is not None]
        with open(out, "w") as f:
            json.dump({"same_parameters": all(same), "parameters": len(same),
                       "recomputes": len(callback.plan.recomputes),
                       "reruns": sum(enter != NOT_RERUN for enter in callback.plan.reruns_in(graph)),
                       "planned_steps": sum(r.planned for r in reports), "steps": len(reports),
                       "predicted_peak": callback.steps.predicted_peak_bytes, "measured_peaks": measured,
                       "block_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
                       "blocks": len(planned.gpt.transformer.h) if gpt else BLOCKS,
                       "note": graph.notes[0]}, f)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:5])
    finally:
        # Lightning leaves its gloo group up: torn down by the interpreter's exit, its threads have aborted a rank
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

"""A Lightning job of two CPU ranks under ModelParallelStrategy, its module sharded with fully_shard in
configure_model, fit with and without LightningPlanCallback; rank 0 writes what both runs gave to argv[1].

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
from torch.distributed.fsdp import fully_shard  # noqa: E402

from udnn_lab.integrations import LightningPlanCallback  # noqa: E402

FEATURES, BATCH, BATCHES = 64, 256, 8  # four steps a rank
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


def fit(callbacks):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * BATCHES, FEATURES, generator=generator)
    y = torch.randint(0, 10, (BATCH * BATCHES,), generator=generator)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    module = Blocks()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=2, callbacks=callbacks, logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return module, trainer


def main(out: str, budget: str, policy: str) -> None:
    callback = LightningPlanCallback(budget, policy=policy, hardware="cpu-amd-epyc-2cpu")
    planned, trainer = fit([callback])
    eager, _ = fit([])
    same = [torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(planned.parameters(), eager.parameters())]
    block_bytes = sum(p.numel() * p.element_size() for p in planned.net[0].parameters())
    if trainer.global_rank == 0:
        reports = callback.reports
        measured = [r.measured_peak_bytes for r in reports if r.measured_peak_bytes is not None]
        with open(out, "w") as f:
            json.dump({"same_parameters": all(same), "parameters": len(same),
                       "recomputes": len(callback.plan.recomputes), "planned_steps": sum(r.planned for r in reports),
                       "steps": len(reports), "predicted_peak": callback.steps.predicted_peak_bytes,
                       "measured_peaks": measured, "block_bytes": block_bytes, "note": callback.steps.graph.notes[0]},
                      f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

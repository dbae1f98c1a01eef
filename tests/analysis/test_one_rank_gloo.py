"""Each rank's measured live bytes against ``trace(..., parallel=spec)``: real DDP and FSDP2 ranks, gloo on CPU.

One spawn of four ranks measures every case on two of them (and a few on all four) the way ``ul.measure``
counts (live storages after each op); this process traces each rank of each case in a fake process group.
Two things of gloo's own are set aside, and only those (``_gloo_view``):
  1. gloo's reduce-scatter copies its input into a buffer of its own on its worker thread, and in
     ``work.wait()`` splits it and copies this rank's chunk into the output (``aten.split``, ``aten.copy_``
     right after ``c10d._reduce_scatter_base_``). NCCL reduces in place, and so does the trace. Those two ops,
     and that buffer, are taken out of the measured run.
  2. gloo's worker thread drops its reference to a finished collective's tensors on its own schedule, so
     a communication buffer can outlive FSDP's last reference in the real run, by a few ops or by many on a
     busy machine (NCCL's watchdog thread does the same on a GPU). Releases of "communication" storages may
     therefore come later in the measured run, never earlier; every allocation, and every other release,
     must be at the very op the trace says, so the measured curve is the trace's plus exactly those
     buffers while gloo held them, and the trace's to the byte where gloo let go in time.
  3. gloo completes a collective on its worker thread, and a communication hook's callback runs there too
     (fp16_compress_hook's copy of the reduced half-precision bucket back into the bucket): the measured run,
     which counts this rank's own thread, does not see it. The trace's ``aten.copy_`` into the bucket right after
     a bucket's all-reduce is set aside, and what it releases taken as released by the all-reduce: the
     callback may run as soon as gloo has reduced, before this rank's next op (and later, 2).
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import same_optimizer
from udnn_lab.graph.liveness import op_table
from udnn_lab.parallel import DDP, FSDP
from udnn_lab.vocabulary import CATEGORIES

from ..spawned_ranks import spawned

BF16_GATHER = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CASES = {  # name: (zoo model, spec for a world size)
    "mlp3 DDP": ("mlp3", lambda world: DDP(world)),
    "mlp3 DDP, fp16 compressed": ("mlp3", lambda world: DDP(world, bucket_cap_mb=0.1, comm_hook="fp16_compress")),
    "mlp3 FSDP": ("mlp3", lambda world: FSDP(world)),
    "mlp3 FSDP, no reshard": ("mlp3", lambda world: FSDP(world, reshard_after_forward=False)),
    "mlp3 FSDP, bf16 all-gather": ("mlp3", lambda world: FSDP(world, mp_policy=BF16_GATHER)),
    "resnet20 DDP": ("resnet20", lambda world: DDP(world)),
    "resnet20 FSDP": ("resnet20", lambda world: FSDP(world)),
    "gpt2-small FSDP": ("hf:gpt2", lambda world: FSDP(world)),
    "mlp3 HSDP": ("mlp3", lambda world: FSDP(world, replicate=2)),  # 2 replicas x 2 shards
}
RANKS = 4  # one spawn: every case on ranks 0 and 1, three on all four (uneven shards: 10 rows over 4; HSDP 2 x 2)
RUNS = [(2, case) for case in CASES if case != "mlp3 HSDP"] + [(RANKS, case) for case in
                                                                 ("mlp3 DDP", "mlp3 FSDP", "mlp3 HSDP")]
_COMMUNICATION = CATEGORIES.index("communication")
_REDUCE_SCATTER, _SPLIT, _COPY = "c10d._reduce_scatter_base_.default", "aten.split.Tensor", "aten.copy_.default"
_ALL_REDUCE = "c10d.allreduce_.default"


def _workload(name: str) -> ul.Workload:
    if name.startswith("hf:"):
        return zoo.get(name, batch=2, seq_len=32, small=True, optimizer="adam", seed=0)
    return zoo.get(name, batch=4, optimizer="adam", seed=0)


def _rank(rank: int, store: str, out: str) -> None:
    """One real rank of four: for each run, wrap the case's model as its spec says (two-rank runs on ranks 0
    and 1, in a group of their own), measure a step after two warm-up steps (DDP rebuilds its buckets in the
    second), and leave the recorded steps in ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    try:
        groups = {2: dist.new_group([0, 1]), RANKS: dist.group.WORLD}
        recorded = {}
        for world, case in RUNS:
            if rank >= world:
                continue
            name, spec = CASES[case]
            work = _workload(name)
            model = _wrapped(spec(world), work.model, groups[world])
            optimizer = same_optimizer(work.optimizer, [{"params": list(model.parameters())}])
            measured = ul.measure(model, work.example_input, work.loss_fn, optimizer, target=work.target,
                                  warmup=2, name=case)
            recorded[world, case] = measured.recorded
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(recorded))


def _wrapped(spec: DDP | FSDP, model: torch.nn.Module, group: dist.ProcessGroup) -> torch.nn.Module:
    if isinstance(spec, DDP):
        return spec.apply(model, process_group=group)
    if spec.replicate > 1:  # HSDP's 2-D mesh, over every rank: the default group
        assert group is dist.group.WORLD
        return spec.apply(model)
    return spec.apply(model, mesh=DeviceMesh.from_group(group, "cpu"))


def _spawned(out: Path) -> list[dict[tuple[int, str], ul.Graph]]:
    """Each rank's measured steps of every run; no rank outlives this call, whatever happens."""
    spawned(_rank, (str(out / "store"), str(out)), RANKS)
    return [pickle.loads(Path(out, f"rank{rank}.pkl").read_bytes()) for rank in range(RANKS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(world size, case): [(traced Graph, measured Graph) of each rank]}."""
    measured = _spawned(tmp_path_factory.mktemp("ranks"))
    found = {}
    for world, case in RUNS:
        name, spec = CASES[case]
        found[world, case] = [(ul.trace(_workload(name), parallel=replace(spec(world), rank=rank)), m[world, case])
                              for rank, m in enumerate(measured[:world])]
    return found


def _gloo_view(graph: ul.Graph) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Op names and, per op, bytes allocated, bytes released (communication buffers, everything else), and the
    bytes live before the step, without gloo's reduce-scatter copies (the module's doc, 1).

    Per op, not per category: a measured step does not follow what autograd saves, so its feature maps read
    as temporaries; communication buffers, parameters, gradients and optimizer state it names as the trace does.
    """
    table = op_table(graph)
    names = [op.name for op in graph.ops]
    communication = table.release[:, _COMMUNICATION]
    released = np.stack([communication, table.release.sum(axis=1) - communication], axis=1)
    baseline, dropped = int((table.baseline - table.gone_at_start).sum()), set()
    for op in graph.ops:
        if op.name != _REDUCE_SCATTER or graph.ops[op.index + 1].name != _SPLIT:
            continue
        split, copy = graph.ops[op.index + 1], graph.ops[op.index + 2]
        buffer = graph.tensors[split.inputs[0]]
        assert copy.name == _COPY and buffer.producer is None and buffer.category != "communication", \
            "gloo's reduce-scatter ran other ops than the module's doc says"
        baseline -= buffer.nbytes
        if buffer.free_step is not None:  # the worker thread may let go of it a few ops late too (doc, 2)
            released[buffer.free_step, 1] -= buffer.nbytes
        dropped |= {split.index, copy.index}
    for index in _hook_copies(graph):
        assert not released[index, 1], "a comm hook's copy released something of the step's"
        released[index - 1] += released[index]
        released[index] = 0
        dropped.add(index)
    kept = [i for i in range(len(names)) if i not in dropped]
    assert not released[sorted(dropped)].any(), "gloo's copy ops released something of the step's"
    return [names[i] for i in kept], table.alloc[kept].sum(axis=1), released[kept], np.int64(baseline)


def _hook_copies(graph: ul.Graph) -> list[int]:
    """The ops of a communication hook's callback: a copy into the bucket right after its all-reduce (doc, 3)."""
    return [op.index for op in graph.ops[1:] if op.name == _COPY and graph.ops[op.index - 1].name == _ALL_REDUCE
            and graph.tensors[op.inputs[0]].category == "buffer"]


def _live(alloc: np.ndarray, released: np.ndarray, baseline: np.int64) -> np.ndarray:
    """Live bytes right after each op, as the graph's memory curve counts them."""
    released_before = np.concatenate([[0], np.cumsum(released.sum(axis=1))[:-1]])
    return baseline + np.cumsum(alloc) - released_before


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_each_rank_allocates_and_releases_what_the_trace_says_at_the_op_it_says(runs, world, case):
    for rank, (traced, measured) in enumerate(runs[world, case]):
        names, alloc, released, baseline = _gloo_view(traced)
        live = _live(alloc, released, baseline)
        # nothing of gloo's in a trace; a hook's callback, at the peak or not, is set aside without changing it
        assert len(names) == len(traced.ops) - len(_hook_copies(traced)) and live.max() == traced.peak_bytes
        m_names, m_alloc, m_released, m_baseline = _gloo_view(measured)
        assert m_names == names, f"rank {rank} ran other ops than the trace"
        assert m_baseline == baseline, f"rank {rank}: what lives before the step"
        assert (m_alloc == alloc).all(), f"rank {rank}: allocations"
        assert (m_released[:, 1] == released[:, 1]).all(), f"rank {rank}: releases"
        late = np.cumsum(released[:, 0]) - np.cumsum(m_released[:, 0])  # communication bytes gloo still held
        assert (late >= 0).all(), f"rank {rank} released a communication buffer before the trace did"
        if not late.any():  # gloo let go in time: the rank is the trace, at every op, to the byte
            assert (_live(m_alloc, m_released, m_baseline) == live).all()


@pytest.mark.parametrize(("world", "case"), RUNS)
def test_rank_0_holds_the_most(runs, world, case):
    """What ``FSDP.rank`` says: uneven shards leave the last ranks less, so rank 0's trace bounds every rank's."""
    peaks = [traced.peak_bytes for traced, _ in runs[world, case]]
    assert peaks[0] == max(peaks)

"""On CUDA the host runs ahead of the GPU: offloaded memory must still leave where the simulation says."""

import copy

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import compute_loss, split_input
from udnn_lab.units import cuda_block_bytes


@pytest.mark.gpu
def test_offloaded_memory_leaves_at_its_release_point_while_the_gpu_lags():
    work = zoo.get("resnet18", batch=32, image_size=64, device="cuda")
    graph = ul.trace(work)
    chosen = ul.plan(graph, None, "vdnn-all", hardware="h100-sxm")
    predicted = ul.simulate(graph, chosen, hardware="h100-sxm").peak_bytes
    model = copy.deepcopy(work.model)
    optimizer = type(work.optimizer)(model.parameters(), **work.optimizer.defaults)
    args, kwargs = split_input(work.example_input)
    runtime = ul.OffloadRuntime(chosen)
    peaks = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        work.model.to("cpu")
        resident = [*model.parameters(), *model.buffers(), work.example_input, work.target,
                    *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
        outside = torch.cuda.memory_allocated() - sum(cuda_block_bytes(t.untyped_storage().nbytes()) for t in resident)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda._sleep(200_000_000)  # the GPU starts the step far behind the host
        with runtime:
            loss = compute_loss(model(*args, **kwargs), work.loss_fn, work.target)
            loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - outside)
    runtime.release()
    # within 2% of the simulated peak (cuDNN workspaces are not in the trace)
    assert max(peaks) <= predicted * 1.02, (peaks, predicted)

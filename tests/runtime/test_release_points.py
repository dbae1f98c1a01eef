"""On CUDA the host runs ahead of the GPU: offloaded memory must still leave where the simulation says."""

import copy

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import compute_loss, split_input
from udnn_lab.units import cuda_block_bytes
from udnn_lab.workload import optimizer_like


@pytest.mark.gpu
def test_offloaded_memory_leaves_at_its_release_point_while_the_gpu_lags():
    work = zoo.get("resnet18", batch=32, image_size=64, device="cuda")
    graph = ul.trace(work)
    chosen = ul.plan(graph, None, "vdnn-all", hardware="h100-sxm")
    predicted = ul.simulate(graph, chosen, hardware="h100-sxm").peak_bytes
    model = copy.deepcopy(work.model)
    optimizer = optimizer_like(work.optimizer, model.parameters())
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


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["vdnn-all", "vdnn++", "recompute", "auto"])
def test_every_policy_is_exact_while_the_gpu_lags_behind_the_host(policy):
    """In the style of torchtune's offload test: a long kernel keeps the GPU busy while the host issues the step,
    so every copy, event and release the runtime orders is exercised against work still in flight."""
    work = zoo.get("resnet18", batch=16, image_size=64, device="cuda")
    graph = ul.trace(work)
    budget = None if policy == "vdnn-all" else (ul.min_budget(graph, policy, hardware="h100-sxm")
                                                  + graph.cuda_peak_bytes) // 2
    chosen = ul.plan(graph, budget, policy, hardware="h100-sxm")
    args, kwargs = split_input(work.example_input)
    grads = []
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        for runtime in (None, ul.OffloadRuntime(chosen)):
            model = copy.deepcopy(work.model)
            torch.manual_seed(0)
            torch.cuda._sleep(100_000_000)
            with runtime if runtime is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                               lambda t: t):
                compute_loss(model(*args, **kwargs), work.loss_fn, work.target).backward()
            torch.cuda.synchronize()
            grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.gpu
def test_a_handle_dropped_before_its_prefetch_finished_has_compute_wait_for_the_copy_not_the_host():
    """NOTE [offload runtime] 7: when autograd lets go of a handle it never unpacked, the block and the host slice
    may still be in use by the prefetch: compute waits for it before anything reuses them, and the host goes on."""
    from udnn_lab.runtime._by_ops import OpByOpStep
    from udnn_lab.runtime._copies import Copies

    work = zoo.get("resnet18", batch=16, image_size=64, device="cuda")
    graph = ul.trace(work)
    runtime = ul.OffloadRuntime(ul.plan(graph, None, "vdnn-all", hardware="h100-sxm"))
    step = OpByOpStep(runtime)
    step.copies = Copies(torch.device("cuda", torch.cuda.current_device()))
    slot = next(iter(step.slots.values()))
    host = torch.ones(64 << 20, dtype=torch.uint8).pin_memory()
    with torch.cuda.stream(step.copies.prefetch_stream):
        torch.cuda._sleep(200_000_000)  # the prefetch queues behind a long kernel on its stream
    slot.restored, slot.prefetch_done = step.copies.to_device(host)
    done = slot.prefetch_done
    assert not done.query()
    step._drop(slot)
    assert slot.restored is None and not done.query()  # the host did not wait
    assert step.dropped_in_flight == [done]  # the step's end will (NOTE [offload runtime] 9)
    after = torch.cuda.Event()
    after.record(step.copies.compute)  # the next compute work: the block's next user
    after.synchronize()
    assert done.query()

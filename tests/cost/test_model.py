import json

import numpy as np
import pytest

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.cost.model import CUDA_LAUNCH_S, CostModel, RateCurve, op_kind
from udnn_lab.hardware.profiles import Hardware

H100 = Hardware.load("h100-sxm")


def test_op_kinds():
    assert op_kind("aten.convolution.default", 10) == "conv"
    assert op_kind("aten.convolution_backward.default", 10) == "conv_backward"
    assert op_kind("aten.addmm.default", 10) == "matmul"
    assert op_kind("aten.mm.default", 10) == "matmul"
    assert op_kind("aten.relu.default", 0) == "memory"
    assert op_kind("aten._scaled_dot_product_flash_attention_for_cpu.default", 5) == "attention"


def test_roofline_takes_the_slower_of_compute_and_memory():
    cost = CostModel(H100)
    compute_bound = cost.roofline_s("aten.mm.default", 10**12, 10**6)
    assert compute_bound == pytest.approx(CUDA_LAUNCH_S + 10**12 / H100.fp32_flops_per_s)
    memory_bound = cost.roofline_s("aten.relu.default", 0, 10**9)
    assert memory_bound == pytest.approx(CUDA_LAUNCH_S + 10**9 / H100.memory_bytes_per_s)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    cost = CostModel(H100)
    assert cost.transfer_time_s(10**9, "d2h", pinned=True) == pytest.approx(
        H100.d2h_pinned_latency_s + 10**9 / H100.d2h_pinned_bytes_per_s)
    assert cost.transfer_time_s(10**9, "h2d", pinned=False) > cost.transfer_time_s(10**9, "h2d", pinned=True)


def test_graph_ops_carry_flops_from_the_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    work = zoo.get("resnet18", batch=2, image_size=32)
    graph = ul.trace(work)
    counter = FlopCounterMode(display=False)
    with counter:
        work.loss_fn(work.model(work.example_input), work.target).backward()
    assert sum(op.flops for op in graph.ops if op.phase != "optimizer") == counter.get_total_flops()
    views = [op for op in graph.ops if op.name == "aten.t.default"]
    assert views and all(op.bytes_read == op.bytes_written == 0 for op in views)


def test_rate_curve_fits_interpolates_and_round_trips(tmp_path):
    profiles = [ul.profile(zoo.get(name, batch=4), repeats=1) for name in ("mlp3", "mlp4")]
    curve = RateCurve.fit(profiles)
    assert "kind:matmul" in curve.points and "aten.addmm.default" in curve.points and curve.op_overhead_s >= 0
    points = curve.points["aten.addmm.default"]
    flops = [p[0] for p in points]
    assert flops == sorted(flops)
    assert curve.flops_per_s("aten.addmm.default", flops[0]) == pytest.approx(points[0][1])
    assert curve.flops_per_s("aten.addmm.default", 1) == pytest.approx(points[0][1])  # clamped
    assert curve.flops_per_s("aten.bmm.default", flops[0]) is not None  # by its kind
    assert curve.flops_per_s("aten.convolution.default", 10**9) is None
    assert curve.memory_bytes_per_s("aten.some_new_op.default") == curve.bytes_per_s.get("kind:memory")
    path = curve.save(tmp_path / "curve.json")
    assert RateCurve.load(path) == curve


def test_a_rate_curve_fitted_with_dtypes_keeps_half_precision_apart(tmp_path):
    import dataclasses

    fp32 = ul.profile(zoo.get("mlp3", batch=4), repeats=1)
    # the same ops as if they had run in bf16 at ten times the speed (as tensor cores do)
    bf16 = dataclasses.replace(fp32, time_s=tuple(t / 10 for t in fp32.time_s))
    dtypes = [("float32",) * len(fp32.ops), ("bfloat16",) * len(bf16.ops)]
    curve = RateCurve.fit([fp32, bf16], dtypes=dtypes)
    flops = curve.points["aten.addmm.default"][0][0]
    slow, fast = (curve.flops_per_s("aten.addmm.default", flops, dtype) for dtype in ("float32", "bfloat16"))
    assert curve.per_precision and "kind:matmul@bfloat16" in curve.points and fast > 5 * slow
    assert RateCurve.load(curve.save(tmp_path / "curve.json")).flops_per_s("aten.addmm.default", flops,
                                                                            "bfloat16") == fast
    mixed = RateCurve.fit([fp32, bf16])  # without dtypes: one rate for both, as curves fitted before
    assert not mixed.per_precision
    assert mixed.flops_per_s("aten.addmm.default", flops, "bfloat16") == mixed.flops_per_s("aten.addmm.default",
                                                                                           flops)
    with pytest.raises(ValueError, match="one per op"):
        RateCurve.fit([fp32], dtypes=[("float32",)])


def test_rate_curve_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        RateCurve.fit([])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"device_name": "x", "points": {"kind:matmul": [[1, "fast"]]}}))
    with pytest.raises(ValueError, match="bad.json.*malformed"):
        RateCurve.load(path)


def test_cost_model_uses_a_fitted_curve_for_unmeasured_sizes():
    prof = ul.profile(zoo.get("mlp3", batch=4), repeats=1)
    curve = RateCurve.fit([prof])
    graph = ul.trace(zoo.get("mlp3", batch=64))
    hardware = Hardware.load("cpu-amd-epyc-2cpu")
    times = CostModel(hardware, rates=curve).op_times_s(graph)
    assert len(times) == len(graph.ops) and (times > 0).all() and np.isfinite(times).all()


def test_half_precision_matmuls_run_at_the_tensor_core_rate_of_the_profile():
    import udnn_lab as ul
    from udnn_lab.cost.model import CUDA_LAUNCH_S, CostModel

    a100 = ul.Hardware.load("a100")
    cost = CostModel(a100)
    flops, nbytes = 10**12, 10**6  # compute-bound
    fp32 = cost.roofline_s("aten.mm.default", flops, nbytes, "float32")
    bf16 = cost.roofline_s("aten.mm.default", flops, nbytes, "bfloat16")
    assert bf16 < fp32 / 10
    assert abs(bf16 - CUDA_LAUNCH_S - flops / a100.peak_flops_per_s("bf16")) < 1e-4 * bf16
    elementwise = [cost.roofline_s("aten.add.Tensor", 10**6, 10**9, dtype) for dtype in ("float32", "bfloat16")]
    assert elementwise[0] == elementwise[1]  # memory-bound: the dtype's rate does not matter


def test_a_bf16_step_is_faster_on_an_a100_than_on_an_rtx_4090():
    import torch

    import udnn_lab as ul
    from udnn_lab.cost.model import CostModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(torch.bfloat16)
    graph = ul.trace(model, torch.randn(512, 4096, dtype=torch.bfloat16, device="meta"), optimizer=None,
                     device="meta")
    times = {name: CostModel(ul.Hardware.load(name)).op_times_s(graph).sum() for name in ("a100", "rtx-4090")}
    assert times["a100"] < times["rtx-4090"]  # 312 against 165 bf16 TFLOPS; in fp32 it would be 19.5 against 83

"""This machine's rate curve: fitted on three small steps, kept beside its measured profile, used by default."""

import pytest

import udnn_lab as ul
from udnn_lab.cost import RateCurve, calibrate, machine_rates
from udnn_lab.cost import calibration as calibration_module
from udnn_lab.hardware import Hardware, MachineDevice, this_machine


@pytest.fixture(scope="module")
def curve():
    return calibrate("cpu", progress=False, repeats=1)


def test_the_calibration_spans_the_kinds_of_op_a_step_has(curve):
    assert {"kind:conv", "kind:conv_backward", "kind:matmul", "aten.convolution.default"} <= set(curve.points)
    assert "kind:memory" in curve.bytes_per_s and curve.op_overhead_s > 0
    matmuls = [flops for flops, _ in curve.points["kind:matmul"]]
    assert min(matmuls) < 1e7 and max(matmuls) > 1e9  # the sizes steps have, not one size
    assert "threads" in curve.source  # says where and how it was fitted


def test_only_this_machines_measured_profile_gets_a_curve_fitted_here(curve, monkeypatch, tmp_path):
    monkeypatch.setenv("UDNN_LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(this_machine, "device_name", lambda device: "Intel(R) Xeon(R) Gold 6338")
    calls = []
    monkeypatch.setattr(calibration_module, "calibrate", lambda device_type, progress=True: calls.append(1) or curve)
    assert machine_rates(Hardware.load("cpu-amd-epyc-2cpu")) is None  # made elsewhere: its figures are all there is
    here = Hardware.from_dict({**Hardware.load("cpu-amd-epyc-2cpu").to_dict(), "name": "cpu-intel-xeon-2cpu",
                               "device_names": ["Intel(R) Xeon(R) Gold 6338"]})
    monkeypatch.setattr(calibration_module, "device_name", lambda device: "Intel(R) Xeon(R) Gold 6338")
    assert machine_rates(here) == curve and machine_rates(here) == curve and calls == [1]  # fitted once, then read
    cached = tmp_path / "rates" / f"{MachineDevice.of('cpu').cache_key}.json"
    assert RateCurve.load(cached) == curve


def test_a_graph_simulated_on_this_machines_profile_uses_its_curve(curve, monkeypatch, tmp_path):
    monkeypatch.delenv("UDNN_LAB_HARDWARE", raising=False)
    monkeypatch.setenv("UDNN_LAB_CACHE_DIR", str(tmp_path))
    name = "Intel(R) Xeon(R) Gold 6338"
    monkeypatch.setattr(this_machine, "device_name", lambda device: name)
    here = Hardware.from_dict({**Hardware.load("cpu-amd-epyc-2cpu").to_dict(), "name": "cpu-intel-xeon-2cpu",
                               "device_names": [name]})
    this_machine.save_cached(MachineDevice.of("cpu"), here)
    monkeypatch.setattr(calibration_module, "calibrate", lambda device_type, progress=True: curve)
    graph = ul.trace(ul.zoo.get("mlp3", batch=8))
    by_rule = ul.simulate(graph)
    assert by_rule.hardware == "cpu-intel-xeon-2cpu"
    assert by_rule.step_time_s == ul.simulate(graph, hardware=here, rates=curve).step_time_s
    assert by_rule.step_time_s != ul.simulate(graph, hardware=here, rates=False).step_time_s

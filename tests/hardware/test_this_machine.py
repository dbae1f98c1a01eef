"""NOTE [the profile for this machine]: measured here and cached, else the closest shipped one, with a warning."""

import json
import types
import warnings

import pytest
import torch

import udnn_lab as ul
import udnn_lab.runtime  # noqa: F401 - registers the runtime's host probes (NOTE [host probes] 1)
from udnn_lab.errors import HardwareProfileError, ShippedProfileWarning
from udnn_lab.hardware import HOOKS_BY_PATH, Hardware, MachineDevice, machine_hardware, this_machine

XEON = "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """No UDNN_LAB_HARDWARE, a cache of the test's own, and a quick measurement that counts its calls."""
    monkeypatch.delenv("UDNN_LAB_HARDWARE", raising=False)
    monkeypatch.setenv("UDNN_LAB_CACHE_DIR", str(tmp_path))
    calls = []

    def measure(device_type, progress):
        calls.append(device_type)
        return Hardware.measure(device_type, sizes=(4096, 1 << 20), repeats=1, matmul_size=64, conv_size=8,
                                progress=False)

    return types.SimpleNamespace(calls=calls, measure=measure, cache=tmp_path)


def _fake_cpu(monkeypatch, name):
    monkeypatch.setattr(this_machine, "device_name", lambda device: name)


def _fake_gpu(monkeypatch, name, memory_gib):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(
        total_memory=memory_gib << 30))
    monkeypatch.setattr(this_machine, "device_name", lambda device: name)


def test_an_unknown_cpu_is_measured_once_and_its_profile_cached_for_this_torch(machine, monkeypatch):
    _fake_cpu(monkeypatch, XEON)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShippedProfileWarning)  # measured here: no shipped stand-in, no warning
        first = machine_hardware("cpu", measure=machine.measure)
        second = machine_hardware("cpu", measure=machine.measure)
    assert machine.calls == ["cpu"] and first == second and first.measured
    cached = list((machine.cache / "hardware").glob("*.json"))
    assert [path.name for path in cached] == [MachineDevice.of("cpu").cache_key + ".json"]
    assert "intel-r-xeon" in cached[0].name and torch.__version__.replace(".", "-").split("+")[0] in cached[0].name
    machine_hardware("cpu", "measure", measure=machine.measure)  # asked to measure again: it does
    assert machine.calls == ["cpu", "cpu"]


def test_a_cache_file_that_does_not_read_is_measured_again(machine, monkeypatch):
    _fake_cpu(monkeypatch, XEON)
    path = this_machine.cached_path(MachineDevice.of("cpu"))
    path.parent.mkdir(parents=True)
    path.write_text('{"name": "cut sh')
    assert machine_hardware("cpu", measure=machine.measure).measured and machine.calls == ["cpu"]
    assert json.loads(path.read_text())["device_type"] == "cpu"


@pytest.mark.parametrize("figure", ["dispatch_mode_op_s", "hook_call_s", "replay_op_s"])
def test_a_profile_cached_before_a_host_figure_was_measured_is_measured_again(machine, monkeypatch, figure):
    _fake_cpu(monkeypatch, XEON)
    first = machine_hardware("cpu", measure=machine.measure)
    assert getattr(first, figure) is not None
    path = this_machine.cached_path(MachineDevice.of("cpu"))
    older = json.loads(path.read_text())
    del older[figure], older["sources"][figure]
    path.write_text(json.dumps(older))
    assert getattr(machine_hardware("cpu", measure=machine.measure), figure) is not None
    assert machine.calls == ["cpu", "cpu"]


def test_a_profile_whose_hook_calls_were_measured_with_every_module_hooked_is_measured_again(machine, monkeypatch):
    """NOTE [host probes] 2: the runtime now hooks only the modules a plan needs (NOTE [hook points] 8), so a hook
    call measured before that is not its cost now."""
    _fake_cpu(monkeypatch, XEON)
    first = machine_hardware("cpu", measure=machine.measure)
    assert HOOKS_BY_PATH in first.sources["hook_call_s"]
    path = this_machine.cached_path(MachineDevice.of("cpu"))
    older = json.loads(path.read_text())
    older["sources"]["hook_call_s"] = older["sources"]["hook_call_s"].replace(f" ({HOOKS_BY_PATH})", "")
    path.write_text(json.dumps(older))
    assert HOOKS_BY_PATH in machine_hardware("cpu", measure=machine.measure).sources["hook_call_s"]
    assert machine.calls == ["cpu", "cpu"]
    machine_hardware("cpu", measure=machine.measure)  # the new one is kept
    assert machine.calls == ["cpu", "cpu"]


def test_an_unknown_cpu_without_measuring_gets_the_shipped_cpu_profile_and_a_warning_naming_it(machine, monkeypatch):
    _fake_cpu(monkeypatch, XEON)
    with pytest.warns(ShippedProfileWarning, match="'cpu-amd-epyc-2cpu'.*no shipped profile is for 'Intel"):
        chosen = machine_hardware("cpu", "shipped", measure=machine.measure)
    assert chosen.name == "cpu-amd-epyc-2cpu" and machine.calls == []


def test_an_unknown_gpu_that_cannot_be_measured_gets_the_shipped_one_nearest_in_memory(machine, monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA GeForce RTX 3090", 24)

    def broken(device_type, progress):
        raise RuntimeError("CUDA error: no kernel image is available")

    with pytest.warns(ShippedProfileWarning) as caught:
        chosen = machine_hardware("cuda", measure=broken)
    assert chosen.name == "rtx-4090"  # 24 GiB like the L4; the nearer name
    messages = [str(w.message) for w in caught]
    assert any("could not measure" in m and "no kernel image" in m for m in messages)
    assert any("'rtx-4090'" in m and "nearest in memory" in m for m in messages)


def test_a_known_gpu_asked_for_shipped_gets_its_own_profile_a_measured_one_first(machine, monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 80)
    with pytest.warns(ShippedProfileWarning, match="made for 'NVIDIA H100 80GB HBM3' on another machine"):
        chosen = machine_hardware("cuda", "shipped")
    assert chosen.name == "nvidia-h100-80gb-hbm3-measured"
    datasheet = Hardware.load("h100-sxm")  # the links between GPUs are not measured on one: the datasheet's
    assert chosen.gpus_per_node == 8 and chosen.intra_node_bytes_per_s == datasheet.intra_node_bytes_per_s
    assert "the shipped profile 'h100-sxm'" in chosen.sources["inter_node_bytes_per_s"]
    assert chosen.h2d_pinned_bytes_per_s == Hardware.load("nvidia-h100-80gb-hbm3-measured").h2d_pinned_bytes_per_s


def test_an_h200_gets_the_h200_measured_on_one(machine, monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H200", 140)
    with pytest.warns(ShippedProfileWarning):
        chosen = machine_hardware("cuda", "shipped")
    assert chosen.name == "nvidia-h200-measured" and chosen.h2d_pinned_bytes_per_s == pytest.approx(55.55e9, rel=1e-3)
    assert chosen.d2h_pageable_bytes_per_s == pytest.approx(17.91e9, rel=1e-3) and chosen.gpus_per_node == 8


def test_a_cuda_graph_on_a_machine_without_cuda_gets_h100_sxm_with_a_warning(machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(ShippedProfileWarning, match="'h100-sxm'.*no CUDA device here"):
        assert machine_hardware("cuda", measure=machine.measure).name == "h100-sxm"
    assert machine.calls == []


def test_the_variable_names_a_profile_per_device_type(machine, monkeypatch):
    _fake_cpu(monkeypatch, XEON)
    monkeypatch.setenv("UDNN_LAB_HARDWARE", "a100")
    assert machine_hardware("cuda").name == "a100"
    assert machine_hardware("cpu", measure=machine.measure).measured and machine.calls == ["cpu"]  # not a100
    monkeypatch.setenv("UDNN_LAB_HARDWARE", "a100, shipped")
    with pytest.warns(ShippedProfileWarning):
        assert machine_hardware("cpu", measure=machine.measure).name == "cpu-amd-epyc-2cpu"
    monkeypatch.setenv("UDNN_LAB_HARDWARE", "a10g")
    with pytest.raises(HardwareProfileError, match="UDNN_LAB_HARDWARE='a10g': unknown hardware 'a10g'"):
        machine_hardware("cuda")


def test_plan_and_simulate_need_no_hardware_and_say_which_profile_they_used(machine):
    graph = ul.trace(ul.zoo.get("mlp3", batch=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShippedProfileWarning)
        simulation = ul.simulate(graph, ul.plan(graph, None, "keep-all"))  # measures this machine (seconds)
    cached = this_machine.load_cached(MachineDevice.of("cpu"))
    assert cached is not None and cached.measured and simulation.hardware == cached.name
    assert f"hardware={cached.name!r}" in repr(simulation)

import dataclasses
import json
import math
import pickle

import pytest
import torch

import udnn_lab.runtime  # noqa: F401 - registers the runtime's host probes (NOTE [host probes] 1)
from udnn_lab.devices import device_name
from udnn_lab.hardware.machine_probes import SWEEP_COLUMNS
from udnn_lab.hardware.profiles import Hardware, HardwareMismatchWarning, HardwareProfileError, UnknownHardwareError


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Quick and steady measurements on a small shared box; other test modules get their threads back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REQUIRED_PROFILES = ["a100", "a100-40gb", "gtx-1080-ti", "h100-sxm", "h200", "k40c", "l4", "l40s", "mi300x", "rtx-4090",
                     "titan-x-maxwell", "v100"]
TINY = dict(sizes=(4096, 65536), repeats=2, matmul_size=64, conv_size=8, progress=False)


def _valid_dict() -> dict:
    return Hardware.load("a100").to_dict()


def _write(tmp_path, data, name="broken.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_every_required_profile_ships_and_a_cpu_profile_too():
    names = Hardware.names()
    assert set(REQUIRED_PROFILES) <= set(names)
    assert any(name.startswith("cpu-") for name in names)


@pytest.mark.parametrize("name", Hardware.names())
def test_shipped_profile_loads_round_trips_and_cites_every_figure(name, tmp_path):
    hardware = Hardware.load(name)
    assert hardware.name == name
    assert Hardware.from_dict(hardware.to_dict(), origin=name) == hardware
    assert Hardware.load(hardware.save(tmp_path / f"{name}.json")) == hardware
    for spec in dataclasses.fields(hardware):
        value = getattr(hardware, spec.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert value >= 0 and spec.name in hardware.sources
    if hardware.measured:
        assert all("measured on" in source for source in hardware.sources.values())


def test_shipped_figures_match_datasheets():
    h100 = Hardware.load("h100-sxm")
    assert h100.memory_bytes == 80 * 2**30
    assert h100.memory_bytes_per_s == 3.35e12 and h100.fp32_flops_per_s == 67e12
    assert Hardware.load("k40c").fp32_flops_per_s == 4.29e12
    assert Hardware.load("titan-x-maxwell").h2d_pinned_bytes_per_s == 12.8e9
    assert Hardware.load("gtx-1080-ti").tf32_flops_per_s is None


# name: (capacity GiB, memory bandwidth, fp32, tf32, bf16, fp16 peaks), dense tensor-core rates, from each source
DATASHEETS = {
    "rtx-4090": (24, 1008e9, 82.6e12, 82.6e12, 165.2e12, 165.2e12),
    "l4": (24, 300e9, 30.3e12, 60e12, 121e12, 121e12),
    "l40s": (48, 864e9, 91.6e12, 183e12, 362.05e12, 362.05e12),
    "a100-40gb": (40, 1555e9, 19.5e12, 156e12, 312e12, 312e12),
    "mi300x": (192, 5.3e12, 163.4e12, 653.7e12, 1307.4e12, 1307.4e12),
}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_newer_profiles_carry_their_datasheet_figures(name):
    hardware = Hardware.load(name)
    gib, bandwidth, fp32, tf32, bf16, fp16 = DATASHEETS[name]
    assert hardware.device_type == "cuda" and not hardware.measured
    assert hardware.memory_bytes == gib * 2**30 and hardware.memory_bytes_per_s == bandwidth
    assert hardware.peak_flops_per_s(torch.float32) == fp32
    assert hardware.peak_flops_per_s(torch.float32, tf32=True) == tf32
    assert hardware.peak_flops_per_s(torch.bfloat16) == bf16 and hardware.peak_flops_per_s(torch.float16) == fp16
    # the host link is a typical value, not a datasheet figure: its source must say so
    assert all("estimate" in hardware.sources[f"{d}_pinned_bytes_per_s"] for d in ("h2d", "d2h"))
    assert all("http" in hardware.sources[f] for f in ("memory_bytes", "memory_bytes_per_s", "fp32_flops_per_s"))


def test_the_40_gb_a100_differs_from_the_80_gb_part_only_in_memory():
    small, large = Hardware.load("a100-40gb"), Hardware.load("a100")
    assert small.memory_bytes * 2 == large.memory_bytes and small.memory_bytes_per_s < large.memory_bytes_per_s
    assert [small.peak_flops_per_s(k) for k in ("fp32", "tf32", "bf16")] == [
        large.peak_flops_per_s(k) for k in ("fp32", "tf32", "bf16")]
    assert "NVIDIA A100-SXM4-40GB" in small.device_names and not set(small.device_names) & set(large.device_names)


@pytest.mark.parametrize("spelling", ["h100-sxm", "H100_SXM", "h100 sxm", "H100SXM"])
def test_load_by_name_ignores_case_dashes_underscores(spelling):
    assert Hardware.load(spelling).name == "h100-sxm"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownHardwareError) as caught:
        Hardware.load("h900")
    message = str(caught.value)
    assert "h900" in message and all(name in message for name in REQUIRED_PROFILES)
    assert isinstance(caught.value, HardwareProfileError) and isinstance(caught.value, ValueError)


def test_missing_path_says_so(tmp_path):
    with pytest.raises(HardwareProfileError, match="no hardware profile file"):
        Hardware.load(tmp_path / "nothing.json")


@pytest.mark.parametrize("field, value, expected", [
    ("memory_bytes", None, "missing field"),
    ("memory_bytes", "80 GB", "positive whole number of bytes"),
    ("memory_bytes", -5, "positive whole number of bytes"),
    ("memory_bytes", 1.5, "positive whole number of bytes"),
    ("h2d_pinned_bytes_per_s", -1.0, "positive number"),
    ("h2d_pinned_bytes_per_s", 0, "positive number"),
    ("h2d_pinned_bytes_per_s", True, "positive number"),
    ("d2h_pageable_latency_s", -1e-6, "zero or more"),
    ("tf32_flops_per_s", "fast", "positive number"),
    ("device_type", "tpu", "'cuda' or 'cpu'"),
    ("device_names", "NVIDIA A100", "list of device names"),
    ("measured", "yes", "true or false"),
])
def test_malformed_profile_names_the_field_and_the_file(tmp_path, field, value, expected):
    data = _valid_dict()
    if value is None:
        del data[field]
    else:
        data[field] = value
    path = _write(tmp_path, data)
    with pytest.raises(HardwareProfileError) as caught:
        Hardware.load(path)
    assert field in str(caught.value) and str(path) in str(caught.value) and expected in str(caught.value)


def test_a_figure_without_a_source_is_rejected(tmp_path):
    data = _valid_dict()
    del data["sources"]["fp32_flops_per_s"]
    with pytest.raises(HardwareProfileError, match="'fp32_flops_per_s' has no source"):
        Hardware.load(_write(tmp_path, data))


def test_unknown_field_and_bad_json_are_reported(tmp_path):
    data = _valid_dict()
    data["memory_byte"] = 1
    with pytest.raises(HardwareProfileError, match="unknown field.*memory_byte"):
        Hardware.load(_write(tmp_path, data))
    path = tmp_path / "cut.json"
    path.write_text('{"name": "cut",')
    with pytest.raises(HardwareProfileError, match=r"cut\.json: not valid JSON \(line 1"):
        Hardware.load(path)
    with pytest.raises(HardwareProfileError, match="JSON object"):
        Hardware.load(_write(tmp_path, [1, 2]))


def test_what_if_copies_are_validated_too():
    a100 = Hardware.load("a100")
    faster = dataclasses.replace(a100, h2d_pinned_bytes_per_s=2 * a100.h2d_pinned_bytes_per_s)
    assert faster.transfer_time_s(10**9) < a100.transfer_time_s(10**9)
    with pytest.raises(HardwareProfileError, match="h2d_pinned_bytes_per_s"):
        dataclasses.replace(a100, h2d_pinned_bytes_per_s=0)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    hardware = Hardware.load("v100")
    nbytes = 256 * 2**20
    for direction in ("h2d", "d2h"):
        for pinned in (True, False):
            rate = hardware.bandwidth_bytes_per_s(direction, pinned)
            expected = hardware.latency_s(direction, pinned) + nbytes / rate
            assert math.isclose(hardware.transfer_time_s(nbytes, direction, pinned=pinned), expected)
    assert math.isclose(hardware.transfer_time_s("256 MiB"), hardware.transfer_time_s(nbytes))
    assert hardware.transfer_time_s(nbytes, pinned=False) > hardware.transfer_time_s(nbytes, pinned=True)
    assert hardware.transfer_time_s(0) == 0.0
    with pytest.raises(ValueError, match="'h2d'.*'d2h'"):
        hardware.transfer_time_s(1, direction="up")


def test_peak_flops_falls_back_to_fp32_where_the_device_has_no_faster_path():
    a100, k40c = Hardware.load("a100"), Hardware.load("k40c")
    assert a100.peak_flops_per_s(torch.float32) == 19.5e12
    assert a100.peak_flops_per_s(torch.float32, tf32=True) == 156e12
    assert a100.peak_flops_per_s(torch.bfloat16) == 312e12
    assert k40c.peak_flops_per_s("bf16") == k40c.fp32_flops_per_s
    with pytest.raises(ValueError, match="no FLOP rate"):
        a100.peak_flops_per_s(torch.int8)


def test_measure_on_cpu_gives_positive_figures_and_the_sweep():
    profile, sweep = Hardware.measure_with_sweep("cpu", **TINY)
    assert isinstance(Hardware.measure("cpu", **TINY), Hardware)
    assert profile.measured and profile.device_type == "cpu"
    assert profile.memory_bytes > 0 and profile.memory_bytes_per_s > 0
    assert profile.fp32_flops_per_s > 0 and profile.conv_fp32_achieved_flops_per_s > 0
    assert profile.h2d_pinned_bytes_per_s > 0 and profile.d2h_pageable_latency_s >= 0
    assert profile.dispatch_mode_op_s is not None and profile.dispatch_mode_op_s > 0
    assert "pass-through dispatch mode" in profile.sources["dispatch_mode_op_s"]
    for figure in ("hook_call_s", "offload_action_s", "replay_op_s"):  # NOTE [host probes]: the runtime's probe
        assert getattr(profile, figure) is not None and 0 <= getattr(profile, figure) < 1e-2, figure
        assert "the runtime's host probe" in profile.sources[figure]
    assert list(sweep.columns) == list(SWEEP_COLUMNS)
    assert sorted(sweep["nbytes"]) == [4096, 65536] and (sweep["bytes_per_s"] > 0).all()
    assert (sweep["repeats"] == 2).all()
    assert Hardware.from_dict(profile.to_dict()) == profile
    assert profile.check_matches("cpu")


def test_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        Hardware.measure("cpu", repeats=0, progress=False)
    with pytest.raises(ValueError, match="cannot measure"):
        Hardware.measure("meta", progress=False)


def test_profile_of_another_device_warns():
    with pytest.warns(HardwareMismatchWarning, match="h100-sxm.*Hardware.measure"):
        assert not Hardware.load("h100-sxm").check_matches("cpu")
    with pytest.warns(HardwareMismatchWarning):
        Hardware.load("a100", device="cpu")


def test_same_device_under_another_spelling_matches():
    profile = Hardware.measure("cpu", **TINY)
    renamed = dataclasses.replace(profile, device_names=("  " + device_name(torch.device("cpu")).upper(),))
    assert renamed.check_matches("cpu")


@pytest.mark.gpu
def test_measure_on_cuda_sweeps_both_directions_and_both_memory_kinds():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    profile, sweep = Hardware.measure_with_sweep("cuda", sizes=(4096, 1 << 20), repeats=2, matmul_size=256,
                                      conv_size=16, progress=False)
    assert profile.device_type == "cuda" and profile.measured and profile.check_matches("cuda")
    copies = sweep[sweep["direction"].isin(["h2d", "d2h"])]
    assert set(map(tuple, copies[["direction", "pinned"]].drop_duplicates().values)) == {
        ("h2d", True), ("h2d", False), ("d2h", True), ("d2h", False)}
    assert (sweep["bytes_per_s"] > 0).all()
    assert profile.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert profile.fp16_flops_per_s > 0


def test_a_profile_pickles_to_an_equal_one():  # sweeps send it to their worker processes
    for name in ("h100-sxm", "cpu-amd-epyc-2cpu"):
        profile = Hardware.load(name)
        assert pickle.loads(pickle.dumps(profile)) == profile

"""The multi-GPU figures of the shipped profiles: datasheet values where a system has them, None where not."""

import pytest

from udnn_lab.hardware.profiles import Hardware, HardwareProfileError

# name: (GPUs per node, GPU-to-GPU bandwidth per direction, NIC bandwidth per GPU per direction)
SYSTEMS = {
    "h100-sxm": (8, 450e9, 50e9),  # DGX H100: NVLink 4 900 GB/s both ways, one 400 Gb/s ConnectX-7 per GPU
    "h200": (8, 450e9, 50e9),
    "a100": (8, 300e9, 25e9),  # DGX A100: NVLink 3 600 GB/s both ways, one 200 Gb/s ConnectX-6 per GPU
    "a100-40gb": (8, 300e9, 25e9),
    "v100": (8, 150e9, 6.25e9),  # DGX-1: NVLink 2 300 GB/s both ways, 4 x 100 Gb/s EDR for 8 GPUs
    "mi300x": (8, 448e9, 50e9),  # 7 Infinity Fabric links of 64 GB/s each way
}
WITHOUT = ["gtx-1080-ti", "k40c", "l4", "l40s", "rtx-4090", "titan-x-maxwell",
           "nvidia-h100-80gb-hbm3-measured", "nvidia-h200-measured"]


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_systems_carry_their_datasheet_links_with_sources(name):
    hardware = Hardware.load(name)
    figures = (hardware.gpus_per_node, hardware.intra_node_bytes_per_s, hardware.inter_node_bytes_per_s)
    assert figures == SYSTEMS[name]
    assert hardware.intra_node_latency_s and hardware.inter_node_latency_s
    assert "estimate" in hardware.sources["intra_node_latency_s"]  # NCCL's model, not a measurement
    assert all(key in hardware.sources for key in ("gpus_per_node", "intra_node_bytes_per_s",
                                                   "inter_node_bytes_per_s"))


@pytest.mark.parametrize("name", WITHOUT)
def test_devices_without_multi_gpu_figures_say_none_and_why(name):
    hardware = Hardware.load(name)
    assert hardware.gpus_per_node is hardware.intra_node_bytes_per_s is hardware.inter_node_bytes_per_s is None
    assert "No collective figures" in hardware.notes


def test_the_cpu_profile_has_the_gloo_link_it_measured_and_no_node_figures():
    cpu = Hardware.load("cpu-amd-epyc-2cpu")
    assert cpu.intra_node_bytes_per_s and cpu.intra_node_latency_s is not None
    assert cpu.gpus_per_node is cpu.inter_node_bytes_per_s is None
    assert all("2 gloo ranks" in cpu.sources[k] for k in ("intra_node_bytes_per_s", "intra_node_latency_s"))


def test_measuring_a_cpu_with_collectives_times_two_gloo_ranks():
    measured = Hardware.measure("cpu", sizes=["4 KiB", "1 MiB"], repeats=1, matmul_size=64, conv_size=8,
                                progress=False, collectives=True)
    assert measured.intra_node_bytes_per_s > 0 and measured.intra_node_latency_s >= 0
    assert measured.sources["intra_node_bytes_per_s"].startswith("measured on")
    plain = Hardware.measure("cpu", sizes=["4 KiB"], repeats=1, matmul_size=64, conv_size=8, progress=False)
    assert plain.intra_node_bytes_per_s is None


def test_a_collective_figure_needs_a_source_and_a_sensible_value():
    data = Hardware.load("h100-sxm").to_dict()
    with pytest.raises(HardwareProfileError, match="gpus_per_node"):
        Hardware.from_dict({**data, "gpus_per_node": 0})
    with pytest.raises(HardwareProfileError, match="inter_node_latency_s"):
        Hardware.from_dict({**data, "inter_node_latency_s": -1.0})
    sources = {k: v for k, v in data["sources"].items() if k != "intra_node_bytes_per_s"}
    with pytest.raises(HardwareProfileError, match="'intra_node_bytes_per_s' has no source"):
        Hardware.from_dict({**data, "sources": sources})

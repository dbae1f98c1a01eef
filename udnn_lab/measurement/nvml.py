"""Device readings through NVML (nvidia-ml-py), or a clear 'unavailable' when there is no driver."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NvmlReading:
    available: bool
    reason: str = ""  # why there is no reading
    device_name: str = ""
    driver_version: str = ""
    used_bytes: int | None = None  # device memory in use by every process
    total_bytes: int | None = None
    utilization_percent: int | None = None


def read(index: int = 0) -> NvmlReading:
    """One reading of device ``index``; never raises for a missing driver or library."""
    try:
        import pynvml  # optional: NVML only where there is an NVIDIA driver
    except ImportError:
        return NvmlReading(False, "nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return NvmlReading(False, f"NVML unavailable: {err} (no NVIDIA driver on this machine?)")
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return NvmlReading(True, "", _text(pynvml.nvmlDeviceGetName(handle)),
                           _text(pynvml.nvmlSystemGetDriverVersion()), int(memory.used), int(memory.total),
                           int(utilization.gpu))
    except pynvml.NVMLError as err:
        return NvmlReading(False, f"NVML could not read device {index}: {err}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Which device, and what it calls itself."""

from __future__ import annotations

import os
import platform
from itertools import chain

import torch


def as_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{device} was asked for but CUDA is not available here; use 'cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: str | torch.device | None = None) -> str:
    """What the device calls itself: the CUDA device name or the CPU model name."""
    device = as_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model runs on: its first parameter's or buffer's (CPU for a model with neither).

    Raises ValueError for a model on the meta device: it has no data to run with.
    """
    first = next(chain(model.parameters(), model.buffers()), None)
    if first is None:
        return torch.device("cpu")
    if first.device.type == "meta":
        raise ValueError("the model has meta parameters (no data), so it cannot run for real: build it on a "
                         "device, e.g. ul.zoo.get(name, batch=..., device='cpu')")
    return first.device


HOST_POOL_SHARE = 0.5  # the share of the host memory available that offloading may take by default


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping), else physical memory."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

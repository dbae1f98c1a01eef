"""The profile for this machine when none is named: one rule for Python, the CLI, MemoryLab and the report.

NOTE [the profile for this machine]
1. ``hardware=`` (or the ``UDNN_LAB_HARDWARE`` variable, when ``hardware`` is None) is a profile name, a
   profile .json path, or one of the choices: ``"auto"`` (the default), ``"measure"``, ``"shipped"``.
   The variable may hold several, comma-separated: a profile applies to graphs of its own device type
   (``UDNN_LAB_HARDWARE=a100`` picks the CUDA profile and leaves CPU graphs to the rule).
2. ``auto``: where the graph's device is here (the CPU always; CUDA when a device is visible), a profile
   measured on this machine is used: the one cached for this device and torch version, else one measured
   now (seconds, with a progress bar) and cached. A cached profile is keyed by the device's name, its
   CPU count (CPU) and torch's version, under ``UDNN_LAB_CACHE_DIR`` (default ``~/.cache/udnn_lab``).
3. Where the device is not here (a CUDA graph traced on a CPU machine), measuring fails, or ``shipped``
   was asked for: the closest shipped profile, with a ShippedProfileWarning naming it: one made for this
   device name (a measured one first), else for a CUDA device the one nearest in memory, else ``h100-sxm``
   for CUDA and the shipped CPU profile for a CPU.
4. ``measure``: measure now even when a cached profile exists, and cache the result.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from udnn_lab.devices import device_name
from udnn_lab.errors import HardwareProfileError, ShippedProfileWarning, UnknownHardwareError
from udnn_lab.hardware.host_probes import HOOKS_BY_PATH, host_probes
from udnn_lab.hardware.profiles import Hardware, _name_key

HARDWARE_VARIABLE = "UDNN_LAB_HARDWARE"
CACHE_VARIABLE = "UDNN_LAB_CACHE_DIR"
CHOICES = ("auto", "measure", "shipped")
PREDICTED_DEVICE = "cuda"  # what a search, MemoryLab, the report and the CLI predict for when not told: GPU memory
DEFAULT_CUDA_PROFILE = "h100-sxm"  # the GPU most training runs on today; where nothing is known of the device


@dataclass(frozen=True)
class MachineDevice:
    """What the rule needs to know of the device a graph is for: its type, and whether and what it is here."""

    device_type: str  # "cpu" or "cuda"
    here: bool  # a device of this type is on this machine (so it can be measured)
    name: str | None = None  # as torch or /proc/cpuinfo names it; None when not here
    memory_bytes: int | None = None  # CUDA: total memory of the device here

    @classmethod
    def of(cls, device_type: str) -> MachineDevice:
        if device_type == "cpu":
            return cls("cpu", True, device_name("cpu"))
        if device_type == "cuda" and torch.cuda.is_available():
            return cls("cuda", True, device_name("cuda"), torch.cuda.get_device_properties(0).total_memory)
        if device_type == "cuda":
            return cls("cuda", False)
        raise ValueError(f"no hardware profile for a {device_type!r} graph: trace for 'cpu' or 'cuda'")

    @property
    def cache_key(self) -> str:
        cpus = f"-{os.cpu_count()}cpu" if self.device_type == "cpu" else ""
        return f"{_slug(self.name or 'unknown')}{cpus}-torch{_slug(torch.__version__)}"


def machine_hardware(device_type: str, choice: str | None = None, progress: bool = True,
                     measure: Callable[[str, bool], Hardware] | None = None) -> Hardware:
    """The profile for a graph on ``device_type`` under ``choice`` (NOTE [the profile for this machine]).

    ``choice`` None reads ``UDNN_LAB_HARDWARE``; ``measure`` (device type, progress) -> Hardware is
    ``Hardware.measure`` unless a caller (a test) gives another.
    """
    device = MachineDevice.of(device_type)
    choice = _choice_for(device_type, choice)
    if choice not in CHOICES:
        return Hardware.load(choice)
    if device.here and choice != "shipped":
        cached = None if choice == "measure" else load_cached(device)
        if cached is not None:
            return with_datasheet_links(cached)
        measured = _measured(device, progress, measure or (lambda kind, bar: Hardware.measure(kind, progress=bar)))
        if measured is not None:
            return with_datasheet_links(measured)
    return with_datasheet_links(closest_shipped(device))


LINK_FIGURES = ("gpus_per_node", "intra_node_bytes_per_s", "intra_node_latency_s", "inter_node_bytes_per_s",
                "inter_node_latency_s", "host_memory_bytes_per_s")


def with_datasheet_links(hardware: Hardware) -> Hardware:
    """A measured GPU profile, which has no figures for links between GPUs (they are not measured on one),
    with those of the datasheet profile for the same device, each source saying so; otherwise as it is."""
    if hardware.device_type != "cuda" or hardware.gpus_per_node is not None:
        return hardware
    names = {_name_key(name) for name in hardware.device_names}
    datasheet = next((p for p in map(Hardware.load, Hardware.names()) if p.device_type == "cuda"
                      and p.gpus_per_node is not None and names & {_name_key(n) for n in p.device_names}), None)
    if datasheet is None:
        return hardware
    data = hardware.to_dict()
    for figure in LINK_FIGURES:
        value = getattr(datasheet, figure)
        data[figure] = value
        if value is not None:
            data["sources"][figure] = f"the shipped profile {datasheet.name!r}: {datasheet.sources[figure]}"
    return Hardware.from_dict(data, origin=f"{hardware.name} with {datasheet.name}'s links")


def closest_shipped(device: MachineDevice) -> Hardware:
    """The shipped profile nearest to ``device`` (NOTE [the profile for this machine] 3), with a warning."""
    shipped = [profile for profile in map(Hardware.load, Hardware.names()) if profile.device_type == device.device_type]
    same_name = [p for p in shipped if device.name and _name_key(device.name) in {_name_key(n) for n in p.device_names}]
    if same_name:
        chosen = next((p for p in same_name if p.measured), same_name[0])
        why = f"it was made for {device.name!r} on another machine"
    elif device.device_type == "cuda" and device.memory_bytes:
        chosen = min(shipped, key=lambda p: _nearness(p, device))
        why = f"no shipped profile is for {device.name!r}; it is the one nearest in memory"
    elif device.device_type == "cuda":
        chosen = Hardware.load(DEFAULT_CUDA_PROFILE)
        why = "there is no CUDA device here to measure"
    else:
        chosen = shipped[0]
        why = f"no shipped profile is for {device.name!r}"
    warnings.warn(f"simulating on the shipped profile {chosen.name!r} ({chosen.title}): {why}. Name the profile to "
                  f"use with hardware= (--hardware, or {HARDWARE_VARIABLE}), or measure the device with "
                  "ul.Hardware.measure()", ShippedProfileWarning,
                  stacklevel=3)
    return chosen


def _nearness(profile: Hardware, device: MachineDevice) -> tuple[int, float]:
    """Memory apart in whole GiB, then names unlike (an RTX 3090 is nearer the RTX 4090 than the L4, both 24 GiB)."""
    apart = abs(profile.memory_bytes - (device.memory_bytes or 0)) >> 30
    likeness = max(difflib.SequenceMatcher(None, _name_key(device.name or ""), _name_key(name)).ratio()
                   for name in profile.device_names)
    return apart, -likeness


def cache_dir() -> Path:
    """Where measured profiles are kept: ``UDNN_LAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/udnn_lab``."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "udnn_lab"


def cached_path(device: MachineDevice) -> Path:
    return cache_dir() / "hardware" / f"{device.cache_key}.json"


def load_cached(device: MachineDevice) -> Hardware | None:
    """The profile measured here before for this device and torch, if one was cached and still reads."""
    path = cached_path(device)
    if not path.is_file():
        return None
    try:
        cached = Hardware.load(path)
    except (HardwareProfileError, OSError):
        return None  # a file cut short or from another version: measured again and replaced
    host = (cached.dispatch_mode_op_s,) + ((cached.hook_call_s, cached.offload_action_s, cached.replay_op_s)
                                           if host_probes() else ())  # NOTE [host probes] 2
    if host_probes() and HOOKS_BY_PATH not in cached.sources.get("hook_call_s", ""):
        return None  # its hook calls measured before the runtime hooked modules by path
    return cached if None not in host else None  # measured before those figures were


def save_cached(device: MachineDevice, hardware: Hardware) -> Path | None:
    """Write atomically (several processes may measure at once); None where the cache cannot be written."""
    path = cached_path(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            json.dump(hardware.to_dict(), handle, indent=2)
        os.replace(handle.name, path)
    except OSError:
        return None
    return path


def _measured(device: MachineDevice, progress: bool, measure: Callable[[str, bool], Any]) -> Hardware | None:
    try:
        hardware = measure(device.device_type, progress)
    except (RuntimeError, OSError, HardwareProfileError) as error:
        warnings.warn(f"could not measure this machine's {device.device_type} ({error}); using a shipped profile",
                      ShippedProfileWarning, stacklevel=4)
        return None
    save_cached(device, hardware)
    return hardware


def _choice_for(device_type: str, choice: str | None) -> str:
    """``choice``, else the part of ``UDNN_LAB_HARDWARE`` for this device type, else "auto"."""
    if choice is not None:
        return choice.strip()
    words = [word.strip() for word in os.environ.get(HARDWARE_VARIABLE, "").split(",") if word.strip()]
    for word in words:
        if word in CHOICES or _profile_device_type(word) == device_type:
            return word
    return "auto"


def _profile_device_type(name: str) -> str:
    try:
        return Hardware.load(name).device_type
    except (UnknownHardwareError, HardwareProfileError) as error:
        raise HardwareProfileError(f"{HARDWARE_VARIABLE}={os.environ.get(HARDWARE_VARIABLE)!r}: {error}") from None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")

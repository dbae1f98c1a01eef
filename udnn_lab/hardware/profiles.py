"""Hardware profiles: what a device holds, computes and moves, with a source for every figure.

A profile comes from ``data/hardware/<name>.json`` (datasheet figures, for what-if analysis)
or from ``Hardware.measure()`` on the machine at hand. Sizes are int bytes, rates are
per second, times are float seconds; every figure names its source in ``sources``.

Conventions:
- ``memory_bytes_per_s`` counts read + write traffic (as datasheets and STREAM do), so a
  device-to-device copy of n bytes in t seconds is 2n/t.
- Transfer figures count bytes copied: a copy of n bytes takes
  ``latency_s + n / bytes_per_s`` (``transfer_time_s``).
- On a CPU-only machine "host" and "device" are the same RAM, so its transfer figures
  are memcpy figures, and pinned equals pageable.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pandas as pd
import torch

from udnn_lab.devices import as_device, device_name
from udnn_lab.errors import HardwareMismatchWarning, HardwareProfileError, UnknownHardwareError
from udnn_lab.hardware.machine_probes import measure_hardware
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.vocabulary import DIRECTIONS, memory_kind

_PACKAGE = Path(__file__).resolve().parents[1]
# data/ of a source checkout (editable install), else the copy a wheel carries inside the package
DATA_DIR = next((d for d in (_PACKAGE.parent / "data", _PACKAGE / "data") if (d / "hardware").is_dir()),
                _PACKAGE.parent / "data")
PROFILE_DIR = DATA_DIR / "hardware"


def _figure(kind: str, **kwargs: Any) -> Any:
    return field(metadata={"kind": kind}, **kwargs)


@dataclass(frozen=True, kw_only=True, repr=False)
class Hardware:
    """One device: capacity, peak compute, memory and host-link bandwidths, and their sources."""

    name: str = _figure("text")  # profile id, the JSON file's stem, e.g. "h100-sxm"
    title: str = _figure("text")  # what people call it, e.g. "NVIDIA H100 SXM5 80 GB"
    device_type: str = _figure("device_type")  # "cuda" or "cpu"
    device_names: tuple[str, ...] = _figure("names")  # as torch.cuda.get_device_name / /proc/cpuinfo say
    measured: bool = _figure("flag")  # True: figures measured here; False: datasheet or typical values
    memory_bytes: int = _figure("bytes")  # device memory capacity
    memory_bytes_per_s: float = _figure("rate")  # device memory bandwidth, read + write
    fp32_flops_per_s: float = _figure("rate")  # peak (datasheet) or best achieved (measured), IEEE fp32
    tf32_flops_per_s: float | None = _figure("rate?", default=None)  # dense tensor-core TF32; None: none
    bf16_flops_per_s: float | None = _figure("rate?", default=None)  # dense; None: not supported
    fp16_flops_per_s: float | None = _figure("rate?", default=None)  # dense (tensor cores where present)
    matmul_fp32_achieved_flops_per_s: float | None = _figure("rate?", default=None)  # measured only
    conv_fp32_achieved_flops_per_s: float | None = _figure("rate?", default=None)  # measured only
    h2d_pinned_bytes_per_s: float = _figure("rate")
    h2d_pinned_latency_s: float = _figure("seconds")
    h2d_pageable_bytes_per_s: float = _figure("rate")
    h2d_pageable_latency_s: float = _figure("seconds")
    d2h_pinned_bytes_per_s: float = _figure("rate")
    d2h_pinned_latency_s: float = _figure("seconds")
    d2h_pageable_bytes_per_s: float = _figure("rate")
    d2h_pageable_latency_s: float = _figure("seconds")
    # collectives between GPUs (NOTE [collectives] in simulation/_communication.py); None: no multi-GPU figure
    gpus_per_node: int | None = _figure("count?", default=None)  # GPUs in one node of the usual system (DGX: 8)
    intra_node_bytes_per_s: float | None = _figure("rate?", default=None)  # GPU to GPU in a node, per direction
    intra_node_latency_s: float | None = _figure("seconds?", default=None)  # per step of a ring inside a node
    inter_node_bytes_per_s: float | None = _figure("rate?", default=None)  # per GPU across nodes (its NIC), each way
    inter_node_latency_s: float | None = _figure("seconds?", default=None)  # per step of a ring across nodes
    host_memory_bytes_per_s: float | None = _figure("rate?", default=None)  # one node's host memory, read + write
    # host seconds a Python dispatch mode adds to each op: what a step followed op by op pays (NOTE [simulated
    # streams] 6); measured only (Hardware.measure), None: not measured, and such steps are not priced
    dispatch_mode_op_s: float | None = _figure("seconds?", default=None)
    # host seconds of the runtime's own work when it follows a step by its hooks (NOTE [simulated streams] 6): per
    # module or saved-tensor hook call it handles, per offload it carries out (a copy's bytes aside), per op a
    # recomputation records and re-runs (the op's own time aside); measured only (Hardware.measure, by the
    # runtime's host probe: NOTE [host probes]), None: not measured, and that work is not priced
    hook_call_s: float | None = _figure("seconds?", default=None)
    offload_action_s: float | None = _figure("seconds?", default=None)
    replay_op_s: float | None = _figure("seconds?", default=None)
    sources: Mapping[str, str] = _figure("sources", hash=False)  # figure field name -> where it comes from
    notes: str = _figure("notes", default="")

    def __post_init__(self) -> None:
        for spec in fields(self):
            object.__setattr__(self, spec.name, _checked(spec.name, spec.metadata["kind"], getattr(self, spec.name)))
        _check_sources(self)

    def __repr__(self) -> str:
        how = "measured" if self.measured else "datasheet"
        return (f"Hardware({self.name!r}, {self.title!r}, {how}, memory={format_bytes(self.memory_bytes)}, "
                f"fp32={self.fp32_flops_per_s / 1e12:.3g} TFLOP/s, "
                f"h2d pinned={format_bytes(int(self.h2d_pinned_bytes_per_s))}/s)")

    # ---- loading and saving -------------------------------------------------------------

    @staticmethod
    def names() -> list[str]:
        """Names of the shipped profiles (stems of ``data/hardware/*.json``)."""
        return sorted(path.stem for path in PROFILE_DIR.glob("*.json"))

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, device: str | torch.device | None = None) -> Hardware:
        """A shipped profile by name (case, '-', '_' and spaces ignored) or a profile JSON by path.

        With ``device``, warn (HardwareMismatchWarning) when the profile was made for another device.
        """
        path = _profile_path(name_or_path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise HardwareProfileError(f"cannot read hardware profile {path}: {error}") from None
        except json.JSONDecodeError as error:
            raise HardwareProfileError(
                f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
                "fix the file or make it again with Hardware.measure() and .save()") from None
        hardware = cls.from_dict(data, origin=str(path))
        if device is not None:
            hardware.check_matches(device)
        return hardware

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "hardware profile") -> Hardware:
        """Build and validate a profile; errors name ``origin`` (e.g. the file) and the bad field."""
        if not isinstance(data, Mapping):
            raise HardwareProfileError(f"{origin}: a hardware profile is a JSON object, got {type(data).__name__}")
        known = [spec.name for spec in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise HardwareProfileError(f"{origin}: unknown field(s) {unknown}; a profile has the fields {known}")
        missing = [spec.name for spec in fields(cls) if spec.name not in data and _is_required(spec)]
        if missing:
            raise HardwareProfileError(f"{origin}: missing field(s) {missing}; add them (a figure needs a "
                                       "value and an entry in 'sources')")
        try:
            return cls(**data)
        except HardwareProfileError as error:
            raise HardwareProfileError(f"{origin}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; ``Hardware.from_dict(hw.to_dict()) == hw``."""
        data = {spec.name: getattr(self, spec.name) for spec in fields(self)}
        data["device_names"] = list(self.device_names)
        data["sources"] = dict(self.sources)
        return data

    def __reduce__(self):  # its sources are a read-only mapping, which does not pickle: rebuilt from the dict
        return Hardware.from_dict, (self.to_dict(), f"pickled profile {self.name!r}")

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    # ---- figures for the cost model -----------------------------------------------------

    def bandwidth_bytes_per_s(self, direction: str = "h2d", pinned: bool = True) -> float:
        return getattr(self, f"{_direction(direction)}_{memory_kind(pinned)}_bytes_per_s")

    def latency_s(self, direction: str = "h2d", pinned: bool = True) -> float:
        return getattr(self, f"{_direction(direction)}_{memory_kind(pinned)}_latency_s")

    def transfer_time_s(self, nbytes: int | str, direction: str = "h2d", pinned: bool = True) -> float:
        """Seconds to copy ``nbytes`` across the host link: latency + bytes / bandwidth; 0 for 0 bytes."""
        size = parse_bytes(nbytes)
        if size == 0:
            return 0.0
        return self.latency_s(direction, pinned) + size / self.bandwidth_bytes_per_s(direction, pinned)

    def peak_flops_per_s(self, dtype: torch.dtype | str = torch.float32, tf32: bool = False) -> float:
        """Peak rate for ``dtype``; where the device has no faster path for it, the fp32 rate."""
        keys: dict[torch.dtype | str, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        key = keys.get(dtype, dtype)
        if key not in ("fp32", "tf32", "bf16", "fp16"):
            raise ValueError(f"no FLOP rate for {dtype!r}: use torch.float32, torch.bfloat16, torch.float16 "
                             "or 'fp32', 'tf32', 'bf16', 'fp16'")
        if key == "fp32" and tf32:
            key = "tf32"
        rate = getattr(self, f"{key}_flops_per_s")
        return self.fp32_flops_per_s if rate is None else rate

    def check_matches(self, device: str | torch.device | None = None) -> bool:
        """True when this profile describes ``device``; otherwise warn and return False."""
        device = as_device(device)
        actual = device_name(device)
        if device.type == self.device_type and _name_key(actual) in {_name_key(n) for n in self.device_names}:
            return True
        warnings.warn(
            f"hardware profile {self.name!r} describes {self.title} ({self.device_type}), but {device} is "
            f"{actual!r}: its bandwidths and FLOP rates may not hold here. Measure this device with "
            f"Hardware.measure({str(device)!r}) or load a profile made for it (shipped: {Hardware.names()})",
            HardwareMismatchWarning, stacklevel=2)
        return False

    # ---- measuring the machine at hand --------------------------------------------------

    @classmethod
    def measure(cls, device: str | torch.device | None = None, sizes: Iterable[int | str] | None = None,
                repeats: int = 5, matmul_size: int | None = None, conv_size: int | None = None,
                progress: bool = True, collectives: bool = False) -> Hardware:
        """Measure the device (default: CUDA if present, else CPU) and return its profile.

        ``collectives=True`` (CPU): also time all-reduces between two gloo ranks on this machine, the link
        figures a CPU rank of several is simulated with (a few seconds more). ``measure_with_sweep`` takes the
        same arguments and also returns the copy sweep. See :func:`udnn_lab.hardware.machine_probes.measure_hardware`.
        """
        return cls.measure_with_sweep(device, sizes, repeats, matmul_size, conv_size, progress, collectives)[0]

    @classmethod
    def measure_with_sweep(cls, device: str | torch.device | None = None, sizes: Iterable[int | str] | None = None,
                           repeats: int = 5, matmul_size: int | None = None, conv_size: int | None = None,
                           progress: bool = True, collectives: bool = False) -> tuple[Hardware, pd.DataFrame]:
        """Measure the device as ``measure`` does: the profile, and the copy sweep (one row per copy size)."""
        figures, sweep = measure_hardware(device, sizes, repeats, matmul_size, conv_size, progress, collectives)
        return cls(**figures), sweep


# ---- validation ---------------------------------------------------------------------------

def _is_required(spec: Any) -> bool:
    return spec.default is MISSING


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


# kind -> (is the value acceptable, what it must be (for the error), its inside form)
_KINDS: Mapping[str, tuple[Callable[[Any], bool], str, Callable[[Any], Any]]] = MappingProxyType({
    "text": (_is_text, "a non-empty string", str),
    "notes": (lambda v: isinstance(v, str), "a string", str),
    "device_type": (lambda v: v in ("cuda", "cpu"), "'cuda' or 'cpu'", str),
    "names": (lambda v: isinstance(v, (list, tuple)) and bool(v) and all(map(_is_text, v)),
              "a non-empty list of device names (strings)", tuple),
    "flag": (lambda v: isinstance(v, bool), "true or false", bool),
    "bytes": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
              "a positive whole number of bytes", int),
    "rate": (lambda v: _is_number(v) and v > 0, "a positive number (per second)", float),
    "rate?": (lambda v: v is None or (_is_number(v) and v > 0), "a positive number (per second) or null",
              lambda v: None if v is None else float(v)),
    "seconds": (lambda v: _is_number(v) and v >= 0, "a number of seconds, zero or more", float),
    "seconds?": (lambda v: v is None or (_is_number(v) and v >= 0), "a number of seconds, zero or more, or null",
                 lambda v: None if v is None else float(v)),
    "count?": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
               "a positive whole number or null", lambda v: v),
    "sources": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and _is_text(t) for k, t in v.items()),
                "an object mapping each figure's field name to a non-empty source string",
                lambda v: MappingProxyType(dict(v))),
})


def _checked(name: str, kind: str, value: Any) -> Any:
    """``value`` in its inside form (tuple, float, read-only mapping), or an error naming the field."""
    acceptable, expected, inside = _KINDS[kind]
    if not acceptable(value):
        raise HardwareProfileError(f"field {name!r} must be {expected}, got {value!r}")
    return inside(value)


_FIGURE_KINDS = ("bytes", "rate", "rate?", "seconds", "seconds?", "count?")


def _check_sources(hardware: Hardware) -> None:
    figures = [spec.name for spec in fields(hardware) if spec.metadata["kind"] in _FIGURE_KINDS]
    stray = sorted(set(hardware.sources) - set(figures))
    if stray:
        raise HardwareProfileError(f"field 'sources' names {stray}, which are not figures; figures are {figures}")
    for name in figures:
        if getattr(hardware, name) is not None and name not in hardware.sources:
            raise HardwareProfileError(f"field {name!r} has no source: add 'sources': {{{name!r}: "
                                       "'<datasheet or paper title / URL, or how it was measured>'}}")


def _profile_path(name_or_path: str | os.PathLike) -> Path:
    text = os.fspath(name_or_path)
    if text.endswith(".json") or os.sep in text or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise HardwareProfileError(f"no hardware profile file at {path}; give an existing .json file "
                                       f"or a shipped name: {Hardware.names()}")
        return path
    by_key = {_name_key(stem): PROFILE_DIR / f"{stem}.json" for stem in Hardware.names()}
    if _name_key(text) not in by_key:
        raise UnknownHardwareError(f"unknown hardware {text!r}; known: {Hardware.names()}. Or pass a path to "
                                   "a profile .json, or measure this machine with Hardware.measure()")
    return by_key[_name_key(text)]


def _name_key(text: str) -> str:
    """'NVIDIA GeForce GTX 1080 Ti' and 'GeForce GTX 1080 Ti' compare equal; so do 'h100-sxm', 'H100_SXM'."""
    words = re.sub(r"\b(nvidia|geforce|tesla)\b", "", text.lower())
    return re.sub(r"[^a-z0-9]", "", words)


def _direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'h2d' (host to device) or 'd2h' (device to host), got {direction!r}")
    return direction


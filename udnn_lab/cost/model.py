"""Per-op compute time and per-copy transfer time: what the simulator charges for each step.

Compute time comes from a Profile of the same step when one is given; otherwise from a
roofline, ``overhead + max(FLOPs / achieved rate, bytes / memory bandwidth)``, where the
achieved rate depends on the op's kind and size (document 000's ``FLOPS(FLOPs_l)``): a
RateCurve fitted on profiles taken on the device, or the Hardware profile's figures.
Transfers cost ``latency + bytes / bandwidth`` for pinned or pageable host memory.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from udnn_lab.cost.profiling import Profile
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware.profiles import DATA_DIR, Hardware, HardwareMismatchWarning

RATES_DIR = DATA_DIR / "rates"
HOST_READ = "aten._local_scalar_dense.default"  # Tensor.item(): the host waits for the op (NOTE [simulated streams] 9)
CUDA_LAUNCH_S = 5e-6  # an eager kernel launch: what a tiny op costs on a GPU when nothing is measured
_MIN_MEMORY_OP_BYTES = 1 << 20  # memory-bound ops below this are dominated by overhead, not bandwidth
_TINY_OP_BYTES = 4096


def op_kind(name: str, flops: int) -> str:
    """conv, conv_backward, matmul, attention, other (counted FLOPs) or memory (no FLOPs)."""
    if "convolution_backward" in name:
        return "conv_backward"
    if "convolution" in name:
        return "conv"
    if any(f"aten.{k}." in name for k in ("mm", "addmm", "bmm", "baddbmm")):
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    return "other" if flops > 0 else "memory"


@dataclass(frozen=True)
class RateCurve:
    """What ops achieve on one device: FLOP/s against op size, bytes/s, and a per-op overhead.

    Rates are kept per op name (``aten.addmm.default``) and per kind of op (``kind:matmul``,
    ``kind:memory``); a look-up tries the name first, then the kind. An op computing in half precision has its own
    keys (``kind:matmul@bfloat16``): on a GPU with tensor cores it runs many times the float32 rate, and one median
    over both is right for neither. A curve fitted without dtypes (no ``@`` key) stands for every dtype.
    """

    device_name: str
    points: Mapping[str, tuple[tuple[float, float], ...]]  # name or kind -> ((flops, flops per s), ...), ascending
    bytes_per_s: Mapping[str, float]  # name or kind -> bytes read + written per second, for ops without FLOPs
    op_overhead_s: float  # what an op costs beyond its work (dispatch, launch)
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def flops_per_s(self, name: str, flops: float, dtype: str = "float32") -> float | None:
        """Interpolated in log-log space; clamped at both ends; None if neither name nor kind was measured (in
        ``dtype``'s precision, where the curve was fitted per precision)."""
        tag = _precision_tag(dtype) if self.per_precision else ""
        points = self.points.get(name + tag) or self.points.get(f"kind:{op_kind(name, int(flops) or 1)}{tag}")
        if not points:
            return None
        xs = np.log([p[0] for p in points])
        ys = np.log([p[1] for p in points])
        return float(np.exp(np.interp(math.log(max(flops, 1.0)), xs, ys)))

    def memory_bytes_per_s(self, name: str) -> float | None:
        return self.bytes_per_s.get(name) or self.bytes_per_s.get("kind:memory")

    @functools.cached_property
    def per_precision(self) -> bool:
        """Fitted with each op's compute dtype: half-precision ops have keys of their own."""
        return any("@" in key for key in self.points)

    @classmethod
    def fit(cls, profiles: Iterable[Profile], source: str = "",
            dtypes: Iterable[Sequence[str] | None] | None = None) -> RateCurve:
        """Fit on ops timed by ``ul.profile`` on one device: median rate per name (and kind), size bin and, where
        ``dtypes`` gives each profile's ops' compute dtypes (None for a profile without them: float32), precision."""
        profiles = list(profiles)
        if not profiles:
            raise ValueError("fitting a rate curve needs at least one Profile")
        if len({p.device_name for p in profiles}) > 1:
            raise ValueError(f"profiles from several devices ({sorted({p.device_name for p in profiles})}): "
                             "fit one curve per device")
        per_op = list(dtypes) if dtypes is not None else [None] * len(profiles)
        if len(per_op) != len(profiles) or any(d is not None and len(d) != len(p.ops)
                                               for p, d in zip(profiles, per_op)):
            raise ValueError("dtypes: one sequence of compute dtypes per profile, one per op (or None)")
        rows = [(*row, _precision_tag(dtype)) for p, d in zip(profiles, per_op)
                for row, dtype in zip(zip(p.ops, p.flops, p.bytes_read, p.bytes_written, p.time_s),
                                      d or ("float32",) * len(p.ops))]
        tiny = [t for _, flops, r, w, t, _ in rows if flops == 0 and r + w <= _TINY_OP_BYTES]
        overhead = statistics.median(tiny) if tiny else 0.0
        bins: dict[tuple[str, int], list[float]] = defaultdict(list)
        bandwidths: dict[str, list[float]] = defaultdict(list)
        for name, flops, read, written, seconds, tag in rows:
            work_s = max(seconds - overhead, seconds * 0.05, 1e-9)
            if flops > 0:
                for key in (name + tag, f"kind:{op_kind(name, flops)}{tag}"):
                    bins[(key, int(math.log2(flops)))].append(flops / work_s)
            elif read + written >= _MIN_MEMORY_OP_BYTES:
                for key in (name, "kind:memory"):
                    bandwidths[key].append((read + written) / work_s)
        points: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (key, exponent), rates in sorted(bins.items()):
            points[key].append((float(2 ** exponent * math.sqrt(2)), statistics.median(rates)))
        return cls(device_name=profiles[0].device_name, points={k: tuple(v) for k, v in points.items()},
                   bytes_per_s={k: statistics.median(v) for k, v in bandwidths.items()},
                   op_overhead_s=overhead, source=source or f"fitted on {', '.join(p.model_name for p in profiles)}")

    def to_dict(self) -> dict:
        return {"device_name": self.device_name, "points": {k: [list(p) for p in v] for k, v in self.points.items()},
                "bytes_per_s": dict(self.bytes_per_s), "op_overhead_s": self.op_overhead_s,
                "source": self.source, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: Mapping, origin: str = "rate curve") -> RateCurve:
        try:
            points = {str(k): tuple((float(f), float(r)) for f, r in v) for k, v in data["points"].items()}
            return cls(device_name=str(data["device_name"]), points=points,
                       bytes_per_s={str(k): float(v) for k, v in data["bytes_per_s"].items()},
                       op_overhead_s=float(data["op_overhead_s"]), source=str(data.get("source", "")),
                       notes=tuple(data.get("notes", ())))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{origin}: malformed rate curve ({type(err).__name__}: {err}); expected fields "
                             "device_name, points {name: [[flops, flops_per_s], ...]}, bytes_per_s {name: rate}, "
                             "op_overhead_s") from err

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> RateCurve:
        path = Path(path)
        return cls.from_dict(json.loads(path.read_text()), origin=str(path))

    @classmethod
    def for_hardware(cls, hardware: Hardware) -> RateCurve | None:
        """The curve kept for this hardware profile (data/rates/<name>.json), if one was fitted."""
        path = RATES_DIR / f"{hardware.name}.json"
        return cls.load(path) if path.exists() else None


@dataclass(frozen=True)
class CostModel:
    """Times for the simulator: ops from a Profile or a roofline, copies from the Hardware profile.

    ``memo`` keeps what was computed under this model (op times per graph, simulations per
    plan) for planners that ask again; it is never compared or shown.
    """

    hardware: Hardware
    profile: Profile | None = None
    rates: RateCurve | None = None
    ranks_per_node: int | None = None  # for collectives: ranks sharing a node (None: the profile's gpus_per_node)
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def op_times_s(self, graph: Graph) -> np.ndarray:
        """Compute time of every op of ``graph``, in seconds."""
        key = ("op_times", id(graph), graph.fingerprint)
        if key not in self.memo:
            self.memo[key] = self._op_times_s(graph)
        return self.memo[key]

    def _op_times_s(self, graph: Graph) -> np.ndarray:
        if self.profile is not None:
            self.profile.check_matches(graph)
            if self.profile.device_name not in self.hardware.device_names:
                warnings.warn(f"the profile was taken on {self.profile.device_name}, but the hardware profile is "
                              f"{self.hardware.title}: its op times may not hold there", HardwareMismatchWarning,
                              stacklevel=2)
            return np.asarray(self.profile.time_s) + self.profile.overhead_per_op_s
        return np.array([self.roofline_s(op.name, op.flops, op.bytes_read + op.bytes_written, _compute_dtype(graph, op))
                         for op in graph.ops])

    def host_op_times_s(self, graph: Graph) -> np.ndarray:
        """Host seconds each op of ``graph`` takes to be issued on CUDA (NOTE [simulated streams] 9): the profile's
        ``host_time_s``; zeros where not measured."""
        key = ("host_op_times", id(graph), graph.fingerprint)
        if key not in self.memo:
            self.memo[key] = self._host_op_times_s(graph)
        return self.memo[key]

    def _host_op_times_s(self, graph: Graph) -> np.ndarray:
        profile = self.profile
        if profile is None or profile.device != "cuda" or profile.host_time_s is None:
            return np.zeros(len(graph.ops))
        profile.check_matches(graph)
        seconds = np.asarray(profile.host_time_s, dtype=float)
        # a read's measured host time is mostly its wait for the device, which the simulator models itself
        seconds[[op.index for op in graph.ops if op.name == HOST_READ]] = 0.0
        return seconds

    @property
    def dispatch_mode_op_s(self) -> float:
        """Host seconds a step followed op by op pays per op (NOTE [simulated streams] 6): the profiled step's own
        figure where there is one, else the hardware profile's; 0 where neither was measured."""
        return self._step_first("dispatch_mode_op_s")

    @property
    def hook_call_s(self) -> float:
        """Host seconds the runtime spends per hook call it handles (NOTE [simulated streams] 6): the profiled step's
        own figure where there is one (NOTE [host probes] 4), else the hardware profile's; 0 where neither was
        measured."""
        return self._step_first("hook_call_s")

    @property
    def offload_action_s(self) -> float:
        """Host seconds of one offload's actions, its copies' bytes aside (NOTE [simulated streams] 6): the profiled
        step's own figure where there is one (NOTE [host probes] 4), else the hardware profile's."""
        return self._step_first("offload_action_s")

    @property
    def runtime_step_s(self) -> float:
        """Host seconds of the runtime's own work once per step it follows (NOTE [simulated streams] 6): the
        profiled step's figure (NOTE [host probes] 4); 0 where it was not measured."""
        return self._step_first("runtime_step_s")

    @property
    def replay_op_s(self) -> float:
        """Host seconds a recomputation adds to each op it records and re-runs, the op aside (NOTE [simulated
        streams] 6): the profiled step's own figure where there is one (NOTE [host probes] 4), else the hardware
        profile's; 0 where neither was measured."""
        return self._step_first("replay_op_s")

    @property
    def replay_recompute_s(self) -> float:
        """Host seconds each recomputation the runtime records and replays costs besides its ops (NOTE [simulated
        streams] 6): the profiled step's figure (NOTE [host probes] 4); 0 where it was not measured."""
        return self._step_first("replay_recompute_s")

    @property
    def recording_step_s(self) -> float:
        """Host seconds a step in which the runtime records a recomputation costs once (NOTE [simulated streams] 6):
        the profiled step's figure (NOTE [host probes] 4); 0 where it was not measured."""
        return self._step_first("recording_step_s")

    @property
    def rerun_call_s(self) -> float:
        """Host seconds each module call the runtime re-runs to recompute costs beyond its ops and packs (NOTE
        [simulated streams] 6): the profiled step's figure (NOTE [host probes] 4); 0 where it was not measured."""
        return self._step_first("rerun_call_s")

    def _step_first(self, figure: str) -> float:
        """A host figure: the profiled step's own where it was measured there, else the hardware profile's (which has
        no figure of some names); 0 where neither was measured."""
        measured = getattr(self.profile, figure) if self.profile is not None else None
        if measured is None:
            measured = getattr(self.hardware, figure, None)
        return measured or 0.0

    def roofline_s(self, name: str, flops: int, nbytes: int, dtype: str = "float32") -> float:
        """``overhead + max(flops / achieved rate, bytes / memory bandwidth)`` for one op computing in ``dtype``."""
        rate = self.rates.flops_per_s(name, flops, dtype) if self.rates is not None and flops else None
        if rate is None:
            rate = self._hardware_rate(op_kind(name, flops), dtype)
        bandwidth = self.rates.memory_bytes_per_s(name) if self.rates is not None else None
        bandwidth = bandwidth or self.hardware.memory_bytes_per_s
        work = max(flops / rate if flops else 0.0, nbytes / bandwidth if nbytes else 0.0)
        return self._overhead_s() + work

    def transfer_time_s(self, nbytes: int, direction: str, pinned: bool = True) -> float:
        """``latency + bytes / bandwidth`` for a copy of ``nbytes`` (0 for nothing). On a CPU whose profiled step
        measured an offload's actions (NOTE [host probes] 4), the copies' calls were timed in them, the host making
        the copies itself: the latency, a copy's call, is not added again; and where it measured what the runtime's
        copies cost in the step (``Profile.copy_bytes_per_s``), that is the rate."""
        if nbytes <= 0:
            return 0.0
        key = ("link", direction, pinned)
        if key not in self.memo:
            cpu_step = self.profile if self.hardware.device_type == "cpu" else None
            in_actions = cpu_step is not None and cpu_step.offload_action_s is not None
            step_rate = cpu_step.copy_bytes_per_s if cpu_step is not None else None
            self.memo[key] = (0.0 if in_actions else self.hardware.latency_s(direction, pinned),
                              step_rate or self.hardware.bandwidth_bytes_per_s(direction, pinned))
        latency, bandwidth = self.memo[key]
        return latency + nbytes / bandwidth

    def _hardware_rate(self, kind: str, dtype: str = "float32") -> float:
        hw = self.hardware
        achieved = None
        if kind in ("conv", "conv_backward"):
            achieved = hw.conv_fp32_achieved_flops_per_s
        elif kind in ("matmul", "attention"):
            achieved = hw.matmul_fp32_achieved_flops_per_s
        if dtype in _HALF and kind in _TENSOR_CORE_KINDS:
            # tensor cores: the half-precision peak, at the efficiency the device reaches in fp32
            return hw.peak_flops_per_s(_HALF[dtype]) * ((achieved or hw.fp32_flops_per_s) / hw.fp32_flops_per_s)
        return achieved or hw.fp32_flops_per_s

    def _overhead_s(self) -> float:
        if self.rates is not None:
            return self.rates.op_overhead_s
        return CUDA_LAUNCH_S if self.hardware.device_type == "cuda" else 0.0


_HALF = {"bfloat16": "bf16", "float16": "fp16"}  # the names Hardware.peak_flops_per_s takes
_TENSOR_CORE_KINDS = ("conv", "conv_backward", "matmul", "attention")


def _precision_tag(dtype: str) -> str:
    """A rate curve key's suffix for ops computing in ``dtype``: none for float32 (and what is not half)."""
    return f"@{dtype}" if dtype in _HALF else ""


def _compute_dtype(graph: Graph, op) -> str:
    """The dtype an op computes in: that of its first output (else first input) storage."""
    for tensor in (*op.outputs, *op.inputs):
        return graph.tensors[tensor].dtype.removeprefix("torch.")
    return "float32"

"""The Graph of one training step: aten ops in execution order and the storages they touch.

A Graph is plain data produced by :func:`udnn_lab.analysis.tracing`; nothing here runs torch.
Tensors are keyed by *storage*: views and in-place results share their base's
storage and add no bytes.

Step indices: op ``i`` is the i-th aten op of the step. A tensor with
``alloc_step == i`` is live from op ``i`` on; one with ``free_step == i`` is
released right after op ``i`` (so it still counts at op ``i``). ``alloc_step == -1``
means it existed before the step (parameters, inputs, optimizer state);
``free_step is None`` means it is still alive when the step ends.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from udnn_lab.graph import liveness
from udnn_lab.graph.step_records import HookEvent, ModuleCall, OpInfo, TensorInfo
from udnn_lab.units import Bytes, format_bytes
from udnn_lab.vocabulary import PHASES

# Backend variants of one op: a step traced where CPU kernels stand in for CUDA ones names the
# portable op, the real CUDA step the cuDNN one; both are the same op of the same step.
_BACKEND_VARIANTS = {
    "cudnn_batch_norm": "native_batch_norm", "miopen_batch_norm": "native_batch_norm",
    "_native_batch_norm_legit": "native_batch_norm", "_native_batch_norm_legit_functional": "native_batch_norm",
    "cudnn_batch_norm_backward": "native_batch_norm_backward",
    "miopen_batch_norm_backward": "native_batch_norm_backward",
    # sdpa's fused kernels: which one runs is the device's choice (an H200 under torch 2.11 picks cuDNN's where a
    # trace made without a GPU has FlashAttention, NOTE [stand-in attention]); their outputs come in the same order
    **{f"_scaled_dot_product_{kernel}_attention{part}": f"fused_attention{part}"
       for kernel in ("flash", "efficient", "cudnn") for part in ("", "_backward")},
}


def op_family(name: str) -> str:
    """An op's name without overload or backend variant ('aten.cudnn_batch_norm.default' -> 'native_batch_norm').

    Two steps whose ops have the same families in the same order are the same step.
    """
    base = name.split(".")[1] if name.count(".") >= 2 else name
    return _BACKEND_VARIANTS.get(base, base)


def writes_in_place(name: str) -> bool:
    """Whether an op (by its name) writes into its input: 'aten.relu_.default', 'aten.add.out'; a view, which
    also returns its input's storage, does not."""
    parts = name.split(".")
    base = parts[1] if len(parts) >= 2 else name
    overload = parts[2] if len(parts) >= 3 else ""
    return (base.endswith("_") and not base.endswith("__")) or overload.startswith("out")


@dataclass(frozen=True, repr=False, eq=False)
class Graph:
    """Ops, tensors and module calls of one traced training step (compared and hashed by identity)."""

    model_name: str
    device: str  # 'cpu' or 'cuda': the memory curve counts tensors on this device
    ops: tuple[OpInfo, ...]
    tensors: tuple[TensorInfo, ...]
    module_calls: tuple[ModuleCall, ...]
    fake: bool  # traced under FakeTensorMode (no real memory)
    torch_version: str
    notes: tuple[str, ...] = field(default=())
    # module and saved-tensor hook calls, in order; empty when the step ran other kernels than the device's
    # (CPU kernels standing in for CUDA ones save other tensors), so a runtime cannot follow them
    hook_events: tuple[HookEvent, ...] = field(default=())
    # the step writes in place, under autograd, into a storage a view shares: only then do its ops depend on view
    # replay (NOTE [view replay] 4); a graph that does not say is taken to
    rebuilds_views: bool = True
    # the names of the parameters holding a gradient at the step's end: those a PyTorch optimizer keeps state for
    # (NOTE [optimizer state of a traced step] in analysis/step.py); None where the trace did not say
    graded_parameters: frozenset[str] | None = None
    # a real step on a CPU under an offload runtime: (op, bytes) for each op its recomputations ran before, out of
    # the recording's sight, and the most live while they ran, what they made counted (NOTE [offload runtime] 6)
    replayed_bytes: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        counts = {phase: sum(op.phase == phase for op in self.ops) for phase in PHASES}
        return (
            f"Graph({self.model_name!r}, device={self.device!r}, ops={len(self.ops)} "
            f"(forward {counts['forward']}, backward {counts['backward']}, optimizer {counts['optimizer']}), "
            f"tensors={len(self.tensors)}, peak={format_bytes(self.peak_bytes)})"
        )

    # -- memory over the step ------------------------------------------------------------
    @cached_property
    def _live(self):
        return liveness.live_bytes(self)

    @property
    def peak_bytes(self) -> Bytes:
        """Most bytes live at once during the step (exact storage sizes)."""
        return Bytes(self._live.peak_bytes)

    @property
    def cuda_peak_bytes(self) -> Bytes:
        """Peak as the CUDA caching allocator would count it (``memory_allocated``)."""
        return Bytes(self._live.cuda_peak_bytes)

    @property
    def counted_peak_bytes(self) -> Bytes:
        """The peak as a budget on the step's device counts it: the caching allocator's 512-byte blocks on CUDA,
        exact bytes elsewhere."""
        return self.cuda_peak_bytes if self.device == "cuda" else self.peak_bytes

    @property
    def peak_step(self) -> int:
        """Op index at which the peak is first reached (-1: before the first op)."""
        return self._live.peak_step

    @property
    def baseline_bytes(self) -> int:
        """Bytes live before the first op: parameters, buffers, inputs, optimizer state."""
        return self._live.baseline_bytes

    @property
    def cuda_baseline_bytes(self) -> int:
        """Baseline in 512-byte CUDA blocks."""
        return self._live.baseline_cuda

    def memory_curve(self) -> pd.DataFrame:
        """One row per op: live bytes in total and per category right after the op."""
        return liveness.memory_curve(self, self._live)

    def breakdown(self) -> pd.DataFrame:
        """Bytes per category at the peak, with each category's own maximum over the step, and its most in host
        memory (``host_bytes``: an FSDP2 rank that offloads its parameters keeps them there)."""
        return liveness.breakdown(self, self._live, self._host_live)

    @cached_property
    def _host_live(self):
        return liveness.live_bytes(self, liveness.host_table(self))

    @property
    def host_peak_bytes(self) -> Bytes:
        """Most bytes this step holds in host memory at once, besides the device's: an FSDP2 rank that offloads its
        parameters keeps its shards, their gradients and the optimizer's state there, and steps there. A step that
        keeps everything on its device has only what PyTorch itself keeps on the host (Adam's step counters)."""
        return Bytes(self._host_live.peak_bytes)

    def layers(self) -> pd.DataFrame:
        """One row per module: execution order, calls, output bytes, saved bytes, parameters."""
        return liveness.layers(self)

    def schedule(self, level: str = "layer", include_parameters: bool = False) -> pd.DataFrame:
        """Document 000's table: per step, tensors read, allocated and released.

        ``level='layer'`` groups consecutive ops of one module into one step (forward
        then backward); ``level='op'`` gives one step per aten op.
        """
        return liveness.schedule(self, level=level, include_parameters=include_parameters)

    @cached_property
    def fingerprint(self) -> str:
        """A digest of the ops and tensor sizes: plans and profiles made for this graph carry it."""
        digest = hashlib.sha1(self.model_name.encode())
        for op in self.ops:
            digest.update(f"{op.phase}:{op.name};".encode())
        digest.update(",".join(str(t.nbytes) for t in self.tensors).encode())
        return digest.hexdigest()

    # -- look-ups ------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def tensor(self, name_or_id: str | int) -> TensorInfo:
        """A tensor by its name (``'layer1.0.conv1.weight'``, ``'t12'``) or id."""
        if isinstance(name_or_id, int):
            return self.tensors[name_or_id]
        try:
            return self._by_name[name_or_id]
        except KeyError:
            raise KeyError(f"no tensor named {name_or_id!r} in this graph; names look like "
                           f"{[t.name for t in self.tensors[:3]]} (see graph.tensors)") from None

    def on_device(self, tensor: TensorInfo) -> bool:
        """Whether ``tensor`` counts toward this graph's device memory."""
        return tensor.device == self.device

    def on_host(self, tensor: TensorInfo) -> bool:
        """Whether ``tensor`` lives in host memory beside a device's (a CPU step's tensors are its device's)."""
        return tensor.device == "cpu" and self.device != "cpu"

    def tensors_frame(self) -> pd.DataFrame:
        """Every tensor as one row (ids, bytes, category, producer, uses, life)."""
        return liveness.tensors_frame(self)

"""What stands in for CUDA's kernels when CPU kernels run a CUDA step, and what the graph's notes then say
(tracing.py and one_rank.py)."""

from __future__ import annotations

from contextlib import ExitStack

from torch._subclasses.fake_tensor import FakeTensorMode

from udnn_lab.analysis._fake.attention import STAND_IN_ATTENTION_NOTE, CudaAttentionKernels
from udnn_lab.analysis._fake.autocast import STAND_IN_AUTOCAST_NOTE, CudaAutocastLists
from udnn_lab.analysis._fake.dropout import STAND_IN_DROPOUT_NOTE, CudaDropoutKernel
from udnn_lab.workload import StepOptions

CPU_FOR_CUDA_NOTE = ("no CUDA device here: traced with CPU kernels; sizes are those of the CUDA step, "
                     "cuDNN-specific saved tensors and workspaces are not included")
CPU_AUTOCAST_NOTE = ("autocast ran with the CPU's lists of ops to cast (CPU kernels stood in for CUDA ones): CUDA's "
                     "autocast casts some other ops, so casts and saved tensors can differ from the CUDA step")


class CudaStandIns:
    """While entered, where CPU kernels run a CUDA step (``substituted``), the step saves what CUDA's would: its fused
    attention (NOTE [stand-in attention]), its fused dropout (NOTE [stand-in dropout]) and, for a mixed precision,
    its autocast lists (NOTE [stand-in autocast]). Nothing is replaced where the step runs its own device's
    kernels."""

    def __init__(self, fake_mode: FakeTensorMode, substituted: bool, options: StepOptions) -> None:
        self.substituted, self.options = substituted, options
        self.attention = CudaAttentionKernels(fake_mode) if substituted else None
        self.dropout = CudaDropoutKernel(fake_mode) if substituted else None
        self.casts = CudaAutocastLists(fake_mode) if substituted and options.mixed else None
        self._entered = ExitStack()

    def __enter__(self) -> CudaStandIns:
        for part in (self.attention, self.dropout, self.casts):
            if part is not None:
                self._entered.enter_context(part)
        return self

    def __exit__(self, *exc) -> None:
        self._entered.close()

    def notes(self) -> list[str]:
        """What the graph's notes say of the substitution."""
        notes = [CPU_FOR_CUDA_NOTE] if self.substituted else []
        if self.substituted and self.options.mixed:
            notes.append(CPU_AUTOCAST_NOTE)
        if self.attention is not None and self.attention.substituted:
            notes.append(STAND_IN_ATTENTION_NOTE)
        if self.dropout is not None and self.dropout.substituted:
            notes.append(STAND_IN_DROPOUT_NOTE)
        if self.casts is not None and self.casts.cast:
            notes.append(STAND_IN_AUTOCAST_NOTE)
        return notes

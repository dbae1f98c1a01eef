"""What a fit search found: every probe, the largest size that fits, the first that does not, and why it stopped."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from udnn_lab.units import format_bytes
from udnn_lab.vocabulary import Dimension


@dataclass(frozen=True)
class Probe:
    """One size tried: its step traced under fake tensors and held against the budget."""

    size: int  # the batch size or the sequence length
    # What decided whether it fits, counted as the budget counts (512-byte blocks on CUDA): under keep-all the traced
    # peak; under another policy the simulated peak of its plan when one fits, else the smallest budget its plans meet
    peak_bytes: int
    fits: bool  # peak_bytes <= the budget and host_bytes <= the host budget
    traced_peak_bytes: int  # the traced peak with every tensor kept (the same as peak_bytes under keep-all)
    host_bytes: int = 0  # host memory the plan's offloads take (Plan.host_pool_bytes); 0 when nothing is offloaded


@dataclass(frozen=True, repr=False)
class FitSearch:
    """The largest batch size (or sequence length) whose training step fits a budget, and how it was found."""

    model_name: str
    dimension: Dimension
    size: int  # the largest size that fits; 0 when not even the smallest tried does
    peak_bytes: int | None  # that size's Probe.peak_bytes; None when nothing fits
    failed_size: int | None  # the smallest size tried that does not fit; None when the search reached its limit
    failed_peak_bytes: int | None  # that size's Probe.peak_bytes
    stopped: str  # why the search ended, in words
    probes: tuple[Probe, ...]  # in the order they ran
    budget_bytes: int
    policy: str
    hardware: str  # the profile's name; its device type decides how bytes are counted
    device: str  # 'cuda': the peaks count the caching allocator's 512-byte blocks; 'cpu': exact bytes
    weights_bytes: int  # the model's parameters, on the device all step whatever the size
    host_budget_bytes: int | None = None  # host memory offloads may take; None: not checked
    multiple_of: int = 1  # only multiples of this were tried
    limit: int | None = None  # the largest size the search could try (given, or the model's positions)
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        name = "sequence length" if self.dimension == "seq_len" else "batch"
        if self.size:
            found = f"largest {name} {self.size}, peak {format_bytes(self.peak_bytes or 0)}"
        else:
            found = f"no {name} fits"
        return (f"FitSearch({self.model_name!r}, {found} of {format_bytes(self.budget_bytes)} under {self.policy} "
                f"on {self.hardware}; {self.stopped}; {len(self.probes)} probes)")

    @property
    def fits(self) -> bool:
        """Whether any size fits."""
        return self.size > 0

    def to_frame(self) -> pd.DataFrame:
        """One row per probe, by size: peak (as decided and as traced), fits, and the budget, to chart peak vs size."""
        rows = [{"model": self.model_name, "dimension": self.dimension, "size": p.size, "peak_bytes": p.peak_bytes,
                 "traced_peak_bytes": p.traced_peak_bytes, "host_bytes": p.host_bytes, "fits": p.fits,
                 "budget_bytes": self.budget_bytes, "host_budget_bytes": self.host_budget_bytes, "policy": self.policy,
                 "probe": order} for order, p in enumerate(self.probes)]
        columns = ["model", "dimension", "size", "peak_bytes", "traced_peak_bytes", "host_bytes", "fits",
                   "budget_bytes", "host_budget_bytes", "policy", "probe"]
        return pd.DataFrame(rows, columns=columns).sort_values("size", kind="stable").reset_index(drop=True)


def disagreements(probes: tuple[Probe, ...]) -> tuple[str, ...]:
    """Notes on probes that contradict NOTE [monotone peak]: a size that fits above one that does not."""
    failed = [p.size for p in probes if not p.fits]
    if not failed:
        return ()
    smallest_failed = min(failed)
    return tuple(f"size {p.size} fits although {smallest_failed} does not: the peak is not monotone in the size, so "
                 "the answer may not be the largest that fits" for p in probes if p.fits and p.size > smallest_failed)

"""The search for the largest size that fits: grow it exponentially until a step does not fit, then bisect.

NOTE [monotone peak]
The search assumes that a step's peak does not fall as the size grows: a larger batch or a
longer sequence holds at least what a smaller one holds, so the sizes that fit are the ones
up to the answer. Without that, bisection could step over a size that fits. It is assumed,
not proven (a kernel chosen by size could break it), so every probe is kept and
``result.disagreements`` reports two that contradict it. Under the assumption the search
takes about 2 log2(answer) probes, and its answer is checked by the probes themselves: the
size returned fits and the next one tried (size + multiple_of) does not, unless the limit
was reached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from udnn_lab.fitting.result import Probe


@dataclass(frozen=True)
class Bracket:
    """Where the search ended: the largest size that fits and the smallest that does not, as probed."""

    probes: tuple[Probe, ...]  # in the order they ran
    fitting: Probe | None  # None: not even the smallest size fits
    failed: Probe | None  # None: the limit fits
    reached_limit: bool


def largest_fitting(probe: Callable[[int], Probe], start: int = 1, limit: int | None = None,
                    multiple_of: int = 1) -> Bracket:
    """Probe sizes (multiples of ``multiple_of``, from ``start`` up to ``limit``) for the largest that fits.

    Sizes double from ``start`` until one does not fit or ``limit`` is reached, then the gap
    between the last that fitted and the first that did not is bisected (NOTE [monotone peak]).
    """
    top = None if limit is None else limit // multiple_of  # in units of multiple_of
    unit = -(-start // multiple_of)  # the first multiple at or above start
    if top is not None and unit > top:
        raise ValueError(f"start {start} is above the limit {limit}: no multiple of {multiple_of} lies between them")
    found: dict[int, Probe] = {}
    low, high = 0, None  # in units: the largest known to fit (0: none yet), the smallest known not to
    while True:
        found[unit] = probe(unit * multiple_of)
        if found[unit].fits:
            low = unit
        else:
            high = unit
        if high is None:
            if unit == top:
                break
            unit = 2 * unit if top is None else min(2 * unit, top)
        elif high - low <= 1:
            break
        else:
            unit = (low + high) // 2
    return Bracket(probes=tuple(found.values()), fitting=found.get(low),
                   failed=None if high is None else found[high], reached_limit=high is None)

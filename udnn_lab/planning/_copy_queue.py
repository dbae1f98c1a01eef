"""One copy stream as a planner sees it: copies run in the order they are issued, one at a time.

The simulator queues every copy out on one device-to-host stream and every copy in on one
host-to-device stream (NOTE [simulated streams] 2, 3): a copy issued while others are in
flight waits for them. A planner adding copies one by one asks when a new one would end,
behind those it has already chosen. Times are the keep-all step's (op starts with nothing
delaying them), so a queue behind stalls is not modelled: the simulator checks.
"""

from __future__ import annotations

import bisect

import numpy as np


class CopyQueue:
    def __init__(self) -> None:
        self._issued: list[tuple[float, int]] = []  # (issue time, tensor), in the order the stream runs them
        self._times = np.zeros(0)  # the issue times alone
        self._seconds = np.zeros(0)
        self._due = np.zeros(0)  # when the op that waits for each copy starts (inf: none waits)
        self._ends = np.zeros(0)  # when each copy ends, behind the ones before it

    def end_if_added(self, issued_s: float, tensor: int, seconds: float) -> float:
        """When a copy issued at ``issued_s`` would end, behind the chosen copies issued before it."""
        before = bisect.bisect_left(self._issued, (issued_s, tensor))
        free = float(self._ends[before - 1]) if before else 0.0
        return max(issued_s, free) + seconds

    def end_of(self, issued_s: float, tensor: int) -> float:
        """When the queued copy of ``tensor`` issued at ``issued_s`` ends."""
        at = bisect.bisect_left(self._issued, (issued_s, tensor))
        if at == len(self._issued) or self._issued[at] != (issued_s, tensor):
            raise KeyError(f"no copy of tensor {tensor} issued at {issued_s} s is queued")
        return float(self._ends[at])

    def added_wait(self, issued_s: float, tensor: int, seconds: float, due_s: float,
                   instead_of: tuple[float, int] | None = None) -> float:
        """How much longer the ops that wait for copies would wait in all, with this copy added (replacing
        ``instead_of``, issued before it): its own wait past ``due_s`` and the delay it adds to those behind it."""
        at = bisect.bisect_left(self._issued, (issued_s, tensor))
        first = at if instead_of is None else bisect.bisect_left(self._issued, instead_of)
        free = float(self._ends[first - 1]) if first else 0.0
        kept = slice(first if instead_of is None else first + 1, at)
        times = np.concatenate([self._times[kept], [issued_s], self._times[at:]])
        seconds_after = np.concatenate([self._seconds[kept], [seconds], self._seconds[at:]])
        due = np.concatenate([self._due[kept], [due_s], self._due[at:]])
        after = _ends(times, seconds_after, free)
        waited = np.maximum(self._ends[first:] - self._due[first:], 0.0).sum()
        return float(np.maximum(after - due, 0.0).sum() - waited)

    def add(self, issued_s: float, tensor: int, seconds: float, due_s: float = np.inf) -> None:
        at = bisect.bisect_left(self._issued, (issued_s, tensor))
        self._issued.insert(at, (issued_s, tensor))
        self._times, self._seconds, self._due = (
            np.concatenate([a[:at], [value], a[at:]])
            for a, value in ((self._times, issued_s), (self._seconds, seconds), (self._due, due_s)))
        self._requeue(at)

    def remove(self, issued_s: float, tensor: int) -> None:
        at = bisect.bisect_left(self._issued, (issued_s, tensor))
        if at == len(self._issued) or self._issued[at] != (issued_s, tensor):
            raise KeyError(f"no copy of tensor {tensor} issued at {issued_s} s is queued")
        del self._issued[at]
        self._times, self._seconds, self._due = (np.concatenate([a[:at], a[at + 1:]])
                                                 for a in (self._times, self._seconds, self._due))
        self._requeue(at)

    def _requeue(self, at: int) -> None:
        """The ends of the copies from ``at`` on (those before it do not move)."""
        free = float(self._ends[at - 1]) if at else 0.0
        self._ends = np.concatenate([self._ends[:at], _ends(self._times[at:], self._seconds[at:], free)])


def _ends(issued: np.ndarray, seconds: np.ndarray, free: float) -> np.ndarray:
    """When each copy ends, in order, on a stream free from ``free``. end_i = max(issue_i, end_i-1) + seconds_i
    unrolls to S_i + max(free, max over j <= i of (issue_j - S_j-1)), S the running sum of the seconds: one
    pass in numpy however long the queue."""
    if not len(issued):
        return issued
    total = np.cumsum(seconds)
    return total + np.maximum(np.maximum.accumulate(issued - (total - seconds)), free)

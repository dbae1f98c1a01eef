"""Q4's signals, sampled while the jobs run, and the two-sample Kolmogorov-Smirnov test that compares them.

On a GPU (document 004): device utilization and PCIe throughput from NVML
(nvidia-ml-py). On a CPU there is no PCIe and no device counter, so the same questions
are asked of what Linux offers: the share of the study's cores busy (/proc/stat: the
cores the jobs are pinned to, the CPU's "device"; every core when they are not pinned),
and per job the CPU time it got and the time it waited, runnable, for a
core (/proc/<pid>/task/*/schedstat: the CPU's analogue of a context waiting for the
GPU). Every sample is (time.monotonic(), source, signal, value); a rate is taken between
two consecutive readings.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

CPU_SIGNALS = {"device_busy_percent": "share of the study's CPU cores busy, by anything (/proc/stat)",
               "machine_busy_percent": "share of all the machine's cores busy (/proc/stat; jobs pinned only)",
               "cpu_busy_percent": "CPU time the job's process got, % of one core (schedstat)",
               "runqueue_wait_percent": "time the job's threads waited runnable for a core, % of wall time"}
GPU_SIGNALS = {"device_busy_percent": "GPU utilization: share of time a kernel ran (NVML)",
               "h2d_bytes_per_s": "PCIe bytes the GPU received (host to device, NVML)",
               "d2h_bytes_per_s": "PCIe bytes the GPU sent (device to host, NVML)"}


class Sampler:
    """A thread reading the signals every ``interval_s`` for the pids ``pids()`` returns.

    ``cores``: the CPU cores whose busy share is the device's (None: every core); ``gpu_index``:
    read the device's signals from that GPU through NVML instead."""

    def __init__(self, pids: Callable[[], dict[str, int]], interval_s: float = 0.05, gpu_index: int | None = None,
                 cores: tuple[int, ...] | None = None):
        self.pids, self.interval_s, self.cores = pids, interval_s, cores
        self.samples: list[tuple[float, str, str, float]] = []
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="udnn-sharing-sampler", daemon=True)
        self._nvml = _Nvml(gpu_index, self.notes) if gpu_index is not None else None
        self._last: dict[tuple[str, str], tuple[float, float]] = {}

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5.0)
        if self._nvml is not None:
            self._nvml.close()

    def mean(self, source: str, signal: str, start: float, end: float) -> float | None:
        """The mean of ``source``'s ``signal`` over the samples taken from ``start`` to ``end``; None if none."""
        values = [v for t, s, name, v in list(self.samples) if s == source and name == signal and start <= t <= end]
        return float(np.mean(values)) if values else None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._read(now)
            except Exception as err:  # a sampler error must not end the study; say so once
                if not self.notes or not self.notes[-1].startswith("sampler"):
                    self.notes.append(f"sampler: {type(err).__name__}: {err}")

    def _read(self, now: float) -> None:
        if self._nvml is not None:
            for signal, value in self._nvml.read().items():
                self.samples.append((now, "device", signal, value))
        else:
            busy, total = _cpu_jiffies(self.cores)
            self._rate(now, "device", "device_busy_percent", busy, scale=100.0, per=total)
            if self.cores is not None:  # what the rest of the machine did meanwhile
                busy, total = _cpu_jiffies(None)
                self._rate(now, "device", "machine_busy_percent", busy, scale=100.0, per=total)
        for job, pid in self.pids().items():
            counters = _schedstat(pid)
            if counters is None:
                continue
            self._rate(now, job, "cpu_busy_percent", counters[0] / 1e9, scale=100.0)
            self._rate(now, job, "runqueue_wait_percent", counters[1] / 1e9, scale=100.0)

    def _rate(self, now: float, source: str, signal: str, value: float, scale: float, per: float | None = None):
        """Append the change of a counter since the last reading, per second (or per ``per``'s change)."""
        key = (source, signal)
        reference = per if per is not None else now
        last = self._last.get(key)
        self._last[key] = (value, reference)
        if last is not None and reference > last[1]:
            self.samples.append((now, source, signal, scale * (value - last[0]) / (reference - last[1])))


def _cpu_jiffies(cores: tuple[int, ...] | None) -> tuple[float, float]:
    """(busy, total) jiffies of ``cores`` (None: all of them) since boot."""
    names = {"cpu"} if cores is None else {f"cpu{core}" for core in cores}
    busy = total = 0.0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name in names:
            fields = [float(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(fields)
            busy += sum(fields) - fields[3] - fields[4]
    return busy, total


def _schedstat(pid: int) -> tuple[float, float] | None:
    """(run ns, runnable-wait ns) summed over the process's threads; None once it is gone."""
    run = wait_ns = 0.0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                values = (task / "schedstat").read_text().split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            run += float(values[0])
            wait_ns += float(values[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return run, wait_ns


class _Nvml:
    """NVML opened once for the sampler's life; readings per call; never raises."""

    def __init__(self, index: int, notes: list[str]) -> None:
        self.handle = None
        try:
            import pynvml  # optional: NVML only where there is an NVIDIA driver

            pynvml.nvmlInit()
            self.pynvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as err:
            notes.append(f"NVML unavailable, no GPU signals for Q4: {err}")

    def read(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        nv = self.pynvml
        values = {"device_busy_percent": float(nv.nvmlDeviceGetUtilizationRates(self.handle).gpu)}
        try:  # KB/s over NVML's last 20 ms
            values["h2d_bytes_per_s"] = 1024.0 * nv.nvmlDeviceGetPcieThroughput(self.handle, nv.NVML_PCIE_UTIL_RX_BYTES)
            values["d2h_bytes_per_s"] = 1024.0 * nv.nvmlDeviceGetPcieThroughput(self.handle, nv.NVML_PCIE_UTIL_TX_BYTES)
        except nv.NVMLError:
            pass
        return values

    def close(self) -> None:
        if self.handle is not None:
            try:
                self.pynvml.nvmlShutdown()
            except Exception:
                pass


# -- the two-sample Kolmogorov-Smirnov test ----------------------------------------------------
EXACT_KS_LIMIT = 10_000  # n * m up to which the p-value is exact (the count below is O(n * m))


def ks_2samp(first, second) -> tuple[float, float]:
    """(D, p) of the two-sided two-sample KS test: D = the largest gap between the two empirical CDFs.

    p is exact for n * m <= EXACT_KS_LIMIT (the share of the C(n+m, n) orderings of the pooled
    samples whose CDF gap reaches D), else the asymptotic Kolmogorov distribution with
    Stephens' small-sample correction."""
    a = np.sort(np.asarray(first, dtype=float))
    b = np.sort(np.asarray(second, dtype=float))
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        raise ValueError(f"the KS test needs at least one sample on each side, got {n} and {m}")
    pooled = np.concatenate([a, b])
    # the gap in units of 1 / (n m), an integer: |F_a - F_b| = |i m - j n| / (n m)
    gap = int(np.abs(np.searchsorted(a, pooled, side="right") * m - np.searchsorted(b, pooled, side="right") * n).max())
    statistic = gap / (n * m)
    if n * m <= EXACT_KS_LIMIT:
        return statistic, _exact_p(n, m, gap)
    effective = math.sqrt(n * m / (n + m))
    return statistic, kolmogorov_sf((effective + 0.12 + 0.11 / effective) * statistic)


def _exact_p(n: int, m: int, gap: int) -> float:
    """P(D >= gap / (n m)) when both samples come from one continuous distribution: 1 - the share of
    monotone lattice paths from (0, 0) to (n, m) that keep |i m - j n| < gap at every point."""
    inside = [0] * (m + 1)  # paths to (i, j) that stayed inside, for the current i
    for i in range(n + 1):
        for j in range(m + 1):
            if abs(i * m - j * n) >= gap:
                inside[j] = 0
            elif i == 0 and j == 0:
                inside[j] = 1
            else:
                inside[j] = (inside[j] if i > 0 else 0) + (inside[j - 1] if j > 0 else 0)
    every = math.comb(n + m, n)
    return (every - inside[m]) / every  # in integers first: a tiny p keeps its digits


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution: 2 * sum_j (-1)^(j-1) exp(-2 j^2 x^2)."""
    if x < 0.2:  # the series converges slowly here, and the answer is 1 to double precision
        return 1.0
    total = sum((-1) ** (j - 1) * math.exp(-2.0 * j * j * x * x) for j in range(1, 101))
    return float(min(1.0, max(0.0, 2.0 * total)))

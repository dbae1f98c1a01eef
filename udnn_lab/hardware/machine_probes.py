"""Measure the machine at hand: copy bandwidth sweeps and achieved FLOP rates.

Returns the fields of a Hardware profile as plain data; ``Hardware.measure`` builds the
profile from them (this module never imports ``Hardware``).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from udnn_lab.devices import as_device, device_name
from udnn_lab.errors import HardwareProfileError, UnmeasuredFigureWarning
from udnn_lab.hardware._dispatch_probe import dispatch_mode_op_s
from udnn_lab.hardware._gloo_links import link_figures, measure_gloo
from udnn_lab.hardware.host_probes import host_probes
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.vocabulary import DIRECTIONS, memory_kind

SWEEP_COLUMNS = ("device", "direction", "pinned", "nbytes", "seconds", "seconds_min", "repeats", "bytes_per_s")
CUDA_SWEEP_SIZES = tuple(4096 << i for i in range(19))  # 4 KiB .. 1 GiB
CPU_SWEEP_SIZES = tuple(4096 << (2 * i) for i in range(9))  # 4 KiB .. 256 MiB: well past L3 cache, still quick


def measure_hardware(device: str | torch.device | None = None, sizes: Iterable[int | str] | None = None,
                     repeats: int = 5, matmul_size: int | None = None, conv_size: int | None = None,
                     progress: bool = True, collectives: bool = False) -> tuple[dict[str, Any], pd.DataFrame]:
    """Measure the device (default: CUDA if present, else CPU): a profile and the copy sweep.

    On CUDA: H2D and D2H copies, pinned and pageable, for each of ``sizes`` (default 4 KiB to
    1 GiB), a device-to-device copy, and matmul/conv rates. On CPU: memcpy for each size
    (default 4 KiB to 256 MiB) and matmul/conv rates, a few seconds in all. ``matmul_size``
    is n of an n x n matmul; ``conv_size`` the height and width of a 3x3 conv's input.

    The sweep has one row per copy size (columns SWEEP_COLUMNS, times are medians over
    ``repeats``); ``direction`` is 'h2d' or 'd2h' (CUDA), 'd2d' (one device copy, CUDA)
    or 'memcpy' (CPU). Figures: a link's rate is its largest copy's, its latency what the
    smallest copy takes beyond that. ``collectives`` (CPU): the gloo link between ranks on this machine too
    (hardware/_gloo_links.py).
    """
    device = as_device(device)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if sizes is not None:
        sizes = tuple(parse_bytes(size) for size in sizes)
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"sizes must be one or more positive sizes (e.g. (4096, '1 MiB')), got {sizes}")
    if device.type == "cuda":
        fields, sweep = _measure_cuda(device, sizes or CUDA_SWEEP_SIZES, repeats, matmul_size or 8192,
                                      conv_size or 56, progress)
    elif device.type == "cpu":
        fields, sweep = _measure_cpu(sizes or CPU_SWEEP_SIZES, repeats, matmul_size or 1024, conv_size or 56,
                                     progress)
        if collectives:
            figures, sources = gloo_figures(repeats)
            fields = {**fields, **figures, "sources": {**fields["sources"], **sources}}
    else:
        raise ValueError(f"cannot measure a {device.type!r} device: use 'cpu' or 'cuda' / 'cuda:<index>'")
    return _with_host_probes(device, repeats, fields), sweep


def _with_host_probes(device: torch.device, repeats: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The fields with what each registered host probe measured (NOTE [host probes] 1)."""
    for probe in host_probes():
        try:
            measured = probe(device, repeats, fields)
        except Exception as error:  # noqa: BLE001 - a later stage's probe must not cost the profile (NOTE [host probes] 3)
            warnings.warn(f"{getattr(probe, '__name__', 'a host probe')} could not measure on {device_name(device)} "
                          f"({type(error).__name__}: {error}); its figures stay unmeasured, and the host work they "
                          "price is not priced", UnmeasuredFigureWarning, stacklevel=3)
            continue
        how = _measured_source(device_name(device), measured.source)
        fields = {**fields, **measured.figures, "sources": {**fields["sources"],
                                                            **dict.fromkeys(measured.figures, how)}}
    return fields


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        raise HardwareProfileError("cannot read this machine's memory size (os.sysconf); write the CPU "
                                   "profile's memory_bytes by hand") from None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ---- timing -------------------------------------------------------------------------------

def _cpu_times(work: Callable[[], Any], repeats: int) -> list[float]:
    work()  # warm-up: first-touch page faults, allocator and kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return times


def _cuda_times(work: Callable[[], Any], repeats: int, stream: torch.cuda.Stream) -> list[float]:
    times = []
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # inputs were made on the current stream
    with torch.cuda.stream(stream):
        work()
        stream.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            work()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return times


def _sweep_row(device: str, direction: str, pinned: bool, nbytes: int, times: list[float]) -> dict[str, Any]:
    seconds = statistics.median(times)
    return dict(device=device, direction=direction, pinned=pinned, nbytes=nbytes, seconds=seconds,
                seconds_min=min(times), repeats=len(times), bytes_per_s=nbytes / seconds)


def _fit_link(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(bytes_per_s, latency_s): the largest copy's rate, and what the smallest copy costs beyond it.

    The largest copy, not the fastest: mid-sized CPU copies run from cache, and what gets
    offloaded is big.
    """
    bandwidth = max(rows, key=lambda row: row["nbytes"])["bytes_per_s"]
    smallest = min(rows, key=lambda row: row["nbytes"])
    return bandwidth, max(0.0, smallest["seconds"] - smallest["nbytes"] / bandwidth)


@contextmanager
def _progress(total: int, enabled: bool, description: str) -> Iterator[Callable[[], Any]]:
    if not enabled:
        yield lambda: None
        return
    with tqdm(total=total, desc=description, leave=False) as bar:
        yield lambda: bar.update(1)


@contextmanager
def _strict_fp32(tf32: bool = False) -> Iterator[None]:
    """Matmul and conv in IEEE fp32 (or TF32) for the duration, whatever the global setting; restored after."""
    matmul = torch.backends.cuda.matmul
    cudnn: Any = torch.backends.cudnn  # torch swaps the module for an object whose conv (torch 2.9+) mypy cannot see
    if hasattr(matmul, "fp32_precision"):
        saved = matmul.fp32_precision, cudnn.conv.fp32_precision
        matmul.fp32_precision = cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"
    else:  # older torch, which has no cudnn.conv either
        saved = matmul.allow_tf32, cudnn.allow_tf32
        matmul.allow_tf32 = cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        if hasattr(matmul, "fp32_precision"):
            matmul.fp32_precision, cudnn.conv.fp32_precision = saved
        else:
            matmul.allow_tf32, cudnn.allow_tf32 = saved


def _compute_rates(device: torch.device, dtypes: dict[str, torch.dtype], matmul_size: int, conv_size: int,
                   timer: Callable[[Callable[[], Any]], list[float]], tick: Callable[[], Any]) -> dict[str, float]:
    """Achieved FLOP/s per label: 'matmul_<label>' for each dtype and 'conv_fp32'."""
    rates = {}
    n = matmul_size
    for label, dtype in dtypes.items():
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.empty(n, n, device=device, dtype=dtype)
        with _strict_fp32(tf32=label == "tf32"):
            rates[f"matmul_{label}"] = 2 * n**3 / statistics.median(timer(lambda: torch.mm(a, b, out=out)))
        tick()
    batch, channels = (32, 128) if device.type == "cuda" else (8, 64)
    x = torch.randn(batch, channels, conv_size, conv_size, device=device)
    weight = torch.randn(channels, channels, 3, 3, device=device)
    with _strict_fp32(), torch.no_grad():
        seconds = statistics.median(timer(lambda: torch.nn.functional.conv2d(x, weight, padding=1)))
    rates["conv_fp32"] = 2 * batch * channels * channels * 9 * conv_size**2 / seconds
    tick()
    return rates


# ---- measuring ----------------------------------------------------------------------------

def _measure_cpu(sizes: tuple[int, ...], repeats: int, matmul_size: int, conv_size: int,
                 progress: bool) -> tuple[dict[str, Any], pd.DataFrame]:
    name = device_name(torch.device("cpu"))
    largest = max(sizes)
    source = torch.ones(largest, dtype=torch.uint8)
    target = torch.zeros(largest, dtype=torch.uint8)
    rows = []
    with _progress(len(sizes) + 3, progress, f"measuring {name}") as tick:
        for nbytes in sorted(sizes):
            src, dst = source[:nbytes], target[:nbytes]
            times = _cpu_times(lambda: dst.copy_(src), repeats)
            rows.append(_sweep_row(name, "memcpy", False, nbytes, times))
            tick()
        rates = _compute_rates(torch.device("cpu"), {"fp32": torch.float32}, matmul_size, conv_size,
                               lambda work: _cpu_times(work, repeats), tick)
        dispatch = _dispatch_figure(torch.device("cpu"), repeats, tick)
    bandwidth, latency = _fit_link(rows)
    how = _measured_source(name, f"{torch.get_num_threads()} torch threads")
    link = {f"{d}_{k}_{q}": v for d in DIRECTIONS for k in ("pinned", "pageable")
            for q, v in (("bytes_per_s", bandwidth), ("latency_s", latency))}
    sources = {key: f"{how}: memcpy sweep {format_bytes(min(sizes))}..{format_bytes(largest)} (CPU only: host "
                    "and device are the same RAM; pinned = pageable)" for key in link}
    fields = dict(
        name=f"cpu-{_slug(name)}-{os.cpu_count()}cpu", title=f"{name}, {os.cpu_count()} CPUs (measured)",
        device_type="cpu", device_names=(name,), measured=True, memory_bytes=_host_memory_bytes(),
        memory_bytes_per_s=2 * bandwidth, **_rate_figures(rates), **link, notes=_measured_note(),
        dispatch_mode_op_s=dispatch[0],
        sources={**sources, **_rate_sources(how, rates, matmul_size, conv_size), **_dispatch_source(how, dispatch),
                 "memory_bytes": f"{how}: os.sysconf physical pages x page size",
                 "memory_bytes_per_s": f"{how}: 2 x memcpy rate of {format_bytes(largest)} (read + write)"},
    )
    return fields, pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


def gloo_figures(repeats: int = 5) -> tuple[dict[str, float], dict[str, str]]:
    """The intra-node link figures of a CPU profile, measured between two gloo ranks here, and their sources."""
    times = measure_gloo(repeats=repeats)
    bandwidth, latency = link_figures(times)
    how = _measured_source(device_name(torch.device("cpu")), "2 gloo ranks")
    sizes = f"{format_bytes(min(times)[0])}..{format_bytes(max(times)[0])}"
    figures = {"intra_node_bytes_per_s": bandwidth, "intra_node_latency_s": latency}
    sources = {"intra_node_bytes_per_s": f"{how}: all-reduce of {format_bytes(max(times)[0])} (p = 2: its bytes "
                                         f"over each rank's link)",
               "intra_node_latency_s": f"{how}: all-reduce sweep {sizes}, what the smallest takes beyond the "
                                       f"bandwidth, over its 2 ring steps"}
    return figures, sources


def _measure_cuda(device: torch.device, sizes: tuple[int, ...], repeats: int, matmul_size: int, conv_size: int,
                  progress: bool) -> tuple[dict[str, Any], pd.DataFrame]:
    name = device_name(device)
    largest = max(sizes)
    stream = torch.cuda.Stream(device)
    on_device = torch.ones(largest, dtype=torch.uint8, device=device)
    device_copy = torch.empty_like(on_device)
    host = {True: torch.ones(largest, dtype=torch.uint8).pin_memory(), False: torch.ones(largest, dtype=torch.uint8)}
    timer: Callable[[Callable[[], Any]], list[float]] = lambda work: _cuda_times(work, repeats, stream)  # noqa: E731
    dtypes = _cuda_dtypes(device)
    rows = []
    with _progress(4 * len(sizes) + 1 + len(dtypes) + 2, progress, f"measuring {name}") as tick:
        for pinned in (True, False):
            for nbytes in sorted(sizes):
                src, dst = host[pinned][:nbytes], on_device[:nbytes]
                rows.append(_sweep_row(name, "h2d", pinned, nbytes, timer(lambda: dst.copy_(src, non_blocking=pinned))))
                tick()
                rows.append(_sweep_row(name, "d2h", pinned, nbytes, timer(lambda: src.copy_(dst, non_blocking=pinned))))
                tick()
        rows.append(_sweep_row(name, "d2d", False, largest, timer(lambda: device_copy.copy_(on_device))))
        tick()
        rates = _compute_rates(device, dtypes, matmul_size, conv_size, timer, tick)
        dispatch = _dispatch_figure(device, repeats, tick)
    return _cuda_profile(device, name, rows, rates, dispatch, sizes, matmul_size, conv_size), \
        pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


def _cuda_dtypes(device: torch.device) -> dict[str, torch.dtype]:
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    if torch.cuda.get_device_capability(device) >= (8, 0):  # TF32 and BF16 tensor cores: Ampere and later
        dtypes.update(tf32=torch.float32, bf16=torch.bfloat16)
    return dtypes


def _cuda_profile(device: torch.device, name: str, rows: list[dict[str, Any]], rates: dict[str, float],
                  dispatch: tuple[float, int], sizes: tuple[int, ...], matmul_size: int,
                  conv_size: int) -> dict[str, Any]:
    how = _measured_source(name, f"torch {torch.__version__}, CUDA events")
    link, sources = {}, {}
    for direction in DIRECTIONS:
        for pinned in (True, False):
            prefix = f"{direction}_{memory_kind(pinned)}"
            chosen = [r for r in rows if r["direction"] == direction and r["pinned"] == pinned]
            link[f"{prefix}_bytes_per_s"], link[f"{prefix}_latency_s"] = _fit_link(chosen)
            for key in (f"{prefix}_bytes_per_s", f"{prefix}_latency_s"):
                sources[key] = f"{how}: {direction} {memory_kind(pinned)} copy sweep " \
                               f"{format_bytes(min(sizes))}..{format_bytes(max(sizes))}"
    d2d = next(r for r in rows if r["direction"] == "d2d")
    return dict(
        name=f"{_slug(name)}-measured", title=f"{name} (measured)", device_type="cuda", device_names=(name,),
        measured=True, memory_bytes=torch.cuda.get_device_properties(device).total_memory,
        memory_bytes_per_s=2 * d2d["bytes_per_s"], **_rate_figures(rates), **link, notes=_measured_note(),
        dispatch_mode_op_s=dispatch[0],
        sources={**sources, **_rate_sources(how, rates, matmul_size, conv_size), **_dispatch_source(how, dispatch),
                 "memory_bytes": f"{how}: torch.cuda.get_device_properties().total_memory",
                 "memory_bytes_per_s": f"{how}: 2 x device-to-device copy of {format_bytes(d2d['nbytes'])}"},
    )


def _dispatch_figure(device: torch.device, repeats: int, tick: Callable[[], Any]) -> tuple[float, int]:
    figure = dispatch_mode_op_s(device, repeats)
    tick()
    return figure


def _dispatch_source(how: str, figure: tuple[float, int]) -> dict[str, str]:
    return {"dispatch_mode_op_s": f"{how}: host time of a small residual network's step ({figure[1]} traced ops, "
                                  "forward and backward) under a pass-through dispatch mode, less without, per op"}


def _rate_figures(rates: dict[str, float]) -> dict[str, float | None]:
    return dict(
        fp32_flops_per_s=max(rates["matmul_fp32"], rates["conv_fp32"]),
        tf32_flops_per_s=rates.get("matmul_tf32"), bf16_flops_per_s=rates.get("matmul_bf16"),
        fp16_flops_per_s=rates.get("matmul_fp16"),
        matmul_fp32_achieved_flops_per_s=rates["matmul_fp32"], conv_fp32_achieved_flops_per_s=rates["conv_fp32"],
    )


def _rate_sources(how: str, rates: dict[str, float], matmul_size: int, conv_size: int) -> dict[str, str]:
    matmul = f"{how}: median of {matmul_size}x{matmul_size} matmuls"
    sources = {f"{label}_flops_per_s": f"{matmul} in {label} (achieved, not a datasheet peak)"
               for label in ("tf32", "bf16", "fp16") if f"matmul_{label}" in rates}
    conv = f"{how}: median of 3x3 conv2d on {conv_size}x{conv_size} inputs, IEEE fp32"
    sources.update(
        fp32_flops_per_s=f"{how}: best achieved IEEE fp32 rate of matmul ({matmul_size}^2) and 3x3 conv "
                         "(not a datasheet peak)",
        matmul_fp32_achieved_flops_per_s=f"{matmul}, IEEE fp32", conv_fp32_achieved_flops_per_s=conv)
    return sources


def _measured_source(name: str, detail: str) -> str:
    return f"measured on {name} {datetime.date.today().isoformat()} with udnn_lab Hardware.measure ({detail})"


def _measured_note() -> str:
    return (f"Measured by udnn_lab Hardware.measure on {platform.platform()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads. Achieved rates depend on sizes, threads and load: "
            "measure again rather than reuse on other machines.")

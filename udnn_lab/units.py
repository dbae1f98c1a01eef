"""Sizes and times: parse what people type, format what people read.

Inside the package sizes are ints in bytes and times are floats in seconds.
"""

from __future__ import annotations

import math
import numbers
import re

_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE = re.compile(r"^\s*(-?\s*[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_ACCEPTED = "an int of bytes or a string like '512', '6 GiB', '6GB', '1.5g', '300 MiB', '80kb'"


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Binary units (KiB, MiB, GiB, TiB) and bare letters (K, M, G, T, as in
    ``--memory 6G``) are powers of 1024; KB, MB, GB, TB are powers of 1000.
    """
    if isinstance(value, bool):
        raise TypeError(f"a size must be {_ACCEPTED}, got a bool")
    if isinstance(value, numbers.Integral):  # numpy integers too
        number, scale = int(value), 1
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"a size must be finite, got {value!r}")
        number, scale = float(value), 1
    elif isinstance(value, str):
        number, scale = _parse_size_string(value)
    else:
        raise TypeError(f"a size must be {_ACCEPTED}, got {type(value).__name__}")
    if number < 0:  # most sizes typed are budgets: say it in their words
        raise ValueError(f"a budget cannot be negative, nor any size: got {value!r}; give 0 or more bytes, "
                         "e.g. '6 GiB'")
    return int(round(number * scale))


def _parse_size_string(text: str) -> tuple[float, int]:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size: use {_ACCEPTED}")
    number, unit = float(match.group(1).replace(" ", "")), match.group(2).lower()
    scale = _unit_scale(unit.removesuffix("ytes").removesuffix("yte") if unit.endswith(("bytes", "byte")) else unit)
    if scale is None:
        raise ValueError(
            f"unknown size unit {match.group(2)!r} in {text!r}: use B, KB/MB/GB/TB (powers of 1000), "
            "KiB/MiB/GiB/TiB or K/M/G/T (powers of 1024)"
        )
    return number, scale


def _unit_scale(unit: str) -> int | None:
    """'' and 'b' are bytes; 'g' and 'gib' are 1024**3; 'gb' is 1000**3."""
    if unit in ("", "b"):
        return 1
    letter, rest = unit[0], unit[1:]
    if letter not in _DECIMAL:
        return None
    if rest in ("", "i", "ib"):
        return _BINARY[letter]
    if rest == "b":
        return _DECIMAL[letter]
    return None


def format_bytes(nbytes: int | float, digits: int = 2) -> str:
    """``1536 -> '1.50 KiB'``; negative values keep their sign."""
    sign = "-" if nbytes < 0 else ""
    size = abs(float(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(size)} B"
            return f"{sign}{size:.{digits}f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_budget(nbytes: int) -> str:
    """A size to type as a budget, at least ``nbytes``: ``356142799 -> '339.7MiB'`` (rounded up, no space)."""
    if nbytes < 1024:
        return f"{max(int(nbytes), 0)}B"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40)):
        if nbytes < 1024 * scale or unit == "TiB":
            tenths = math.ceil(nbytes * 10 / scale)
            return f"{tenths // 10}.{tenths % 10}{unit}"
    raise AssertionError("unreachable")


class Bytes(int):
    """A size in bytes that shows its size: ``Bytes(1_707_000_000)`` reads ``1.59 GiB (1,707,000,000 bytes)``.

    Still an int for comparisons, JSON and ``str``; arithmetic on it gives plain ints.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{format_bytes(self)} ({int(self):,} bytes)"

    def __str__(self) -> str:
        return int.__repr__(self)

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython's display of a cell's value
        printer.text(repr(self))


def format_seconds(seconds: float, digits: int = 3) -> str:
    """``0.0123 -> '12.3 ms'`` with ``digits`` significant figures."""
    if seconds == 0:
        return "0 s"
    size = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if size >= scale or unit == "ns":
            value = seconds / scale
            return f"{value:.{digits}g} {unit}"
    raise AssertionError("unreachable")


CUDA_BLOCK_BYTES = 512  # the caching allocator's kMinBlockSize: every request is a multiple of it


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request of ``nbytes``.

    Requests are rounded up to a multiple of 512 bytes (the smallest block is
    512); an empty request takes no block at all. The one place this rounding lives.
    """
    if nbytes <= 0:
        return 0
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES

"""Published peak GPU memory of transformer fine-tuning runs, each with its source, to set against predictions.

``data/published/fine_tune_peaks.json`` is a list of records, one per published figure: the setup as the source
states it (a field is null where the source is silent: nothing is filled in by guess), the figure as printed
(``published_value``, ``published_unit``) and in bytes (``peak_bytes``), what was counted, and where it was
published (``source_url``, ``source_title``, ``quote_or_location``). Runs on quantized base weights (QLoRA) are
marked ``quantized``: udnn_lab does not model quantization, so set them apart when comparing.

``published_fine_tune_peaks()`` checks every record and returns them as a DataFrame, one row each.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pandas as pd

from udnn_lab.errors import PublishedDataError
from udnn_lab.units import parse_bytes
from udnn_lab.vocabulary import FINE_TUNE_METHODS, PEAK_COUNTERS

_PACKAGE = Path(__file__).resolve().parents[1]
# data/ of a source checkout (editable install), else the copy a wheel carries inside the package
DATA_DIR = next((d for d in (_PACKAGE.parent / "data", _PACKAGE / "data") if (d / "published").is_dir()),
                _PACKAGE.parent / "data")
FINE_TUNE_PEAKS_FILE = DATA_DIR / "published" / "fine_tune_peaks.json"

PUBLISHED_UNITS = ("MB", "MiB", "GB", "GiB")  # as sources print them; MB and GB are powers of 1000
# no single device holds more than this; a larger figure is a typo or a whole cluster's memory
_LARGEST_SANE_PEAK = 2**40
_SMALLEST_SANE_PEAK = 2**26  # 64 MiB: below any transformer fine-tune's peak


def _field(kind: str) -> Any:
    return field(metadata={"kind": kind})


@dataclass(frozen=True, kw_only=True)
class PublishedPeak:
    """One published peak-memory figure of a fine-tuning run, with its setup and its source."""

    id: str = _field("id")  # unique, lower case, e.g. 'litgpt-llama-2-7b-lora'
    model: str = _field("text")  # as the source names it, e.g. 'Llama-2-7b'
    method: str = _field("method")  # 'full', 'lora' or 'qlora'
    precision: str | None = _field("text?")  # e.g. 'fp32', 'fp16-mixed', 'bf16'
    optimizer: str | None = _field("text?")
    batch: int | None = _field("count?")  # samples per step on one device (the micro-batch)
    seq_len: int | None = _field("count?")  # tokens per sample (or the cap the source gives)
    gradient_checkpointing: bool | None = _field("flag?")
    attention: str | None = _field("text?")  # attention implementation, e.g. 'sdpa', 'flash_attention_2'
    quantized: bool = _field("flag")  # base weights quantized (QLoRA): not modelled by udnn_lab
    measured_counter: str | None = _field("counter")  # which counter, where the source names or shows it
    measured_what: str = _field("text")  # what the figure counts, in the source's words where it says
    published_value: float = _field("value")  # the figure as printed ...
    published_unit: str = _field("unit")  # ... and its unit: 'MB', 'MiB', 'GB' or 'GiB'
    peak_bytes: int = _field("bytes")  # published_value x unit, rounded to a whole byte
    device: str | None = _field("text?")  # the GPU the figure was measured on
    source_url: str = _field("url")
    source_title: str = _field("text")
    quote_or_location: str = _field("text")  # the table, section or sentence holding the figure
    notes: str = _field("notes")  # anything else of the setup: LoRA rank and targets, dataset, caveats

    def __post_init__(self) -> None:
        for spec in fields(self):
            object.__setattr__(self, spec.name, _checked(spec.name, spec.metadata["kind"], getattr(self, spec.name)))
        _check_consistency(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "published record") -> PublishedPeak:
        """Build and check one record; errors name ``origin`` (the file and record) and the bad field."""
        if not isinstance(data, Mapping):
            raise PublishedDataError(f"{origin}: a record is a JSON object, got {type(data).__name__}")
        known = [spec.name for spec in fields(cls)]
        unknown = sorted(set(data) - set(known))
        missing = [name for name in known if name not in data]
        if unknown or missing:
            raise PublishedDataError(f"{origin}: unknown field(s) {unknown}, missing field(s) {missing}; a record "
                                     f"has exactly the fields {known} (null where the source is silent)")
        try:
            return cls(**data)
        except PublishedDataError as error:
            raise PublishedDataError(f"{origin}: {error}") from None


def published_fine_tune_peaks(path: str | os.PathLike | None = None) -> pd.DataFrame:
    """The published fine-tuning peaks (``data/published/fine_tune_peaks.json``, or ``path``), checked, one row each.

    Columns are the fields of :class:`PublishedPeak`; ``batch`` and ``seq_len`` are nullable integers and
    ``gradient_checkpointing`` a nullable boolean, so a source's silence stays visible as <NA>.
    """
    records = load_published_peaks(path)
    frame = pd.DataFrame([asdict(record) for record in records], columns=[spec.name for spec in fields(PublishedPeak)])
    return frame.astype({"batch": "Int64", "seq_len": "Int64", "gradient_checkpointing": "boolean"})


def load_published_peaks(path: str | os.PathLike | None = None) -> list[PublishedPeak]:
    """Every record of the file, checked; ids must be unique."""
    path = Path(path) if path is not None else FINE_TUNE_PEAKS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PublishedDataError(f"cannot read published measurements {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise PublishedDataError(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: "
                                 f"{error.msg}); fix the file") from None
    if not isinstance(data, list) or not data:
        raise PublishedDataError(f"{path}: expected a non-empty JSON list of records, got {type(data).__name__}")
    records, seen = [], set()
    for index, item in enumerate(data):
        label = item.get("id") if isinstance(item, Mapping) else None
        record = PublishedPeak.from_dict(item, origin=f"{path}, record {index} ({label!r})")
        if record.id in seen:
            raise PublishedDataError(f"{path}: id {record.id!r} appears twice; give each record its own id")
        seen.add(record.id)
        records.append(record)
    return records


# ---- checks ---------------------------------------------------------------------------------

def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# kind -> (is the value acceptable, what it must be (for the error))
_KINDS: Mapping[str, tuple[Callable[[Any], bool], str]] = MappingProxyType({
    "id": (lambda v: isinstance(v, str) and re.fullmatch(r"[a-z0-9][a-z0-9.\-]*", v) is not None,
           "lower-case letters, digits, '.' and '-'"),
    "text": (_is_text, "a non-empty string"),
    "text?": (lambda v: v is None or _is_text(v), "a non-empty string, or null where the source is silent"),
    "notes": (lambda v: isinstance(v, str), "a string"),
    "method": (lambda v: v in FINE_TUNE_METHODS, f"one of {list(FINE_TUNE_METHODS)}"),
    "counter": (lambda v: v is None or v in PEAK_COUNTERS, f"one of {list(PEAK_COUNTERS)}, or null"),
    "count?": (lambda v: v is None or _is_count(v), "a positive whole number, or null where the source is silent"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "flag?": (lambda v: v is None or isinstance(v, bool), "true, false, or null where the source is silent"),
    "value": (_is_positive_number, "a positive number (the figure as the source prints it)"),
    "unit": (lambda v: v in PUBLISHED_UNITS, f"one of {list(PUBLISHED_UNITS)}"),
    "bytes": (lambda v: _is_count(v) and _SMALLEST_SANE_PEAK <= v <= _LARGEST_SANE_PEAK,
              "a whole number of bytes between 64 MiB and 1 TiB"),
    "url": (lambda v: isinstance(v, str) and re.fullmatch(r"https://\S+", v) is not None,
            "an https:// address of the source"),
})


def _checked(name: str, kind: str, value: Any) -> Any:
    acceptable, expected = _KINDS[kind]
    if not acceptable(value):
        raise PublishedDataError(f"field {name!r} must be {expected}, got {value!r}")
    return float(value) if kind == "value" else value


def _check_consistency(record: PublishedPeak) -> None:
    expected = parse_bytes(f"{record.published_value!r} {record.published_unit}")
    if record.peak_bytes != expected:
        raise PublishedDataError(
            f"field 'peak_bytes' is {record.peak_bytes}, but {record.published_value:g} {record.published_unit} is "
            f"{expected} bytes: set peak_bytes to {expected} (MB and GB are powers of 1000, MiB and GiB of 1024)")
    if record.method == "qlora" and not record.quantized:
        raise PublishedDataError("field 'quantized' must be true for a 'qlora' record (its base weights are "
                                 "quantized)")

"""Published fine-tuning peaks: every record sourced, its bytes the printed figure's, its setup sane."""

import json

import pandas as pd
import pytest

from udnn_lab.errors import PublishedDataError
from udnn_lab.zoo import published_fine_tune_peaks
from udnn_lab.zoo.published import FINE_TUNE_PEAKS_FILE, PublishedPeak, load_published_peaks

UNIT_BYTES = {"MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30}  # written out here, not taken from udnn_lab


@pytest.fixture(scope="module")
def peaks() -> pd.DataFrame:
    return published_fine_tune_peaks()


def _records() -> list[dict]:
    return json.loads(FINE_TUNE_PEAKS_FILE.read_text(encoding="utf-8"))


def _write(tmp_path, records):
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps(records))
    return path


def test_at_least_eight_records_from_several_sources_each_with_its_source(peaks):
    assert len(peaks) >= 8 and peaks["id"].is_unique
    assert peaks["source_url"].nunique() >= 3
    for column in ("source_url", "source_title", "quote_or_location", "measured_what", "model"):
        assert peaks[column].str.strip().str.len().gt(0).all(), column
    assert peaks["source_url"].str.startswith("https://").all()


def test_peak_bytes_is_the_printed_figure_in_bytes(peaks):
    for row in peaks.itertuples():
        assert row.peak_bytes == round(row.published_value * UNIT_BYTES[row.published_unit]), row.id


def test_values_are_sane(peaks):
    assert peaks["peak_bytes"].between(2**26, 2**40).all()
    assert peaks["batch"].dropna().gt(0).all() and peaks["seq_len"].dropna().gt(0).all()
    assert set(peaks["method"]) <= {"full", "lora", "qlora"}
    assert peaks.loc[peaks["method"] == "qlora", "quantized"].all()
    unquantized = peaks[~peaks["quantized"]]
    assert {"full", "lora"} <= set(unquantized["method"])  # both kinds a trace can reproduce


def test_a_source_s_silence_stays_missing_rather_than_guessed(peaks):
    assert str(peaks["batch"].dtype) == "Int64" and str(peaks["gradient_checkpointing"].dtype) == "boolean"
    t0 = peaks.set_index("id").loc["peft-t0-3b-full"]
    assert pd.isna(t0["batch"]) and pd.isna(t0["seq_len"]) and pd.isna(t0["measured_counter"])


def test_figures_as_their_sources_print_them(peaks):
    by_id = peaks.set_index("id")
    vanilla = by_id.loc["hf-bert-large-batch4-fp32"]
    assert vanilla["peak_bytes"] == 14949 * 2**20 and vanilla["measured_counter"] == "nvml_used"
    assert by_id.loc["torchtune-llama-3.1-8b-lora-rtx-4090", "peak_bytes"] == round(16.2 * 2**30)
    assert by_id.loc["litgpt-llama-2-7b-lora", "peak_bytes"] == 19_770_000_000
    # the same model and batch: checkpointing keeps less than storing every activation
    assert (by_id.loc["hf-bert-large-batch1-accumulate4-checkpointing", "peak_bytes"]
            < by_id.loc["hf-bert-large-batch1-accumulate4", "peak_bytes"])


def test_the_shipped_file_round_trips_through_records():
    records = load_published_peaks()
    assert [r.id for r in records] == [item["id"] for item in _records()]
    assert all(isinstance(r, PublishedPeak) for r in records)


@pytest.mark.parametrize("change, expected", [
    (lambda r: r.pop("source_url"), "missing field(s) ['source_url']"),
    (lambda r: r.update(source_url="github.com/x"), "https://"),
    (lambda r: r.update(source_title=" "), "'source_title' must be a non-empty string"),
    (lambda r: r.update(peak_bytes=r["peak_bytes"] + 1), "set peak_bytes to"),
    (lambda r: r.update(published_unit="gigabytes"), "'published_unit' must be one of"),
    (lambda r: r.update(method="qlora", quantized=False), "'quantized' must be true"),
    (lambda r: r.update(method="adapter"), "'method' must be one of"),
    (lambda r: r.update(batch=0), "'batch' must be a positive whole number"),
    (lambda r: r.update(measured_counter="smi"), "'measured_counter' must be one of"),
    (lambda r: r.update(extra=1), "unknown field(s) ['extra']"),
    (lambda r: r.update(published_value=4e6, published_unit="GB", peak_bytes=4 * 10**15), "between 64 MiB and 1 TiB"),
])
def test_a_bad_record_is_refused_naming_the_file_the_record_and_the_field(tmp_path, change, expected):
    records = _records()
    change(records[1])
    path = _write(tmp_path, records)
    with pytest.raises(PublishedDataError) as caught:
        published_fine_tune_peaks(path)
    message = str(caught.value)
    assert expected in message and str(path) in message and "record 1" in message


def test_duplicate_ids_an_empty_file_and_bad_json_are_refused(tmp_path):
    records = _records()
    records[2]["id"] = records[0]["id"]
    with pytest.raises(PublishedDataError, match="appears twice"):
        published_fine_tune_peaks(_write(tmp_path, records))
    with pytest.raises(PublishedDataError, match="non-empty JSON list"):
        published_fine_tune_peaks(_write(tmp_path, []))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(PublishedDataError, match="not valid JSON"):
        published_fine_tune_peaks(broken)
    with pytest.raises(PublishedDataError, match="cannot read"):
        published_fine_tune_peaks(tmp_path / "absent.json")

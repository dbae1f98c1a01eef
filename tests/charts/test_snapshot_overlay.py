"""The snapshot overlay chart (charts/snapshot_overlay.py): curves on the step's allocations, the peaks as bars."""

import pickle

import pytest
import torch

import udnn_lab as ul
from udnn_lab import charts, frames


def overlay(tmp_path, events, segments=()):
    graph = ul.trace(torch.nn.Linear(64, 64), torch.randn(16, 64))
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps({"segments": list(segments), "device_traces": [events]}))
    return frames.snapshot_overlay(ul.load_snapshot(path), graph)


def views(spec: dict):
    for key in ("hconcat", "layer"):
        for part in spec.get(key, []):
            yield from views(part)
    if "mark" in spec:
        yield spec


def test_the_chart_draws_each_curve_its_peak_and_both_peaks_as_bars(tmp_path):
    frames_ = [{"filename": "/me/train.py", "line": 3, "name": "step"}]
    events = [{"action": "segment_alloc", "addr": 0, "size": 2**21},
              {"action": "alloc", "addr": 0, "size": 4096, "frames": frames_},
              {"action": "alloc", "addr": 8192, "size": 8192, "frames": frames_},
              {"action": "free_completed", "addr": 0, "size": 4096}]
    held_at_the_end = {"total_size": 2**21, "blocks": [{"address": 8192, "size": 8192, "requested_size": 8192,
                                                       "state": "active_allocated"}]}
    shown = overlay(tmp_path, events, [held_at_the_end])
    chart = charts.snapshot_overlay(shown.timeline(), shown.peak_parts(), title="a run")
    spec = chart.to_dict()
    assert spec["title"]["text"] == "a run" and "peak predicted" in spec["title"]["subtitle"]
    marks = [view["mark"]["type"] if isinstance(view["mark"], dict) else view["mark"] for view in views(spec)]
    assert marks.count("line") == 3 and marks.count("point") == 1 and marks.count("bar") == 1  # with reserved
    rows = [row for values in spec["datasets"].values() for row in values]
    lines = {row["line"] for row in rows if "line" in row}
    assert lines == {"predicted allocated (cpu, keep-all)", "measured allocated (snapshot)",
                     "measured reserved (snapshot)"}
    bars = {row["side"] for row in rows if "side" in row}
    assert bars == {"predicted", "measured"}
    assert max(row["value"] for row in rows if row.get("line") == "measured reserved (snapshot)") == 2.0  # MiB


def test_the_chart_takes_only_the_overlay_s_frames(tmp_path):
    shown = overlay(tmp_path, [])
    with pytest.raises(ValueError, match=r"SnapshotOverlay.timeline\(\)"):
        charts.snapshot_overlay(shown.peak_parts(), shown.peak_parts())

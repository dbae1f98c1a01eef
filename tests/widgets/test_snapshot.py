"""MemoryLab's snapshot overlay (widgets/_snapshot.py), driven by setting values as the other widget tests are."""

import html
import pickle

import pytest

import udnn_lab as ul
from udnn_lab.widgets._snapshot import DIFFERENCES_SHOWN
from udnn_lab.widgets.app import MemoryLab


@pytest.fixture(scope="module")
def lab_and_run(tmp_path_factory):
    """MemoryLab on a CPU step, and the same step run for real on this CPU, written as a snapshot."""
    lab = MemoryLab("resnet11", batch=16, image_size=32, policy="keep-all", hardware="cpu-amd-epyc-2cpu",
                    debounce_s=0)
    work = lab.session.trainable(lab.setting)
    path = ul.write_cpu_snapshot(tmp_path_factory.mktemp("runs") / "resnet11.pickle.gz", work)
    return lab, path


def rows(chart) -> list[dict]:
    return [row for values in chart.spec["datasets"].values() for row in values]


def test_a_snapshot_is_laid_over_the_prediction_on_screen(lab_and_run):
    lab, path = lab_and_run
    assert lab.snapshot.chart.layout.display == "none"  # nothing until a snapshot is read
    lab.snapshot.path.value = str(path)  # what Enter in the box sends: read as it arrives
    assert lab.snapshot.overlay is not None
    lab.snapshot.load_button.click()  # read again
    overlay = lab.snapshot.overlay
    graph = lab.session.graph(lab.setting)
    assert overlay is not None and overlay.predicted_peak_bytes == graph.peak_bytes == overlay.measured_peak_bytes
    assert lab.snapshot.chart.layout.display is None and lab.snapshot.message.value == ""
    drawn = {row["line"] for row in rows(lab.snapshot.chart) if "line" in row}
    assert drawn == {"predicted allocated (cpu, keep-all)", "measured allocated (snapshot)"}
    assert "peak</b>: predicted" in lab.snapshot.table.value and "every size at the peaks" in lab.snapshot.table.value


def test_the_overlay_follows_the_plan_and_lists_what_differs(lab_and_run):
    lab, path = lab_and_run
    lab.overlay_snapshot(path)
    lab.policy.value = "vdnn-all"
    minimum = lab.session.min_budget(lab.setting, "vdnn-all", lab.hardware.value)
    lab.budget_entry.value = ul.format_bytes(int(minimum * 1.1))
    overlay = lab.snapshot.overlay
    assert overlay.policy == "vdnn-all" and overlay.difference_bytes > 0  # the run kept everything
    table = lab.snapshot.table.value
    differing = overlay.differences().query("difference_bytes != 0")
    assert table.count("class='udnn-snapshot-difference'") == min(len(differing), DIFFERENCES_SHOWN)
    top = differing.iloc[0]  # the largest difference, first
    first_row = table.split("class='udnn-snapshot-difference'")[1]
    assert ul.format_bytes(int(top["size_bytes"])) in first_row and html.escape(top["match"]) in first_row
    lab.policy.value = "keep-all"


def test_a_bad_file_is_one_line_in_the_app_and_what_was_shown_stays(lab_and_run, tmp_path):
    lab, path = lab_and_run
    lab.overlay_snapshot(path)
    shown = lab.snapshot.chart.spec
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[ValueError("x")]]}))
    lab.overlay_snapshot(bad)
    message = lab.snapshot.message.value
    assert "SnapshotError" in message and "builtins.ValueError" in message and "refused unread" in message
    assert "Traceback" not in message and "\n" not in message
    lab.overlay_snapshot(tmp_path / "missing.pickle")
    assert "no snapshot at" in lab.snapshot.message.value
    assert lab.snapshot.chart.spec == shown

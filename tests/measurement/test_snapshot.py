"""Memory snapshots from any run, read safely (measurement/snapshot.py)."""

import gzip
import os
import pickle
import tarfile
from pathlib import Path

import pytest

import udnn_lab as ul
from udnn_lab.errors import SnapshotError

RUN = Path(__file__).resolve().parents[2] / "data" / "benchmarks" / "gpu" / "h200-20261126T1459-corpus"
MIB = 2**20


@pytest.fixture(scope="module")
def resnet50(tmp_path_factory):
    """A real snapshot: ResNet-50 b256 under auto at 50% of keep-all, on an H200 (the 2026-11-26 run)."""
    with tarfile.open(RUN / "diagnostics-1.tgz") as archive:
        data = archive.extractfile("gpu_corpus/resnet50-auto-50%-snapshot.pickle.gz").read()
    path = tmp_path_factory.mktemp("snapshots") / "resnet50.pickle.gz"
    path.write_bytes(data)
    return path


def test_a_real_snapshot_is_read_and_its_peak_found(resnet50):
    snapshot = ul.load_snapshot(resnet50)
    peak = snapshot.peak()
    assert round(peak.allocated_bytes / MIB, 1) == 10754.8  # what the run's diagnosis printed
    places = peak.by_place()
    assert places.iloc[0]["where"] == "modules/conv.py:548 _conv_forward" and places["bytes"].sum() == \
        peak.allocated_bytes
    assert round(snapshot.transients(1).iloc[0]["bytes"] / MIB, 1) == 1184.0  # its largest cuDNN workspace


def test_a_plain_pickle_reads_as_a_gzipped_one(resnet50, tmp_path):
    plain = tmp_path / "plain.pickle"
    plain.write_bytes(gzip.decompress(resnet50.read_bytes()))
    assert ul.load_snapshot(plain).peak() == ul.load_snapshot(resnet50).peak()


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Payload(marker)]]}))
    with pytest.raises(SnapshotError, match="asks to load posix.system.*refused unread") as raised:
        ul.load_snapshot(path)
    assert not marker.exists() and "\n" not in str(raised.value)
    assert pickle.loads(path.read_bytes()) is not None and marker.exists()  # the same file under pickle runs it


@pytest.mark.parametrize("content, says", [
    (pickle.dumps([1, 2, 3]), "holds no 'segments'"),
    (b"not a pickle at all", "is not a memory snapshot"),
    (pickle.dumps({"segments": []})[:-3], "is not a memory snapshot"),
])
def test_what_is_not_a_snapshot_is_said_in_one_line(tmp_path, content, says):
    path = tmp_path / "file.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match=says):
        ul.load_snapshot(path)
    with pytest.raises(SnapshotError, match="no snapshot at .*_dump_snapshot"):
        ul.load_snapshot(tmp_path / "missing.pickle")


def test_an_empty_history_has_no_peak(tmp_path):
    path = tmp_path / "empty.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": []}, protocol=4))
    snapshot = ul.load_snapshot(path)
    assert snapshot.peak().allocated_bytes == 0 and snapshot.transients().empty


def test_a_replay_counts_what_was_held_before_the_history_began(resnet50):
    snapshot = ul.load_snapshot(resnet50)
    replay = snapshot.replay()
    held_at_end = sum(block["requested_size"] for segment in snapshot.segments for block in segment["blocks"]
                      if block["state"].startswith("active"))
    assert replay.start_bytes == replay.allocated_bytes[-1] == held_at_end  # the step gave back all it took
    assert round(replay.start_bytes / MIB, 1) == 634.2
    assert round(replay.peak.allocated_bytes / MIB, 1) == 11389.0  # 10754.8 above the start, as peak() says
    assert replay.peak.allocated_bytes == replay.allocated_bytes[replay.peak_event] == max(replay.allocated_bytes)
    assert sum(block.size for block in replay.peak.blocks) == replay.peak.allocated_bytes
    reserved = replay.reserved_bytes
    assert reserved[-1] == sum(segment["total_size"] for segment in snapshot.segments)
    assert (round(reserved[0] / MIB), round(max(reserved) / MIB)) == (4362, 14116)
    counted = snapshot.replay(ul.units.cuda_block_bytes)  # requests in the allocator's 512-byte blocks
    assert counted.peak.allocated_bytes > replay.peak.allocated_bytes and counted.peak_event == replay.peak_event


def test_a_replay_of_a_small_history_by_hand(tmp_path):
    frames = [{"filename": "/home/me/train.py", "line": 7, "name": "step"}]
    events = [{"action": "free_requested", "addr": 1, "size": 300},
              {"action": "free_completed", "addr": 1, "size": 300},
              {"action": "segment_alloc", "addr": 4096, "size": 2048},
              {"action": "alloc", "addr": 4096, "size": 1000, "frames": frames},
              {"action": "alloc", "addr": 5096, "size": 500, "frames": frames},
              {"action": "free_completed", "addr": 4096, "size": 1000}]
    segments = [{"total_size": 1024, "blocks": [{"address": 2, "size": 512, "requested_size": 400,
                                                 "state": "active_allocated"}]},
                {"total_size": 2048, "blocks": [{"address": 5096, "size": 512, "requested_size": 500,
                                                 "state": "active_allocated"}]}]
    path = tmp_path / "small.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [events]}))
    replay = ul.load_snapshot(path).replay()
    assert replay.start_bytes == 300 + 400  # freed without being allocated; held at the end, never allocated
    assert replay.allocated_bytes == (700, 400, 400, 1400, 1900, 900)
    assert replay.reserved_bytes == (1024, 1024, 3072, 3072, 3072, 3072)
    assert (replay.peak.allocated_bytes, replay.peak_event) == (1900, 4)
    assert sorted((b.size, b.where) for b in replay.peak.blocks) == [
        (400, "(held before the history began)"), (500, "me/train.py:7 step"), (1000, "me/train.py:7 step")]

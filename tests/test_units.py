import json
import pickle

import pytest

import udnn_lab as ul
from udnn_lab.units import Bytes, cuda_block_bytes, format_budget, format_bytes, format_seconds, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("512", 512), (1024, 1024), (3.0, 3), ("6 GiB", 6 * 2**30), ("6GiB", 6 * 2**30), ("6 gib", 6 * 2**30),
    ("6GB", 6 * 10**9), ("6 gb", 6 * 10**9), ("6G", 6 * 2**30), ("1.5g", int(1.5 * 2**30)),
    ("300 MiB", 300 * 2**20), ("80kb", 80_000), ("80 KiB", 80 * 1024), ("2 bytes", 2), ("1e3 B", 1000),
    ("2 TB", 2 * 10**12), ("1 TiB", 2**40),
])
def test_parse_bytes_accepts_common_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["6 GX", "abc", "", "GiB", "1.2.3 MB"])
def test_parse_bytes_rejects_garbage_with_a_hint(bad):
    with pytest.raises(ValueError, match="GiB"):
        parse_bytes(bad)


def test_parse_bytes_takes_numpy_numbers():
    import numpy as np

    assert parse_bytes(np.int64(4096)) == 4096 and parse_bytes(np.float32(2.0)) == 2


def test_parse_bytes_rejects_negative_and_wrong_types():
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-5)
    with pytest.raises(TypeError):
        parse_bytes([1])
    with pytest.raises(TypeError):
        parse_bytes(True)


def test_format_bytes_and_seconds():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(17) == "17 B"
    assert format_bytes(-2048) == "-2.00 KiB"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(3e-6) == "3 µs"


def test_cuda_block_bytes_rounds_to_512_byte_blocks():
    assert cuda_block_bytes(0) == 0
    assert cuda_block_bytes(1) == 512
    assert cuda_block_bytes(512) == 512
    assert cuda_block_bytes(513) == 1024
    assert cuda_block_bytes(10**6) == 1000448


def test_bytes_read_as_a_size_and_stay_an_int():
    size = Bytes(1_707_000_000)
    assert repr(size) == "1.59 GiB (1,707,000,000 bytes)"
    assert str(size) == f"{size}" == "1707000000" and f"{size:,}" == "1,707,000,000"
    assert json.dumps({"peak": size}) == '{"peak": 1707000000}'
    assert size == 1_707_000_000 and size < 2 << 30 and isinstance(size, int)
    assert type(size + 1) is int and type(size // 2) is int
    assert pickle.loads(pickle.dumps(size)) == size
    printed = []
    size._repr_pretty_(type("Printer", (), {"text": lambda self, text: printed.append(text)})(), False)
    assert printed == [repr(size)]


def test_sizes_the_api_returns_read_as_sizes():
    graph = ul.trace(ul.zoo.get("mlp3", batch=2))
    for size in (graph.peak_bytes, graph.cuda_peak_bytes, ul.min_budget(graph, "auto", hardware="h100-sxm")):
        assert isinstance(size, Bytes) and "bytes)" in repr(size)


@pytest.mark.parametrize("nbytes, text", [
    (356142799, "339.7MiB"), (300, "300B"), (1024, "1.0KiB"), (6 << 30, "6.0GiB"), ((6 << 30) + 1, "6.1GiB"),
])
def test_a_budget_to_type_reads_as_a_size_and_is_never_under_the_bytes(nbytes, text):
    assert format_budget(nbytes) == text
    assert nbytes <= parse_bytes(text) < nbytes * 1.02 + 1024  # rounded up by at most a tenth of its unit


@pytest.mark.parametrize("negative", ["-1GB", "-1", "-0.5 GiB", -5, -2.5])
def test_a_negative_size_says_a_budget_cannot_be_negative(negative):
    with pytest.raises(ValueError, match="a budget cannot be negative"):
        parse_bytes(negative)


def test_plan_says_a_negative_budget_cannot_be_one():
    graph = ul.trace(ul.zoo.get("mlp3", batch=2))
    with pytest.raises(ValueError, match="a budget cannot be negative, nor any size: got '-1GB'"):
        ul.plan(graph, "-1GB", hardware="h100-sxm")

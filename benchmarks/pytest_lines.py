"""A pytest plugin for the GPU check: one JSON line per test as it starts and as each phase ends, written at once to
the file ``UDNN_TEST_LINES`` names. A run that dies inside a test (a CUDA kernel's segmentation fault) keeps every
result before it, with its failure text, and names the test it died in.

    UDNN_TEST_LINES=lines.jsonl python -m pytest -p pytest_lines ...   (benchmarks/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import os


def _write(record: dict) -> None:
    path = os.environ.get("UDNN_TEST_LINES")
    if path:
        with open(path, "a") as lines:
            lines.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _write({"test": nodeid, "event": "start"})


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed":  # a setup that skips or fails ends the test there
        _write({"test": report.nodeid, "event": report.when, "outcome": report.outcome,
                "seconds": report.duration, "message": str(report.longrepr)[-4000:] if report.longrepr else ""})

import os

# One thread per pytest-xdist worker (the suite runs on two cores), two otherwise.
_threads = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
os.environ.setdefault("OMP_NUM_THREADS", _threads)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(_threads))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

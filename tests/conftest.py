import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

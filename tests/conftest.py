import os

# One thread per pytest-xdist worker (the suite runs on two cores), two otherwise.
_threads = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = _threads  # kernels and child processes the tests start inherit it
else:
    os.environ.setdefault("OMP_NUM_THREADS", _threads)

# CPU graphs simulate on the shipped CPU profile wherever the suite runs, so that no result depends on the machine
# (NOTE [the profile for this machine]); tests/hardware/test_this_machine.py checks the rule itself
os.environ["UDNN_LAB_HARDWARE"] = "cpu-amd-epyc-2cpu"

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


def _vdnn_all_for_cuda(name: str, **options):
    import udnn_lab as ul

    graph = ul.trace(ul.zoo.get(name, batch=2, device="meta", **options), device="cuda")
    hardware = "titan-x-maxwell"
    return graph, ul.simulate(graph, ul.plan(graph, None, "vdnn-all", hardware=hardware), hardware=hardware)


@pytest.fixture(scope="session")
def small():
    """A ResNet-18 step at batch 2, 32x32, traced for CUDA on meta weights, and its vdnn-all simulation."""
    return _vdnn_all_for_cuda("resnet18", image_size=32)


@pytest.fixture(scope="session")
def resnet1001():
    """ResNet-1001 at batch 2, traced for CUDA on meta weights, and its vdnn-all simulation."""
    return _vdnn_all_for_cuda("resnet1001")

import gc

import pytest

from udnn_lab.collector import collector_paused


@pytest.fixture
def collecting():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_paused_inside_and_back_after(collecting):
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_comes_back_after_an_error(collecting):
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("interrupted")
    assert gc.isenabled()


def test_a_collector_paused_before_stays_paused(collecting):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()

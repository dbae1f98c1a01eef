"""The search alone, on sizes whose fit is known: exponential growth, then bisection (NOTE [monotone peak])."""

import math

import pytest

from udnn_lab.fitting.result import Probe, disagreements
from udnn_lab.fitting.search import largest_fitting


def _threshold(answer: int, tried: list[int] | None = None):
    """A step whose peak is its size: sizes up to ``answer`` fit a budget of ``answer``."""
    def probe(size: int) -> Probe:
        if tried is not None:
            tried.append(size)
        return Probe(size, size, size <= answer, size)
    return probe


@pytest.mark.parametrize("answer", [0, 1, 2, 3, 7, 8, 9, 100, 1000, 4097])
def test_the_answer_fits_and_the_next_size_does_not(answer):
    tried: list[int] = []
    bracket = largest_fitting(_threshold(answer, tried))
    assert (bracket.fitting.size if bracket.fitting else 0) == answer
    assert bracket.failed.size == answer + 1 and not bracket.failed.fits
    assert not bracket.reached_limit
    assert len(tried) == len(set(tried)) == len(bracket.probes)  # no size is tried twice


@pytest.mark.parametrize("answer", [1, 5, 100, 1000, 100_000])
def test_the_search_takes_logarithmically_many_probes(answer):
    bracket = largest_fitting(_threshold(answer))
    assert len(bracket.probes) <= 2 * math.ceil(math.log2(answer + 1)) + 1


def test_a_limit_that_fits_ends_the_search_there():
    bracket = largest_fitting(_threshold(1000), limit=300)
    assert bracket.reached_limit and bracket.failed is None and bracket.fitting.size == 300
    assert max(p.size for p in bracket.probes) == 300


def test_only_multiples_are_tried():
    bracket = largest_fitting(_threshold(203), start=10, multiple_of=8)
    assert all(p.size % 8 == 0 for p in bracket.probes)
    assert bracket.probes[0].size == 16  # the first multiple at or above start
    assert (bracket.fitting.size, bracket.failed.size) == (200, 208)


def test_a_start_that_does_not_fit_is_bisected_down():
    bracket = largest_fitting(_threshold(5), start=64)
    assert (bracket.fitting.size, bracket.failed.size) == (5, 6)


def test_a_start_above_the_limit_is_refused():
    with pytest.raises(ValueError, match="above the limit"):
        largest_fitting(_threshold(5), start=20, limit=10)


def test_probes_that_contradict_the_monotone_peak_are_reported():
    assert disagreements((Probe(4, 4, True, 4), Probe(8, 9, False, 9), Probe(6, 6, True, 6))) == ()
    notes = disagreements((Probe(4, 9, False, 9), Probe(8, 3, True, 3)))
    assert len(notes) == 1 and "not monotone" in notes[0] and "8 fits although 4" in notes[0]

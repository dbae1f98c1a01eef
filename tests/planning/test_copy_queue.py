"""A copy stream as auto sees it: copies in issue order, one at a time, each ending behind the one before.

Checked against the recursion written out (end = max(issue, previous end) + seconds), over copies
added and removed in any order; and the added wait against the total wait recomputed from scratch.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from udnn_lab.planning._copy_queue import CopyQueue

copies = st.lists(st.tuples(st.floats(0, 10), st.floats(0.01, 3), st.floats(0, 14)), min_size=0, max_size=12)


def _ends(queued):
    free, ends = 0.0, []
    for issued, _, seconds, _ in sorted(queued):
        free = max(issued, free) + seconds
        ends.append(free)
    return ends


def _wait(queued):
    return sum(max(0.0, end - due) for end, (_, _, _, due) in zip(_ends(queued), sorted(queued)))


def _filled(drawn):
    queue, queued = CopyQueue(), []
    for tensor, (issued, seconds, due) in enumerate(drawn):
        queue.add(issued, tensor, seconds, due)
        queued.append((issued, tensor, seconds, due))
    return queue, queued


@settings(max_examples=60, deadline=None)
@given(drawn=copies, gone=st.data())
def test_each_copy_ends_behind_those_issued_before_it(drawn, gone):
    queue, queued = _filled(drawn)
    for _ in range(gone.draw(st.integers(0, len(queued)))):
        issued, tensor, _, _ = queued.pop(gone.draw(st.integers(0, len(queued) - 1)))
        queue.remove(issued, tensor)
    assert queue._ends.tolist() == pytest.approx(_ends(queued))
    issued, seconds = 5.0, 1.0
    free = max([end for end, copy in zip(_ends(queued), sorted(queued)) if copy[:2] < (issued, 99)], default=0.0)
    assert queue.end_if_added(issued, 99, seconds) == pytest.approx(max(issued, free) + seconds)


@settings(max_examples=60, deadline=None)
@given(drawn=copies, new=st.tuples(st.floats(0, 10), st.floats(0.01, 3), st.floats(0, 14)), replace=st.booleans())
def test_the_added_wait_is_the_whole_queue_s_wait_with_the_copy_less_without(drawn, new, replace):
    queue, queued = _filled(drawn)
    issued, seconds, due = new
    if replace and queued:  # a later prefetch of a queued tensor: it leaves its place for a later one
        old = queued[0]
        issued = old[0] + 1.0
        added = queue.added_wait(issued, old[1], seconds, due, instead_of=old[:2])
        expected = _wait([c for c in queued if c is not old] + [(issued, old[1], seconds, due)]) - _wait(queued)
    else:
        added = queue.added_wait(issued, 99, seconds, due)
        expected = _wait([*queued, (issued, 99, seconds, due)]) - _wait(queued)
    assert added == pytest.approx(expected, abs=1e-9)
    assert added >= -1e-9 or replace


def test_removing_a_copy_never_queued_says_which():
    queue = CopyQueue()
    queue.add(1.0, 3, 0.5)
    with pytest.raises(KeyError, match="tensor 4"):
        queue.remove(1.0, 4)
    assert queue.end_if_added(0.0, 1, 0.25) == 0.25 and math.isclose(queue.end_if_added(1.2, 5, 0.25), 1.75)

"""The cyclic garbage collector, paused while a stage makes or searches through many objects.

A full collection passes over every object the process holds (with torch imported, over 300,000,
and more in a notebook): about a quarter of a second each time. Recording a step and planning a
deep graph make objects faster than they let them go, so the collector would sweep again and
again, for no cycles they make.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside; the collector is as it was after (reference counting goes on)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()

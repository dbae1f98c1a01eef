"""Results computed from a Graph, kept for as long as that Graph lives and no longer."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

Result = TypeVar("Result")


def per_graph(function: Callable[..., Result]) -> Callable[..., Result]:
    """Cache ``function(graph, *args)`` per graph, holding the graph weakly.

    Graphs compare and hash by identity, so each one gets its own results; when a graph is
    collected, so are its results (an ``lru_cache`` would keep graphs alive instead).
    """
    results: weakref.WeakKeyDictionary[Any, dict[tuple, Result]] = weakref.WeakKeyDictionary()

    @functools.wraps(function)
    def cached(graph, *args) -> Result:
        mine = results.setdefault(graph, {})
        if args not in mine:
            mine[args] = function(graph, *args)
        return mine[args]

    return cached

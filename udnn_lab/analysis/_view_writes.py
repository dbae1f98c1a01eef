"""Whether a step writes, under autograd, into a storage a view shares (NOTE [view replay] 4).

Only then does autograd rebuild a view's history, and only then does turning view replay on or off change
the step's ops: a runtime follows a step that never does without it, which would cost it every view op.
"""

from __future__ import annotations

import torch


class ViewWrites:
    """Follows one step's ops: which storages were viewed, and whether one (or a view) was written in place while
    autograd records. Storages are known by id(), which may be reused after one is freed: a reused id can only make
    the answer yes where it was no, never the reverse."""

    def __init__(self) -> None:
        self.found = False
        self._viewed: set[int] = set()
        self._kinds: dict = {}  # op -> (positions it views, positions it writes)

    def follow(self, func, args: tuple, kwargs: dict) -> None:
        """Call with each op before it runs."""
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _view_kind(func)
        viewing, written = kind
        for position in viewing:
            value = args[position] if position < len(args) else None
            if isinstance(value, torch.Tensor):
                self._viewed.add(id(value.untyped_storage()))
        if written and not self.found and torch.is_grad_enabled() and _requires_grad(args, kwargs):
            for position in written:
                value = args[position] if isinstance(position, int) and position < len(args) else \
                    kwargs.get(str(position))
                if isinstance(value, torch.Tensor) and (value._is_view()
                                                        or id(value.untyped_storage()) in self._viewed):
                    self.found = True
                    return


def _view_kind(func) -> tuple[tuple[int, ...], tuple[int | str, ...]]:
    """An op's arguments its outputs view (an alias returned, not written) and those it writes in place."""
    schema = func._schema
    returns_alias = any(result.alias_info is not None for result in schema.returns)
    viewing, written = [], []
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None:
            continue
        if alias.is_write:
            written.append(argument.name if argument.kwarg_only else position)
        elif returns_alias and not argument.kwarg_only:
            viewing.append(position)
    return tuple(viewing), tuple(written)


def _requires_grad(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and v.requires_grad for v in value):
            return True
    return False

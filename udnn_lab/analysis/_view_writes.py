"""Whether a step writes, under autograd, into a storage a view shares (NOTE [view replay] 4).

Only then does autograd rebuild a view's history, and only then does turning view replay on or off change
the step's ops: a runtime follows a step that never does without it, which would cost it every view op.
"""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.vocabulary import traced_op
from udnn_lab.workload import Workload


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
        if self.found:  # the answer is yes for the rest of the step
            return
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _view_kind(func)
        viewing, written = kind
        for position in viewing:
            value = args[position] if position < len(args) else None
            if isinstance(value, torch.Tensor):
                self._viewed.add(id(value.untyped_storage()))
        if written and torch.is_grad_enabled() and _requires_grad(args, kwargs):
            for position in written:
                value = args[position] if isinstance(position, int) and position < len(args) else \
                    kwargs.get(str(position))
                if isinstance(value, torch.Tensor) and (value._is_view()
                                                        or id(value.untyped_storage()) in self._viewed):
                    self.found = True
                    return


def written_positions(func) -> tuple[int | str, ...]:
    """Where an op writes in place: positions of written arguments (keyword-only ones by name)."""
    return tuple(argument.name if argument.kwarg_only else position
                 for position, argument in enumerate(func._schema.arguments)
                 if argument.alias_info is not None and argument.alias_info.is_write)


def _view_kind(func) -> tuple[tuple[int, ...], tuple[int | str, ...]]:
    """An op's arguments its outputs view (an alias returned, not written) and those it writes in place."""
    schema = func._schema
    viewing: tuple[int, ...] = ()
    if any(result.alias_info is not None for result in schema.returns):
        viewing = tuple(position for position, argument in enumerate(schema.arguments)
                        if argument.alias_info is not None and not argument.alias_info.is_write
                        and not argument.kwarg_only)
    return viewing, written_positions(func)


def real_step_ops(work: Workload, replay_views: bool) -> list[str]:
    """The ops a real forward and backward of ``work`` runs (on a copy of its model), as the Graph counts them: what
    view replay changes where a step rebuilds a view's history."""
    model = copy.deepcopy(work.model)
    args, kwargs = split_input(work.example_input)
    torch.manual_seed(0)
    with _OpNames() as seen:
        run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, replay_views=replay_views)
    return seen.names


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if traced_op(func):  # the ops a Graph records (records_op)
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _requires_grad(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and v.requires_grad for v in value):
            return True
    return False

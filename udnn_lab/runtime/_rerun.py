"""Recompute by calling a module's forward again (NOTE [hook points] 7): what non-reentrant checkpoint does, for a
recomputation the plan made of one whole module call."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from udnn_lab.analysis.recording import PLAIN_TYPES
from udnn_lab.errors import ReplayError
from udnn_lab.graph.plan_ir import Plan, Recompute, other_step
from udnn_lab.graph.reruns import RUNNING_STATISTICS, RerunCall
from udnn_lab.graph.reruns import rerun_calls as reruns_of
from udnn_lab.graph.step_graph import HookEvent
from udnn_lab.runtime._made_bytes import MadeBytes, out_of_sight


def rerun_calls(plan: Plan) -> dict[int, RerunCall]:
    """Recomputation index -> the module call it re-runs, for a located plan's recomputations that re-run one."""
    return reruns_of(plan.hook_events, plan.reruns, plan.recomputes)


class ModuleRerun:
    """One recomputation carried out by re-running a module call: its state as forward met it, then the re-run."""

    def __init__(self, recompute: Recompute, call: RerunCall, events: tuple[HookEvent, ...]) -> None:
        self.recompute = recompute
        self.packs = len(call.packs)
        self.wanted = {index: (tensor, events[call.packs[index]]) for index, tensor in call.restores.items()}
        self.module: torch.nn.Module | None = None
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.versions: tuple[tuple[torch.Tensor, int], ...] = ()
        self.rng: tuple[torch.Tensor, torch.Tensor | None, int] | None = None
        self.autocast: tuple[tuple[str, torch.dtype], ...] = ()
        self.autocast_cache = True
        self.done = False

    def entered(self, module: torch.nn.Module) -> None:
        """At the call's 'enter': the generators and autocast as its forward starts."""
        self.module = module
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else -1
        self.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(cuda) if cuda >= 0 else None, cuda)
        self.autocast = tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                              if torch.is_autocast_enabled(kind))
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def exited(self, args: tuple, kwargs: dict) -> None:
        """At the call's 'exit': its arguments, detached as they required grad, with their versions."""
        values = (*args, *kwargs.values())
        if all(isinstance(value, _FLAT) for value in values):  # most calls: no containers to flatten
            self.args, self.kwargs = tuple(map(_detached, args)), {k: _detached(v) for k, v in kwargs.items()}
            leaves: list = list(values)
        else:
            leaves, spec = tree_flatten((args, kwargs))
            if not all(isinstance(leaf, PLAIN_TYPES) for leaf in leaves):
                module = type(self.module).__name__
                raise other_step(f"this step is not the one the plan was made for: {module} takes an argument that "
                                 "is neither a tensor nor a plain value (a cache?) where the traced step's did not, "
                                 "so the plan's re-run of that call could change it; trace this step and plan again")
            self.args, self.kwargs = tree_unflatten([_detached(leaf) for leaf in leaves], spec)
        self.versions = tuple((t, t._version) for t in leaves if isinstance(t, torch.Tensor))

    def run(self, counted: MadeBytes | None = None) -> dict[int, torch.Tensor]:
        """Re-run the call once; the restored tensors by Graph tensor id (nothing if it ran already). ``counted``,
        where given, counts the storages the re-run makes while they are alive (NOTE [offload runtime] 6)."""
        if self.done:
            return {}
        if self.module is None or self.rng is None:
            raise ReplayError("a recomputation's module call was not met in forward: run forward and backward inside "
                              "the runtime, and plan again if the model changed")
        for source, version in self.versions:
            if source._version != version:
                raise ReplayError("a tensor a recomputed module call reads was modified by an inplace operation after "
                                  "forward used it, so forward cannot be reproduced; plan its tensors as kept or "
                                  "offloaded instead")
        found: dict[int, torch.Tensor] = {}
        seen = 0

        def pack(tensor: torch.Tensor) -> None:
            nonlocal seen
            wanted = self.wanted.get(seen)
            seen += 1
            if wanted is not None:
                graph_id, event = wanted
                if str(tensor.dtype) != event.dtype or tuple(tensor.shape) != event.shape:
                    raise ReplayError(_differs(self.module, f"saves a {tensor.dtype} tensor of shape "
                                               f"{list(tensor.shape)} where forward saved a {event.dtype} one of "
                                               f"shape {list(event.shape)}"))
                # detached: the saved output itself leads to its node, whose saved-tensor hooks hold this
                # function: a cycle through autograd that no garbage collector frees
                found[graph_id] = tensor.detach()

        module = self.module
        # NOTE [offload runtime] 8: not ops of the step (the statistics' copies neither)
        with out_of_sight(counted), _running_statistics_copied(module), _generators(self.rng), \
                _autocast(self.autocast, self.autocast_cache), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            module.forward(*self.args, **self.kwargs)
        if seen != self.packs or len(found) != len(self.wanted):
            raise ReplayError(_differs(module, f"saves {seen} tensors where forward saved {self.packs}"))
        self.done, self.module, self.args, self.kwargs, self.versions = True, None, (), {}, ()
        restored = dict(found)
        found.clear()  # ``pack`` lives on with the re-run's graph as long as anything holds that
        return restored


# the plain values that are leaves of any argument tree (PLAIN_TYPES less the tuple-like torch.Size and slice)
_FLAT = (torch.Tensor, type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _never_unpacked(_packed) -> torch.Tensor:
    raise ReplayError("a recomputed module call's own autograd graph was used: nothing should run backward "
                      "through it")


def _differs(module, what: str) -> str:
    return (f"re-running {type(module).__name__} to recompute its tensors, its forward {what}: the module takes "
            "another path when called again (it reads state forward changed); follow the plan by recording with "
            "plan.located(graph, on_hooks=False)")


@contextlib.contextmanager
def _generators(state: tuple[torch.Tensor, torch.Tensor | None, int]):
    """The CPU and CUDA generators as at the call's start during the re-run, then as they were."""
    cpu, cuda, device = state
    cpu_now = torch.get_rng_state()
    cuda_now = torch.cuda.get_rng_state(device) if cuda is not None else None
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_now)
        if cuda_now is not None:
            torch.cuda.set_rng_state(cuda_now, device)


@contextlib.contextmanager
def _autocast(enabled: tuple[tuple[str, torch.dtype], ...], cache: bool):
    with contextlib.ExitStack() as stack:
        for kind, dtype in enabled:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        yield


@contextlib.contextmanager
def _running_statistics_copied(module: torch.nn.Module):
    """Batch normalization in training writes its running statistics (some without saying so): the re-run writes
    copies of them, made where the re-run's ops are (out of the step's sight)."""
    swapped = []
    for inner, name in _statistics_of(module):
        buffer = inner._buffers.get(name)
        if buffer is not None:
            swapped.append((inner, name, buffer))
            inner._buffers[name] = buffer.clone()
    try:
        yield
    finally:
        for inner, name, buffer in swapped:
            inner._buffers[name] = buffer


_STATISTICS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _statistics_of(module: torch.nn.Module) -> tuple[tuple[torch.nn.Module, str], ...]:
    """The (submodule, buffer name) of every running statistic inside ``module``: looked up once per module, as a
    step re-runs the same calls again and again."""
    found = _STATISTICS.get(module)
    if found is None:
        found = _STATISTICS[module] = tuple((inner, name) for inner in module.modules() for name in inner._buffers
                                            if name in RUNNING_STATISTICS)
    return found

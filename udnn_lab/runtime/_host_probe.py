"""What the runtime's own host work costs on this machine (NOTE [host probes] in hardware/host_probes.py).

Three figures, each from interleaved steps of a network of small residual blocks (the ops and
argument lists of a real network, on inputs too small to take time), least times against least times: a
machine's figures are what its runtime costs with the machine to itself. A busy machine slows some rounds, not
all: with medians, a probe taken while tests ran in parallel on two cores put the hook call at 38 us (4 to 5
times its quiet figure) and the replay's extra at 0; with four busy processes beside it on two cores, the
replay's extra from least times stayed within 45% of its quiet figure where from medians it reached 8 times it.

- ``hook_call_s`` and ``offload_action_s``: two plans followed by hooks, one offloading one saved
  activation and one offloading all of them; the host time each adds to an eager step is
  ``hook calls x hook_call_s + offloads x offload_action_s``, two equations in two unknowns.
- ``replay_op_s``: a Replay (NOTE [offload runtime] 6) records the network's forward inside a dispatch
  mode, with grad and through the runtime's own per-op recording (``recorded_call``), against the same
  mode passing the ops through, and re-runs it, against the same forward under ``no_grad``; the two
  differences over the ops recorded.

The step probes (``_step_probes``) measure ``replay_op_s`` and ``hook_call_s`` the same ways on the profiled
step itself (NOTE [host probes] 4).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch

from udnn_lab.analysis import trace
from udnn_lab.errors import PlanError
from udnn_lab.graph import Graph, Offload, Plan, Recompute, TensorInfo
from udnn_lab.hardware import HOOKS_BY_PATH, HostFigures, PassThroughMode
from udnn_lab.runtime._replay import Replay, per_op_kind, recorded_call
from udnn_lab.runtime._slots import OpMode
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.vocabulary import traced_op

_BLOCKS = 8


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU()) for _ in range(_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + x
        return x


def runtime_host_figures(device: torch.device, repeats: int, measured: Mapping[str, Any]) -> HostFigures:
    """The runtime's host figures on ``device`` (module docstring); ``measured``: the profile's figures so far."""
    network, x = _Residual().to(device), torch.randn(2, 4, 4, 4, device=device)
    graph = trace(network, x)
    one, every = offload_plans(graph)
    # given the network, each runtime hooks only the modules its plan needs, as ul.train's does (NOTE [hook points] 8)
    runtimes = {"one": OffloadRuntime(one, model=network), "every": OffloadRuntime(every, model=network)}
    try:
        contexts: dict[str, Callable[[], Any]] = {"eager": nullcontext}
        contexts.update({name: partial(itself, runtime) for name, runtime in runtimes.items()})
        seconds = {name: min(values) for name, values in
                   interleaved(lambda: _step(network, x), x.device, contexts, max(repeats, 5) * 4 + 2).items()}
    finally:
        for runtime in runtimes.values():
            runtime.release()
    calls = {name: sum(plan.hook_calls(graph).values()) for name, plan in (("one", one), ("every", every))}
    solved = solve_nonnegative([(calls["one"], len(one.offloads)), (calls["every"], len(every.offloads))],
                               [seconds["one"] - seconds["eager"], seconds["every"] - seconds["eager"]])
    if solved is None:
        raise RuntimeError("the host probe's two plans make hook calls in proportion to their offloads: the time per "
                           "call and per offload cannot be told apart on this device")
    hook_call_s, offload_action_s = solved
    replay_op_s, recorded = replay_op_s_on(lambda: network(x), x.device, max(repeats, 5) * 4 + 2, least=True)
    return HostFigures(
        {"hook_call_s": hook_call_s, "offload_action_s": offload_action_s, "replay_op_s": replay_op_s},
        f"the runtime's host probe: an {_BLOCKS}-block residual network's step followed by hooks ({HOOKS_BY_PATH}) "
        "offloading one "
        f"saved activation ({calls['one']} hook calls) and all {len(every.offloads)} ({calls['every']} calls), "
        f"less eager; a replay recording and re-running its {recorded} forward ops, less passing them through and "
        "a forward without grad")


def itself(runtime: OffloadRuntime) -> OffloadRuntime:
    return runtime


def offload_plans(graph: Graph) -> tuple[Plan, Plan]:
    """Two located plans followed by hooks: one saved activation offloaded, and every one that can be."""
    offloads = [alone.offloads[0] for tensor in graph.tensors if (alone := offload_by_hooks(graph, tensor)) is not None]
    plans = tuple(Plan("probe", graph.fingerprint, offloads=chosen).located(graph)
                  for chosen in ((offloads[len(offloads) // 2],), tuple(offloads))) if offloads else ()
    if not plans or any(plan.followed_op_by_op(graph) for plan in plans):
        raise RuntimeError("the host probe's plans are not followed by hooks: the runtime's hook calls cannot be "
                           "timed on this device")
    return plans[0], plans[1]


def offload_by_hooks(graph: Graph, tensor: TensorInfo) -> Plan | None:
    """A plan offloading a saved activation alone, from its last use in forward to its first in backward, where it
    is valid and followed by hooks; None elsewhere."""
    if tensor.category != "feature_map" or not tensor.saved or tensor.first_backward_use is None \
            or tensor.producer is None:
        return None
    last = tensor.last_forward_use if tensor.last_forward_use is not None else tensor.alloc_step
    offload = Offload(tensor.id, after_op=last, prefetch_at=tensor.first_backward_use - 1)
    alone = Plan("probe", graph.fingerprint, offloads=(offload,))
    try:
        alone.validate(graph)
    except PlanError:
        return None
    return None if alone.followed_op_by_op(graph) else alone


def interleaved(step: Callable[[], Any], device: torch.device, contexts: Mapping[str, Callable[[], Any]],
                rounds: int, limit_s: float | None = None) -> dict[str, list[float]]:
    """Host seconds of ``step`` under each context, taken in turn for ``rounds`` less two (warm-up), in a new order
    each round (a step right after a longer one runs at another pace: the caches it left); ``limit_s``: fewer rounds
    (three measured at least) once that long has passed."""
    times: dict[str, list[float]] = {name: [] for name in contexts}
    order = random.Random(0)
    started = time.perf_counter()
    for index in range(rounds):
        if limit_s is not None and index >= 5 and time.perf_counter() - started > limit_s:
            break
        for name in order.sample(list(contexts), len(contexts)):
            context = contexts[name]
            seconds = host_seconds(lambda: under(step, context()), device)
            if index >= 2:  # warm-up
                times[name].append(seconds)
    return times


def _step(network: torch.nn.Module, x: torch.Tensor) -> None:
    network.zero_grad(set_to_none=True)
    network(x).sum().backward()


def host_seconds(work: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    return time.perf_counter() - start  # host time: a GPU runs these tiny kernels faster than they are issued


def solve_nonnegative(rows: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...] | None:
    """The figures ``x``, none below 0, with ``rows @ x`` closest to ``seconds`` (least squares; noise can make an
    exact solution negative: that figure is 0 then, and the others explain the rows as well as they can); None where
    the rows cannot tell them apart."""
    matrix = np.array(rows, dtype=float)
    scale = np.abs(matrix).max(axis=0)  # columns of calls, offloads, ops, steps or bytes: solved at one scale
    if (scale == 0).any() or np.linalg.matrix_rank(matrix / scale) < matrix.shape[1]:
        return None
    scaled, target = matrix / scale, np.asarray(seconds, dtype=float)
    best: tuple[float, np.ndarray] | None = None
    width = matrix.shape[1]
    for size in range(width, 0, -1):  # every set of figures left free, the rest 0: a handful of columns
        for kept in itertools.combinations(range(width), size):
            part, *_ = np.linalg.lstsq(scaled[:, kept], target, rcond=None)
            if (part < 0).any():
                continue
            full = np.zeros(width)
            full[list(kept)] = part
            residual = float(np.sum((scaled @ full - target) ** 2))
            if best is None or residual < best[0] - 1e-30:
                best = (residual, full)
    return None if best is None else tuple(float(v) for v in best[1] / scale)


_traced = per_op_kind(traced_op)


class _Recording(OpMode):
    """Records every traced forward op into a Replay, as the runtime's recording window does."""

    def __init__(self, replay: Replay, device: torch.device) -> None:
        super().__init__(self._record)
        self.replay, self.device = replay, device
        self.ops = 0

    def _record(self, func, args: tuple, kwargs: dict):
        if not _traced(func):  # known once per op kind, as the runtime knows them
            return func(*args, **kwargs)
        self.ops += 1
        return recorded_call((self.replay,), func, args, kwargs, lambda _: self.device)


def replay_op_s_on(forward: Callable[[], Any], device: torch.device, rounds: int,
                 limit_s: float | None = None, least: bool = False) -> tuple[float, int]:
    """(host seconds a replay adds to each op it records and re-runs, ops recorded): ``forward`` recorded against
    passed through a dispatch mode, and re-run against run plainly, without grad, medians of ``rounds`` less 2
    (``least``: their least); ``limit_s``: fewer rounds (three measured at least) once the probe has taken that
    long."""
    recording: list[float] = []
    passing: list[float] = []
    rerun: list[float] = []
    plain: list[float] = []
    ops = 0
    started = time.perf_counter()
    for index in range(rounds):
        if limit_s is not None and len(recording) >= 3 and time.perf_counter() - started > limit_s:
            break
        replay = Replay(Recompute(tensors=(0,), ops=(0,), at_op=0))
        mode = _Recording(replay, device)
        # recorded as the runtime records, with grad (outputs that need it are detached as they are recorded); the
        # replay runs without building a graph, against a forward that builds none
        seconds = (host_seconds(lambda: under(forward, mode), device),
                   host_seconds(lambda: under(forward, PassThroughMode()), device),
                   host_seconds(replay.run, device),
                   host_seconds(lambda: under(forward, torch.no_grad()), device))
        ops = mode.ops
        if index >= 2:
            for values, value in zip((recording, passing, rerun, plain), seconds):
                values.append(value)
    summary = min if least else statistics.median
    added = summary(recording) - summary(passing) + summary(rerun) - summary(plain)
    return max(added, 0.0) / max(ops, 1), ops


def under(forward: Callable[[], Any], mode) -> None:
    with mode:
        forward()

"""The runtime's host figures measured on a profiled step itself (NOTE [host probes] 4).

- ``step_replay_figures``: ``replay_op_s`` as the machine probe measures it, on the step's own forward: per op,
  a replay costs more where ops take more arguments and outputs.
- ``step_hook_figures``: ``hook_call_s`` as the machine probe measures it, on the whole step: the step under a
  plan offloading the one saved activation (of its smallest few) whose offload takes the fewest hook calls, and
  under one offloading all of those few, against the step alone, round by round: two equations in the time per
  hook call and per offload, solved where they are well apart. A module hook is handed the call's arguments,
  so a model of many small modules called with keywords pays more per call than the probe's network of
  convolutions. Where the extra time does not stand clear of the step's own variation (a long step, few hook
  calls), it returns no figure: the machine's stands.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

from udnn_lab.graph import Graph, Offload, Plan
from udnn_lab.hardware import HostFigures, ProbedStep
from udnn_lab.runtime._host_probe import interleaved, itself, offload_by_hooks, replay_op_s_on, two_unknowns
from udnn_lab.runtime.offload import OffloadRuntime

STEP_PROBE_S = 3.0  # what each step probe may take, once it has three rounds
SMALLEST_OFFLOADS = 16  # the probe's plans offload among this many of the step's smallest saved activations
CLEAR_OF_NOISE = 3.0  # standard errors the extra time must stand above zero
# a step whose hook calls, at this much each, would add less than VISIBLE of it is not probed: a few rounds of it
# vary by more than that (a large step on a GPU, whose host issues kernels it waits for)
CHEAP_CALL_S, VISIBLE = 5e-6, 0.01


def step_replay_figures(step: ProbedStep, repeats: int) -> HostFigures:
    """The replay's host time per op on the step's own forward."""
    # a difference of medians wants rounds; a large step's forward takes long: a few seconds at most
    replay_op_s, recorded = replay_op_s_on(step.forward, step.device, max(repeats, 5) * 2 + 2, STEP_PROBE_S)
    return HostFigures({"replay_op_s": replay_op_s},
                       f"a replay recording and re-running this step's {recorded} forward ops, less passing them "
                       "through and a forward without grad")


def step_hook_figures(step: ProbedStep, repeats: int) -> HostFigures:
    """The runtime's host time per hook call on the step itself (module docstring)."""
    plans = _probe_plans(step.graph)
    if plans is None:
        return HostFigures({}, "this step has no two offload plans followed by hooks whose hook calls per offload "
                               "differ enough to tell the two apart: the machine's figure stands")
    one, several = plans
    calls = {"one": _calls(one, step.graph), "several": _calls(several, step.graph)}
    if calls["several"] * CHEAP_CALL_S < VISIBLE * step.step_time_s:
        return HostFigures({}, f"this step ({step.step_time_s * 1e3:.1f} ms) is too long for its probe's "
                               f"{calls['several']} hook calls to show: the machine's figure stands")
    runtimes = {"one": OffloadRuntime(one), "several": OffloadRuntime(several)}
    try:
        contexts: dict[str, Callable[[], Any]] = {"eager": nullcontext}
        contexts.update({name: partial(itself, runtime) for name, runtime in runtimes.items()})
        rounds = interleaved(step.run, step.device, contexts, max(repeats, 5) * 20 + 2, STEP_PROBE_S)
    finally:
        for runtime in runtimes.values():
            runtime.release()
    extra = {name: _paired_extra(rounds[name], rounds["eager"]) for name in runtimes}
    what = (f"this step offloading one saved activation ({calls['one']} hook calls) and its "
            f"{len(several.offloads)} smallest ({calls['several']}), less the step alone, over "
            f"{len(rounds['eager'])} rounds")
    if any(median < CLEAR_OF_NOISE * error for median, error in extra.values()):
        return HostFigures({}, f"{what}: not clear of the step's own variation, so the machine's figure stands")
    hook_call_s, _ = two_unknowns((calls["one"], 1, extra["one"][0]),
                                  (calls["several"], len(several.offloads), extra["several"][0]))
    return HostFigures({"hook_call_s": hook_call_s} if hook_call_s > 0 else {}, what)


def _probe_plans(graph: Graph) -> tuple[Plan, Plan] | None:
    """(one offload, several), located, or None where their hook calls per offload are too close to solve for."""
    candidates: list[tuple[Offload, int]] = []  # (the offload, its hook calls alone), smallest tensors first
    for tensor in sorted(graph.tensors, key=lambda t: t.nbytes):
        if len(candidates) == SMALLEST_OFFLOADS:
            break
        alone = offload_by_hooks(graph, tensor)
        if alone is not None:  # its hook calls from the analysis that found it followed by hooks
            candidates.append((alone.offloads[0], _calls(alone, graph)))
    if len(candidates) < 2:
        return None
    fewest = min(candidates, key=lambda candidate: candidate[1])[0]
    one, several = (Plan("probe", graph.fingerprint, offloads=chosen).located(graph)
                    for chosen in ((fewest,), tuple(offload for offload, _ in candidates)))
    per_offload = (_calls(one, graph), _calls(several, graph) / len(several.offloads))
    return (one, several) if per_offload[0] >= 2 * per_offload[1] else None


def _calls(plan: Plan, graph: Graph) -> int:
    return sum(plan.hook_calls(graph).values())


def _paired_extra(under: list[float], alone: list[float]) -> tuple[float, float]:
    """(the median of what a step under a plan took beyond the step alone in the same round, its standard error)."""
    differences = [a - b for a, b in zip(under, alone)]
    median = statistics.median(differences)
    spread = 1.4826 * statistics.median(abs(d - median) for d in differences)  # a standard deviation, robustly
    return median, 1.2533 * spread / math.sqrt(len(differences))  # a median's error, as a normal sample's

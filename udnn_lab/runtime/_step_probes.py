"""The runtime's host figures measured on a profiled step itself (NOTE [host probes] 4).

- ``step_replay_figures``: ``replay_op_s`` as the machine probe measures it, on the step's own forward: per op,
  a replay costs more where ops take more arguments and outputs. It runs after ``step_hook_figures``, and only
  where that one found no figure of its own.
- ``step_hook_figures``: ``hook_call_s`` as the machine probe measures it, on the whole step: the step under
  plans offloading the one saved activation (of its smallest few) whose offload takes the fewest hook calls, the
  one whose offload takes the most, and all of those few, against the step alone, round by round: three
  equations in the time per hook call, per offload and per step (``offload_action_s``, ``runtime_step_s``),
  solved where they are apart (else two, for the time per call alone). On a CPU, where the host makes the copies
  while the step waits, a fourth plan offloads as many of its largest (``LARGEST_BYTES`` at most), and a fourth
  unknown is the time per byte copied out and back (``copy_bytes_per_s``): a copy the caches hold runs several times
  faster than the machine's largest copy, a restore from memory the step has since moved past slower. Then, in rounds
  of its own, the step under a recomputation of the middle half of its forward, under one of nearly all of it and
  under several short ones spread over it, recorded and replayed by the runtime: what they took beyond those figures,
  the dispatch mode over their recording windows and the re-run ops' own time, is three equations in what the runtime
  pays per op it re-runs (``replay_op_s``: the windows' bookkeeping, the unpacks that replay), per recomputation
  (``replay_recompute_s``) and once in a step that records (``recording_step_s``), which ``step_replay_figures``'s
  stand-in recording does not see (where the several cannot be made, the first two, over the ops they re-ran, give
  ``replay_op_s`` alone); and under a re-run of each call of its repeated block (NOTE [hook points] 7), what each
  re-run costs beyond its ops and packs (``rerun_call_s``). On a CPU the extra times are put at the pace the profile
  timed the step at (its plain steps against these rounds' steps alone): a machine whose pace drifts over seconds
  would otherwise add seconds of one pace to a step of another. The runtime is given the step's model, as
  ``ul.train`` gives it, so it makes the calls the simulator prices (NOTE [hook points] 8); a step probed without its
  model is followed with every module hooked, and the fewest calls make the one offload's plan. A module hook is
  handed the call's arguments, so a model of many small modules called with keywords pays more per call than the
  probe's network of convolutions. Where the extra time does not stand clear of the step's own variation (a long
  step, few hook calls), it returns no figure: the machine's stands.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

from udnn_lab.graph import Graph, Plan
from udnn_lab.graph.reruns import NOT_RERUN, rerun_call
from udnn_lab.hardware import HostFigures, ProbedStep
from udnn_lab.runtime._host_probe import interleaved, itself, replay_op_s_on, solve_nonnegative
from udnn_lab.runtime._probe_plans import (
    hook_calls_of,
    offload_plans,
    offloaded_bytes,
    recorded_chains,
    rerun_blocks,
)
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.units import format_bytes

# what each step probe may take, once it has three rounds, at a profile's default repeats (5); in proportion to more:
# a short step's time beside the runtime's Python drifts by a few percent between windows of a few seconds (GPT-2's
# small decoder on one EPYC thread: the recomputation's extra over the step 0.92 to 1.00 of it in 3 s windows of one
# minute, 0.955 to 0.973 averaged over 9 s), and a profile taken with more repeats is asked for closer figures
STEP_PROBE_S = 3.0
CLEAR_OF_NOISE = 3.0  # standard errors the extra time must stand above zero
# a step whose hook calls, at this much each, would add less than VISIBLE of it is not probed: a few rounds of it
# vary by more than that (a large step on a GPU, whose host issues kernels it waits for)
CHEAP_CALL_S, VISIBLE = 5e-6, 0.01


def step_replay_figures(step: ProbedStep, repeats: int, measured: Mapping[str, float]) -> HostFigures:
    """The replay's host time per op on the step's own forward; nothing where ``measured`` (the figures so far)
    has it from the runtime itself (``step_hook_figures``)."""
    if "replay_op_s" in measured:
        return HostFigures({}, "the replay's figure was measured on the runtime recording this step: no stand-in")
    # a difference of medians wants rounds; a large step's forward takes long: a few seconds at most
    replay_op_s, recorded = replay_op_s_on(step.forward, step.device, max(repeats, 5) * 2 + 2, STEP_PROBE_S)
    return HostFigures({"replay_op_s": replay_op_s},
                       f"a replay recording and re-running this step's {recorded} forward ops, less passing them "
                       "through and a forward without grad")


def step_hook_figures(step: ProbedStep, repeats: int, measured: Mapping[str, float]) -> HostFigures:
    """The runtime's host time per hook call, per offload and per step on the step itself (module docstring)."""
    every_module = step.model is None
    plans = offload_plans(step.graph, every_module, largest=step.device.type == "cpu")
    if plans is None:
        return HostFigures({}, "this step has no two offload plans followed by hooks whose hook calls per offload "
                               "differ enough to tell the two apart: the machine's figure stands")
    calls = {name: hook_calls_of(plan, step.graph, every_module) for name, plan in plans.items()}
    if calls["several"] * CHEAP_CALL_S < VISIBLE * step.step_time_s:
        return HostFigures({}, f"this step ({step.step_time_s * 1e3:.1f} ms) is too long for its probe's "
                               f"{calls['several']} hook calls to show: the machine's figure stands")
    # one runtime per distinct plan: without the model, the fewest calls are the one offload's too
    distinct = {name: plan for name, plan in plans.items() if name != "fewest" or plan is not plans["one"]}
    rounds = _rounds_under(step, distinct, repeats)
    extra = {name: _extra_at_pace(step, rounds, name) for name in distinct}
    extra.setdefault("fewest", extra["one"])
    several = len(plans["several"].offloads)
    large = ""
    if "large" in plans:
        copied = format_bytes(offloaded_bytes(plans["large"], step.graph))
        large = f" and {len(plans['large'].offloads)} largest ({copied})"
    what = (f"this step offloading one saved activation ({calls['fewest']} and {calls['one']} hook calls) and its "
            f"{several} smallest ({calls['several']}){large}, less the step alone, over {len(rounds['eager'])} rounds")
    if any(median < CLEAR_OF_NOISE * error for median, error in extra.values()):
        return HostFigures({}, f"{what}: not clear of the step's own variation, so the machine's figure stands")
    solved = solve_nonnegative([_row(plans[name], step.graph, calls[name], "large" in plans) for name in plans],
                               [extra[name][0] for name in plans])
    if solved is not None:
        figures = dict(zip(("hook_call_s", "offload_action_s", "runtime_step_s"), solved[:3]))
        if len(solved) == 4 and solved[3] > 0:  # seconds per byte copied: on a CPU (module docstring)
            figures["copy_bytes_per_s"] = 1.0 / solved[3]
        recomputing = recorded_chains(step.graph) if step.op_host_s is not None else ()
        rerunning = rerun_blocks(step.graph) if step.op_host_s is not None else None
        if not recomputing and rerunning is None:
            return HostFigures(figures, what)
        found, about = _recomputation_figures(step, recomputing, rerunning, repeats, figures, every_module)
        return HostFigures({**figures, **found}, f"{what}; then {about}")
    two = solve_nonnegative([(calls["one"], 1), (calls["several"], several)], [extra["one"][0], extra["several"][0]])
    return HostFigures({"hook_call_s": two[0]} if two is not None and two[0] > 0 else {},
                       f"{what}; the time per offload and per step could not be told apart")


# what the chains' rounds solve for, per op re-run, per recomputation recorded and once per step that records
REPLAY_FIGURES = ("replay_op_s", "replay_recompute_s", "recording_step_s")


def _recomputation_figures(step: ProbedStep, chains: tuple[Plan, ...], rerunning: Plan | None, repeats: int,
                           figures: dict[str, float], every_module: bool) -> tuple[dict[str, float], str]:
    """The recordings' figures from ``chains`` (``_recording_figures``) and the time per re-run call from
    ``rerunning`` (what it took beyond the rest, over its calls), in rounds of their own (a step this much longer,
    taken between the hook plans', changes theirs), and what was done."""
    named = {f"recomputing {index}": plan for index, plan in enumerate(chains)}
    if rerunning is not None:
        named["rerunning"] = rerunning
    rounds = _rounds_under(step, named, repeats)
    beyond = {name: _beyond(step, rounds, name, plan, figures, every_module) for name, plan in named.items()}
    found: dict[str, float] = {}
    about = []
    if chains:
        recorded = ", ".join(f"{sum(len(r.ops) for r in chain.recomputes)} forward ops in {len(chain.recomputes)}"
                             for chain in chains)
        replayed = _recording_figures([(chain, beyond[name]) for name, chain in named.items() if name != "rerunning"])
        found.update(replayed or {})
        about.append(f"recording {recorded}" + ("" if replayed else " (not clear of the step's variation: the "
                                                                      "replay's figure stands)"))
    if rerunning is not None:
        extra = beyond["rerunning"]
        if extra is not None:
            found["rerun_call_s"] = max(extra, 0.0) / len(rerunning.recomputes)
        about.append(f"re-running {len(rerunning.recomputes)} calls of its repeated block"
                     + ("" if extra is not None else " (not clear of the step's variation)"))
    return found, (" and ".join(about) + ", less those figures, the dispatch mode and the ops' own time")


def _beyond(step: ProbedStep, rounds: dict[str, list[float]], name: str, plan: Plan, figures: dict[str, float],
            every_module: bool) -> float | None:
    """What ``name``'s plan took beyond the rest of what the step under it took, as the simulator prices the rest
    (NOTE [simulated streams] 6): the runtime's step, its hook calls (a re-run call's packs among them), the
    dispatch mode over its recording windows and the re-run ops' own time; None where its extra is not clear of the
    step's variation."""
    median, error = _extra_at_pace(step, rounds, name)
    if median < CLEAR_OF_NOISE * error:
        return None
    assert step.op_host_s is not None
    ops = [i for recompute in plan.recomputes for i in recompute.ops]
    dispatched = sum(len(window) for window in plan.dispatched_ops(step.graph))
    packs = sum(len(rerun_call(step.graph.hook_events, enter, recompute.tensors).packs)
                for enter, recompute in zip(plan.reruns_in(step.graph), plan.recomputes) if enter != NOT_RERUN)
    calls = hook_calls_of(plan, step.graph, every_module) + packs
    known = (figures["runtime_step_s"] + calls * figures["hook_call_s"]
             + dispatched * (step.dispatch_mode_op_s or 0.0) + sum(step.op_host_s[i] for i in ops))
    return median - known


def _recording_figures(beyond: Sequence[tuple[Plan, float | None]]) -> dict[str, float] | None:
    """Per op recorded and re-run, per recomputation and once per step (``REPLAY_FIGURES``) from what the chains
    took beyond the rest, where three tell them apart, else per op alone, over all their ops; None where one is not
    clear of the step's variation."""
    if any(extra is None for _, extra in beyond):
        return None
    rows: list[tuple[float, ...]] = [(float(sum(len(r.ops) for r in plan.recomputes)), float(len(plan.recomputes)), 1.0)
                                     for plan, _ in beyond]
    seconds = [float(extra) for _, extra in beyond if extra is not None]
    solved = solve_nonnegative(rows, seconds) if len(rows) >= len(REPLAY_FIGURES) else None
    if solved is not None:
        return dict(zip(REPLAY_FIGURES, solved))
    return {"replay_op_s": max(sum(seconds), 0.0) / sum(row[0] for row in rows)}


def _rounds_under(step: ProbedStep, plans: Mapping[str, Plan], repeats: int) -> dict[str, list[float]]:
    """``interleaved`` rounds of the step alone ('eager') and under a runtime following each plan, given the step's
    model (module docstring); the runtimes are released after."""
    runtimes = {name: OffloadRuntime(plan, model=step.model) for name, plan in plans.items()}
    try:
        contexts: dict[str, Callable[[], Any]] = {"eager": nullcontext}
        contexts.update({name: partial(itself, runtime) for name, runtime in runtimes.items()})
        return interleaved(step.run, step.device, contexts, max(repeats, 5) * 20 + 2, _probe_s(repeats))
    finally:
        for runtime in runtimes.values():
            runtime.release()


def _probe_s(repeats: int) -> float:
    return STEP_PROBE_S * max(repeats, 5) / 5


def _row(plan: Plan, graph: Graph, calls: int, copies: bool) -> tuple[float, ...]:
    """What a probe plan does per hook call, per offload and once per step, and with ``copies`` the bytes it copies
    (each offloaded byte out and back): the columns of ``solve_nonnegative``."""
    row: tuple[float, ...] = (calls, len(plan.offloads), 1.0)
    return row + (2.0 * offloaded_bytes(plan, graph),) if copies else row


def _extra_at_pace(step: ProbedStep, rounds: dict[str, list[float]], name: str) -> tuple[float, float]:
    """``_paired_extra`` of ``name``'s rounds against the step alone, put at the pace the profile timed the step at:
    a CPU's pace drifts over seconds, and the simulator adds the extra to that step. On a GPU the rounds time the
    host issuing a step, the profile the device running it: not the same measure of one pace, taken as they are."""
    pace = step.step_time_s / statistics.median(rounds["eager"]) if step.device.type == "cpu" else 1.0
    median, error = _paired_extra(rounds[name], rounds["eager"])
    return median * pace, error * pace


def _paired_extra(under: list[float], alone: list[float]) -> tuple[float, float]:
    """(the median of what a step under a plan took beyond the step alone in the same round, its standard error)."""
    differences = [a - b for a, b in zip(under, alone)]
    median = statistics.median(differences)
    spread = 1.4826 * statistics.median(abs(d - median) for d in differences)  # a standard deviation, robustly
    return median, 1.2533 * spread / math.sqrt(len(differences))  # a median's error, as a normal sample's

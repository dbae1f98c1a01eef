"""Host figures of work a later stage does, measured with that stage's own code (NOTE [host probes]).

NOTE [host probes]
  1. Some host time a plan costs is spent in the runtime's own Python: its hook calls, its
     actions, its replays (NOTE [simulated streams] 6). Only the runtime's code can measure
     what its code costs, and the runtime comes after this stage in the data flow, so it
     registers a probe here when it is imported (``register_host_probe``) and
     ``Hardware.measure`` runs every probe registered, after its own figures, which it hands
     over. A probe returns figures named after ``Hardware`` fields and one line saying how
     it measured them.
  2. Without a probe (this stage imported alone) those figures stay None: not measured, and
     not priced; a cached machine profile is then not measured again for them. With one, a
     cached profile whose hook-call figure was not measured as the runtime now runs (its
     source does not say ``HOOKS_BY_PATH``: before it hooked only the modules a plan needs,
     NOTE [hook points] 8) is measured again. The package
     imports the runtime with any stage that measures or prices a machine (``ul.Hardware``,
     ``ul.simulate``, ``ul.plan``, ...), so a profile measured through it has them.
  3. A probe that fails leaves its figures None with an UnmeasuredFigureWarning naming the
     error: the rest of the profile, measured by this stage, is kept.
  4. A figure that depends on the step as much as on the machine is measured on the profiled
     step too: a replay's host time per op grows with its ops' arguments and outputs, a hook
     call's with the modules' (a module hook is handed every argument; a model of many small
     modules called with keywords pays twice what a network of convolutions does). The runtime
     registers step probes (``register_step_probe``) that ``ul.profile`` runs on the step
     itself (``ProbedStep``: its forward, the whole step, its Graph, its model, which the
     runtime hooks as ``ul.train`` does); the cost model prefers the profile's figure to the
     machine's, as it does for ``dispatch_mode_op_s``. The step's hook probe also finds what an
     offload and what a followed step costs once (setting it up and tearing it down, the view
     replay it turns on: ``runtime_step_s``, which only a step probe measures), and, timing the step
     under recomputations the runtime records and replays too, what each op recorded and re-run
     costs the runtime itself (``replay_op_s``: its recording windows' bookkeeping, the unpacks
     that replay, beyond the dispatch mode and the ops' own time), each recomputation and a step
     that records any once (``replay_recompute_s``, ``recording_step_s``), and each module call it
     re-runs (``rerun_call_s``, on the step's repeated block; these three profile figures only),
     which supersedes the figure of
     the replay probe's stand-in recording (each step probe is handed the figures measured before
     it: registered after, the stand-in does not run where it is superseded). On a CPU it offloads
     some of the step's largest saved activations too, for what each byte the runtime copies out
     and back costs in the step
     (``copy_bytes_per_s``): a CPU runs a copy from its caches several times faster than its
     largest copy, and a restore from memory the step has since moved past slower. A probe fails as
     in 3, leaving the profile's figure None; a probe whose figure does not show above the
     step's own variation (a long step, few hook calls) returns none, and the machine's stands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HostFigures:
    """Figures a host probe measured (``Hardware`` field -> seconds), and how."""

    figures: Mapping[str, float]
    source: str


# (device, repeats, figures measured so far) -> its figures
# what the runtime's host probe says of how it measured a hook call (2): with the modules a plan needs hooked by path
HOOKS_BY_PATH = "the modules each plan needs hooked by path"
HostProbe = Callable[[torch.device, int, Mapping[str, Any]], HostFigures]
_PROBES: dict[str, HostProbe] = {}


def register_host_probe(name: str, probe: HostProbe) -> None:
    """Have ``Hardware.measure`` run ``probe`` (NOTE [host probes] 1); a name registered again is replaced."""
    _PROBES[name] = probe


def host_probes() -> tuple[HostProbe, ...]:
    return tuple(_PROBES.values())


@dataclass(frozen=True)
class ProbedStep:
    """The profiled step as a step probe may run it (NOTE [host probes] 4)."""

    forward: Callable[[], Any]  # its forward, as the step runs it (precision included)
    # the whole step as it was recorded (forward, loss, backward, the optimizer's step), as a training loop runs it:
    # without view replay, which a runtime around it turns on (NOTE [view replay] 3)
    run: Callable[[], Any]
    graph: Any  # that step's Graph, recorded on real tensors with its hook events (graph/ is not imported here)
    device: torch.device
    step_time_s: float  # the whole step, as timed plainly: what a probe's figure must show above
    model: torch.nn.Module | None = None  # the step's model, which a runtime probed on it hooks (NOTE [hook points] 8)
    # each op's host seconds as the cost model prices them (on a CPU its time and its share of the step's time
    # between ops, on a GPU its issue), and what a dispatch mode adds per op: what a probe knows of a recomputation
    # it times before the runtime's own work
    op_host_s: tuple[float, ...] | None = None
    dispatch_mode_op_s: float | None = None


# (the step, repeats, figures measured on it so far) -> its figures (NOTE [host probes] 4)
StepProbe = Callable[[ProbedStep, int, Mapping[str, float]], HostFigures]
_STEP_PROBES: dict[str, StepProbe] = {}


def register_step_probe(name: str, probe: StepProbe) -> None:
    """Have ``ul.profile`` run ``probe`` on the profiled step (NOTE [host probes] 4); a name registered again is
    replaced."""
    _STEP_PROBES[name] = probe


def step_probes() -> tuple[StepProbe, ...]:
    return tuple(_STEP_PROBES.values())

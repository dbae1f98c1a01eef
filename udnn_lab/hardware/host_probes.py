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
     not priced; a cached machine profile is then not measured again for them. The package
     imports the runtime with any stage that measures or prices a machine (``ul.Hardware``,
     ``ul.simulate``, ``ul.plan``, ...), so a profile measured through it has them.
  3. A probe that fails leaves its figures None with an UnmeasuredFigureWarning naming the
     error: the rest of the profile, measured by this stage, is kept.
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
HostProbe = Callable[[torch.device, int, Mapping[str, Any]], HostFigures]
_PROBES: dict[str, HostProbe] = {}


def register_host_probe(name: str, probe: HostProbe) -> None:
    """Have ``Hardware.measure`` run ``probe`` (NOTE [host probes] 1); a name registered again is replaced."""
    _PROBES[name] = probe


def host_probes() -> tuple[HostProbe, ...]:
    return tuple(_PROBES.values())

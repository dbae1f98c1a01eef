"""Host memory: what this machine has, what a plan's offloads hold there, and the host budget plans keep to.

NOTE [host budget]
1. A plan's host bytes are what the runtime sets aside for its offloads (``Plan.host_pool_bytes``): its pinned
   pool (the most offloaded bytes in host memory at once), or every offloaded tensor's CUDA blocks if that is
   more, since the runtime's pool then holds them all. ``plan_host_bytes`` counts the same from the graph, for
   plans not yet located.
2. By default (``"local"``) a plan may take what the runtime's pool would take on this machine: ``HOST_POOL_SHARE``
   (half) of the host memory available now (psutil's ``available``: what can be had without swapping). The other
   half is the margin, for the training process itself (its Python heap, the data loader, a CPU copy of the model),
   the page cache and whatever else runs here: pinned pages cannot be swapped out, so a pool that took it all would
   hand the rest to the out-of-memory killer. The runtime's pool refuses more by default, so a plan within this
   budget is one the runtime will run here.
3. A CPU graph's device is the host: its offloads move bytes from one part of the same RAM to another, and what
   the plan keeps "on the device" (up to its budget) comes out of the same memory as its pool. Its default host
   budget is the pool's share less what the device part leaves of the memory available:
   ``min(share x available, available - budget)``, never below 0.
4. For a plan made for another machine (a what-if on a profile this machine is not), pass that machine's figure
   as ``host_budget=``, or None not to check host memory at all.
5. A real try (inputs or tensors built on this host, pinned buffers) is checked before it is made
   (``require_host``): it may take what is available less ``HOST_RESERVE``; pinned buffers may take the pool's
   share (2).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from udnn_lab.devices import HOST_POOL_SHARE
from udnn_lab.errors import HostMemoryTooSmall
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.units import cuda_block_bytes, format_bytes, parse_bytes

HOST_RESERVE = 0.1  # a real try leaves this share of the available host memory alone (NOTE [host budget] 5)
LOCAL = "local"  # the host budget that means "what this machine's runtime pool may take" (NOTE [host budget] 2)


@dataclass(frozen=True)
class HostMemory:
    """This machine's host memory, read at one moment."""

    total_bytes: int  # physical memory
    available_bytes: int  # what can be had without swapping (MemAvailable)

    @property
    def pinnable_bytes(self) -> int:
        """What the runtime's pinned pool may take here (NOTE [host budget] 2)."""
        return int(self.available_bytes * HOST_POOL_SHARE)

    @property
    def usable_bytes(self) -> int:
        """What a real try may allocate here (NOTE [host budget] 5)."""
        return int(self.available_bytes * (1 - HOST_RESERVE))


def host_memory() -> HostMemory:
    """This machine's host memory now (every reader in planning and fitting goes through this one)."""
    memory = psutil.virtual_memory()
    return HostMemory(int(memory.total), int(memory.available))


def host_budget_bytes(host_budget: int | str | None, device: str, budget_bytes: int | None) -> int | None:
    """The host bytes a plan's offloads may take: ``host_budget`` read, or this machine's share for ``"local"``
    (NOTE [host budget] 2, 3 for a CPU ``device``); None: not checked."""
    if host_budget is None:
        return None
    if is_local(host_budget):
        memory = host_memory()
        if device != "cpu" or budget_bytes is None:
            return memory.pinnable_bytes
        return max(0, min(memory.pinnable_bytes, memory.available_bytes - budget_bytes))
    try:
        return parse_bytes(host_budget)
    except (TypeError, ValueError) as error:
        raise ValueError(f"cannot read the host budget {host_budget!r}: {error}; give bytes, a size such as "
                         f"'512GiB', {LOCAL!r} (what this machine can pin) or None (not checked)") from None


def is_local(host_budget: int | str | None) -> bool:
    """Whether ``host_budget`` asks for this machine's figure (NOTE [host budget] 2)."""
    return isinstance(host_budget, str) and host_budget.strip().lower() == LOCAL


def local_note(host_bytes: int, device: str) -> str:
    """Where a "local" host budget comes from, in words (for notes)."""
    cpu = "; on a CPU the device budget comes out of the same memory" if device == "cpu" else ""
    return (f"offloads may take {format_bytes(host_bytes)} of host memory: {HOST_POOL_SHARE:.0%} of what this "
            f"machine has available now, as the runtime's pool would take here{cpu}; pass host_budget= for the "
            "training machine's")


def plan_host_bytes(graph: Graph, plan: Plan) -> int:
    """Host memory the runtime sets aside for ``plan``'s offloads (NOTE [host budget] 1), from the graph."""
    blocks = sum(cuda_block_bytes(graph.tensors[o.tensor].nbytes) for o in plan.offloads)
    return max(plan.pinned_pool_bytes, blocks)


def require_host(needed_bytes: int, what: str, advice: str, *, pinned: bool = False) -> None:
    """Raise HostMemoryTooSmall before a real try that needs ``needed_bytes`` of host memory (pinned: of what may
    be pinned) when this machine does not have it (NOTE [host budget] 5)."""
    memory = host_memory()
    allowed = memory.pinnable_bytes if pinned else memory.usable_bytes
    if needed_bytes > allowed:
        kind = "pinned host memory" if pinned else "host memory"
        share = f"{HOST_POOL_SHARE:.0%}" if pinned else f"{1 - HOST_RESERVE:.0%}"
        raise HostMemoryTooSmall(
            f"{what} needs {format_bytes(needed_bytes)} of {kind}, and this machine has "
            f"{format_bytes(allowed)} for it ({share} of the {format_bytes(memory.available_bytes)} available of "
            f"{format_bytes(memory.total_bytes)}): {advice}", needed_bytes, allowed)

"""How many GPUs, and which sharding, make a step fit: per-rank peak and step time against world size.

``sweep_ranks`` has one rank of the workload's step under DDP, FSDP2 and HSDP at each world size asked for,
traced (``ul.trace(..., parallel=...)``: from this process, a fake process group, no GPU) or made exactly from the
ranks traced (DDP ranks from one; FSDP2 ranks where NOTE [FSDP ranks across world sizes] allows), simulates it on
the hardware profile, and for the "+offload" setups plans the rank's step under the budget. ``min_world_size`` finds the
smallest world size at which one setup fits. The workload's batch is each rank's batch (data parallel: the
global batch grows with the world).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from udnn_lab import zoo
from udnn_lab.errors import HostBudgetExceeded, PlanInfeasible
from udnn_lab.fitting._rank_jobs import RankJob, Traced
from udnn_lab.fitting._sweep_processes import processes_for, run_ranks
from udnn_lab.graph import Graph
from udnn_lab.hardware import PREDICTED_DEVICE, Hardware
from udnn_lab.parallel import DDP, FSDP, Parallel, describe
from udnn_lab.planning import check_within_device, floor_bytes, plan
from udnn_lab.planning import sweep as planning_sweep
from udnn_lab.simulation import Simulation, simulate
from udnn_lab.simulation.simulator import resolve_hardware
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.workload import Workload

PROGRESS_SECONDS = 3.0  # the progress bar shows once a sweep has run this long
SETUPS = ("DDP", "FSDP2", "FSDP2+offload", "HSDP", "HSDP+offload")
DEFAULT_SETUPS = ("DDP", "FSDP2", "FSDP2+offload")
DEFAULT_WORLD_SIZES = tuple(2 ** k for k in range(11))  # 1 to 1024
COLUMNS = ["world_size", "setup", "spec", "budget_bytes", "fits", "peak_bytes", "traced_peak_bytes",
           "step_time_s", "communication_s", "exposed_communication_s", "communication_at_peak_bytes", "policy",
           "offloads", "recomputes", "host_bytes_per_node", "trace_s", "plan_s", "why"]
_SWEEP_SETTINGS = ("policies", "ranks_per_node", "host_budget", "fsdp_options", "progress", "workers")
DEFAULT_RANKS_PER_NODE = 8  # an HGX/DGX node; a profile's own figure wins where it has one


@dataclass(frozen=True, repr=False)
class WorldSizeSearch:
    """The smallest world size, of those tried, at which a setup's step fits a per-rank budget."""

    model_name: str
    setup: str
    world_size: int | None  # None: none of the candidates fits
    budget_bytes: int
    hardware: str
    probes: pd.DataFrame = field(compare=False)  # sweep_ranks' rows of the world sizes tried, in order
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        found = f"fits from {self.world_size} ranks" if self.world_size else "fits at none of the sizes tried"
        return (f"WorldSizeSearch({self.model_name!r}, {self.setup}, {found} in {format_bytes(self.budget_bytes)} "
                f"per rank on {self.hardware}; {len(self.probes)} probes)")


def sweep_ranks(work: Workload | str, world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
                budgets: Iterable[int | str] | int | str | None = None, *, setups: Sequence[str] = DEFAULT_SETUPS,
                policies: Sequence[str] | str = ("auto",), hardware: Hardware | str | None = None,
                ranks_per_node: int | None = None, host_budget: int | str | None = None,
                fsdp_options: dict[str, Any] | None = None, progress: bool | None = None,
                workers: int | None = None, **options: Any) -> pd.DataFrame:
    """Per-rank peak and predicted step time of ``work`` for each world size x setup x budget (``COLUMNS``).

    ``work``: a Workload (build it on the meta device: only shapes are used) or a zoo name with ``options``
    for ``ul.zoo.get`` (built on meta). Setups: 'DDP' (whole replicas), 'FSDP2' (sharded over every rank),
    'HSDP' (sharded within a node of ``ranks_per_node``, replicated across nodes; FSDP2 up to one node), each
    with every tensor kept, and '+offload': the same rank's step under each of ``policies``' plans for the
    budget (what udnn_lab's offload and recompute add). ``budgets``: per rank (default: the device's memory).
    ``host_budget``: host memory of one node that the ranks' pinned pools share (``ranks_per_node`` x each
    rank's pool), or None not to check. ``fsdp_options``: more FSDP settings (``mp_policy``,
    ``reshard_after_forward``). A step time is that of the rank's step as the simulator predicts it. A budget
    under what any plan of the rank needs (``planning.floor_bytes``) is not planned: its row's peak is that floor.
    ``workers``: processes tracing ranks at once, this one included (NOTE [sweep processes]): by default one per
    core, started once the first rank says the others would take longer than starting them.
    """
    profile = resolve_hardware(hardware, PREDICTED_DEVICE)
    work = _workload(work, options)
    sizes = _world_sizes(world_sizes)
    chosen = _setups(setups)
    budget_list = _budgets(budgets, profile)
    per_node = _ranks_per_node(ranks_per_node, profile)
    host_bytes = None if host_budget is None else parse_bytes(host_budget)
    planners = [policies] if isinstance(policies, str) else list(policies)
    if not planners or any(p == "keep-all" for p in planners):
        raise ValueError(f"policies are the planning policies of the '+offload' setups (not keep-all: the setups "
                         f"without '+offload' keep everything), got {policies!r}")
    specs = {(setup, size): parallel_spec(setup, size, per_node, fsdp_options) for size in sizes for setup in chosen}
    job = RankJob(work, profile, budget_list, planners, specs,
                  partial(_row, profile=profile, per_node=per_node, host_budget=host_bytes))
    bar = tqdm(total=sum(1 + job.plans_of(spec) for spec in job.tasks), desc=f"one rank of {work.name}",
               unit="step", leave=False, disable=progress is False, delay=0 if progress else PROGRESS_SECONDS)

    def finished(rank: Traced, processes: int) -> None:
        how = "done" if rank.trace_s else "made from the ranks traced"
        bar.set_postfix_str(f"{describe(rank.spec)} {how}" + (f"; {processes} processes" if processes > 1 else ""))
        bar.update(1 + job.plans_of(rank.spec))

    with bar:
        bar.set_postfix_str(f"tracing {job.traced} ranks, making {len(job.tasks) - job.traced} from them")
        found = {rank.spec: rank for rank in run_ranks(job, workers, finished)}
    rows = []
    for (setup, _), spec in specs.items():
        rows += [row for row in found[spec].rows if row["setup"] == setup]
    return pd.DataFrame(rows, columns=COLUMNS)


def min_world_size(work: Workload | str, budget: int | str | None = None, *, setup: str = "FSDP2",
                   candidates: Iterable[int] = DEFAULT_WORLD_SIZES, **settings: Any) -> WorldSizeSearch:
    """The smallest of ``candidates`` at which ``setup``'s rank fits ``budget`` (default: the device's memory).

    The candidates are tried from the smallest up (with ``workers``, that many at once), and the search stops at
    the first that fits. Not a
    bisection: a rank's peak does fall as sharded parameters, gradients and optimizer state shrink, but FSDP pads
    every parameter to a multiple of the world size, so past the point where a dimension splits into one row
    per rank, the padded all-gather buffers grow again (a 10-row layer over 1024 ranks gathers 1024 rows).
    ``settings`` are ``sweep_ranks``'s (``policies``: one, ``hardware``, ``ranks_per_node``, ``host_budget``,
    zoo options, ...).
    """
    sizes = _world_sizes(candidates)
    _setups([setup])
    profile = resolve_hardware(settings.pop("hardware", None), PREDICTED_DEVICE)
    budget_bytes = _budgets(budget, profile)[0]
    work = _workload(work, {key: settings.pop(key) for key in list(settings) if key not in _SWEEP_SETTINGS})
    rows: list[dict[str, Any]] = []
    found = None
    workers = settings.get("workers")  # given: as many sizes at once as there are processes
    chunk = 1 if workers is None else processes_for(len(sizes), workers)
    for start in range(0, len(sizes), chunk):
        probes = sweep_ranks(work, sizes[start:start + chunk], [budget_bytes], setups=[setup], hardware=profile,
                             **settings)
        for row in probes.to_dict("records"):
            rows.append(row)
            if row["fits"]:
                found = row["world_size"]
                break
        if found is not None:
            break
    table = pd.DataFrame(rows, columns=COLUMNS)
    notes = () if found is not None else (f"not even {sizes[-1]} ranks fit: {table.iloc[-1]['why']}",)
    return WorldSizeSearch(model_name=work.name, setup=setup, world_size=found, budget_bytes=budget_bytes,
                           hardware=profile.name, probes=table, notes=notes)


def _row(graph: Graph, spec: Parallel, budget_bytes: int, policy: str, *, profile: Hardware,
         per_node: int, host_budget: int | None) -> dict[str, Any]:
    traced = int(graph.cuda_peak_bytes if profile.device_type == "cuda" else graph.peak_bytes)
    at_peak = graph.breakdown()["bytes_at_peak"]
    # FSDP2's offloaded shards, gradients and optimizer state, and the optimizer's scratch, on every rank of a node
    offloaded = int(graph.host_peak_bytes) * per_node if isinstance(spec, FSDP) and spec.offload_params else 0
    row: dict[str, Any] = {"spec": _describe(spec), "budget_bytes": budget_bytes, "traced_peak_bytes": traced,
                           "communication_at_peak_bytes": int(at_peak.get("communication", 0)), "policy": policy,
                           "offloads": 0, "recomputes": 0, "host_bytes_per_node": offloaded, "why": ""}
    if policy == "keep-all" or (policy == "auto" and traced <= budget_bytes):  # auto's fastest then keeps all
        simulation = simulate(graph, None, profile, ranks_per_node=per_node)
        on_host = host_budget is None or offloaded <= host_budget
        why = f"needs {format_bytes(traced)}" if traced > budget_bytes else "" if on_host else \
            f"the node's {per_node} ranks keep {format_bytes(offloaded)} of offloaded parameters in host memory"
        return {**row, **_timing(simulation), "fits": not why, "peak_bytes": traced, "why": why}
    floor = floor_bytes(graph)
    if floor > budget_bytes:  # no plan of any policy goes under it: not worth planning
        return {**row, "fits": False, "peak_bytes": floor, "step_time_s": float("nan"),
                "communication_s": float("nan"), "exposed_communication_s": float("nan"),
                "why": f"no plan goes under {format_bytes(floor)} (what its ops need at once, with what it holds "
                       "throughout)"}
    share = None if host_budget is None else max(0, host_budget - offloaded) // per_node  # each rank's pool's
    try:
        chosen = plan(graph, budget_bytes, policy, profile, ranks_per_node=per_node, host_budget=share)
    except HostBudgetExceeded as error:
        return {**row, "fits": False, "peak_bytes": int(error.peak_bytes), "step_time_s": float("nan"),
                "communication_s": float("nan"), "exposed_communication_s": float("nan"),
                "host_bytes_per_node": error.host_bytes * per_node + offloaded,
                "why": f"the node's {per_node} pinned pools need {format_bytes(error.host_bytes * per_node)} of "
                       "host memory"}
    except PlanInfeasible as error:
        return {**row, "fits": False, "peak_bytes": int(error.minimum_bytes), "step_time_s": float("nan"),
                "communication_s": float("nan"), "exposed_communication_s": float("nan"),
                "why": f"{policy}'s plans need {format_bytes(error.minimum_bytes)}"}
    simulation = simulate(graph, chosen, profile, ranks_per_node=per_node)
    host = chosen.host_pool_bytes * per_node + offloaded
    fits = simulation.fits and (host_budget is None or host <= host_budget)
    pools = "pinned pools and offloaded parameters" if offloaded else "pinned pools"
    why = "" if fits else (f"the node's {per_node} {pools} need {format_bytes(host)} of host memory"
                           if simulation.fits else f"its plan peaks at {format_bytes(simulation.peak_bytes)}")
    return {**row, **_timing(simulation), "fits": fits, "peak_bytes": int(simulation.peak_bytes),
            "offloads": len(chosen.offloads), "recomputes": len(chosen.recomputes), "host_bytes_per_node": host,
            "why": why}


def _timing(simulation: Simulation) -> dict[str, float]:
    return {"step_time_s": simulation.step_time_s, "communication_s": simulation.communication_time_s,
            "exposed_communication_s": simulation.exposed_communication_s}


def parallel_spec(setup: str, world_size: int, ranks_per_node: int = DEFAULT_RANKS_PER_NODE,
                  fsdp_options: dict[str, Any] | None = None) -> Parallel:
    """The DDP or FSDP spec a setup name ('DDP', 'FSDP2', 'HSDP', with or without '+offload') stands for."""
    _setups([setup])
    base, per_node, fsdp_options = setup.removesuffix("+offload"), ranks_per_node, fsdp_options or {}
    if base == "DDP":
        return DDP(world_size)
    if base == "HSDP" and world_size > per_node:
        if world_size % per_node:
            raise ValueError(f"HSDP shards within a node of {per_node} ranks: {world_size} ranks are not whole nodes")
        return FSDP(world_size, replicate=world_size // per_node, **fsdp_options)
    return FSDP(world_size, **fsdp_options)


def _describe(spec: Parallel) -> str:
    return describe(replace(spec, rank=0)).removeprefix("rank 0 of ")


def _workload(work: Workload | str, options: dict[str, Any]) -> Workload:
    if isinstance(work, str):
        return zoo.get(work, **{"device": "meta", **options})
    if options:
        raise TypeError(f"{', '.join(sorted(options))}: options are for a zoo name; a Workload is built already")
    if not isinstance(work, Workload):
        raise TypeError(f"work is a ul.Workload or a zoo name, got {type(work).__name__}")
    return work


def _world_sizes(world_sizes: Iterable[int]) -> list[int]:
    sizes = sorted(set(world_sizes))
    bad = [size for size in sizes if isinstance(size, bool) or not isinstance(size, int) or size < 1]
    if not sizes or bad:
        raise ValueError(f"world sizes are positive ints (ranks, one per GPU), got {list(world_sizes) or 'none'}")
    return sizes


def _setups(setups: Sequence[str]) -> list[str]:
    unknown = [setup for setup in setups if setup not in SETUPS]
    if unknown or not setups:
        raise ValueError(f"unknown setup(s) {unknown or 'none'}: the setups are {', '.join(SETUPS)}")
    return list(dict.fromkeys(setups))


def _budgets(budgets: Iterable[int | str] | int | str | None, profile: Hardware) -> list[int]:
    if budgets is None:
        return [int(profile.memory_bytes)]
    found = [parse_bytes(b) for b in ([budgets] if isinstance(budgets, (int, str)) else budgets)]
    if not found or any(b <= 0 for b in found):
        raise ValueError(f"budgets are sizes per rank above 0 bytes ('80GiB', bytes), got {budgets!r}")
    for budget in found:
        check_within_device(budget, profile)
    return found


def _ranks_per_node(ranks_per_node: int | None, profile: Hardware) -> int:
    if ranks_per_node is None:
        return profile.gpus_per_node or DEFAULT_RANKS_PER_NODE
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node is a positive int (GPUs of one node), got {ranks_per_node!r}")
    return ranks_per_node



def sweep(subject: Graph | Workload | str, budgets: Iterable[int | str] | int | str | None = None,
          policies: Iterable[str] | None = None, hardware: Hardware | str | None = None, profile: Any = None,
          rates: Any = None, *, world_sizes: Iterable[int] | None = None, **ranks_options: Any) -> pd.DataFrame:
    """What-if tables. Without ``world_sizes``: budget x policy for one traced Graph (``planning.sweep``, with its
    ``ranks_per_node`` and ``host_budget``).
    With ``world_sizes``: world size x setup x budget for a Workload or zoo name (``sweep_ranks``; its
    ``setups``, ``ranks_per_node``, ``host_budget``, ... go in ``ranks_options``)."""
    if world_sizes is None:
        per_node = ranks_options.pop("ranks_per_node", None)  # a rank's graph: the links its collectives cross
        host_budget = ranks_options.pop("host_budget", "local")  # the host memory its plans' offloads may take
        if ranks_options:
            raise TypeError(f"{', '.join(sorted(ranks_options))}: these are for a sweep over world_sizes")
        if not isinstance(subject, Graph):
            raise TypeError(f"sweep over budgets takes a traced Graph (ul.trace), got {type(subject).__name__}; "
                            "for a Workload or zoo name give world_sizes=[1, 2, 4, ...] to sweep over ranks")
        if budgets is None:
            raise TypeError("sweep(graph, budgets): give the budgets to try, e.g. ['4GiB', '6GiB']")
        return planning_sweep(subject, [budgets] if isinstance(budgets, (int, str)) else budgets, policies,
                              hardware, profile, rates, ranks_per_node=per_node, host_budget=host_budget)
    if profile is not None or rates is not None:
        raise TypeError("a sweep over world sizes times each rank from the hardware profile: leave profile and "
                        "rates out (a measured profile is of one traced step)")
    if isinstance(subject, Graph):
        raise TypeError("a sweep over world sizes traces the step at each one: give the Workload (or zoo name) "
                        "rather than a traced Graph")
    return sweep_ranks(subject, world_sizes, budgets, policies=tuple(policies or ("auto",)),
                       hardware=hardware, **ranks_options)

"""What sets a step's peak where no plan of its saved tensors lowers it, in words, with what would help: the model's
state (weights, gradients, optimizer state) or one op's working set (planning errors and plan notes say it)."""

from __future__ import annotations

from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.units import format_bytes

UNLOWERED = "no lower peak than keeping every tensor"  # how a plan's note starts where it lowers nothing

FIXED = ("parameter", "buffer", "parameter_gradient", "optimizer_state")  # no plan of saved tensors moves them
FIXED_SHARE = 0.8  # of the smallest budget: above it, say that the floor is the model's state, not its activations


def fixed_floor(graph: Graph, minimum: int) -> str:
    """Where weights, their gradients and the optimizer's state are most of a policy's smallest budget: that in
    words, with what would lower it (offloading or recomputing saved tensors cannot); else ''."""
    curve = graph.memory_curve()
    fixed = curve[list(FIXED)].sum(axis=1)
    at = int(fixed.to_numpy().argmax())
    held = int(fixed.iloc[at])
    if not minimum or held < FIXED_SHARE * minimum:
        return ""
    weights = int(curve["parameter"].iloc[at] + curve["buffer"].iloc[at])
    return (f"; {format_bytes(held)} of it ({held / minimum:.0%}) is weights ({format_bytes(weights)}), their "
            f"gradients ({format_bytes(int(curve['parameter_gradient'].iloc[at]))}) and optimizer state "
            f"({format_bytes(int(curve['optimizer_state'].iloc[at]))}), which no offload or recomputation of saved "
            "tensors moves: shard them (FSDP), keep optimizer state in 8 bits or on the host, or train fewer "
            "parameters (LoRA); a smaller batch lowers only the rest")


def one_op_floor(graph: Graph, minimum: int) -> str:
    """Where one op's inputs and outputs, with the model's state beside them, are most of a policy's smallest
    budget: they are all on the device while it runs, so no plan goes lower; that in words, else ''."""
    curve = graph.memory_curve()
    fixed = curve[list(FIXED)].sum(axis=1).to_numpy()
    best = (0, -1)
    for op in graph.ops:
        touched = {t for t in (*op.inputs, *op.outputs)
                   if graph.on_device(graph.tensors[t]) and graph.tensors[t].category not in FIXED}
        best = max(best, (sum(graph.tensors[t].nbytes for t in touched), op.index))
    working, at = best
    if at < 0 or not minimum:
        return ""
    touched = set(graph.ops[at].inputs) | set(graph.ops[at].outputs)
    held = sum(t.nbytes for t in graph.tensors if t.held_past_forward and t.id not in touched and graph.on_device(t)
               and t.producer is not None and t.producer <= at and (t.free_step is None or t.free_step >= at))
    if working + held + int(fixed[at]) < FIXED_SHARE * minimum:
        return ""
    op = graph.ops[at]
    if op.phase == "optimizer":
        helps = ("it is the optimizer's step, not the batch: a fused optimizer (fused=True) makes no such temporaries, "
                 "and sharding (FSDP) or 8-bit optimizer state shrinks what sits beside them")
    else:
        helps = ("a smaller micro-batch or input (fewer tokens, smaller images) lowers it (gradient accumulation keeps "
                 "the batch)")
    return (f"; op {at} ({op.name}, in {op.module or 'the model'}) alone reads and writes {format_bytes(working)} "
            f"at once, beside {format_bytes(int(fixed[at]))} of weights, gradients and optimizer state and "
            f"{format_bytes(held)} the training loop holds (the output, the loss), and all of it is on the device "
            f"while the op runs, which no offload or recomputation changes: {helps}")


def unlowered_note(graph: Graph, planned: Simulation, kept: Simulation) -> str:
    """A plan that moves saved tensors yet peaks no lower than keeping them all: that in one line, with what sets
    the peak and what would lower it."""
    peak = planned.peak_bytes
    why = fixed_floor(graph, peak) or one_op_floor(graph, peak)
    if not why:
        curve = planned.curve
        counted = curve["cuda_live_bytes" if graph.device == "cuda" else "live_bytes"]
        op = graph.ops[int(counted.to_numpy().argmax())] if len(counted) else None
        where = f" at op {op.index} ({op.name}, {op.phase}, in {op.module or 'the model'})" if op is not None else ""
        why = (f"; its peak is{where}, where the tensors it moves are not what is live: a policy that moves others "
               "(auto) or a smaller micro-batch lowers it")
    return (f"{UNLOWERED}: {format_bytes(peak)} against {format_bytes(kept.peak_bytes)}, in "
            f"{planned.step_time_s / kept.step_time_s:.2f}x the step time{why}")


def unlowered(plan: Plan) -> str:
    """The plan's note saying it peaks no lower than keeping every tensor ('' when it lowers the peak)."""
    return next((note for note in plan.notes if note.startswith(UNLOWERED)), "")

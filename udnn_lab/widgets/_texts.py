"""What MemoryLab writes: the chart's title and subtitle, the line under the budget, the summary.

Plain functions from values to text (HTML where the app shows it as HTML); nothing here decides
anything or touches a widget.
"""

from __future__ import annotations

import html

from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.widgets._state import MeasuredStep, Setting

GREEN, RED = "#2ca02c", "#d62728"


def sentences(*parts: str) -> str:
    """The parts as sentences of one text: each ends with a full stop unless it ends with one already."""
    kept = [part.strip() for part in parts if part and part.strip()]
    return " ".join(part if part[-1] in ".!?" else part + "." for part in kept)


def wrapping(text: str) -> str:
    return f"<div style='white-space:normal;overflow-wrap:anywhere;line-height:1.4'>{text}</div>"


def error_text(error: Exception, *more: str) -> str:
    """An error as the app shows it: its kind in bold, then its message and ``more`` as sentences, in red."""
    return (f"<span style='color:{RED}'><b>{type(error).__name__}</b>: "
            f"{html.escape(sentences(str(error), *more))}</span>")


def fit_line(simulation: Simulation, error: Exception | None = None, *, reserved_bytes: int | None = None,
             budget_bytes: int | None = None, counted_bytes: int | None = None) -> str:
    """The line under the budget: whether the plan on screen fits it, and when no plan does, why (``error``); with
    ``reserved_bytes``, the budget (``budget_bytes``, the user's: the plan's own is what it was made for in
    allocated bytes) counts what the caching allocator reserves, and the line says that peak; with
    ``counted_bytes`` (a CUDA step), the allocated peak as torch.cuda.max_memory_allocated counts it, whole blocks
    and all (NOTE [whole blocks]), is the one held to the budget and said, beside the live peak."""
    if error is not None:
        return wrapping(f"<b style='color:{RED}'>does not fit</b> · "
                        + error_text(error, "The chart shows every tensor kept"))
    if reserved_bytes is not None:
        fits = budget_bytes is None or reserved_bytes <= budget_bytes
        verdict = f"<b style='color:{GREEN}'>fits</b>" if fits else f"<b style='color:{RED}'>does not fit</b>"
        return wrapping(f"{verdict}: reserved peak <b>{format_bytes(reserved_bytes)}</b> (allocator model; "
                        f"allocated {format_bytes(simulation.peak_bytes)}) "
                        f"{'within' if fits else 'over'} the budget")
    if counted_bytes is not None and counted_bytes != simulation.peak_bytes:
        fits = budget_bytes is None or counted_bytes <= budget_bytes
        verdict = f"<b style='color:{GREEN}'>fits</b>" if fits else f"<b style='color:{RED}'>does not fit</b>"
        return wrapping(f"{verdict}: peak <b>{format_bytes(counted_bytes)}</b> as torch.cuda.max_memory_allocated "
                        f"counts it (live tensors {format_bytes(simulation.peak_bytes)}, the rest the caching "
                        f"allocator's whole blocks) {'within' if fits else 'over'} the budget")
    if simulation.fits:
        return wrapping(f"<b style='color:{GREEN}'>fits</b>: peak <b>{format_bytes(simulation.peak_bytes)}</b> "
                        f"within the budget")
    return wrapping(f"<b style='color:{RED}'>does not fit</b>: peak <b>{format_bytes(simulation.peak_bytes)}</b> "
                    f"is over the budget")


def profile_named(hardware: Hardware) -> str:
    """The profile's name, what it is of, and where its figures come from."""
    how = "measured" if hardware.measured else "datasheet"
    return f"{hardware.name} ({hardware.title}, {hardware.device_type.upper()}, {how})"


def summary(simulation: Simulation, hardware: Hardware, host_bytes: int = 0) -> str:
    """The plan on screen in one line, after the profile it was simulated with."""
    budget = format_bytes(simulation.budget_bytes) if simulation.budget_bytes is not None else "none"
    fits = f"<span style='color:{GREEN}'>fits</span>" if simulation.fits else \
        f"<span style='color:{RED}'>does not fit</span>"
    # FSDP2's offloaded parameters: the rank's host memory, beside the device memory the chart shows
    host = f" · host memory <b>{format_bytes(host_bytes)}</b> at most" if host_bytes else ""
    return wrapping(f"profile <b class='udnn-profile'>{html.escape(profile_named(hardware))}</b> · "
                    f"peak <b>{format_bytes(simulation.peak_bytes)}</b> of budget {budget} ({fits}) · step "
                    f"<b>{format_seconds(simulation.step_time_s)}</b>, stalled "
                    f"{format_seconds(simulation.stall_time_s)} · copied {format_bytes(simulation.d2h_bytes)} out, "
                    f"{format_bytes(simulation.h2d_bytes)} back{host} · policy {html.escape(simulation.policy)}")


def step_named(graph: Graph, setting: Setting) -> str:
    """The network (with its attention and LoRA rank), the batch, and the sequence and precision when they apply."""
    tokens = f", {setting.seq_len} tokens" if setting.seq_len is not None else ""
    precision = f", {setting.precision}" if setting.precision != "32-true" else ""
    ranks = f", one rank of {setting.parallel} x {setting.world_size}" if setting.parallel is not None else ""
    ranks += ", parameters on host" if setting.offload_params else ""
    return f"{graph.model_name}, batch {setting.batch}{tokens}{precision}{ranks}"


def policy_named(policy: str, plan, infeasible: bool, budget_bytes: int) -> str:
    """The policy the user chose, what auto chose, and whether it fits."""
    if infeasible:
        return f"{policy} cannot fit {format_bytes(budget_bytes)} (shown: every tensor kept)"
    chose = plan.chosen_policy
    return f"{policy} (chose {chose})" if chose and chose != policy else policy


def predicted_for(graph: Graph, hardware: Hardware) -> str:
    """The subtitle of a prediction: the device it is for and the profile it was simulated with."""
    return (f"predicted for {graph.device.upper()} with the profile {hardware.name} ({hardware.title}), "
            f"{len(graph.ops)} ops")


def measured_subtitle(measured: MeasuredStep, graph: Graph, hardware: Hardware) -> list[str]:
    """The subtitle of a measured step: what is shown, and in one line why the chart changed from the prediction."""
    here = measured.graph.device
    shown = (f"predicted for this machine's {here.upper()} (profile {measured.hardware_name}) beside the step "
             f"measured there, {len(measured.graph.ops)} ops")
    if here == graph.device and measured.hardware_name == hardware.name:
        return [shown]
    switched = (f"Measure ran it on this machine's {here.upper()}, replacing the {hardware.name} "
                f"({graph.device.upper()}) prediction of {len(graph.ops)} ops; change a setting to go back")
    return [shown, switched]


def minimum_named(policy: str, minimum_bytes: int | None, hardware: Hardware,
                  measured: MeasuredStep | None) -> str:
    """The policy's smallest budget on the profile, and on this machine when a measured step is shown."""
    if minimum_bytes is None:
        return ""
    text = (f"minimum feasible ({html.escape(policy)}): <b>{format_bytes(minimum_bytes)}</b> "
            f"on {html.escape(hardware.name)}")
    if measured is not None and measured.min_budget_bytes is not None:
        text += (f"; <b>{format_bytes(measured.min_budget_bytes)}</b> on this machine's "
                 f"{measured.graph.device.upper()} (the chart's rule)")
    return wrapping(text)

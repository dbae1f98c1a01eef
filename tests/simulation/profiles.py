"""A CUDA profile of a traced graph with the roofline's op times, for tests that set one measured figure."""

from udnn_lab.cost.model import CostModel
from udnn_lab.cost.profiling import Profile
from udnn_lab.hardware.profiles import Hardware


def roofline_profile(graph, hardware: Hardware, **measured) -> Profile:
    """``graph``'s step profiled as on ``hardware``'s device, each op taking its roofline time; ``measured``: the
    Profile fields a test sets (scratch_bytes, host_time_s, ...)."""
    times = tuple(float(t) for t in CostModel(hardware).op_times_s(graph))
    return Profile(
        model_name=graph.model_name, device="cuda", device_name=hardware.device_names[0], torch_version="test",
        measured_at="2026-11-27T00:00:00+00:00", graph_fingerprint=graph.fingerprint,
        ops=tuple(op.name for op in graph.ops), phases=tuple(op.phase for op in graph.ops),
        modules=tuple(op.module for op in graph.ops), flops=tuple(op.flops for op in graph.ops),
        bytes_read=tuple(op.bytes_read for op in graph.ops), bytes_written=tuple(op.bytes_written for op in graph.ops),
        time_s=times, time_min_s=times, repeats=1, step_time_s=sum(times), threads=1, **measured)

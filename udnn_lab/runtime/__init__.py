"""The runtime: carry a Plan out around a training step, and managed training."""

from udnn_lab.hardware import register_host_probe, register_step_probe
from udnn_lab.runtime._host_probe import runtime_host_figures
from udnn_lab.runtime._step_probes import step_hook_figures, step_replay_figures
from udnn_lab.runtime.offload import OffloadRuntime, PlanMismatch, StepStats
from udnn_lab.runtime.pinned_pool import HostMemoryError
from udnn_lab.runtime.training import Run, train

register_host_probe("runtime", runtime_host_figures)  # NOTE [host probes] 1
# NOTE [host probes] 4: the stand-in replay after the hook probe, which measures the replay on the runtime itself
register_step_probe("runtime hook calls", step_hook_figures)
register_step_probe("runtime replays", step_replay_figures)

__all__ = ["HostMemoryError", "OffloadRuntime", "PlanMismatch", "Run", "StepStats", "train"]

"""The words every stage shares: phases of a step, memory categories, pseudo-module scopes."""

PHASES = ("forward", "backward", "optimizer")
CATEGORIES = (
    "parameter",
    "buffer",
    "input",
    "feature_map",  # produced in forward and saved by autograd for backward
    "gradient_map",  # produced in backward, not a parameter's gradient
    "parameter_gradient",
    "optimizer_state",
    "temporary",  # everything else: forward scratch, the loss, optimizer scratch
)
LOSS_SCOPE = "<loss>"
OPTIMIZER_SCOPE = "<optimizer>"
AUTOGRAD_SCOPE = "<autograd>"
DIRECTIONS = ("h2d", "d2h")  # host-to-device and device-to-host copies


def memory_kind(pinned: bool) -> str:
    """Host memory a copy reads or writes: page-locked ('pinned') or ordinary ('pageable')."""
    return "pinned" if pinned else "pageable"

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

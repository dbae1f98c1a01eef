"""The vDNN papers' accounting of a step's memory: every buffer allocated for the whole step, none reused.

SEEDS.md on document 002: "Memory is computable before running: AlexNet at batch 128 needs about
**1.1 GB**; VGG-16 at batch 128 about **14 GB**", and "Memory by function: parameters, feature maps
(forward intermediates), gradient maps (backward intermediates), workspace (cuDNN scratch buffers,
freed when the call returns)". It does not say how those figures were counted. We read them
(assumed, as issue 16 does) as vDNN's baseline, the network-wide allocation: every layer's feature
maps, gradient maps, weights, weight gradients and workspace allocated for the whole iteration,
no buffer reused. PyTorch's accounting (``Graph.peak_bytes``) instead frees each tensor after its
last use, so the same step peaks lower.

How the traced step maps onto the paper's functions (what is assumed is marked so):

- weights: the parameters and buffers.
- weight gradients: the parameters' gradients.
- input: the batch, the first layer's X.
- feature maps: every storage forward produces, kept all step (PyTorch's extras such as max
  pooling's int64 indices included: they are buffers of this step's layers).
- gradient maps (assumed): one buffer per layer output, the size of that output: each layer
  writes its dX into its own buffer, dY of a layer being dX of the next, as in the paper's layer
  model. A layer output is a floating-point storage made in forward and returned by a module call
  (a functional op inside a module's forward makes no layer of its own); a layer that works in
  place (an in-place ReLU) shares its input's storage and adds none. The batch gets no gradient
  map (nothing computes its gradient). PyTorch's own backward makes more gradient storages than
  this (ReLU's backward writes a new one), which its reuse hides.
- workspace: not counted. cuDNN's scratch buffers are not in a trace under fake tensors, and the
  papers give no per-layer figure to model them from; the network-wide total is therefore a lower
  bound on the paper's, short by the workspace of every convolution. For AlexNet and VGG-16 at
  batch 128 it already exceeds document 002's figures without them (notebook 02), so workspaces
  would widen that gap, not close it.
- optimizer state (assumed excluded): document 002's functions do not list momentum, so it is
  reported apart and left out of the total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from udnn_lab.units import format_bytes

if TYPE_CHECKING:
    from udnn_lab.graph.step_graph import Graph, TensorInfo


@dataclass(frozen=True)
class NetworkWide:
    """A step's memory under the network-wide allocation vDNN compares against (module docstring), in bytes."""

    model_name: str
    weights_bytes: int
    weight_gradients_bytes: int
    input_bytes: int
    feature_maps_bytes: int
    gradient_maps_bytes: int
    workspace_bytes: int  # 0: cuDNN workspaces are not traced (module docstring)
    optimizer_state_bytes: int  # reported apart, not in total_bytes

    @property
    def total_bytes(self) -> int:
        """Every buffer of the paper's functions at once: the baseline's memory, constant over the step."""
        return (self.weights_bytes + self.weight_gradients_bytes + self.input_bytes + self.feature_maps_bytes
                + self.gradient_maps_bytes + self.workspace_bytes)

    def __repr__(self) -> str:
        return (f"NetworkWide({self.model_name!r}, total={format_bytes(self.total_bytes)}: weights "
                f"{format_bytes(self.weights_bytes)}, weight gradients {format_bytes(self.weight_gradients_bytes)}, "
                f"input {format_bytes(self.input_bytes)}, feature maps {format_bytes(self.feature_maps_bytes)}, "
                f"gradient maps {format_bytes(self.gradient_maps_bytes)}, workspace not traced; optimizer state "
                f"{format_bytes(self.optimizer_state_bytes)} left out)")


def network_wide(graph: Graph) -> NetworkWide:
    """The step's device memory if every buffer of every layer were allocated for the whole step (vDNN's baseline).

    Counts exact storage bytes, each storage once, on the graph's device (see the module docstring for
    what is assumed).
    """
    device = [t for t in graph.tensors if graph.on_device(t)]

    def made_in(phase: str, t: TensorInfo) -> bool:
        return t.producer is not None and graph.ops[t.producer].phase == phase

    def total(tensors) -> int:
        return sum(t.nbytes for t in tensors)

    returned = {i for call in graph.module_calls for i in call.outputs}
    layer_outputs = [t for t in device if t.id in returned and made_in("forward", t) and _is_floating(t.dtype)]
    return NetworkWide(
        model_name=graph.model_name,
        weights_bytes=total(t for t in device if t.category in ("parameter", "buffer")),
        weight_gradients_bytes=total(t for t in device if t.category == "parameter_gradient"),
        input_bytes=total(t for t in device if t.category == "input"),
        feature_maps_bytes=total(t for t in device if made_in("forward", t)),
        gradient_maps_bytes=total(layer_outputs),
        workspace_bytes=0,
        optimizer_state_bytes=total(t for t in device if t.category == "optimizer_state"),
    )


def _is_floating(dtype: str) -> bool:
    return "float" in dtype  # 'float32', 'bfloat16', 'torch.float16': the dtypes a gradient can have

"""The words every stage shares, each fixed set in one place: a Literal type and the tuple of its values.

Annotate with the Literal (``phase: Phase``) and iterate or check with the tuple (``PHASES``).
"""

from __future__ import annotations

from typing import Literal, get_args

Phase = Literal["forward", "backward", "optimizer"]
PHASES: tuple[Phase, ...] = get_args(Phase)

Category = Literal[
    "parameter",
    "buffer",
    "input",
    "feature_map",  # produced in forward and saved by autograd for backward
    "weight_cast",  # a lower-precision copy of a parameter made in forward (autocast's, cached for the forward)
    "gradient_map",  # produced in backward, not a parameter's gradient
    "parameter_gradient",
    "optimizer_state",
    "communication",  # a collective's buffer: DDP's gradient buckets, FSDP's all-gather and reduce-scatter buffers
    "temporary",  # everything else: forward scratch, the loss, optimizer scratch
]
CATEGORIES: tuple[Category, ...] = get_args(Category)
# what a plan may move or rebuild: feature maps, and autocast's low-precision copies of the weights (each saved by
# its matmul until that matmul's backward, rebuilt by one cast of a weight that never leaves the device)
PLANNED_CATEGORIES: tuple[Category, ...] = ("feature_map", "weight_cast")

# pseudo-module scopes of ops that belong to no module of the model
PACKAGE_VERSION = "0.1.0"  # this udnn_lab (pyproject.toml says the same): plan files name the one that wrote them

LOSS_SCOPE = "<loss>"
OPTIMIZER_SCOPE = "<optimizer>"
GRAD_SCALER_SCOPE = "<grad scaler>"  # 16-mixed: unscaling the gradients, the inf check, the scale's update
CLIP_SCOPE = "<clip grad norm>"

# The step's numeric precision, named as PyTorch Lightning names it. '-true': weights, gradients and optimizer
# state in that dtype. '-mixed': float32 weights, forward and loss under torch.autocast in that dtype; '16-mixed'
# also scales the loss with a torch.amp.GradScaler.
Precision = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
AUTOGRAD_SCOPE = "<autograd>"

Action = Literal["keep", "offload", "recompute"]  # what a plan does with a saved tensor
ACTIONS: tuple[Action, ...] = get_args(Action)

Policy = Literal["keep-all", "vdnn-all", "vdnn-conv", "vdnn-dyn", "vdnn++", "pin-greedy", "pin-dp",
                 "checkpoint-segments", "recompute", "auto", "optimal"]
POLICY_NAMES: tuple[Policy, ...] = get_args(Policy)

# the simulated streams, and the lanes of the stream chart; one rank of several adds the collectives' stream and
# FSDP2's all-gather copy-in stream (NOTE [collectives] in simulation/_communication.py)
Stream = Literal["compute", "d2h", "h2d", "comm", "comm_copy_in"]
STREAMS: tuple[Stream, ...] = get_args(Stream)

# compute waiting: for memory, a prefetch, a copy, a collective's result
# stall_host: a GPU waiting for a host that follows the step op by op (NOTE [simulated streams] 6)
Stall = Literal["stall_memory", "stall_prefetch", "stall_sync", "stall_communication", "stall_host"]
STALLS: tuple[Stall, ...] = get_args(Stall)
Collective = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "point_to_point", "collective"]
COLLECTIVES: tuple[Collective, ...] = get_args(Collective)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")  # the op namespaces of a process group's collectives
UNTRACED_NAMESPACES = ("prim", "profiler")  # ops no tool that aligns to a Graph counts
# _fused_sdp_choice: asked by the stand-in for CUDA's attention (NOTE [stand-in attention]); eager sdpa asks a stub
UNTRACED_OPS = ("aten.detach.default", "aten._fused_sdp_choice.default")
# shard_to_device, gradient_to_host: an FSDP2 rank that offloads its parameters copies them across
TimelineKind = Literal["op", "recompute", "offload", "prefetch", "prefetch_cancelled", "stall_memory",
                       "stall_prefetch", "stall_sync", "stall_communication", "stall_host", "all_gather",
                       "reduce_scatter", "all_reduce", "all_to_all", "point_to_point", "collective",
                       "shard_to_device", "gradient_to_host"]
TIMELINE_KINDS: tuple[TimelineKind, ...] = get_args(TimelineKind)

Direction = Literal["h2d", "d2h"]  # host-to-device and device-to-host copies
DIRECTIONS: tuple[Direction, ...] = get_args(Direction)

FineTuneMethod = Literal["full", "lora", "qlora"]  # qlora: LoRA on quantized base weights
FINE_TUNE_METHODS: tuple[FineTuneMethod, ...] = get_args(FineTuneMethod)

# attention of Hugging Face models, by transformers' names: torch's fused scaled_dot_product_attention, or
# matmul, softmax and matmul, which keeps the seq x seq scores
AttentionImplementation = Literal["sdpa", "eager"]
ATTENTION_IMPLEMENTATIONS: tuple[AttentionImplementation, ...] = get_args(AttentionImplementation)

# what a published peak counted: torch.cuda.max_memory_allocated / max_memory_reserved, or the device's used
# memory as nvidia-smi (NVML) reports it, CUDA context included
PeakCounter = Literal["max_memory_allocated", "max_memory_reserved", "nvml_used"]
PEAK_COUNTERS: tuple[PeakCounter, ...] = get_args(PeakCounter)


def memory_kind(pinned: bool) -> str:
    """Host memory a copy reads or writes: page-locked ('pinned') or ordinary ('pageable')."""
    return "pinned" if pinned else "pageable"

Dimension = Literal["batch", "seq_len"]  # what a fit search grows: the batch size, or the sequence length
DIMENSIONS: tuple[Dimension, ...] = get_args(Dimension)


def traced_op(func) -> bool:
    """Whether a trace records ops of this kind (an OpOverload): every tool that aligns to a Graph counts the same."""
    return func.namespace not in UNTRACED_NAMESPACES and str(func) not in UNTRACED_OPS

"""How a training step is spread over ranks: DDP (full replicas, gradients all-reduced in buckets) or FSDP2
(parameters, gradients and optimizer state sharded; each block's parameters all-gathered around its use).

A spec says what PyTorch's own engine is asked for. ``apply`` wraps a model as that engine wraps it, inside a
process group you have initialized (the real run); ``ul.trace(..., parallel=spec)`` runs the same wrapping for
one rank of a fake process group (the prediction), so both describe one step.

FSDP's blocks, by default (``shard_blocks``): every child of the outermost ``nn.ModuleList`` and ``nn.Sequential``
containers that holds parameters (a transformer's layers, a ResNet's blocks, an MLP's Linear layers); a model
without such containers has its top-level children that hold parameters; then the root, which takes what is
left (embeddings, heads) and keeps its parameters from forward to backward (FSDP2's own rule for a root,
whose parameters backward needs first). ``FSDP(wrap=...)`` replaces the rule: ``wrap(model, shard)`` calls
``shard(module)`` (``fully_shard`` with the spec's settings, overridable per call:
``shard(layer, reshard_after_forward=False)``) on the modules it picks; the root is sharded after it unless it was.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from udnn_lab.sharded_model import ShardedLayout, offloads, sharded_layout

# PyTorch's default DDP communication hooks a DDP spec can register (DDP(comm_hook=name)), by name
COMM_HOOKS: dict[str, Callable[..., Any]] = {"allreduce": default_hooks.allreduce_hook,
                                             "fp16_compress": default_hooks.fp16_compress_hook,
                                             "bf16_compress": default_hooks.bf16_compress_hook}
Shard = Callable[..., Any]  # fully_shard with a spec's settings: shard(module, **overrides)
Wrap = Callable[[nn.Module, Shard], Any]  # picks the modules to shard: wrap(model, shard)


def _check_ranks(world_size: Any, rank: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size counts the ranks (processes, one per GPU): a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank is the rank a trace describes: 0 to world_size - 1 = {world_size - 1}, got {rank!r}")


def _check_flags(spec: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(spec, name), bool):
            raise ValueError(f"{name} is True or False, got {getattr(spec, name)!r}")


def _group_for(world_size: int) -> None:
    """Raise unless a default process group of ``world_size`` ranks is initialized (what ``apply`` runs in)."""
    if not dist.is_initialized():
        raise RuntimeError("apply() wraps the model for a real run: initialize the process group first "
                           "(torch.distributed.init_process_group, one process per rank); for a prediction "
                           "from one process use ul.trace(..., parallel=spec)")
    if dist.get_world_size() != world_size:
        raise ValueError(f"the spec is for world_size={world_size} but the process group has "
                         f"{dist.get_world_size()} ranks: make the spec with world_size={dist.get_world_size()}")


@dataclass(frozen=True)
class DDP:
    """DistributedDataParallel: every rank holds the whole model and optimizer; gradients are all-reduced in
    buckets of ``bucket_cap_mb`` MiB (torch's own default 25; its first bucket is 1 MiB) as backward makes them.

    ``comm_hook``: one of PyTorch's default communication hooks, by name (``COMM_HOOKS``): ``"fp16_compress"`` and
    ``"bf16_compress"`` all-reduce each bucket as a half-precision copy (one more buffer per bucket in flight),
    ``"allreduce"`` as the built-in reduction does, from Python. ``apply`` registers it on the wrapper, with the
    spec's process group as its state."""

    world_size: int
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False  # True: gradients live in the buckets (no second copy)
    forward_sync_buffers: bool = True  # buffers (batch-norm statistics) go from rank 0 to all before each forward
    static_graph: bool = False
    find_unused_parameters: bool = False
    rank: int = 0  # the rank a trace describes (every DDP rank holds the same); a real run's is its process's
    comm_hook: str | None = None

    def __post_init__(self) -> None:
        _check_ranks(self.world_size, self.rank)
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook names one of PyTorch's default DDP communication hooks: one of "
                             f"{sorted(COMM_HOOKS)} or None, got {self.comm_hook!r}")
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) \
                or not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb is the size of a gradient bucket in MiB: a positive number, "
                             f"got {self.bucket_cap_mb!r}")
        _check_flags(self, ("gradient_as_bucket_view", "forward_sync_buffers", "static_graph",
                            "find_unused_parameters"))

    @classmethod
    def of(cls, wrapper: DistributedDataParallel, world_size: int, rank: int) -> DDP:
        """The spec of a running job's DistributedDataParallel: its settings, its communication hook, this
        process's rank. A hook other than PyTorch's default ones, or one given another state than the wrapper's own
        process group, is refused: what it allocates and when is its own, and a trace without it would leave that
        out."""
        return cls(world_size, bucket_cap_mb=wrapper.bucket_bytes_cap / 2**20,
                   gradient_as_bucket_view=wrapper.gradient_as_bucket_view,
                   forward_sync_buffers=wrapper.broadcast_buffers,  # torch >= 2.13 keeps the old name as an alias
                   static_graph=wrapper.static_graph, find_unused_parameters=wrapper.find_unused_parameters,
                   rank=rank, comm_hook=_comm_hook_of(wrapper))

    def apply(self, model: nn.Module, *, process_group: dist.ProcessGroup | None = None,
              init_sync: bool = True) -> DistributedDataParallel:
        """``model`` wrapped in DistributedDataParallel with this spec's settings (the default process group
        unless ``process_group`` is given). ``init_sync``: broadcast rank 0's weights first, as DDP does."""
        if process_group is None:
            _group_for(self.world_size)
        settings: dict[str, Any] = dict(
            bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph, find_unused_parameters=self.find_unused_parameters,
            process_group=process_group, init_sync=init_sync)
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
            wrapped = DistributedDataParallel(model, forward_sync_buffers=self.forward_sync_buffers, **settings)
        else:  # torch < 2.13 names it broadcast_buffers, whose False also leaves the buffers out of the first sync
            wrapped = DistributedDataParallel(model, broadcast_buffers=self.forward_sync_buffers, **settings)
            if init_sync and not self.forward_sync_buffers:
                for buffer in model.buffers():
                    dist.broadcast(buffer, group=process_group, group_src=0)
        if self.comm_hook is not None:
            wrapped.register_comm_hook(process_group, COMM_HOOKS[self.comm_hook])
        return wrapped


def _comm_hook_of(wrapper: DistributedDataParallel) -> str | None:
    registered = list(getattr(wrapper, "_comm_hooks", ()))  # (hook, state), as register_comm_hook keeps them
    if not registered:
        return None
    names = {hook: name for name, hook in COMM_HOOKS.items()}
    hook, state = registered[-1]
    if len(registered) == 1 and hook in names and state in (None, wrapper.process_group):
        return names[hook]
    what = ("one of several hooks" if len(registered) > 1 else "not one of PyTorch's default hooks"
            if hook not in names else f"with a state of its own ({type(state).__name__})")
    raise ValueError(f"this DistributedDataParallel has the communication hook {getattr(hook, '__name__', hook)!r}, "
                     f"{what}, which a plan cannot reproduce: planned ranks take PyTorch's default hooks "
                     f"({', '.join(sorted(COMM_HOOKS))}, registered with the wrapper's process group or None); "
                     "register one of those, or train without the plan")


@dataclass(frozen=True)
class FSDP:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state are split
    over the ranks; each block's parameters are all-gathered before its forward and backward and freed after
    (``reshard_after_forward=False`` keeps them from forward to backward; an int reshards onto that many ranks),
    its gradients reduce-scattered after its backward. The root keeps its own from forward to backward.

    ``replicate`` > 1 is HSDP: the ranks form a ``replicate x (world_size / replicate)`` mesh; parameters are
    sharded within each group of ``world_size / replicate`` ranks (a node, typically) and replicated across the
    groups, so gradients are reduce-scattered within a group, then all-reduced across groups."""

    world_size: int
    reshard_after_forward: bool | int = True
    mp_policy: MixedPrecisionPolicy | None = None  # e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    offload_params: bool = False  # CPUOffloadPolicy: sharded parameters, gradients and optimizer state on the host
    wrap: Wrap | None = None  # wrap(model, shard): which modules are sharded (None: shard_blocks)
    replicate: int = 1  # HSDP: groups of world_size / replicate ranks shard, the groups replicate
    # the rank a trace describes; rank 0 holds the most: a dimension that does not split evenly leaves the last
    # ranks shorter shards (of optimizer state and its scratch; FSDP pads parameters and gradients). A real
    # run's rank is its process's.
    rank: int = 0
    shard_root: bool = True  # False: the model itself is left as ``wrap`` leaves it (a job that shards its parts)

    def __post_init__(self) -> None:
        _check_ranks(self.world_size, self.rank)
        reshard = self.reshard_after_forward
        if not isinstance(reshard, bool) and (not isinstance(reshard, int) or reshard < 1):
            raise ValueError(f"reshard_after_forward is True, False, or the number of ranks to reshard onto after "
                             f"forward (a positive int), got {reshard!r}")
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise ValueError(f"mp_policy is a torch.distributed.fsdp.MixedPrecisionPolicy (or None), got "
                             f"{type(self.mp_policy).__name__}")
        _check_flags(self, ("offload_params", "shard_root"))
        if isinstance(self.replicate, bool) or not isinstance(self.replicate, int) or self.replicate < 1 \
                or self.world_size % self.replicate:
            raise ValueError(f"replicate is how many groups of ranks hold a replica (HSDP): a positive int that "
                             f"divides world_size={self.world_size}, got {self.replicate!r}")
        if self.wrap is not None and not callable(self.wrap):
            raise ValueError(f"wrap is a function wrap(model, shard) that calls shard(module) on the modules to "
                             f"shard, got {type(self.wrap).__name__}")

    @classmethod
    def of(cls, model: nn.Module, rank: int) -> FSDP:
        """The spec of a running job's model, sharded already with ``fully_shard``: the same modules sharded with
        the same settings over a mesh of the same shape, as this process's ``rank``. What a spec cannot reproduce
        (modules sharded together, other placements, several meshes) is refused in one line."""
        layout = sharded_layout(model)
        first = layout.modules[0]
        world_size = math.prod(layout.mesh_shape)
        return cls(world_size, reshard_after_forward=True if first.reshard_after_forward is None
                   else first.reshard_after_forward, mp_policy=first.mp_policy, offload_params=offloads(layout),
                   wrap=partial(_as_laid_out, layout), replicate=layout.mesh_shape[0] if len(layout.mesh_shape) > 1
                   else 1, rank=rank, shard_root=False)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The DeviceMesh's shape: (world_size,), or (replicate, shard) for HSDP."""
        return (self.world_size,) if self.replicate == 1 else (self.replicate, self.world_size // self.replicate)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return None if self.replicate == 1 else ("replicate", "shard")

    def settings(self, mesh: DeviceMesh) -> dict[str, Any]:
        """The keyword arguments of ``fully_shard`` this spec stands for."""
        return {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward,
                "mp_policy": self.mp_policy or MixedPrecisionPolicy(),
                "offload_policy": CPUOffloadPolicy() if self.offload_params else OffloadPolicy()}

    def apply(self, model: nn.Module, *, mesh: DeviceMesh | None = None) -> nn.Module:
        """Shard ``model`` in place, blocks first and the root last, and return it.

        ``mesh``: a DeviceMesh of ``mesh_shape`` (by default one over the default process group, on the device
        the model's parameters are on; 2-D for HSDP). Make the optimizer after this, over ``model.parameters()``.
        """
        if mesh is None:
            _group_for(self.world_size)
            first = next(model.parameters(), None)
            device_type = first.device.type if first is not None and first.device.type != "meta" else "cpu"
            mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        elif tuple(mesh.shape) != self.mesh_shape:
            raise ValueError(f"the mesh has shape {tuple(mesh.shape)} but the spec needs {self.mesh_shape} "
                             f"(world_size={self.world_size}, replicate={self.replicate})")
        settings = self.settings(mesh)

        def shard(module: nn.Module, **overrides: Any) -> Any:
            return fully_shard(module, **{**settings, **overrides})

        (self.wrap or shard_blocks)(model, shard)
        if self.shard_root and not isinstance(model, FSDPModule):
            shard(model, reshard_after_forward=None)  # FSDP2's rule for a root: kept, backward needs it first
        return model


Parallel = DDP | FSDP


def shard_blocks(model: nn.Module, shard: Shard) -> None:
    """FSDP's default wrapping (see the module's doc): ``shard`` each block, in the order they are found."""
    for block in blocks(model):
        shard(block)


def _as_laid_out(layout: ShardedLayout, model: nn.Module, shard: Shard) -> None:
    """Shard ``model`` (a plain copy of a sharded one) as ``layout`` says, module by module."""
    for module in layout.modules:
        shard(model.get_submodule(module.path), reshard_after_forward=module.reshard_after_forward,
              mp_policy=module.mp_policy, offload_policy=module.offload_policy)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the outermost ModuleList and Sequential containers that hold parameters; without such
    containers, the top-level children that do."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            found.extend(child for child in module.children() if _holds_parameters(child))
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found or [child for child in model.children() if _holds_parameters(child)]


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def describe(spec: Parallel) -> str:
    """One line for notes and titles: 'rank 0 of FSDP2 over 8 ranks (reshard after forward)'."""
    if isinstance(spec, DDP):
        hook = f", {spec.comm_hook} comm hook" if spec.comm_hook is not None else ""
        return f"rank {spec.rank} of DDP over {spec.world_size} ranks ({spec.bucket_cap_mb:g} MiB buckets{hook})"
    if isinstance(spec.reshard_after_forward, bool):
        reshard = "reshard after forward" if spec.reshard_after_forward else "no reshard after forward"
    else:
        reshard = f"reshard onto {spec.reshard_after_forward} ranks after forward"
    dtype = spec.mp_policy.param_dtype if spec.mp_policy is not None else None
    gathered = f", parameters gathered in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
    gathered += ", parameters offloaded to the host" if spec.offload_params else ""
    if spec.replicate > 1:
        shard = spec.world_size // spec.replicate
        return (f"rank {spec.rank} of HSDP over {spec.world_size} ranks ({spec.replicate} replicas x {shard} "
                f"shards, {reshard}{gathered})")
    return f"rank {spec.rank} of FSDP2 over {spec.world_size} ranks ({reshard}{gathered})"


def check_spec(parallel: Any) -> Parallel:
    """``parallel`` itself when it is a DDP or FSDP spec; a clear error otherwise."""
    if not isinstance(parallel, (DDP, FSDP)):
        raise TypeError(f"parallel is ul.DDP(world_size, ...) or ul.FSDP(world_size, ...), got "
                        f"{type(parallel).__name__}")
    return parallel


"""How a model was sharded with ``fully_shard`` (FSDP2): which modules, with what settings, over what mesh.

A trainer's callback meets a model its strategy has sharded already (Lightning's ``configure_model``, an
accelerate FSDP2 plugin). ``ul.FSDP.of(model, ...)`` makes the spec that shards a plain copy of it the same way,
from what ``sharded_layout`` reads here: FSDP2's own state on each sharded module (as PyTorch's FSDPMemTracker
reads it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard


@dataclass(frozen=True)
class ShardedModule:
    """One ``fully_shard`` call: the module's path in the model ('' for the model itself) and its settings."""

    path: str
    reshard_after_forward: bool | int | None  # None: FSDP2's own rule (kept by a root, resharded otherwise)
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


@dataclass(frozen=True)
class ShardedLayout:
    """The ``fully_shard`` calls that made a model what it is, children before their parents."""

    modules: tuple[ShardedModule, ...]
    mesh_shape: tuple[int, ...]  # (ranks,) or, for HSDP, (replicas, ranks per replica)
    mesh_dim_names: tuple[str, ...] | None


def sharded_layout(model: nn.Module) -> ShardedLayout:
    """The layout of ``model``'s FSDP2 sharding; a clear error for one a spec cannot reproduce."""
    found = []
    meshes = set()
    for path, module in _children_first(model):
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if len(state._modules) != 1:
            raise ValueError(f"{path or 'the model'} was sharded together with other modules (fully_shard of a "
                             "list), which a plan cannot reproduce: shard each module on its own")
        group = _param_group(state)
        if group is None:  # a module whose parameters its children hold: sharded with its own settings
            found.append(ShardedModule(path, _own_reshard(state, None), state._mp_policy, OffloadPolicy()))
            continue
        _check_placements(path, group)
        meshes.add(group.mesh_info.mesh)
        found.append(ShardedModule(path, _own_reshard(state, group), group.mp_policy, group.offload_policy))
    if not found:
        raise ValueError("the model has no module that fully_shard was applied to")
    if not meshes:
        raise ValueError("no module fully_shard was applied to holds parameters of its own: there is nothing sharded "
                         "for a plan to reproduce; trace the model without ul.FSDP.of")
    if len(meshes) > 1:
        raise ValueError("the model's modules are sharded over different meshes, which a plan cannot reproduce: "
                         "shard them over one mesh")
    mesh = meshes.pop()
    return ShardedLayout(tuple(found), tuple(mesh.shape), mesh.mesh_dim_names if mesh.ndim > 1 else None)


def offloads(layout: ShardedLayout) -> bool:
    return any(isinstance(module.offload_policy, CPUOffloadPolicy) for module in layout.modules)


def _children_first(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in model.named_children():
        yield from _children_first(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), model


def _param_groups(state: Any) -> list[Any]:
    """A sharded module's FSDP2 parameter groups: a list on newer torch; one group or none on 2.11 (as
    ``analysis/_sharded.fsdp_params`` reads them, which does not import FSDP2 before a model is sharded)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        return [group for group in (state._fsdp_param_group,) if group is not None]
    return list(groups)


def _param_group(state: Any) -> Any:
    groups = _param_groups(state)
    if len(groups) > 1:
        raise ValueError("a module's parameters are sharded in several groups, which a plan cannot reproduce")
    return groups[0] if groups else None


def _own_reshard(state: Any, group: Any) -> bool | int | None:
    if state._auto_reshard_after_forward:
        return None
    if group is None or group.post_forward_mesh_info is None:
        return False
    size = group.post_forward_mesh_info.shard_mesh_size
    return True if size == group.mesh_info.shard_mesh_size else size


def _check_placements(path: str, group: Any) -> None:
    for param in group.fsdp_params:
        placement = getattr(param, "fsdp_placement", Shard(0))
        if placement != Shard(0):
            raise ValueError(f"{param._param_fqn} in {path or 'the model'} is sharded as {placement}, not on its "
                             "first dimension: a plan reproduces fully_shard's default placement only")


def gather_once(model: nn.Module) -> None:
    """Make FSDP2's lazy state before the first step (NOTE [trainer steps] 7): each sharded module is gathered and
    resharded once, outside the step, so that its first step runs the ops of every later one. A collective on
    every rank: call it on all, at the same point."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()

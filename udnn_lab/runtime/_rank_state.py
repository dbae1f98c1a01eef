"""The optimizer state a run over ranks starts from, and the state rank 0 hands back when it ends: the whole
model's and its optimizer's, as one process would hold them after training on the whole batches.

A rank's optimizer is the user's class over the wrapped model's parameters, group by group in the user's order
(training_ranks._train_rank), so the i-th parameter of its groups is the i-th of the user's optimizer. The state
goes both ways in ``torch.optim.Optimizer.state_dict``'s own form, keyed by those positions: every rank starts
from the user's optimizer's state (FSDP2 keeps its shard of each tensor), and at the end rank 0 writes it back
for the user's optimizer to load (``load_state_dict``, which puts each tensor on its parameter's device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from udnn_lab.parallel import DDP, Parallel

_GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's host only


def full_model_state(wrapped: torch.nn.Module, inner: torch.nn.Module, spec: Parallel) -> dict[str, Any]:
    """The whole model's state on the host, as rank 0 holds it (FSDP2 gathers it: every rank takes part)."""
    if isinstance(spec, DDP):
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()}
    return get_model_state_dict(wrapped, options=_GATHERED)


def full_optimizer_state(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: Parallel,
                         names: list[str]) -> dict[str, Any]:
    """``optimizer``'s state on the host in ``state_dict`` form, whole tensors, as rank 0 holds it (under FSDP2
    every rank takes part in the gather). ``names``: the parameters' names in the order of its groups."""
    if isinstance(spec, DDP) or not optimizer.state:  # a DDP rank holds it all; no step taken: nothing to gather
        return _on_host(optimizer.state_dict())
    # FSDP2: gathered from the shards, keyed by parameter name; then by position, as state_dict keys it
    full: dict[str, Any] = dict(get_optimizer_state_dict(wrapped, optimizer, options=_GATHERED))
    position = {name: index for index, name in enumerate(names)}
    return {"state": {position[name]: state for name, state in full.get("state", {}).items()},
            "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                             for group in full.get("param_groups", [])]}


def load_optimizer_state(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any],
                         spec: Parallel, names: list[str]) -> None:
    """Start a rank's ``optimizer`` from ``state_dict`` (the user's optimizer's, whole tensors): under FSDP2 each
    rank keeps its shards. ``names``: the parameters' names in the order of its groups."""
    if not state_dict["state"]:
        return  # a fresh optimizer: its first step makes the state
    if isinstance(spec, DDP):
        optimizer.load_state_dict(state_dict)
        return
    by_name: dict[str, Any] = {"state": {names[index]: state for index, state in state_dict["state"].items()},
                               "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                                                for group in state_dict["param_groups"]]}
    set_optimizer_state_dict(wrapped, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _on_host(state_dict: dict[str, Any]) -> dict[str, Any]:
    state = {index: {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value
                     for key, value in entry.items()}
             for index, entry in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]}

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.parallel import DDP, FSDP, blocks, check_spec, describe

from .spawned_ranks import spawned


@pytest.mark.parametrize("world_size", [0, -2, 2.0, True, "8", None])
def test_a_world_size_that_is_not_a_positive_int_is_refused_saying_what_it_counts(world_size):
    for spec in (DDP, FSDP):
        with pytest.raises(ValueError, match="world_size counts the ranks"):
            spec(world_size)


@pytest.mark.parametrize("rank", [-1, 4, 1.0, False])
def test_a_rank_outside_the_world_is_refused(rank):
    with pytest.raises(ValueError, match="0 to world_size - 1 = 3"):
        FSDP(4, rank=rank)
    assert FSDP(4, rank=3).rank == 3


def test_bad_settings_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(2, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="gradient_as_bucket_view is True or False"):
        DDP(2, gradient_as_bucket_view=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"comm_hook names one of PyTorch's default.*'fp16_compress'"):
        DDP(2, comm_hook="powersgd")
    with pytest.raises(ValueError, match="reshard_after_forward"):
        FSDP(2, reshard_after_forward=0)
    with pytest.raises(ValueError, match="MixedPrecisionPolicy"):
        FSDP(2, mp_policy=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offload_params"):
        FSDP(2, offload_params="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"wrap\(model, shard\)"):
        FSDP(2, wrap="layers")  # type: ignore[arg-type]
    for replicate in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="replicate is how many groups"):
            FSDP(8, replicate=replicate)  # type: ignore[arg-type]


def test_specs_are_frozen_and_public_and_say_what_they_are():
    spec = ul.FSDP(8, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(AttributeError):
        spec.world_size = 4  # type: ignore[misc]
    assert ul.DDP is DDP and ul.FSDP is FSDP
    assert describe(spec) == "rank 0 of FSDP2 over 8 ranks (reshard after forward, parameters gathered in bfloat16)"
    assert describe(DDP(4, rank=2)) == "rank 2 of DDP over 4 ranks (25 MiB buckets)"
    assert describe(FSDP(8, offload_params=True)) == \
        "rank 0 of FSDP2 over 8 ranks (reshard after forward, parameters offloaded to the host)"
    hsdp = FSDP(64, replicate=8)
    assert hsdp.mesh_shape == (8, 8) and hsdp.mesh_dim_names == ("replicate", "shard") and spec.mesh_shape == (8,)
    assert describe(hsdp) == "rank 0 of HSDP over 64 ranks (8 replicas x 8 shards, reshard after forward)"
    assert check_spec(spec) is spec
    with pytest.raises(TypeError, match=r"ul.DDP\(world_size, ...\) or ul.FSDP"):
        check_spec("fsdp")


def _paths(model: nn.Module) -> list[str]:
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(m)] for m in blocks(model)]


def test_fsdp_blocks_are_the_children_of_the_outermost_containers_that_hold_parameters():
    assert _paths(zoo.get("mlp3").model) == ["net.0", "net.2", "net.4"]  # the ReLUs hold none
    assert _paths(zoo.get("resnet20").model) == [f"layer{s}.{b}" for s in (1, 2, 3) for b in (0, 1)]
    gpt2 = zoo.get("hf:gpt2", small=True, batch=1, seq_len=8).model
    assert _paths(gpt2) == ["transformer.h.0", "transformer.h.1"]
    assert _paths(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == ["0", "2"]


def test_a_model_without_containers_has_its_top_level_children_as_blocks():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.act, self.head = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

    assert _paths(TwoHeads()) == ["body", "head"]


def test_apply_needs_the_process_group_of_a_real_run_and_says_so():
    with pytest.raises(RuntimeError, match="initialize the process group first"):
        FSDP(2).apply(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"ul.trace\(..., parallel=spec\)"):
        DDP(2).apply(nn.Linear(2, 2))


def _comm_hooks_read_back(rank: int, store: str, out: str) -> None:
    """One rank: DDP.of a wrapper with each kind of hook, written to ``out`` (a spec's repr or the error)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1)
    found = []
    try:
        for name, hook, state in (("none", None, None), ("fp16", default_hooks.fp16_compress_hook, None),
                                  ("bf16 on its group", default_hooks.bf16_compress_hook, dist.group.WORLD),
                                  ("powersgd", powerSGD_hook.powerSGD_hook,
                                   powerSGD_hook.PowerSGDState(process_group=None))):
            wrapper = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
            if hook is not None:
                wrapper.register_comm_hook(state, hook)
            try:
                found.append(f"{name}: {DDP.of(wrapper, 1, 0).comm_hook}")
            except ValueError as err:
                found.append(f"{name}: {err}")
    finally:
        dist.destroy_process_group()
    Path(out).write_text("\n".join(found))


def test_a_running_job_s_comm_hook_is_read_back_and_one_a_plan_cannot_reproduce_is_refused(tmp_path):
    spawned(_comm_hooks_read_back, (str(tmp_path / "store"), str(tmp_path / "found.txt")), 1)
    found = (tmp_path / "found.txt").read_text().splitlines()
    assert found[:3] == ["none: None", "fp16: fp16_compress", "bf16 on its group: bf16_compress"]
    assert found[3].startswith("powersgd: this DistributedDataParallel has the communication hook 'powerSGD_hook'")
    assert "register one of those, or train without the plan" in found[3]
    assert describe(DDP(2, comm_hook="fp16_compress")) == \
        "rank 0 of DDP over 2 ranks (25 MiB buckets, fp16_compress comm hook)"

"""ul.FSDP.of: a model a job sharded with fully_shard is traced as the same rank of the same sharding.

FSDP2's own state is read here, so these run on the oldest torch too (compat).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

import udnn_lab as ul
from udnn_lab.analysis._fake.tensors import meta_replica
from udnn_lab.analysis._fake_group import fake_process_group
from udnn_lab.sharded_model import sharded_layout

pytestmark = pytest.mark.compat
FEATURES = 32
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)

    def block():
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 2 * FEATURES), torch.nn.GELU(),
                                   torch.nn.Linear(2 * FEATURES, FEATURES))

    return torch.nn.Sequential(block(), block(), block(), torch.nn.Linear(FEATURES, 10))


def _workload(model: torch.nn.Module) -> ul.Workload:
    generator = torch.Generator().manual_seed(0)
    return ul.Workload(model=model, example_input=torch.randn(16, FEATURES, generator=generator),
                       target=torch.randint(0, 10, (16,), generator=generator),
                       loss_fn=torch.nn.functional.cross_entropy,
                       optimizer=torch.optim.AdamW(model.parameters()), name="blocks")


def _the_job_s_sharding(model, shard):
    """What a job's own code might do: blocks at fully_shard's defaults, the second in bf16, the head kept."""
    shard(model[0], reshard_after_forward=None)
    shard(model[1], reshard_after_forward=None, mp_policy=BF16)
    shard(model[2], reshard_after_forward=None)
    shard(model[3], reshard_after_forward=False)


def _sharded_in_a_job(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (2,))
    _the_job_s_sharding(model, lambda module, **settings: fully_shard(module, mesh=mesh, **settings))
    return model


def test_a_sharded_model_is_traced_as_the_plain_model_sharded_the_same_way():
    plain = ul.trace(_workload(_model()), parallel=ul.FSDP(2, wrap=_the_job_s_sharding, shard_root=False))
    with fake_process_group(2):  # the job's process group
        model = _sharded_in_a_job(_model())
        spec = ul.FSDP.of(model, rank=0)
        traced = ul.trace(_workload(model), parallel=spec)
        assert ul.trace(_workload(model)).fingerprint == traced.fingerprint  # in a job: this rank, unasked
        assert isinstance(model[1], FSDPModule) and type(model[1][0].weight).__name__ == "DTensor"  # still the job's
    assert traced.fingerprint == plain.fingerprint and traced.peak_bytes == plain.peak_bytes
    assert (spec.world_size, spec.rank, spec.replicate, spec.shard_root) == (2, 0, 1, False)
    with pytest.raises(ValueError, match="sharded with fully_shard but this process has no process group"):
        ul.trace(_workload(model))  # the job is over: no rank to trace
    layout = sharded_layout(model)
    assert [(m.path, m.reshard_after_forward) for m in layout.modules] == [("0", None), ("1", None), ("2", None),
                                                                          ("3", False)]
    assert layout.modules[1].mp_policy == BF16 and layout.mesh_shape == (2,)


def test_the_plain_copy_has_the_model_s_classes_hooks_and_whole_shapes_and_leaves_the_model_as_it_was():
    seen = []
    with fake_process_group(2):
        model = _sharded_in_a_job(_model())
        model[0][1].register_forward_hook(lambda module, args, output: seen.append(output.shape))  # the user's own
        hooks_before = {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()}
        plain = meta_replica(model)
        assert {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()} == hooks_before
    assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    assert [type(m) for m in plain.modules()] == [type(m) for m in _model().modules()]
    assert all(not hooks for m in plain.modules() for hooks in (m._forward_pre_hooks, m._state_dict_pre_hooks,
                                                                m._load_state_dict_post_hooks))
    assert len(plain[0][1]._forward_hooks) == 1  # the user's hook is kept, FSDP's are not
    assert {n: p.shape for n, p in plain.named_parameters()} == {n: p.shape for n, p in _model().named_parameters()}
    assert all(p.device.type == "meta" and type(p) is torch.nn.Parameter for p in plain.parameters())
    copy.deepcopy(plain)  # a plain module again


def test_what_a_spec_cannot_reproduce_is_refused_in_one_line():
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        together = _model()
        fully_shard([together[0], together[1]], mesh=mesh)
        other_placement = _model()
        fully_shard(other_placement[0], mesh=mesh, shard_placement_fn=lambda param: Shard(param.ndim - 1))
        plain = _model()
        without_parameters = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.GELU())
        fully_shard(without_parameters, mesh=mesh)
        cases = [(together, "sharded together with other modules"), (other_placement, "not on its first dimension"),
                 (plain, "no module that fully_shard was applied to"), (without_parameters, "holds parameters")]
        for model, message in cases:
            with pytest.raises(ValueError, match=message) as error:
                ul.FSDP.of(model, rank=0)
            assert "\n" not in str(error.value)
    assert not dist.is_initialized()

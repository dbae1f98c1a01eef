import pytest

import udnn_lab as ul
from udnn_lab import zoo

CASES = [("resnet18", {"image_size": 32}), ("densenet121", {"image_size": 32}), ("googlenet", {"image_size": 64}),
         ("lstm", {}), ("transformer", {"input_shape": (16,)}), ("mlp4", {}), ("vgg11", {"image_size": 32})]


def _summary(graph):
    return ([(op.name, op.phase, op.module, op.inputs, op.outputs, op.allocated, op.released, op.output_shapes,
              op.flops) for op in graph.ops],
            [(t.nbytes, t.dtype, t.shape, t.category, t.alloc_step, t.free_step, t.saved) for t in graph.tensors])


@pytest.mark.parametrize("name, options", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fast_paths_give_fake_modes_own_answers(name, options, optimizer):
    work = zoo.get(name, batch=2, device="meta", optimizer=optimizer, **options)
    fast, slow = ul.trace(work), ul.trace(work, fast_paths=False)
    assert _summary(fast) == _summary(slow)

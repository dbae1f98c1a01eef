import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.errors import FakeTensorUnsupported, ModelInputError


class Skip(nn.Module):
    """h is read by b and, later, by the residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(self.b(h)) + h


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.fc(x.view(x.shape[0], -1)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum() + y.sum()


def _ops(graph, name):
    return [op for op in graph.ops if op.name == name]


@pytest.mark.compat
def test_phases_come_in_order_and_modules_are_named():
    work = zoo.get("mlp3", batch=4)
    graph = ul.trace(work)
    phases = [op.phase for op in graph.ops]
    assert phases == sorted(phases, key=("forward", "backward", "optimizer").index)
    assert {op.module for op in graph.ops if op.phase == "forward"} >= {"net.0", "net.2", "net.4", "<loss>"}
    assert all(op.module == "<optimizer>" for op in graph.ops if op.phase == "optimizer")


def test_backward_ops_point_at_their_forward_op_and_module():
    graph = ul.trace(zoo.get("resnet18", batch=2, image_size=32, device="meta"))
    for op in _ops(graph, "aten.convolution_backward.default"):
        forward = graph.ops[op.forward_op]
        assert forward.name == "aten.convolution.default" and forward.module == op.module
    assert {op.module for op in _ops(graph, "aten.convolution_backward.default")} >= {"conv1", "layer4.1.conv2"}


def test_true_last_use_of_a_tensor_read_by_a_later_layer():
    graph = ul.trace(Skip(), torch.randn(4, 8))
    relu = _ops(graph, "aten.relu.default")[0]
    h = graph.tensors[relu.outputs[0]]
    add = [op for op in graph.ops if op.phase == "forward" and op.name == "aten.add.Tensor" and h.id in op.inputs]
    assert len(add) == 1
    assert h.last_forward_use == add[0].index
    assert h.saved and h.category == "feature_map"
    assert h.first_backward_use is not None and h.last_use > add[0].index


def test_resnet_shortcut_input_lives_until_the_block_add():
    graph = ul.trace(zoo.get("resnet18", batch=2, image_size=32, device="meta"))
    block_add = [op for op in graph.ops if op.phase == "forward" and op.module == "layer1.0"
                 and op.name.startswith("aten.add")][0]
    conv1 = [op for op in graph.ops if op.phase == "forward" and op.module == "layer1.0.conv1"][0]
    shortcut = graph.tensors[conv1.inputs[0]]  # the block's input feeds conv1 and the add
    assert shortcut.id in block_add.inputs
    assert shortcut.last_forward_use >= block_add.index > conv1.index


def test_densenet_features_are_read_by_every_later_concatenation_of_their_block():
    graph = ul.trace(zoo.get("densenet121", batch=2, image_size=32, device="meta"))
    new_features = [op for op in graph.ops if op.phase == "forward"
                    and op.module == "features.denseblock1.denselayer1.conv2"][0]
    features = graph.tensors[new_features.outputs[0]]
    readers = {graph.ops[i].module for i in features.consumers if graph.ops[i].phase == "forward"}
    assert "features.denseblock1.denselayer6" in readers  # the block's last layer concatenates it
    last = graph.ops[features.last_forward_use]
    assert (last.module, last.name) == ("features.denseblock1", "aten.cat.default")  # the block's own output


def test_inception_branches_all_read_the_block_input():
    graph = ul.trace(zoo.get("googlenet", batch=2, image_size=64, device="meta"))
    first = {}
    for op in graph.ops:
        if op.phase == "forward" and op.module.startswith("inception3a.branch") and op.module.endswith(".conv"):
            first.setdefault(op.module.split(".")[1], op)
    assert set(first) == {"branch1", "branch2", "branch3", "branch4"} - {"branch4"} or len(first) >= 3
    block_input = graph.tensors[first["branch1"].inputs[0]]
    readers = {graph.ops[i].module.split(".")[1] for i in block_input.consumers
               if graph.ops[i].module.startswith("inception3a.")}
    assert readers == {"branch1", "branch2", "branch3", "branch4"}


def test_views_and_inplace_ops_alias_and_add_no_bytes():
    graph = ul.trace(Views(), torch.randn(2, 3, 4))
    view = _ops(graph, "aten.view.default")[0]
    assert view.allocated == () and view.outputs == view.inputs[:1]
    relu = _ops(graph, "aten.relu_.default")[0]
    assert relu.allocated == () and relu.outputs[0] in relu.inputs


def test_categories_add_up_for_sgd_with_momentum():
    work = zoo.get("resnet18", batch=2, image_size=32, device="meta")
    graph = ul.trace(work)
    param_bytes = sum(p.numel() * p.element_size() for p in work.model.parameters())
    by_category = {}
    for t in graph.tensors:
        by_category[t.category] = by_category.get(t.category, 0) + t.nbytes
    assert by_category["parameter"] == param_bytes
    assert by_category["optimizer_state"] == param_bytes  # one momentum buffer per parameter
    assert by_category["parameter_gradient"] == param_bytes
    assert by_category["input"] == 2 * 3 * 32 * 32 * 4 + 2 * 8
    final = graph.memory_curve().iloc[-1]
    assert final["parameter_gradient"] == param_bytes and final["feature_map"] == 0


def test_adam_state_is_counted_before_the_step():
    work = zoo.get("mlp3", batch=4, optimizer="adam")
    graph = ul.trace(work)
    param_bytes = sum(p.numel() * p.element_size() for p in work.model.parameters())
    first = graph.memory_curve().iloc[0]
    # exp_avg and exp_avg_sq per parameter, plus the float32 step counters
    assert first["optimizer_state"] == 2 * param_bytes + 4 * len(list(work.model.parameters()))


def test_without_optimizer_there_is_no_optimizer_phase():
    graph = ul.trace(zoo.get("mlp3", batch=4, optimizer=None))
    assert {op.phase for op in graph.ops} == {"forward", "backward"}


def test_the_users_model_and_optimizer_are_untouched():
    work = zoo.get("mlp3", batch=4)
    before = {k: v.clone() for k, v in work.model.state_dict().items()}
    ul.trace(work)
    for key, value in work.model.state_dict().items():
        assert torch.equal(value, before[key]) and not isinstance(value, torch._subclasses.FakeTensor)
    assert all(p.grad is None for p in work.model.parameters())
    assert len(work.optimizer.state) == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in work.model.modules())
    assert torch._C._len_torch_dispatch_stack() == 0


def test_tracing_is_deterministic():
    work = zoo.get("resnet18", batch=2, image_size=32, device="meta")
    a, b = ul.trace(work), ul.trace(work)
    assert [op.name for op in a.ops] == [op.name for op in b.ops]
    assert a.memory_curve()["live_bytes"].tolist() == b.memory_curve()["live_bytes"].tolist()


@pytest.mark.compat
def test_fake_and_real_traces_agree():
    work = zoo.get("mlp4", batch=4)
    fake, real = ul.trace(work), ul.trace(work, fake=False)
    assert not real.fake and fake.fake
    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    assert fake.memory_curve()["live_bytes"].tolist() == real.memory_curve()["live_bytes"].tolist()


def test_a_cuda_step_can_be_predicted_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the substitution does not happen")
    graph = ul.trace(zoo.get("mlp3", batch=4, device="meta"), device="cuda")
    assert graph.device == "cuda" and graph.notes
    assert all(t.device == "cuda" for t in graph.tensors)
    assert any(op.name.startswith("aten._foreach") for op in graph.ops if op.phase == "optimizer")
    assert graph.cuda_peak_bytes >= graph.peak_bytes


def test_host_side_step_counters_stay_off_the_predicted_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the substitution does not happen")
    graph = ul.trace(zoo.get("mlp3", batch=4, optimizer="adam", device="meta"), device="cuda")
    host = [t for t in graph.tensors if t.device == "cpu"]
    assert sum(t.name.endswith(".step") for t in host) == 6  # one per parameter
    assert all(t.shape == () for t in host)  # host-side scalars only


def test_dict_and_tuple_inputs_and_custom_losses():
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, a, b):
            return self.fc(a + b)

    model, a, b = TwoInputs(), torch.randn(3, 4), torch.randn(3, 4)
    by_tuple = ul.trace(model, (a, b), loss_fn=lambda out: out.pow(2).mean())
    by_dict = ul.trace(model, {"a": a, "b": b}, loss_fn=lambda out: out.pow(2).mean())
    assert [op.name for op in by_tuple.ops] == [op.name for op in by_dict.ops]
    assert sum(t.category == "input" for t in by_tuple.tensors) == 2


def test_tied_weights_are_one_storage():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, tokens):
            return self.out(self.embed(tokens))

    graph = ul.trace(Tied(), torch.randint(10, (2, 3)))
    params = [t for t in graph.tensors if t.category == "parameter"]
    assert len(params) == 1 and params[0].nbytes == 10 * 4 * 4


def test_not_a_module_is_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        ul.trace(lambda x: x, torch.randn(2))
    with pytest.raises(TypeError, match="zoo.get"):
        ul.trace("resnet50", torch.randn(2))
    with pytest.raises(TypeError, match="example input"):
        ul.trace(nn.Linear(2, 2))


def test_an_input_that_does_not_fit_names_the_module_and_shapes():
    model = zoo.get("mlp3", batch=2).model
    with pytest.raises(ModelInputError) as info:
        ul.trace(model, torch.randn(2, 100))
    text = str(info.value)
    assert "'net.0'" in text and "Linear" in text and "(2, 100)" in text
    ul.trace(model, torch.randn(2, 784))  # the model still works afterwards
    assert all(not m._forward_pre_hooks for m in model.modules())


class _TakesKeywords(nn.Module):
    """Calls its layer with keyword arguments alone, as transformers' decoders call their attention."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = _KeywordLayer()

    def forward(self, x):
        return self.layer(hidden=x, scale=torch.ones(3))


class _KeywordLayer(nn.Module):
    def forward(self, hidden, scale):
        return hidden * scale


def test_an_input_that_does_not_fit_a_module_called_with_keywords_names_their_shapes():
    with pytest.raises(ModelInputError, match=r"'layer' \(_KeywordLayer\) got input shapes \[\(2, 4\), \(3,\)\]"):
        ul.trace(_TakesKeywords(), torch.randn(2, 4))


def test_data_dependent_ops_ask_for_a_real_small_batch_which_then_works():
    model = DataDependent()
    with pytest.raises(FakeTensorUnsupported, match="nonzero.*fake=False"):
        ul.trace(model, torch.randn(3, 4))
    graph = ul.trace(model, torch.randn(3, 4), fake=False)
    assert any(op.name == "aten.index.Tensor" for op in graph.ops)
    assert all(p.grad is None for p in model.parameters())


def test_bad_losses_are_explained():
    with pytest.raises(ValueError, match="scalar"):
        ul.trace(nn.Linear(3, 2), torch.randn(4, 3), loss_fn=lambda out: out)
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires grad"):
        ul.trace(frozen, torch.randn(4, 3))


def test_graph_lookups_and_repr():
    graph = ul.trace(zoo.get("mlp3", batch=4))
    assert graph.tensor("net.0.weight").category == "parameter"
    assert graph.tensor("input").category == "input"
    assert graph.tensor(0) is graph.tensors[0]
    with pytest.raises(KeyError, match="no tensor named"):
        graph.tensor("nope")
    assert "mlp3" in repr(graph) and "peak=" in repr(graph)
    frame = graph.tensors_frame()
    assert len(frame) == len(graph.tensors) and {"name", "category", "last_use"} <= set(frame.columns)

import sys

import pytest
import torch
from torch import nn

from udnn_lab import zoo
from udnn_lab.errors import MissingDependency, ModelFactoryError, UnknownModelError
from udnn_lab.workload import Workload

ALL_FIXED = ["alexnet", "vgg11", "vgg16", "vgg19", "googlenet", "inception_v3", "resnet18", "resnet34", "resnet50",
             "resnet101", "resnet152", "densenet121", "densenet201", "lstm", "transformer"]


@pytest.mark.parametrize("name", ALL_FIXED + ["resnet1001", "resnet164", "mlp5", "mlp50"])
def test_every_entry_builds_on_meta_with_a_batch(name):
    work = zoo.get(name, batch=3, device="meta")
    assert isinstance(work, Workload) and isinstance(work.model, nn.Module)
    assert work.example_input.shape[0] == 3 and work.target.shape == (3,)
    assert all(p.device.type == "meta" for p in work.model.parameters())
    assert work.batch_size == 3 and work.name


def test_names_are_forgiving_about_case_and_separators():
    assert zoo.entry("ResNet-50").name == "resnet50"
    assert zoo.entry("inception-v3").name == "inception_v3"
    assert zoo.entry("Inception_V3").name == "inception_v3"
    assert zoo.entry("resnet-1001").name == "resnet1001"
    assert zoo.entry("fcn5").name == "mlp5"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownModelError) as info:
        zoo.get("resnet-9000x", batch=2)
    for name in ("alexnet", "densenet201", "resnet<depth>", "mlp<layers>"):
        assert name in str(info.value)


def test_synthetic_resnet_depth_must_be_9n_plus_2():
    with pytest.raises(ValueError, match="9n\\+2.*164"):
        zoo.get("resnet160", batch=2, device="meta")


def test_resnet1001_has_a_thousand_weighted_layers():
    model = zoo.get("resnet1001", batch=1, device="meta").model
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    # 333 blocks x 3 convs + stem + 3 projection shortcuts, plus the classifier
    assert convs == 333 * 3 + 1 + 3


def test_mlp_has_the_asked_number_of_linear_layers():
    model = zoo.get("mlp5", batch=2, device="meta").model
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 5


def test_image_size_and_input_shape_overrides():
    assert zoo.get("resnet18", batch=2, image_size=64, device="meta").example_input.shape == (2, 3, 64, 64)
    assert zoo.get("lstm", batch=2, input_shape=(10,), device="meta").example_input.shape == (2, 10)
    with pytest.raises(ValueError, match="tokens"):
        zoo.get("lstm", batch=2, image_size=64, device="meta")


def test_own_module_needs_an_input_shape():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="input_shape"):
        zoo.get(model, batch=2)
    work = zoo.get(model, batch=5, input_shape=(4,))
    assert work.model is model and work.example_input.shape == (5, 4)


def test_random_weights_are_reproducible_and_real_on_cpu():
    a = zoo.get("mlp2", batch=2, seed=3)
    b = zoo.get("mlp2", batch=2, seed=3)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert torch.equal(a.example_input, b.example_input)


def test_optimizer_choices():
    assert isinstance(zoo.get("mlp2", batch=2, optimizer="adam").optimizer, torch.optim.Adam)
    assert zoo.get("mlp2", batch=2, optimizer=None).optimizer is None
    with pytest.raises(ValueError, match="sgd"):
        zoo.get("mlp2", batch=2, optimizer="lion")


def test_every_optimizer_name_builds_what_it_says():
    built = {name: zoo.get("mlp2", batch=2, optimizer=name).optimizer for name in zoo.OPTIMIZERS}
    assert built["none"] is None
    assert isinstance(built["sgd"], torch.optim.SGD) and built["sgd"].defaults["momentum"] == 0.9
    assert isinstance(built["adafactor"], torch.optim.Adafactor)
    adamw = {name: built[name] for name in ("adamw", "adamw-foreach", "adamw-fused")}
    assert all(isinstance(o, torch.optim.AdamW) for o in adamw.values())
    assert [(o.defaults["foreach"], o.defaults["fused"]) for o in adamw.values()] == \
        [(None, None), (True, None), (None, True)]  # 'adamw' leaves the kernels to PyTorch


def test_precision_builds_the_weights_and_inputs_in_its_dtype():
    mixed = zoo.get("mlp2", batch=2, precision="bf16-mixed")
    assert mixed.precision == "bf16-mixed" and mixed.example_input.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    half = zoo.get("resnet20", batch=2, device="meta", precision="bf16-true")
    assert half.example_input.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in half.model.parameters())
    assert zoo.get("mlp2", batch=2, dtype=torch.float16).precision == "16-true"  # the older way to ask
    assert zoo.get("mlp2", batch=2).precision == "32-true"
    with pytest.raises(ValueError, match="give one of them"):
        zoo.get("mlp2", batch=2, dtype=torch.bfloat16, precision="bf16-mixed")
    with pytest.raises(ValueError, match=r"model\.to\(torch\.bfloat16\)"):  # your own module is never converted
        zoo.get(nn.Linear(4, 2), batch=2, input_shape=(4,), precision="bf16-true")
    own = zoo.get(nn.Linear(4, 2).to(torch.bfloat16), batch=2, input_shape=(4,))  # taken in its own dtype
    assert own.precision == "bf16-true" and own.example_input.dtype == torch.bfloat16


def test_bad_batch_is_refused():
    with pytest.raises(ValueError, match="batch"):
        zoo.get("mlp2", batch=0)


def test_missing_timm_is_reported_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(MissingDependency, match="pip install"):
        zoo.get("inception_v4", batch=2, device="meta")


def test_inception_v4_comes_from_timm_when_installed():
    pytest.importorskip("timm")
    work = zoo.get("inception_v4", batch=2, device="meta")
    assert work.example_input.shape == (2, 3, 299, 299)


def test_classification_loss_counts_aux_heads():
    logits = torch.zeros(2, 3)
    target = torch.tensor([0, 1])
    single = zoo.classification_loss(logits, target)
    with_aux = zoo.classification_loss((logits, logits), target)
    assert torch.allclose(with_aux, single * 1.3)


def test_a_factory_by_its_import_path_builds_your_module(tmp_path, monkeypatch):
    (tmp_path / "factories.py").write_text(
        "import torch\n\ndef two():\n    return torch.nn.Linear(3, 2)\n\n"
        "def broken():\n    raise OSError('no weights here')\n\nnot_a_model = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    work = zoo.get("factories:two", batch=4, input_shape=(3,), device="meta")
    assert isinstance(work.model, torch.nn.Linear) and work.example_input.shape == (4, 3)
    with pytest.raises(ModelFactoryError, match="factories:broken raised OSError: no weights here") as raised:
        zoo.get("factories:broken", input_shape=(3,))
    assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(ModelFactoryError, match="gave a int, not an nn.Module"):
        zoo.get("factories:not_a_model", input_shape=(3,))
    with pytest.raises(ModelFactoryError, match="cannot load the model factory factories:missing"):
        zoo.get("factories:missing", input_shape=(3,))


def test_get_leaves_the_callers_random_stream_as_it_was():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = zoo.get("mlp3", batch=2)
    assert torch.equal(torch.rand(3), expected)  # asking for a model did not reseed the global generator
    again = zoo.get("mlp3", batch=2)
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), again.model.parameters(), strict=True))

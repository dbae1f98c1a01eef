import torch

from udnn_lab import zoo


def test_a_workload_reads_as_a_short_summary_not_its_tensors():
    work = zoo.get("resnet18", batch=16)
    text = repr(work)
    assert text == ("Workload('resnet18': ResNet, input=float32[16, 3, 224, 224], target=int64[16], "
                    "loss=classification_loss, optimizer=SGD)")
    assert "tensor(" not in text and len(text) < 200


def test_the_summary_names_devices_and_what_holds_the_inputs():
    own = zoo.get(torch.nn.Linear(4, 2), batch=2, input_shape=(4,), optimizer=None)
    assert repr(own) == "Workload('Linear': Linear, input=float32[2, 4], loss=sum of outputs, optimizer=none)"
    on_meta = zoo.get("transformer", batch=2, device="meta")
    assert "input=int64[2, 128] on meta" in repr(on_meta)
    paired = zoo.get(torch.nn.Linear(4, 2), batch=2, input_shape=(4,))
    both = type(paired)(paired.model, {"x": torch.zeros(2, 4), "mask": (torch.ones(2, dtype=torch.bool),)})
    assert "input={x: float32[2, 4], mask: (bool[2])}" in repr(both)

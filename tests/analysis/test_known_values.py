"""A fake trace takes the path eager takes where the model decides on integer values (NOTE [known values])."""

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.errors import FakeTensorUnsupported
from udnn_lab.zoo import get as zoo_get


def _names(graph) -> list[str]:
    return [op.name for op in graph.ops]


@pytest.mark.parametrize("name", ["hf:gpt2", "hf:llama-3-8b"])
def test_a_hugging_face_decoder_without_its_cache_is_traced_as_it_runs(name):
    """Without a cache, transformers checks the position ids for packed sequences; for a fake tensor it used to
    skip the check and build a mask, ops the real step never runs, so plans from the trace stopped the real step."""
    torch.set_num_threads(1)
    work = zoo_get(name, optimizer="none", batch=1, small=True, seq_len=16, config_overrides={"use_cache": False})
    fake, real = ul.trace(work), ul.trace(work, fake=False)
    assert _names(fake) == _names(real)
    assert fake.fingerprint == real.fingerprint
    assert "aten._local_scalar_dense.default" in _names(fake)  # the check's read, answered as in eager


class _Branches(nn.Module):
    """Takes one of two paths by whether its integer input counts up by one (a packed-sequence check)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if bool((ids.diff(dim=-1) == 1).all()):
            return self.head(x).sum(dim=1)
        return self.head(x.relu() * 2).mean(dim=1)


@pytest.mark.parametrize("ids", [torch.arange(6).repeat(2, 1), torch.tensor([[3, 1, 4, 1, 5, 9]] * 2)],
                         ids=["counting", "not counting"])
def test_a_branch_on_the_inputs_values_is_the_one_eager_takes(ids):
    torch.manual_seed(0)
    model = _Branches()
    fake, real = ul.trace(model, ids), ul.trace(model, ids, fake=False)
    assert _names(fake) == _names(real)
    assert ("aten.relu.default" in _names(fake)) == (not bool((ids.diff(dim=-1) == 1).all()))


class _Overwritten(nn.Module):
    """Overwrites its integer input with values from a float tensor, then branches on them."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clone()
        ids.copy_(self.head.weight.detach().expand(2, 6).round())
        if bool((ids == 0).all()):
            return self.head(ids.float()).sum()
        return self.head(ids.float()).mean()


def test_values_written_from_what_is_not_known_are_not_known_any_more():
    """The copy's values come from a float tensor (never known): the branch cannot be answered, and the trace says
    so rather than taking the old values' path."""
    with pytest.raises(FakeTensorUnsupported, match="depends on tensor values"):
        ul.trace(_Overwritten(), torch.zeros(2, 6, dtype=torch.long))


class _Random(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((torch.randint(0, 2, (4,)) == 0).all()):
            return self.head(x).sum()
        return self.head(x).mean()


def test_a_random_integer_tensor_has_no_known_values():
    with pytest.raises(FakeTensorUnsupported, match="depends on tensor values"):
        ul.trace(_Random(), torch.randn(2, 4))


def test_transformers_fake_tensor_check_is_as_it_was_after_the_trace():
    import transformers.utils.import_utils as import_utils

    before = import_utils.is_fake_tensor
    ul.trace(zoo_get("hf:gpt2", optimizer="none", batch=1, small=True, seq_len=8))
    assert import_utils.is_fake_tensor is before



# what a rank's forward runs beyond one process's: collectives, FSDP's copies, and the views and splits around them
_AROUND = ("_c10d", "c10d", "fsdp", "aten.all_gather", "aten._foreach_copy", "aten.split", "aten.view", "aten.empty")


@pytest.mark.parametrize("parallel", [ul.DDP(2), ul.FSDP(2)], ids=["ddp", "fsdp"])
def test_one_rank_of_a_decoder_without_its_cache_runs_the_forward_of_one_process(parallel):
    torch.set_num_threads(1)
    work = zoo_get("hf:gpt2", optimizer="none", batch=1, small=True, seq_len=16, config_overrides={"use_cache": False})

    def forward(graph) -> list[str]:
        return [op.name for op in graph.ops if op.phase == "forward" and not op.name.startswith(_AROUND)]

    assert forward(ul.trace(work, parallel=parallel)) == forward(ul.trace(work))


class _PaddingCheck(nn.Module):
    """Branches on whether a padding token ends or starts the batch, as transformers' padding warning reads the
    input ids through an index it makes from a Python list (a real constant fake mode lifts into a fake)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if 0 in ids[:, [-1, 0]]:
            x = x.relu()
        return x.sum()


@pytest.mark.parametrize("ids", [torch.tensor([[0, 3, 4], [5, 6, 7]]), torch.tensor([[1, 3, 4], [5, 6, 7]])],
                         ids=["padded", "not padded"])
def test_a_check_through_an_index_made_from_a_list_is_answered_as_in_eager(ids):
    fake, real = ul.trace(_PaddingCheck(), ids), ul.trace(_PaddingCheck(), ids, fake=False)
    assert _names(fake) == _names(real)
    assert ("aten.relu.default" in _names(fake)) == bool((ids[:, [-1, 0]] == 0).any())


def test_a_hugging_face_encoder_with_a_pad_token_traces_under_fake_tensors():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=100, pad_token_id=0)
    model = transformers.DebertaV2ForMaskedLM(config)
    ids = torch.randint(1, 100, (2, 8))
    batch = {"input_ids": ids, "labels": ids.clone()}
    fake = ul.trace(model, batch, loss_fn=lambda out: out.loss)
    assert _names(fake) == _names(ul.trace(model, batch, loss_fn=lambda out: out.loss, fake=False))

"""HFPlanCallback: a Hugging Face Trainer's model trained under a plan gives eager's parameters, bit for bit."""

import tempfile

import pytest
import torch

import udnn_lab as ul

transformers = pytest.importorskip("transformers")
from udnn_lab.integrations import HFPlanCallback  # noqa: E402

CONFIG = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
torch.manual_seed(0)
WEIGHTS = transformers.GPT2LMHeadModel(CONFIG).state_dict()


class Tokens(torch.utils.data.Dataset):
    """Fixed-length sequences (a plan is for one step's shapes); the ``short_batch``-th batch read is shorter."""

    def __init__(self, count: int = 20, short_batch: int | None = None):
        self.count, self.short_batch, self.reads = count, short_batch, 0

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        short = self.reads // 4 == self.short_batch  # the Trainer reads 4 items a batch, in order
        self.reads += 1
        ids = torch.randint(0, 128, (16 if short else 32,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def _train(callbacks, dataset=None, model=None, steps=4, optimizers=(None, None), **options):
    model = model or transformers.GPT2LMHeadModel(CONFIG)
    model.load_state_dict(WEIGHTS)
    args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True, per_device_train_batch_size=4,
                                          max_steps=steps, report_to=[], logging_steps=2, save_strategy="no",
                                          disable_tqdm=True, **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset or Tokens(), callbacks=callbacks,
                                   optimizers=optimizers)
    trainer.train()
    return model, trainer


def _no_runtime_left():
    modules = torch.nn.modules.module
    return (not modules._global_forward_pre_hooks and not modules._global_forward_hooks
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


@pytest.mark.parametrize("options", [{}, {"gradient_accumulation_steps": 2}, {"bf16": True}],
                         ids=["32-true", "accumulation", "bf16-mixed"])
def test_parameters_equal_training_without_the_callback(options):
    callback = HFPlanCallback("3 MiB", policy="recompute")
    planned, trainer = _train([callback], **options)
    eager, _ = _train([], **options)
    assert callback.plan is not None and callback.plan.recomputes
    for ours, theirs in zip(planned.parameters(), eager.parameters()):
        assert torch.equal(ours, theirs)
    assert "training_step" not in vars(trainer) and _no_runtime_left()  # the Trainer as it was
    logged = [entry for entry in trainer.state.log_history if "udnn/predicted_peak_bytes" in entry]
    assert logged and logged[0]["step"] == 1  # the first planned step, then as the Trainer logs
    measured = [r for r in callback.reports if r.measured_peak_bytes is not None]
    assert len(measured) == 1 and measured[0].step > 0
    assert measured[0].measured_peak_bytes == pytest.approx(measured[0].predicted_peak_bytes, rel=0.01)


def test_a_step_of_other_shapes_runs_without_the_plan():
    callback = HFPlanCallback("3 MiB", policy="recompute")
    _train([callback], dataset=Tokens(short_batch=2), steps=5)
    rows = callback.frame()
    assert list(rows.planned) == [True, True, False, True, True]
    assert "pad batches" in rows.why_unplanned[2]


def test_an_error_in_a_step_lets_the_runtime_go():
    class Failing(transformers.GPT2LMHeadModel):
        calls = 0

        def forward(self, *args, **kwargs):
            Failing.calls += 1
            if Failing.calls == 3:
                raise RuntimeError("a failing batch")
            return super().forward(*args, **kwargs)

    callback = HFPlanCallback("3 MiB", policy="recompute")
    with pytest.raises(RuntimeError, match="a failing batch"):
        _train([callback], model=Failing(CONFIG), remove_unused_columns=False)
    assert _no_runtime_left() and "training_step" not in vars(callback.trainer)


def test_an_error_in_the_optimizer_step_lets_the_runtime_go():
    class Failing(torch.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            Failing.steps += 1
            if Failing.steps == 2:
                raise RuntimeError("out of memory in the optimizer step")
            return super().step(closure)

    callback = HFPlanCallback("3 MiB", policy="recompute")
    model = transformers.GPT2LMHeadModel(CONFIG)
    with pytest.raises(RuntimeError, match="optimizer step"):
        _train([callback], model=model, optimizers=(Failing(model.parameters()), None))
    assert _no_runtime_left() and not callback.steps.in_step  # the step was under the plan when it failed
    assert "step" not in vars(callback.trainer.optimizer) and "_clip_grad_norm" not in vars(callback.trainer)


def test_a_saved_plan_is_used(tmp_path):
    first = HFPlanCallback("3 MiB", policy="recompute")
    _train([first], steps=1)
    again = HFPlanCallback(plan=first.plan.save(tmp_path / "step.plan.json"))
    _train([again], steps=2)
    assert again.plan.recomputes == first.plan.recomputes and all(r.planned for r in again.reports)


def test_no_budget_and_no_plan_is_refused():
    with pytest.raises(ValueError, match="budget"):
        HFPlanCallback()


def test_the_summary_names_the_trainers_loss():
    callback = HFPlanCallback("3 MiB", policy="recompute")
    _, trainer = _train([callback], steps=1)
    assert isinstance(callback.steps.graph, ul.Graph) and callback.steps.graph.model_name == "GPT2LMHeadModel"


def test_a_window_that_reaches_the_loss_counts_the_accelerators_division():
    """Accelerate's backward divides the loss by its accumulation steps, by 1 too: a recording window that runs
    past the model's last module call meets that division (a ViT in bf16 under 'recompute' did)."""
    work = ul.zoo.get("hf:vit-b-16", small=True, batch=2)

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, index):
            return {key: value[0].clone() for key, value in work.example_input.items()}

    def trained(callback):
        model = type(work.model)(work.model.config)
        model.load_state_dict(work.model.state_dict())
        args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True, bf16=True,
                                              per_device_train_batch_size=2, max_steps=2, report_to=[],
                                              save_strategy="no", disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=Images(),
                             callbacks=[callback] if callback else []).train()
        return model

    probe = HFPlanCallback("1 GiB", policy="keep-all")
    trained(probe)
    graph = probe.steps.graph
    callback = HFPlanCallback((graph.peak_bytes + ul.min_budget(graph, "recompute")) // 2, policy="recompute")
    planned, eager = trained(callback), trained(None)
    assert callback.plan.recomputes and all(report.planned for report in callback.reports)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(planned.parameters(), eager.parameters()))


def _ddp_rank(rank: int, folder: str, port: int) -> None:
    """One of two Trainer processes over gloo, as torchrun starts them: the step under the callback, then without."""
    import os

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    callback = HFPlanCallback("4 MiB", policy="recompute", hardware="cpu-amd-epyc-2cpu")  # gloo's links
    options = dict(ddp_backend="gloo", gradient_accumulation_steps=2)  # find_unused_parameters, as by default
    planned, trainer = _train([callback], dataset=Tokens(count=32), **options)  # each rank: 2 steps of 2 an epoch
    eager, _ = _train([], dataset=Tokens(count=32), **options)
    measured = [r for r in callback.reports if r.measured_peak_bytes is not None]
    if rank == 0:
        torch.save({"planned": planned.state_dict(), "eager": eager.state_dict(), "reports": callback.frame(),
                    "recomputes": len(callback.plan.recomputes),
                    "measured": measured[0].measured_peak_bytes if measured else None,
                    "predicted": callback.steps.predicted_peak_bytes,
                    "find_unused": trainer.model_wrapped.find_unused_parameters}, f"{folder}/rank0.pt")


def test_a_ddp_rank_is_planned_and_trains_as_ddp_does_without_the_callback(tmp_path):
    """Each process traces its rank of the step (the Trainer's DDP, no_sync before the last micro-batch)."""
    import socket

    from ..spawned_ranks import spawned

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawned(_ddp_rank, (str(tmp_path), port), 2)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert all(torch.equal(result["planned"][name], result["eager"][name]) for name in result["eager"])
    assert result["recomputes"] > 0 and result["reports"].planned.all() and result["find_unused"]
    assert result["predicted"] <= ul.parse_bytes("4 MiB")
    assert result["measured"] == pytest.approx(result["predicted"], rel=0.01)


def test_a_model_accelerate_sharded_with_fsdp2_is_traced_as_this_process_s_rank_of_its_sharding():
    """accelerate runs FSDP on GPUs only, so the Trainer cannot shard on this CPU: the model is sharded here as its
    FSDP2 plugin shards it (each GPT2Block, then the root), inside a job's process group, and the callback's
    workload for that Trainer's arguments is checked to be this rank of that sharding."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from udnn_lab.analysis._fake_group import fake_process_group
    from udnn_lab.integrations._huggingface import _workload

    def trainer_args(world_size):
        args = SimpleNamespace(world_size=world_size, process_index=1, gradient_accumulation_steps=2,
                               max_grad_norm=1.0, bf16=False, fp16=False)
        return SimpleNamespace(args=args, optimizer=torch.optim.AdamW(model.parameters()))

    example = ({"input_ids": torch.zeros(4, 32, dtype=torch.long), "labels": torch.zeros(4, 32, dtype=torch.long)},)
    with fake_process_group(2, rank=1):
        model = transformers.GPT2LMHeadModel(CONFIG)
        mesh = init_device_mesh("cpu", (2,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        work = _workload(trainer_args(2), model, example)
        with pytest.raises(ValueError, match="sharded over 2 of the Trainer's 4 ranks"):
            _workload(trainer_args(4), model, example)
    spec = work.parallel
    assert isinstance(spec, ul.FSDP) and (spec.world_size, spec.rank) == (2, 1)
    assert work.model is model and work.grad_accumulation == 2 and work.clip_grad_norm == 1.0
    plain = transformers.GPT2LMHeadModel(CONFIG)  # the spec shards a plain copy as the plugin did
    shards = []
    spec.wrap(plain, lambda module, **settings: shards.append(module))
    assert shards == [*plain.transformer.h, plain]

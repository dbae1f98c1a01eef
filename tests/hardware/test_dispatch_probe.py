"""The probe of what a dispatch mode costs per op (hardware/_dispatch_probe.py)."""

import torch

import udnn_lab as ul
from udnn_lab.hardware import PassThroughMode
from udnn_lab.hardware._dispatch_probe import dispatch_mode_op_s


def test_the_pass_through_mode_counts_the_ops_a_trace_counts_and_changes_nothing():
    work = ul.zoo.get("mlp3", batch=4, optimizer="none")
    graph = ul.trace(work)
    x = work.example_input
    torch.manual_seed(0)
    expected = torch.autograd.grad(work.loss_fn(work.model(x), work.target), list(work.model.parameters()))
    mode = PassThroughMode()
    with mode:
        got = torch.autograd.grad(work.loss_fn(work.model(x), work.target), list(work.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    forward_backward = sum(op.phase != "optimizer" for op in graph.ops)
    assert mode.index == forward_backward


def test_the_probe_measures_a_positive_host_time_per_op():
    seconds, ops = dispatch_mode_op_s(torch.device("cpu"), repeats=1)
    assert ops > 50
    assert 0 < seconds < 1e-3  # a Python call per op: microseconds, never a millisecond

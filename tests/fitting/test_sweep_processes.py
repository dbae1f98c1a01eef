"""Ranks of a sweep traced in worker processes (NOTE [sweep processes]): the same rows as traced here, errors
that name the rank, and no process left behind."""

import os
import sys
import tempfile
import time

import psutil
import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.fitting import _sweep_processes, ranks
from udnn_lab.fitting._rank_jobs import RankJob

H100 = "h100-sxm"  # ranks of a GPU cluster, whatever this machine has

TIMES = ["trace_s", "plan_s"]
SWEEP = dict(world_sizes=[1, 2, 4, 8, 16, 32], setups=["DDP", "FSDP2", "FSDP2+offload"], progress=False)


def _children() -> set[int]:
    """This process's children that run (not those ended and not yet reaped)."""
    return {child.pid for child in psutil.Process(os.getpid()).children(recursive=True)
            if child.status() != psutil.STATUS_ZOMBIE}


def test_workers_give_the_rows_this_process_gives_and_end_with_the_sweep():
    before = _children()
    alone = ul.sweep("mlp3", ["12MiB", "40MiB"], workers=1, batch=4, optimizer="adam", **SWEEP, hardware=H100)
    shared = ul.sweep("mlp3", ["12MiB", "40MiB"], workers=2, batch=4, optimizer="adam", **SWEEP, hardware=H100)
    assert _children() == before
    assert shared.drop(columns=TIMES).equals(alone.drop(columns=TIMES))
    traced = shared[shared.trace_s > 0].drop_duplicates(["world_size", "spec"])
    # DDP 2 (the others are made from it); FSDP2 1 to 16, and 32 made from 2 to 16 (8 and 16 split mlp3's 10-row
    # layer unevenly, each in a new way: NOTE [FSDP ranks across world sizes])
    assert len(traced) == 1 + 5 and set(shared[shared.trace_s == 0].world_size) == {1, 4, 8, 16, 32}


def _sweep_workers() -> set[int]:
    """This process's sweep workers that run (not its other children: another test's may outlive it)."""
    found = set()
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "udnn_lab.fitting._sweep_worker" in child.cmdline():
                found.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def _waiting_for(tmp_path, monkeypatch, pattern: str, workers_end: bool = False) -> None:
    """This process's ranks wait (up to a minute) for a file of the sweep's folder that a worker writes, and with
    ``workers_end`` for the workers to end."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run = RankJob.run

    def after_the_worker(job, index, done):  # this process only: a worker runs the real one
        deadline = time.monotonic() + 60
        while not any(path.stat().st_size for path in tmp_path.glob(pattern)) and time.monotonic() < deadline:
            time.sleep(0.05)
        while workers_end and _sweep_workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        return run(job, index, done)

    monkeypatch.setattr(RankJob, "run", after_the_worker)


def test_ranks_are_shared_between_this_process_and_a_worker(tmp_path, monkeypatch):
    _waiting_for(tmp_path, monkeypatch, "*/*.result")
    seen: list = []

    def kept(job, workers, on_done):
        seen.extend(_sweep_processes.run_ranks(job, workers, on_done))
        return seen

    monkeypatch.setattr(ranks, "run_ranks", kept)
    table = ul.sweep("mlp3", "1GiB", workers=2, world_sizes=[2, 4, 8], setups=["FSDP2"], progress=False, batch=4,
                     hardware=H100)
    assert len(table) == 3 and table.fits.all()
    assert {rank.pid for rank in seen} - {os.getpid()}, "the worker traced none of the ranks"
    assert sorted(rank.spec.world_size for rank in seen) == [2, 4, 8]


@pytest.mark.skipif(_sweep_processes.processes_for(2, None) < 2, reason="one core: no workers are started")
def test_workers_start_while_this_process_traces_once_that_has_taken_long_enough(tmp_path, monkeypatch):
    monkeypatch.setattr(_sweep_processes, "WORKER_START_S", 0.01)  # the first rank's 0.1 s is then long enough
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run, found = RankJob.run, []

    def after_a_workers_result(job, index, done):  # this process's first rank waits until a worker has traced one
        deadline = time.monotonic() + 60
        while not found and time.monotonic() < deadline:
            found.extend(path for path in tmp_path.glob("*/*.result") if path.stat().st_size)
            time.sleep(0.05)
        assert found, "no worker started while this process's first rank ran"
        return run(job, index, done)

    monkeypatch.setattr(RankJob, "run", after_a_workers_result)
    seen: list = []

    def kept(job, workers, on_done):
        seen.extend(_sweep_processes.run_ranks(job, workers, on_done))
        return seen

    before = _children()
    monkeypatch.setattr(ranks, "run_ranks", kept)
    table = ul.sweep("mlp3", "1GiB", world_sizes=[2, 4, 8], setups=["FSDP2"], progress=False, batch=4, hardware=H100)
    assert len(table) == 3 and table.fits.all() and _children() == before
    assert {rank.pid for rank in seen} - {os.getpid()}, "no worker was started"


class _Local(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x):
        return self.layer(x)


def _local_work(loss_fn=None) -> ul.Workload:
    model = _Local()
    return ul.Workload(model, torch.randn(4, 16), loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters()),
                       name="local")


def test_a_job_a_worker_cannot_rebuild_is_traced_here(tmp_path, monkeypatch):
    # a class of this process's __main__ (a notebook's, a script's) pickles here, and a worker cannot find it
    monkeypatch.setattr(_Local, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "_Local", _Local, raising=False)
    _waiting_for(tmp_path, monkeypatch, "*/worker0.log", workers_end=True)
    with pytest.warns(UserWarning, match="cannot rebuild the sweep's job here: AttributeError"):
        table = ul.sweep(_local_work(), "1GiB", workers=2, hardware="cpu-amd-epyc-2cpu", world_sizes=[2, 4],
                         setups=["FSDP2"], progress=False)
    assert len(table) == 2 and table.fits.all()


def test_a_job_that_does_not_pickle_is_traced_here():
    with pytest.warns(UserWarning, match="the workload does not pickle"):
        table = ul.sweep(_local_work(lambda out: out.sum()), "1GiB", workers=2, hardware="cpu-amd-epyc-2cpu",
                         **{**SWEEP, "world_sizes": [1, 2, 4, 8]})
    assert len(table) == 4 * 3 and table.fits.all()
    with pytest.raises(ValueError, match="has no inter-node figures: give ranks_per_node of at least 16"):
        ul.sweep(_local_work(), "1GiB", hardware="cpu-amd-epyc-2cpu", world_sizes=[16], setups=["DDP"],
                 progress=False)


def test_an_error_in_a_worker_is_raised_here_with_where_it_happened(monkeypatch):
    monkeypatch.setattr(_sweep_processes, "WORKER_START_S", 0.0)
    with pytest.raises(ValueError, match="unknown setup"):  # raised before any rank is traced
        ul.sweep("mlp3", "1GiB", workers=2, setups=["ZeRO"], world_sizes=[2], batch=4, hardware=H100)
    with pytest.raises(ValueError, match="workers is how many processes"):
        ul.sweep("mlp3", "1GiB", workers=0, world_sizes=[2], batch=4, hardware=H100)


def test_real_weights_above_the_limit_are_not_sent_to_workers(monkeypatch):
    monkeypatch.setattr(_sweep_processes, "WORKER_COPY_BYTES", 1024)  # mlp3 built on the CPU holds more
    with pytest.warns(UserWarning, match=r"weights are real .*device='meta'"):
        table = ul.sweep("mlp3", "1GiB", workers=2, world_sizes=[2, 4], setups=["FSDP2"], progress=False, batch=4,
                         device="cpu", hardware=H100)
    assert len(table) == 2 and table.fits.all()

"""Real rank processes for the tests that check traces and runs against them (gloo on CPU)."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

RANKS_TIMEOUT_S = 240  # for a whole spawn; a rank still alive then is killed


def spawned(target, args: tuple, processes: int, wait_each: bool = False) -> mp.ProcessContext:
    """Run ``target(rank, *args)`` on ``processes`` processes; none outlives this call, whatever happens.

    ``wait_each``: wait for every rank to end by itself (a failed rank does not end the others here), up to
    the timeout; otherwise the first rank that fails ends the others, as torch's join does.
    """
    context = mp.start_processes(target, args=args, nprocs=processes, join=False, start_method="spawn")
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        if wait_each:
            for process in context.processes:
                process.join(max(1.0, deadline - time.monotonic()))
        else:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):  # a failed rank raises here
                if time.monotonic() > deadline:
                    pytest.fail(f"the gloo ranks did not finish in {RANKS_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(10)
        assert not any(p.is_alive() for p in context.processes), "a rank process was left behind"
    return context

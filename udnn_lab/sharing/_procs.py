"""The parent's side of the study's processes: start one worker per job, send orders, gather what they send.

Every worker is a 'spawn' process with a pipe of its own, so a worker that dies (or is
killed) breaks only its own pipe. ``Workers`` is a context manager: leaving it, normally,
by an error or by KeyboardInterrupt, asks each worker to quit, then terminates and
finally kills any that is still there, and joins them all. See NOTE [worker protocol].
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import NamedTuple, cast

from udnn_lab.errors import JobFailed
from udnn_lab.sharing._worker import JobAnalysis, RunOrder, worker_main
from udnn_lab.sharing.jobs import JobSpec

_START_HINT = (" before it was ready; its traceback is on stderr. Run from a script, the study must be started "
               "under `if __name__ == '__main__':` (jobs run in 'spawn' processes, which import the main module)")


class Iteration(NamedTuple):
    """One training step of a job, as its worker reported it (times on time.monotonic, seconds)."""

    step: int
    end: float  # when the step's row reached the worker's callback
    time_s: float  # the step itself: forward, backward, optimizer
    interval_s: float  # since the previous step's end: the step, the loop around it, and time descheduled

    @property
    def start(self) -> float:
        return self.end - self.interval_s


@dataclass
class RunState:
    """What one run of one job has sent so far (filled by Workers.pump)."""

    job: str
    run_id: int
    started: float  # time.monotonic() when the order was sent
    iterations: list[Iteration] = field(default_factory=list)
    facts: dict | None = None  # the run_done facts; None while it runs
    profile: dict[str, float] | None = None  # op -> seconds, for a profile order

    @property
    def done(self) -> bool:
        return self.facts is not None or self.profile is not None

    def after(self, moment: float) -> list[Iteration]:
        """Iterations whose interval began at or after ``moment``."""
        return [it for it in self.iterations if it.start >= moment]


@dataclass
class _Worker:
    spec: JobSpec
    process: BaseProcess
    conn: Connection
    pid: int | None = None
    analysis: JobAnalysis | None = None
    error: str | None = None
    last_heard: float = 0.0


class Workers:
    """One process per job; orders out, events in."""

    def __init__(self, specs: list[JobSpec], device: str, threads: int, stall_timeout_s: float,
                 log: Callable[[str], None], cores: tuple[int, ...] | None = None) -> None:
        self.device, self.threads, self.stall_timeout_s, self.log = device, threads, stall_timeout_s, log
        self.cores = cores
        self._context = multiprocessing.get_context("spawn")
        self._specs = specs
        self._workers: dict[str, _Worker] = {}
        self._runs: dict[tuple[str, int], RunState] = {}
        self._next_run = 0
        self.pids: dict[str, int] = {}  # every pid ever started, for the record

    def __enter__(self) -> Workers:
        try:
            for spec in self._specs:
                parent, child = self._context.Pipe(duplex=True)
                process = self._context.Process(
                    target=worker_main, args=(spec, self.device, self.threads, child, self.cores),
                    name=f"udnn-sharing-{spec.name}", daemon=True)
                process.start()
                child.close()
                self._workers[spec.name] = _Worker(spec, process, parent, last_heard=time.monotonic())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- start-up ----------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> dict[str, str]:
        """Wait until each worker has analyzed its job; returns {job: error} for those that failed."""
        deadline = time.monotonic() + timeout_s
        while any(w.analysis is None and w.error is None for w in self._workers.values()):
            if time.monotonic() > deadline:
                for name, w in self._workers.items():
                    if w.analysis is None and w.error is None:
                        self.fail(name, f"not ready after {timeout_s:.0f} s (building and analyzing the job)")
                break
            self.pump(0.2)
        return {name: w.error for name, w in self._workers.items() if w.error is not None}

    def analyses(self) -> dict[str, JobAnalysis]:
        return {name: w.analysis for name, w in self._workers.items() if w.analysis is not None}

    def alive(self, name: str) -> bool:
        worker = self._workers.get(name)
        return worker is not None and worker.error is None and worker.analysis is not None

    def live_pids(self) -> dict[str, int]:
        return {name: w.pid for name, w in self._workers.items() if w.error is None and w.pid is not None}

    # -- orders ------------------------------------------------------------------------------
    def run(self, job: str, warmup: int, iterations: int | None, cap_bytes: int | None = None,
            measure_peak: bool = False, min_seconds: float = 0.0) -> RunState:
        self._next_run += 1
        order = RunOrder(self._next_run, warmup, iterations, cap_bytes, measure_peak, min_seconds)
        return self._order(job, self._next_run, ("run", order))

    def profile(self, job: str, repeats: int) -> RunState:
        self._next_run += 1
        return self._order(job, self._next_run, ("profile", self._next_run, repeats))

    def running(self, job: str) -> list[RunState]:
        """The job's orders that have not finished."""
        return [state for (name, _), state in self._runs.items() if name == job and not state.done]

    def stop(self, state: RunState) -> None:
        self._send(state.job, ("stop", state.run_id))

    def _order(self, job: str, run_id: int, message: tuple) -> RunState:
        state = RunState(job, run_id, time.monotonic())
        self._runs[(job, run_id)] = state
        self._workers[job].last_heard = time.monotonic()
        self._send(job, message)
        return state

    def _send(self, job: str, message: tuple) -> None:
        worker = self._workers[job]
        if worker.error is not None:
            raise JobFailed(job, worker.error)
        try:
            worker.conn.send(message)
        except (BrokenPipeError, OSError) as err:
            error = f"its process is gone ({err}; exit code {worker.process.exitcode})"
            self.fail(job, error)
            raise JobFailed(job, error) from None

    # -- events ------------------------------------------------------------------------------
    def wait_for(self, condition: Callable[[], bool], jobs: list[str], timeout_s: float | None = None) -> None:
        """Pump events until ``condition()``; raise JobFailed when one of ``jobs`` fails or goes silent."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not condition():
            for job in jobs:
                worker = self._workers[job]
                if worker.error is not None:
                    raise JobFailed(job, worker.error)
                silent = time.monotonic() - worker.last_heard
                if silent > self.stall_timeout_s:
                    error = (f"no word from it for {silent:.0f} s (stall timeout {self.stall_timeout_s:.0f} s): "
                             "hung, or one step takes longer; raise timeout_s for bigger jobs")
                    self.fail(job, error)
                    raise JobFailed(job, error)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {', '.join(jobs)}")
            self.pump(0.05)

    def pump(self, timeout_s: float) -> None:
        """Read what the workers have sent, for up to ``timeout_s``; notice workers that died."""
        live = {w.conn: name for name, w in self._workers.items() if w.error is None}
        if not live:
            time.sleep(timeout_s)
            return
        # wait returns some of the objects it was given: here connections only
        for conn in cast("list[Connection]", wait(list(live), timeout_s)):
            name = live[conn]
            worker = self._workers[name]
            try:
                while worker.error is None and conn.poll():
                    self._handle(name, conn.recv())
            except (EOFError, OSError):
                if worker.error is None:
                    worker.process.join(1.0)
                    hint = "" if worker.analysis is not None else _START_HINT
                    self.fail(name, f"its process died (exit code {worker.process.exitcode}){hint}")

    def _handle(self, name: str, message: tuple) -> None:
        worker = self._workers[name]
        worker.last_heard = time.monotonic()
        kind, run_id = message[0], message[1]
        if kind == "ready":
            worker.pid, worker.analysis = run_id, message[2]
            self.pids[name] = run_id
        elif kind == "error":
            self.fail(name, message[2].strip())
        state = self._runs.get((name, run_id))
        if state is None:
            return
        if kind == "iteration":
            state.iterations.append(Iteration(*message[2:6]))
        elif kind == "run_done":
            state.facts = message[2]
        elif kind == "profile":
            state.profile = message[2]

    # -- failures and the end ------------------------------------------------------------------
    def fail(self, name: str, error: str) -> None:
        """Take a job out of the study: record why, and end its process."""
        worker = self._workers[name]
        if worker.error is None:
            worker.error = error
            self.log(f"job {name} is out of the study: {error.splitlines()[-1]}")
        try:
            worker.conn.send(("quit",))
        except (BrokenPipeError, OSError, ValueError):
            pass
        _end(worker, grace_s=1.0)

    def errors(self) -> dict[str, str]:
        return {name: w.error for name, w in self._workers.items() if w.error is not None}

    def close(self, grace_s: float = 3.0) -> None:
        """Ask every worker to quit; after ``grace_s`` in all, terminate, then kill, whatever is left."""
        for worker in self._workers.values():
            try:
                worker.conn.send(("quit",))
            except (BrokenPipeError, OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for worker in self._workers.values():
            if worker.process.pid is not None:
                worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in self._workers.values():
            _end(worker, grace_s=0.0)


def _end(worker: _Worker, grace_s: float) -> None:
    """Join the worker's process, terminating and then killing it if it does not go in time."""
    process = worker.process
    if process.pid is not None:
        process.join(grace_s)
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
    try:
        worker.conn.close()
    except OSError:
        pass

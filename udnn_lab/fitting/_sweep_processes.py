"""Runs the ranks of a sweep over world sizes in this process and, when that pays, in worker processes too.

NOTE [sweep processes]
  1. The ranks a sweep traces are independent (each its own copy of the model, its own fake process group), and
     a trace is single-threaded Python: worker processes trace some while this one traces others. A rank is
     taken by creating its claim file (O_EXCL: exactly one process gets it), so this process never waits for a
     rank that no one started.
  2. Workers are fresh interpreters (``python -m udnn_lab.fitting._sweep_worker``): not forked (a forked child
     of a process that has run a backward cannot run one, PyTorch's autograd-and-fork rule), and the user's
     ``__main__`` is not run again. Starting one costs seconds of imports, so they start only once a rank traced
     here has run long enough to say the rest would take longer than that (a timer, while it runs);
     ``workers=`` given starts them at once.
  3. The job reaches them pickled. A worker that cannot rebuild it (a model class defined in a notebook or a
     script) exits before it claims anything, and this process traces what it would have. A model whose weights
     are real and above WORKER_COPY_BYTES is not sent at all (every worker would hold a copy; a trace needs only
     their shapes, so a model built on the meta device costs nothing to send).
  4. A result is written under a temporary name and renamed: a result file seen is whole. A rank claimed by a
     worker that ended without its result is traced here.
  5. Workers are ended on the way out, whatever happened (Ctrl-C, an error): none outlives the sweep. A worker
     whose sweep process is gone (killed outright) ends itself.
  6. Ranks made from traced ones (``RankJob.needs``) come after every traced rank, so whoever claims one finds
     what it needs claimed already and waits for it. A traced rank that others need is written to its result
     file by whichever process traced it, this one too, with its graph; each process reads it once.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from udnn_lab.fitting._rank_jobs import RankJob, Traced
from udnn_lab.units import format_bytes

WORKER_START_S = 4.0  # a fresh interpreter importing torch, transformers and udnn_lab: 2.5-3.6 s measured here
POLL_S = 0.05
WORKER_COPY_BYTES = 256 << 20  # real weights sent to each worker, at most (NOTE [sweep processes] 3)
CANNOT_REBUILD = 3  # a worker's exit status when the job does not unpickle there (NOTE [sweep processes] 3)


def processes_for(tasks: int, workers: int | None) -> int:
    """How many processes, this one included, trace ``tasks`` ranks: ``workers``, by default one per core, at
    most one a rank."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers is how many processes trace ranks at once (this one included): a positive "
                         f"int, or None for one per core; got {workers!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(tasks, workers if workers is not None else cores))


@dataclass(frozen=True)
class Failed:
    """A rank whose trace or plans raised, as a worker sends it back."""

    error: BaseException
    where: str
    pid: int = field(default_factory=os.getpid)  # the process it raised in


class Claims:
    """Which ranks are taken (NOTE [sweep processes] 1)."""

    def __init__(self, folder: Path, tasks: int) -> None:
        self.folder, self.tasks = folder / "claims", tasks
        self.folder.mkdir(exist_ok=True)

    def claim(self) -> int | None:
        for index in range(self.tasks):
            try:
                claim = os.open(self.folder / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(claim, str(os.getpid()).encode())
            os.close(claim)
            return index
        return None

    def taken(self) -> int:
        return len(os.listdir(self.folder))

    def claimant(self, index: int) -> int | None:
        """The pid of the process that claimed ``index`` (None: unclaimed, or a claim being written)."""
        try:
            return int((self.folder / str(index)).read_text() or "x")
        except (FileNotFoundError, ValueError):
            return None


def run_one(job: RankJob, index: int, done: Callable[[list[int]], list[Traced]]) -> Traced | Failed:
    try:
        return job.run(index, done)
    except Exception as error:  # sent back whole when it pickles, as its type and message when it does not
        where = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            error = RuntimeError(f"{type(error).__name__}: {error}")
        return Failed(error, where)


def write_result(folder: Path, index: int, result: Traced | Failed) -> None:
    partial = folder / f"{index}.partial"
    partial.write_bytes(pickle.dumps(result))
    partial.rename(folder / f"{index}.result")  # NOTE [sweep processes] 4


def run_ranks(job: RankJob, workers: int | None, on_done: Callable[[Traced, int], None]) -> list[Traced]:
    """Every task of ``job``, run here and in workers (NOTE [sweep processes]); ``on_done(rank, processes)``
    as each one is done."""
    most = processes_for(len(job.tasks), workers)
    with tempfile.TemporaryDirectory(prefix="udnn-lab-sweep-") as name:
        run = _Run(job, Path(name), on_done)
        if workers is not None and most > 1:
            run.pool = _Workers(run.folder, job, most - 1, asked=True)
        try:
            while (index := run.claims.claim()) is not None:
                with _starting_workers(run, most):
                    run.here(index)
                if run.pool:
                    run.pool.collect(run.results, on_done)
            return run.wait_for(list(range(len(job.tasks))))
        finally:
            if run.pool:
                run.pool.end()


@contextmanager
def _starting_workers(run: _Run, most: int) -> Iterator[None]:
    """Start the workers while this process runs a task, as soon as the task has taken long enough that the ranks
    left to trace would take longer than starting them (NOTE [sweep processes] 2); ranks made from traced ones
    are quicker and not counted."""
    to_trace = run.job.traced - run.claims.taken()
    if run.pool is not None or most < 2 or to_trace < 2:
        yield
        return

    def start() -> None:
        run.pool = _Workers(run.folder, run.job, min(most - 1, len(run.job.tasks) - run.claims.taken()))

    timer = threading.Timer(WORKER_START_S / (to_trace * (1 - 1 / most)), start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a pool being started is there to be ended


class _Run:
    """This process's side of one sweep's tasks."""

    def __init__(self, job: RankJob, folder: Path, on_done: Callable[[Traced, int], None]) -> None:
        self.job, self.folder, self.on_done = job, folder, on_done
        self.claims = Claims(folder, len(job.tasks))
        self.results: dict[int, Traced] = {}
        self.pool: _Workers | None = None

    def here(self, index: int) -> None:
        """Run task ``index`` in this process."""
        result = run_one(self.job, index, self.wait_for)
        if self.job.is_base(index):  # NOTE [sweep processes] 6
            write_result(self.folder, index, result)
        self.results[index] = returned(result)
        self.on_done(self.results[index], 1 + (self.pool.count if self.pool else 0))

    def wait_for(self, indices: list[int]) -> list[Traced]:
        """The results of tasks ``indices``, claimed already: collected from workers as they come, run here when
        the worker that claimed one has ended without it (NOTE [sweep processes] 4)."""
        while missing := [index for index in indices if index not in self.results]:
            if self.pool:
                self.pool.collect(self.results, self.on_done)
            ended = [index for index in missing if index not in self.results and not self._running(index)
                     and not (self.folder / f"{index}.result").exists()]
            for index in ended:
                self.here(index)
            if not ended:
                time.sleep(POLL_S)
        return [self.results[index] for index in indices]

    def _running(self, index: int) -> bool:
        pid = self.claims.claimant(index)
        return pid is None or (self.pool is not None and self.pool.alive(pid))


class _Workers:
    """Worker processes of one sweep (NOTE [sweep processes] 2, 3, 5)."""

    def __init__(self, folder: Path, job: RankJob, count: int, asked: bool = False) -> None:
        self.folder, self.count, self.processes, self.asked = folder, 0, [], asked
        model = job.work.model
        real = sum(t.nbytes for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta")
        if real > WORKER_COPY_BYTES:
            self._told(f"the model's weights are real ({format_bytes(real)}) and each worker would hold a copy; "
                       "build the workload on the meta device (device='meta') for workers")
            return
        try:
            (folder / "job.pkl").write_bytes(pickle.dumps(job))
        except Exception as error:  # a job that does not pickle (a lambda as loss): traced here, one after another
            self._told(f"the workload does not pickle ({type(error).__name__}: {error}; define the model, loss and "
                       "optimizer at a module's top level for workers)")
            return
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        for n in range(count):
            with open(folder / f"worker{n}.log", "wb") as log:  # the worker writes to its own copy
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "udnn_lab.fitting._sweep_worker", str(folder)], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True))
        self.count = count

    def __bool__(self) -> bool:
        return bool(self.processes)

    def alive(self, pid: int) -> bool:
        return any(process.pid == pid and process.poll() is None for process in self.processes)

    def _told(self, why: str) -> None:
        if self.asked:
            warnings.warn(f"workers= asked for worker processes, but {why}: the ranks are traced in this process",
                          stacklevel=4)
            self.asked = False

    def collect(self, results: dict[int, Traced], on_done: Callable[[Traced, int], None]) -> None:
        for path in self.folder.glob("*.result"):
            index = int(path.stem)
            if index not in results:
                results[index] = returned(pickle.loads(path.read_bytes()))
                on_done(results[index], 1 + self.count)

    def end(self) -> None:
        if any(process.poll() == CANNOT_REBUILD for process in self.processes):
            log = (self.folder / "worker0.log").read_text(errors="replace").strip().splitlines()
            self._told((log[-1] if log else "a worker could not rebuild the workload")
                       + " (define the model, loss and optimizer at a module's top level for workers)")
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()


def returned(result: Traced | Failed) -> Traced:
    if isinstance(result, Failed):
        if result.pid != os.getpid():  # its traceback is of this process's frames only
            result.error.add_note(f"raised in a sweep worker process:\n{result.where}")
        raise result.error
    return result

"""``python -m udnn_lab.fitting._sweep_worker FOLDER``: one worker process of a sweep over world sizes: it takes
ranks until none is left (NOTE [sweep processes] in _sweep_processes.py)."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from pathlib import Path

import torch

from udnn_lab.fitting._rank_jobs import Traced
from udnn_lab.fitting._sweep_processes import CANNOT_REBUILD, POLL_S, Claims, returned, run_one, write_result


class Finished:
    """The traced ranks this worker's tasks are made from, read from their result files as they come
    (NOTE [sweep processes] 6)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.parent = folder, os.getppid()
        self.read: dict[int, Traced] = {}

    def __call__(self, indices: list[int]) -> list[Traced]:
        for index in indices:
            path = self.folder / f"{index}.result"
            while index not in self.read:
                if path.exists():
                    self.read[index] = returned(pickle.loads(path.read_bytes()))
                elif os.getppid() != self.parent:  # the sweep's process is gone (NOTE [sweep processes] 5)
                    sys.exit(1)
                else:
                    time.sleep(POLL_S)
        return [self.read[index] for index in indices]


def main(folder: Path) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the sweep's own process ends it (NOTE [sweep processes] 5)
    torch.set_num_threads(1)
    try:
        job = pickle.loads((folder / "job.pkl").read_bytes())
    except Exception as error:  # NOTE [sweep processes] 3: the sweep's process traces these ranks itself
        print(f"cannot rebuild the sweep's job here: {type(error).__name__}: {error}", file=sys.stderr)
        return CANNOT_REBUILD
    claims, finished = Claims(folder, len(job.tasks)), Finished(folder)
    while (index := claims.claim()) is not None:
        write_result(folder, index, run_one(job, index, finished))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

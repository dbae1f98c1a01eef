"""``python -m udnn_lab.fitting._sweep_worker FOLDER``: one worker process of a sweep over world sizes: it takes
ranks until none is left (NOTE [sweep processes] in _sweep_processes.py)."""

from __future__ import annotations

import pickle
import signal
import sys
from pathlib import Path

import torch

from udnn_lab.fitting._sweep_processes import CANNOT_REBUILD, Claims, run_one, write_result


def main(folder: Path) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the sweep's own process ends it (NOTE [sweep processes] 5)
    torch.set_num_threads(1)
    try:
        job = pickle.loads((folder / "job.pkl").read_bytes())
    except Exception as error:  # NOTE [sweep processes] 3: the sweep's process traces these ranks itself
        print(f"cannot rebuild the sweep's job here: {type(error).__name__}: {error}", file=sys.stderr)
        return CANNOT_REBUILD
    claims = Claims(folder, len(job.traced))
    while (index := claims.claim()) is not None:
        write_result(folder, index, run_one(job, index))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

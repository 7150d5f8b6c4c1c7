"""A process to be killed while it saves (tests/reliability/test_checkpoint_faults.py).

    python _ckpt_worker.py once PATH SEED WAIT PLAN   save state SEED over PATH once, with the plan in the
                                                      JSON file PLAN (overwrite=True; WAIT=0 saves
                                                      asynchronously); AUTOSHARD_CHECKPOINT_FAULT makes it
                                                      SIGKILL itself at that step of the save
    python _ckpt_worker.py loop PATH              save states 1, 2, 3, ... over PATH until killed,
                                                 printing "saved K" after each
"""

import sys
from pathlib import Path

import numpy as np

import autoshard


def state(seed: int) -> dict:
    """A small tree with several dtypes; every seed gives different values in every leaf."""
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 96)).astype(np.float32),
            "b": rng.standard_normal((96,)).astype(np.float32),
            "count": np.int32(seed),
            "ids": rng.integers(0, 1 << 30, (256,), dtype=np.int32)}


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "once":
        plan = autoshard.Plan.from_json(Path(sys.argv[5]).read_text())
        saving = autoshard.save(path, state(int(sys.argv[3])), plan=plan, overwrite=True, wait=sys.argv[4] == "1")
        saving.wait()
        print("saved", flush=True)
    else:
        for k in range(1, 1 << 30):
            autoshard.save(path, state(k), overwrite=True)
            print(f"saved {k}", flush=True)

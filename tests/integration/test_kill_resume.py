"""Kill and resume: a training run killed after step k resumes from its last checkpoint on another
mesh and plan, and the loss trajectory equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import autoshard
import models

from .._reference import run_steps

pytestmark = pytest.mark.slow     # heavy: CI's second step (`pytest -m slow`)


WORKER = Path(__file__).with_name("_train_worker.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_AFTER = 5, 2


def test_killed_run_resumes_on_another_mesh(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(STEPS)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                seen.append(json.loads(line))
            if len(seen) == KILL_AFTER:
                proc.send_signal(signal.SIGKILL)         # no clean shutdown: as a preempted job dies
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert [r["step"] for r in seen] == list(range(1, KILL_AFTER + 1))

    m = models.get("gpt", "debug", batch_size=8)
    params, batch = m.init(jax.random.key(0)), m.batch()
    opt_state = m.optimizer.init(params)
    want, _, _ = run_steps(jax.jit(m.train_step), params, opt_state, batch, STEPS)

    last = max(tmp_path.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    assert last.name == f"step_{KILL_AFTER}"
    resumed = autoshard.autoshard(m.train_step, mesh={"data": 8}, hardware="cpu-sim")    # another mesh and plan
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), (params, opt_state),
                        resumed.shardings(params, opt_state, batch)[:2])
    p, o = autoshard.restore(last, like=like)
    rest, _, _ = run_steps(resumed, p, o, batch, STEPS - KILL_AFTER)
    np.testing.assert_allclose([r["loss"] for r in seen] + rest, want, rtol=1e-5)
    assert autoshard.Plan.from_json((last / "plan.json").read_text()).mesh == (("data", 2), ("model", 4))

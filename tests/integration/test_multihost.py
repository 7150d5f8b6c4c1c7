"""Multi-host: two processes x 4 CPU devices joined by jax.distributed run a tensor plan and a
pipeline plan under @autoshard; both processes hold the same plan (process 0's, broadcast) and the
losses equal one process on one device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import models

pytestmark = pytest.mark.slow     # heavy: CI's second step (`pytest -m slow`)


WORKER = Path(__file__).with_name("_multihost_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one_device():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), "2", str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])

    m = models.get("gpt", "debug")
    params, batch = m.init(jax.random.key(0)), m.batch()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(m.loss)(params, batch)
        updates, opt_state = m.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state, want = (params, m.optimizer.init(params)), []
    for _ in range(2):
        *state, loss = step(*state, batch)
        want.append(float(loss))
    for name in ("tensor", "pipeline"):
        rows = [next(r for r in o if r["plan"] == name) for o in outs]
        assert all(r["devices"] == 8 and r["local"] == 4 for r in rows)
        assert rows[0]["digest"] == rows[1]["digest"], name          # one plan, bit for bit
        for r in rows:
            np.testing.assert_allclose(r["losses"], want, rtol=1e-5)

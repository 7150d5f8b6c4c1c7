"""A training run to be killed (tests/integration/test_kill_resume.py): the debug GPT under a
`data 2 x model 4` plan, a checkpoint after every step, one JSON line per finished step."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import autoshard  # noqa: E402  (after the backend is configured)
import models  # noqa: E402

ckpt, steps = sys.argv[1], int(sys.argv[2])
m = models.get("gpt", "debug", batch_size=8)
params, batch = m.init(jax.random.key(0)), m.batch()
step = autoshard.autoshard(m.train_step, mesh={"data": 2, "model": 4}, hardware="cpu-sim")
opt_state = m.optimizer.init(params)
for i in range(1, steps + 1):
    params, opt_state, loss = step(params, opt_state, batch)
    autoshard.save(f"{ckpt}/step_{i}", (params, opt_state), plan=step.plan)     # complete when it returns
    print(json.dumps({"step": i, "loss": float(loss)}), flush=True)

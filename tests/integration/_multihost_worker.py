"""One process of a multi-process CPU run (tests/integration/test_multihost.py): joins the other
processes through jax.distributed (coordinator on 127.0.0.1, gloo collectives), trains the debug
GPT two adamw steps under a tensor plan and a pipeline plan, and prints one JSON line per plan."""

import hashlib
import json
import sys

import jax

pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 8 // nproc)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import optax  # noqa: E402  (after the backend is configured)

import autoshard  # noqa: E402
import models  # noqa: E402

m = models.get("gpt", "debug")
params, batch = m.init(jax.random.key(0)), m.batch()


def step(params, opt_state, batch):
    loss, grads = autoshard.value_and_grad(m.loss)(params, batch)
    updates, opt_state = m.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


for name, kw in (("tensor", {"mesh": {"data": 2, "model": 4}}),
                 ("pipeline", {"mesh": {"pipe": 4, "data": 2}, "pipeline": "rannc", "num_microbatches": 2})):
    fast = autoshard.autoshard(step, hardware="cpu-sim", **kw)
    state, losses = (params, m.optimizer.init(params)), []
    for _ in range(2):
        *state, loss = fast(*state, batch)
        losses.append(float(loss))
    digest = hashlib.sha1(fast.plan.to_json().encode()).hexdigest()
    print(json.dumps({"plan": name, "process": pid, "digest": digest, "losses": losses,
                      "devices": jax.device_count(), "local": jax.local_device_count()}), flush=True)
jax.distributed.shutdown()

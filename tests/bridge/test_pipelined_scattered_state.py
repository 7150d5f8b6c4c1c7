"""State committed to different devices (what an MPMD step returns: each stage's parameters on its own
submesh) fed to another pipelined loss: the example-batch check and the stacking read it from one place
(host copies) instead of failing inside jax with 'incompatible devices'."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import autoshard


def _loss(p, b):
    h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])
    return jnp.mean((h @ p["w3"] - b["y"]) ** 2)


def test_parameters_on_different_devices_pipeline_like_one_device():
    d, rng = jax.devices(), np.random.default_rng(0)
    shapes = {"w1": (16, 32), "w2": (32, 32), "w3": (32, 8)}
    params = {k: jax.device_put(jnp.asarray(rng.normal(size=s) / 4, jnp.float32), d[i])
              for (k, s), i in zip(shapes.items(), (0, 5, 7), strict=True)}
    batch = {"x": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    pipe = autoshard.pipelined(_loss, params, batch, mesh={"pipe": 2, "data": 4}, num_microbatches=2)
    loss, grads = pipe.value_and_grad(params, batch)
    want_loss, want_grads = jax.value_and_grad(_loss)(jax.device_get(params), batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for k in shapes:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want_grads[k]), rtol=1e-5, atol=1e-6)
    assert params["w2"].sharding.device_set == {d[5]}          # the caller's arrays are untouched

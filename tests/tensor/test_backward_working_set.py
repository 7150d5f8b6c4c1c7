"""The backward pass's working set in the tensor evaluator's memory: beside the saved activations, the
largest value the backward writes to memory at a time, including a fusion's result a matmul reads (the
logits' cotangent of a language model: XLA:GPU's compiled GPT-2 and BERT steps hold it whole beside
the saved logits at their peak, bench/results/gpu_step_dumps_h200.tar.xz)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoshard

B, D, V = 64, 32, 16384


def _step(params, batch):
    def loss(p):
        logits = jnp.tanh(batch["x"] @ p["w1"]) @ p["out"]          # [B, V], the largest value
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, batch["y"][:, None], axis=-1).mean()
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value


def test_the_logits_cotangent_is_held_beside_the_saved_logits():
    params = {"w1": jax.ShapeDtypeStruct((D, D), jnp.float32), "out": jax.ShapeDtypeStruct((D, V), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((B, D), jnp.float32), "y": jax.ShapeDtypeStruct((B,), jnp.int32)}
    plan = autoshard.plan(_step, params, batch, mesh={"data": 1}, hardware="h100-sxm")
    logits = B * V * 4
    acts = plan.predicted["memory"]["activations"]
    # the logits (saved for the softmax's backward) and their cotangent (softmax - one-hot, written for the
    # output layer's two backward matmuls); everything else is [B, D]-sized
    assert acts == pytest.approx(2 * logits, rel=0.05)

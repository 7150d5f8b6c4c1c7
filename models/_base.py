"""Shared `Model` wrapper: a functional (init, loss, batch, train_step) view of a model.

Each model file subclasses `Model` and implements `init`, `loss` and `_make_batch`; everything
else (abstract shapes, parameter counting, optimizer, the train step) lives here so that every
model exposes exactly the same contract to autoshard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any
Batch = dict[str, jax.Array]

# Fixed key so `batch()` is deterministic across calls and processes.
_BATCH_SEED = 1234


def to_dtype(name: str) -> jnp.dtype:
    """Config dtypes are strings so configs stay hashable/printable."""
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {name!r}; valid: ['bfloat16', 'float16', 'float32']")
    return jnp.dtype(name)


class Model:
    """A registered model instantiated with one (possibly overridden) config."""

    def __init__(self, name: str, config_name: str, config: Any):
        self.name = name
        self.config_name = config_name
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.config_name!r}, {self.config})"

    # --- implemented by subclasses -------------------------------------------------------
    def init(self, key: jax.Array) -> PyTree:
        """Pure function key -> params pytree (traceable by jax.eval_shape)."""
        raise NotImplementedError

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        """Scalar float32 loss."""
        raise NotImplementedError

    def _make_batch(self, key: jax.Array) -> Batch:
        """Example batch from `key`; traced abstractly for `batch(abstract=True)`."""
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------
    def batch(self, abstract: bool = False) -> Batch:
        key = jax.random.key(_BATCH_SEED)
        if abstract:
            # Same function traced abstractly, so shapes/dtypes can never diverge.
            return jax.eval_shape(self._make_batch, key)
        return self._make_batch(key)

    def abstract_params(self) -> PyTree:
        return self._abstract_params

    @functools.cached_property
    def _abstract_params(self) -> PyTree:
        # Cached: tracing init for 100+ layer configs takes a noticeable fraction of a second.
        return jax.eval_shape(self.init, jax.random.key(0))

    def _param_count_proxy(self) -> Model:
        """A model with the same parameter count that is cheaper to trace (default: self).
        Layer-stacked models return their `scan_layers=True` twin: tracing one scanned layer
        instead of 256 unrolled ones keeps num_params() fast for the enlarged configs."""
        return self

    def num_params(self) -> int:
        params = self._param_count_proxy().abstract_params()
        return sum(math.prod(x.shape) for x in jax.tree.leaves(params))

    @functools.cached_property
    def optimizer(self) -> optax.GradientTransformation:
        return optax.adamw(learning_rate=self.config.learning_rate)

    def init_opt_state(self, params: PyTree) -> PyTree:
        return self.optimizer.init(params)

    def abstract_state(self) -> tuple[PyTree, PyTree, Batch]:
        """Abstract (params, opt_state, batch): the arguments of `train_step`."""
        params = self.abstract_params()
        opt_state = jax.eval_shape(self.init_opt_state, params)
        return params, opt_state, self.batch(abstract=True)

    def train_step(self, params: PyTree, opt_state: PyTree, batch: Batch) -> tuple[PyTree, PyTree, jax.Array]:
        loss, grads = jax.value_and_grad(self.loss)(params, batch)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss


def replace_config(config: Any, overrides: dict[str, Any]) -> Any:
    """dataclasses.replace with a helpful error for unknown fields."""
    valid = [f.name for f in dataclasses.fields(config)]
    for key in overrides:
        if key not in valid:
            raise ValueError(f"unknown config field {key!r} for {type(config).__name__}; valid fields: {valid}")
    return dataclasses.replace(config, **overrides)

"""The backbone's reference loop, once: run a train step for a few steps and keep the losses.

`run_steps(jax.jit(m.train_step), ...)` is the single-device reference every equivalence test
compares with; the same loop drives the step under test (an `@autoshard` step, a pipelined one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_steps(step: Callable, params: Any, opt_state: Any, batch: Any, steps: int = 3) -> tuple[list[float], Any, Any]:
    """`steps` calls of `step(params, opt_state, batch) -> (params, opt_state, loss)` on one batch:
    (losses, final params, final optimizer state)."""
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params, opt_state

"""Measured op times: run each traced op alone on the local device (profile="measured").

For users with the real accelerator at hand, measured seconds replace the roofline estimates in the
pipeline partitioners (RaNNC profiles each op on the device, §III-B). Ops are timed one by one,
jitted alone on inputs of their shapes (ops with the same primitive, parameters and shapes are timed
once), so the sum over a block is its measured forward+backward time without fusion across ops —
an upper bound that ranks blocks consistently. On this CPU-only machine the numbers are CPU times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._errors import PlanError
from ._graph import OpGraph
from ._jax_compat import is_literal

# primitives that cannot run on synthetic inputs (PRNG key types, host effects)
_UNTIMED = frozenset({"random_seed", "random_wrap", "random_unwrap", "random_bits", "random_split",
                      "random_fold_in", "debug_callback", "io_callback", "pure_callback"})


def _signature(eqn: Any) -> tuple:
    avals = tuple((tuple(getattr(v.aval, "shape", ())), str(getattr(v.aval, "dtype", ""))) for v in eqn.invars)
    lits = tuple(repr(v.val) if is_literal(v) else None for v in eqn.invars)
    return (eqn.primitive.name, avals, lits, repr(sorted(eqn.params.items(), key=lambda kv: kv[0])))


def _synthetic(aval: Any, rng: np.random.Generator) -> Any:
    dtype = np.dtype(aval.dtype)
    shape = tuple(aval.shape)
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        return jax.numpy.asarray(rng.standard_normal(shape).astype(np.float32), dtype=aval.dtype)
    return jax.numpy.zeros(shape, aval.dtype)   # indices 0 are always in range


def _time_eqn(eqn: Any, rng: np.random.Generator, min_seconds: float, max_runs: int) -> float:
    free = [i for i, v in enumerate(eqn.invars) if not is_literal(v)]

    def run(*xs):
        args = [v.val if is_literal(v) else None for v in eqn.invars]
        for i, x in zip(free, xs, strict=True):
            args[i] = x
        return eqn.primitive.bind(*args, **eqn.params)

    fn = jax.jit(run)
    inputs = [_synthetic(eqn.invars[i].aval, rng) for i in free]
    jax.block_until_ready(fn(*inputs))          # compile and warm up
    times: list[float] = []
    total = 0.0
    while len(times) < 3 or (total < min_seconds and len(times) < max_runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
    return float(np.median(times))


def measure_op_times(graph: OpGraph, estimate: Callable[[int], float], *, min_seconds: float = 2e-3,
                     max_runs: int = 50, seed: int = 0) -> tuple[list[float], list[str]]:
    """Seconds per execution of every op of `graph` (traced with keep_eqns=True). Ops that cannot
    run alone (PRNG keys, host callbacks, control flow joined from branches) keep `estimate(op)`;
    the second result names them by primitive, for the plan's warnings."""
    if graph.eqns is None:
        raise PlanError("autoshard: profile='measured' needs the graph traced with keep_eqns=True.")
    rng = np.random.default_rng(seed)
    cache: dict[tuple, float] = {}
    out: list[float] = []
    estimated: dict[str, int] = {}
    for op in graph.ops:
        eqn = graph.eqns.get(op.index)
        if eqn is None or op.primitive in _UNTIMED or any(
                "key" in str(getattr(v.aval, "dtype", "")) for v in list(eqn.invars) + list(eqn.outvars)):
            out.append(float(estimate(op.index)))
            estimated[op.primitive] = estimated.get(op.primitive, 0) + 1
            continue
        key = _signature(eqn)
        if key not in cache:
            try:
                cache[key] = _time_eqn(eqn, rng, min_seconds, max_runs)
            except Exception:  # noqa: BLE001 - an op that cannot run alone keeps its estimate, named below
                cache[key] = -1.0
        if cache[key] < 0:
            out.append(float(estimate(op.index)))
            estimated[op.primitive] = estimated.get(op.primitive, 0) + 1
        else:
            out.append(cache[key])
    notes = [f"profile='measured': {n} '{p}' op(s) could not run alone and keep the cost model's estimate "
             "(seconds on the hardware spec, mixed with seconds measured here)" for p, n in sorted(estimated.items())]
    return out, notes

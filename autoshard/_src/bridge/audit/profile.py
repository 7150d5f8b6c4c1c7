"""Measured op times: run each traced op alone on the local device (profile="measured").

For users with the real accelerator at hand, measured seconds replace the roofline estimates in the
pipeline partitioners (RaNNC profiles each op on the device, §III-B). Ops are timed one by one,
jitted alone on inputs of their shapes (ops with the same primitive, parameters and shapes are timed
once), so the sum over a block is its measured forward+backward time without fusion across ops —
an upper bound that ranks blocks consistently. On this CPU-only machine the numbers are CPU times.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...core.errors import PlanError
from ...core.graph import OpGraph
from ...pipeline.costs import traced_batch
from ...pipeline.graphpipe.layer_graph_build import curve_sizes, op_curves
from ..compat import is_literal
from ..trace.trace import trace

# primitives that cannot run on synthetic inputs (PRNG key types, host effects)
MIN_MATCHED = 0.9     # share of a step's ops that must recur at a smaller micro-batch (measured curves)
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
                     max_runs: int = 50, seed: int = 0,
                     cache: dict[tuple, float] | None = None) -> tuple[list[float], list[str]]:
    """Seconds per execution of every op of `graph` (traced with keep_eqns=True). Ops that cannot
    run alone (PRNG keys, host callbacks, control flow joined from branches) keep `estimate(op)`;
    the second result names them by primitive, for the plan's warnings. `cache` (signature ->
    seconds) lets several traces of one step time their common ops once."""
    if graph.eqns is None:
        raise PlanError("autoshard: profile='measured' needs the graph traced with keep_eqns=True.")
    rng = np.random.default_rng(seed)
    cache = {} if cache is None else cache
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


def _sliced(args: tuple, graph: OpGraph, batch: int, size: int) -> tuple:
    """`args` with every data input whose leading dim is the batch cut to `size` samples (abstract)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    out = list(leaves)
    for i, v in enumerate(graph.inputs):
        val = graph.values[v]
        if val.role == "data" and val.shape and val.shape[0] == batch:
            x = leaves[i]
            out[i] = jax.ShapeDtypeStruct((size, *tuple(x.shape)[1:]), x.dtype)
    return jax.tree_util.tree_unflatten(treedef, out)


def _align(a: OpGraph, b: OpGraph) -> dict[int, int]:
    """Op i of `a` -> its op in `b`, matching (primitive, module) sequences. Traces at two batch
    sizes are the same program except where size-1 dims change broadcasting (batch 1)."""
    sm = difflib.SequenceMatcher(a=[(o.primitive, o.module) for o in a.ops],
                                 b=[(o.primitive, o.module) for o in b.ops], autojunk=False)
    return {m.a + t: m.b + t for m in sm.get_matching_blocks() for t in range(m.size)}


def measure_op_curves(step: Callable, args: tuple, graph: OpGraph, batch: int, sizes: list[int],
                      estimate: Callable[[int, int], float], *, min_seconds: float = 2e-3,
                      max_runs: int = 50) -> tuple[np.ndarray, list[float], list[str]]:
    """Each op's measured seconds per execution at every micro-batch size in `sizes` ([ops, K]),
    its seconds at the traced `batch` (`graph`'s, traced with keep_eqns=True), and notes.

    The step is traced again with its data inputs cut to each size (shapes only) and every op timed
    alone (`measure_op_times`); ops are matched to `graph`'s by their (primitive, module) sequence
    (`_align`), and the few that differ (batch 1 broadcasts size-1 dims) keep the estimate.
    Sizes above the traced batch (a batch that is not a power of two) scale the batch's time.
    `estimate(op, k)` prices the ops that cannot run alone."""
    cache: dict[tuple, float] = {}     # weight casts and the optimizer are the same at every size
    full, notes = measure_op_times(graph, lambda i: estimate(i, -1), min_seconds=min_seconds, max_runs=max_runs,
                                   cache=cache)
    curves = np.zeros((len(graph.ops), len(sizes)))
    for k, s in enumerate(sizes):
        if s >= batch:
            curves[:, k] = np.asarray(full) * (s / batch)
            continue
        g = trace(step, *_sliced(args, graph, batch, s), keep_eqns=True)
        match = _align(graph, g)
        if len(match) < MIN_MATCHED * len(graph.ops):
            raise PlanError(
                f"autoshard.plan: profile='measured' times every op at micro-batch sizes {sizes}, tracing the step "
                f"with its data inputs cut from {batch} to {s} samples, but only {len(match)} of its {len(graph.ops)} "
                f"ops recur in that trace ({len(g.ops)} ops): the program depends on the batch size, so measured "
                "times cannot be matched to ops. Fix: profile='model', or a step whose ops do not depend on the "
                "batch size.")
        times, more = measure_op_times(g, lambda j: -1.0, min_seconds=min_seconds, max_runs=max_runs, cache=cache)
        for i in range(len(graph.ops)):
            j = match.get(i)
            curves[i, k] = times[j] if j is not None and times[j] >= 0 else estimate(i, k)
        unmatched = len(graph.ops) - len(match)
        if unmatched or len(g.ops) > len(match):
            notes.append(f"profile='measured': at micro-batch {s} the step has {len(g.ops) - len(match)} op(s) that "
                         f"batch {batch} has not and lacks {unmatched} (size-1 dims broadcast differently); those "
                         "keep the cost model's estimate or are left out")
        notes += [n for n in more if n not in notes]
    return curves, full, notes



def measured_layer_costs(step: Callable, args: tuple, graph: OpGraph,
                         hardware: Any) -> tuple[list[float], np.ndarray, list[str]]:
    """`pipeline.layer_graph`'s measured inputs for `step(*args)` traced as `graph` (keep_eqns=True):
    (op_time at the traced batch, op_curves at `curve_sizes(batch)`, notes). Ops that
    cannot be timed keep the roofline on `hardware`."""
    if not any(graph.values[v].role == "data" and graph.values[v].shape for v in graph.inputs):
        raise PlanError("autoshard.plan: profile='measured' with pipeline='graphpipe' times each op at every "
                        "micro-batch size, cutting the data inputs along their batch dim, but the step has no "
                        "data inputs with a batch dim. Fix: profile='model'.")
    batch = traced_batch(graph)
    sizes = curve_sizes(batch)
    model = op_curves(graph, hardware, batch_size=batch)
    reps = [op.repeat for op in graph.ops]
    k_full = next((k for k, s in enumerate(sizes) if s >= batch), len(sizes) - 1)

    def estimate(i: int, k: int) -> float:   # roofline seconds per execution
        return float(model[i, k_full if k < 0 else k]) / reps[i]

    curves, full, notes = measure_op_curves(step, args, graph, batch, sizes, estimate)
    return full, curves, notes


class StepProfiler:
    """Measured op costs of `step(*args)` on the local device (the pipeline layer's `Profiler`)."""

    def __init__(self, step: Callable, args: tuple) -> None:
        self.step, self.args = step, args

    def op_times(self, graph: OpGraph, estimate: Callable[[int], float]) -> tuple[list[float], list[str]]:
        return measure_op_times(graph, estimate)

    def layer_costs(self, graph: OpGraph, hardware: Any) -> tuple[list[float], np.ndarray, list[str]]:
        return measured_layer_costs(self.step, self.args, graph, hardware)

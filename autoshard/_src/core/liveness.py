"""Which ops of a traced step XLA actually runs (pure: no jax import).

A jaxpr keeps equations whose results nothing reads: `jnp.where` under `value_and_grad` leaves a
scalar zero broadcast to [batch, heads, q, k] for the cotangent of the branch that needs none. XLA's
dead-code elimination deletes them before anything runs, so every pricer gives them weight 0: an op
is live when one of its results reaches the step's outputs (transitively), or when it has effects
(callbacks, I/O: the trace marks them) or no results at all (nothing else could justify it).

Loop bodies appear once in an OpGraph, so the back edge from a loop's carried results to its next
iteration is not an edge of the graph; `OpGraph.carried` names those results, and they are live
whenever anything in their loop is (a counter or a recurrent state that only the next iteration reads).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from .graph import OpGraph

# primitives with effects, for graphs traced without the trace's `effectful` mark (hand-built ones)
EFFECTFUL = frozenset({"debug_callback", "io_callback", "debug_print", "outfeed", "infeed", "send", "recv",
                       "callback"})


def _roots(graph: OpGraph) -> np.ndarray:
    """Ops live whatever reads them (bool per op): producers of the step's outputs, ops with effects and ops
    with no results. From the op table's columns."""
    t = graph.table()
    n = len(graph.ops)
    written = t.producer[t.producer >= 0]
    out = np.bincount(written, minlength=n)[:n] == 0        # no results
    out |= t.effectful | np.isin(t.primitive, [k for k, p in enumerate(t.primitives) if p in EFFECTFUL])
    writers = t.producers_of(graph.outputs)
    out[writers[writers >= 0]] = True
    return out


def live_ops(graph: OpGraph) -> np.ndarray:
    """Per op (bool, read-only): does XLA keep it? Cached on the graph (computed once per step)."""
    cached = graph.cache.get("live")
    if cached is not None and cached[0] == len(graph.ops):
        return cached[1]
    values, ops = graph.values, graph.ops
    if not graph.carried:       # no back edges: one walk up the table's edges from the roots
        live = graph.table().feeding(np.flatnonzero(_roots(graph)), np.ones(len(ops), dtype=bool))
        live.flags.writeable = False
        graph.cache["live"] = (len(ops), live)
        return live
    carried_by: dict[int, list[int]] = defaultdict(list)
    for v, uids in graph.carried.items():
        for uid in uids:
            carried_by[uid].append(v)
    live = np.zeros(len(ops), dtype=bool)
    running: set[int] = set()              # loops with a live op: their carried values are read
    stack = np.flatnonzero(_roots(graph)).tolist()
    while stack:
        i = stack.pop()
        if live[i]:
            continue
        live[i] = True
        op = ops[i]
        reads = list(op.inputs)
        for loop in op.loops:
            if loop.uid not in running:
                running.add(loop.uid)
                reads += carried_by.get(loop.uid, ())
        stack.extend(p for v in reads if (p := values[v].producer) is not None and not live[p])
    live.flags.writeable = False
    graph.cache["live"] = (len(ops), live)
    return live


def live_weights(graph: OpGraph, weights: dict[int, float]) -> dict[int, float]:
    """`weights` (op -> executions) with dead ops at 0 (kept as keys: they still link factors)."""
    live = live_ops(graph)
    keys = np.fromiter(weights, dtype=np.int64, count=len(weights))
    return {i: (w if ok else 0.0) for (i, w), ok in zip(weights.items(), live[keys].tolist(), strict=True)}


def is_live(graph: OpGraph) -> Callable[[int], bool]:
    """`live_ops(graph)[i]` as a function."""
    return live_ops(graph).__getitem__

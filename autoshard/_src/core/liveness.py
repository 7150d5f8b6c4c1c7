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


def _roots(graph: OpGraph) -> list[int]:
    """Ops live whatever reads them: producers of the step's outputs and ops with effects."""
    values = graph.values
    out = [p for v in graph.outputs if (p := values[v].producer) is not None]
    out += [op.index for op in graph.ops
            if not op.outputs or op.params.get("effectful") or op.primitive in EFFECTFUL]
    return out


def live_ops(graph: OpGraph) -> np.ndarray:
    """Per op (bool, read-only): does XLA keep it? Cached on the graph (computed once per step)."""
    cached = graph.cache.get("live")
    if cached is not None and cached[0] == len(graph.ops):
        return cached[1]
    values, ops = graph.values, graph.ops
    carried_by: dict[int, list[int]] = defaultdict(list)
    for v, uids in graph.carried.items():
        for uid in uids:
            carried_by[uid].append(v)
    live = np.zeros(len(ops), dtype=bool)
    running: set[int] = set()              # loops with a live op: their carried values are read
    stack = _roots(graph)
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
    live = is_live(graph)
    return {i: (w if live(i) else 0.0) for i, w in weights.items()}


def is_live(graph: OpGraph) -> Callable[[int], bool]:
    """`live_ops(graph)[i]` as a function, for callers asking about a few ops of a deep graph: an op
    is live when it is a root or one of its readers is, found by a walk to the nearest root (the
    latest reader first: a forward op's path runs through its own backward to a parameter update)
    instead of marking the whole graph. Loops with carried values: `live_ops`. Cached on the graph."""
    full = graph.cache.get("live")
    if full is not None and full[0] == len(graph.ops):
        return full[1].__getitem__
    if graph.carried:
        return live_ops(graph).__getitem__
    hit = graph.cache.get("live_walk")
    if hit is None:
        hit = graph.cache["live_walk"] = _LiveWalk(graph).live
    return hit


class _LiveWalk:
    def __init__(self, graph: OpGraph) -> None:
        self.g = graph
        self.known: dict[int, bool] = {}
        self.outputs = set(graph.outputs)

    def root(self, i: int) -> bool:
        op = self.g.ops[i]
        return (not op.outputs or bool(op.params.get("effectful")) or op.primitive in EFFECTFUL
                or not self.outputs.isdisjoint(op.outputs))

    def readers(self, i: int) -> list[int]:
        values = self.g.values
        return sorted({c for v in self.g.ops[i].outputs for c in values[v].consumers}, reverse=True)

    def live(self, i: int) -> bool:
        known = self.known
        if i in known:
            return known[i]
        if self.root(i):          # most asked of a deep step: its other layers' updates, read no further
            known[i] = True
            return True
        # depth first: `path` holds the walk from `i`, each with its readers left to try
        path: list[tuple[int, list[int]]] = [(i, self.readers(i))]
        seen = {i}
        found = self.root(i)
        while path and not found:
            _, todo = path[-1]
            if not todo:
                path.pop()
                continue
            c = todo.pop(0)
            if c in seen or known.get(c) is False:
                continue
            seen.add(c)
            if known.get(c) or self.root(c):
                found = True
                break
            path.append((c, self.readers(c)))
        if found:                 # the walk's ops lead to a root
            for j, _ in path:
                known[j] = True
            if len(seen) > 1:
                known[c] = True
        else:                     # every op reachable from `i` was seen: none reaches a root
            for j in seen:
                known[j] = False
        known[i] = found
        return found

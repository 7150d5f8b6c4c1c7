"""Cutting a loss into a DAG of stages (GraphPipe plans): which stage runs each eqn, and which values
each stage sends to which successor. Pure Python over eqn indices and value keys (no jax), so the
rules are unit-tested on small synthetic programs.

Rules: an eqn reading a parameter the plan places runs on that stage when every stage its inputs
come from precedes it in the DAG, otherwise on the earliest stage (topological order) that follows
all of them. An eqn reading only values runs on the earliest stage following all its inputs'
stages (branches meet at their join). An eqn reading no value at all (only parameters the plan does
not place, such as tied weights) runs on the latest stage preceding every consumer. A value used on
another stage goes straight there: the runtime's edges are exactly these transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import networkx as nx

from ...core.errors import PipelineError


def plan_edges(stages: Sequence[Any]) -> list[tuple[int, int]] | None:
    """The plan's stage edges, or None when they form the chain 0 -> 1 -> ... -> S-1."""
    edges = sorted({(int(a), int(st.index)) for st in stages for a in st.after})
    return None if edges == [(s, s + 1) for s in range(len(stages) - 1)] else edges


def _order(S: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    g = nx.DiGraph(list(edges))
    g.add_nodes_from(range(S))
    try:
        return list(nx.lexicographical_topological_sort(g))
    except nx.NetworkXUnfeasible:
        raise PipelineError(f"autoshard.pipelined: the plan's stage edges {list(edges)} have a cycle.") from None


def assign(S: int, edges: Sequence[tuple[int, int]], plan_anchor: Sequence[int | None],
           key_ins: Sequence[Sequence[Any]], outputs: Sequence[Sequence[Any]], batch_only: Sequence[bool],
           loss_key: Any) -> tuple[list[int], list[tuple[int, int]], dict[int, list[Any]], int]:
    """(stage per eqn (-1: batch-only, recomputed where needed), the runtime's edges, the values
    each stage sends (to every successor), the sink stage that returns the loss)."""
    order = _order(S, edges)
    pos = {s: i for i, s in enumerate(order)}
    reach = {s: {s} for s in range(S)}                 # s and every stage after it
    for s in reversed(order):
        for a, b in edges:
            if a == s:
                reach[s] |= reach[b]
    sinks = [s for s in range(S) if not any(a == s for a, _ in edges)]
    if len(sinks) != 1:
        raise PipelineError(f"autoshard.pipelined: the plan's stage DAG {list(edges)} has sinks {sinks}; the runtime "
                          "needs exactly one last stage (it returns the loss).")
    sink = sinks[0]
    producer = {k: e for e, outs in enumerate(outputs) for k in outs}
    n = len(key_ins)
    stage = [-1] * n
    floating: list[int] = []

    def earliest_after(srcs: set[int]) -> int:
        common = [c for c in range(S) if all(c in reach[i] for i in srcs)]
        if not common:
            raise PipelineError(f"autoshard.pipelined: stages {sorted(srcs)} of the plan's DAG {list(edges)} have no "
                              "common later stage to combine their values on.")
        return min(common, key=pos.__getitem__)

    for e in range(n):
        if batch_only[e]:
            continue
        srcs = {stage[producer[k]] for k in key_ins[e] if k in producer and not batch_only[producer[k]]}
        srcs.discard(-2)                              # inputs from floating eqns impose nothing
        a = plan_anchor[e]
        if a is not None:
            stage[e] = a if all(a in reach[i] for i in srcs) else earliest_after(srcs | {a})
        elif srcs:
            stage[e] = earliest_after(srcs)
        else:
            stage[e] = -2
            floating.append(e)
    for e in reversed(floating):                      # consumers first: they are later in program order
        outs = set(outputs[e])
        users = {stage[c] for c in range(e + 1, n) if not batch_only[c] and outs & set(key_ins[c])}
        if loss_key in outs:
            users.add(sink)
        if not users:
            stage[e] = order[0]
            continue
        before_all = [c for c in range(S) if all(u in reach[c] for u in users)]
        stage[e] = max(before_all, key=pos.__getitem__)   # a sink is after every stage: never empty

    run_edges: set[tuple[int, int]] = set()
    sends: dict[int, list[Any]] = {s: [] for s in range(S)}
    users_of: dict[Any, set[int]] = {}
    for c in range(n):
        if batch_only[c]:
            continue
        for k in key_ins[c]:
            if k in producer and not batch_only[producer[k]]:
                users_of.setdefault(k, set()).add(stage[c])
    if loss_key in producer and not batch_only[producer[loss_key]]:
        users_of.setdefault(loss_key, set()).add(sink)
    for k in sorted(users_of, key=lambda k: producer[k]):
        made = stage[producer[k]]
        far = users_of[k] - {made}
        if far:
            sends[made].append(k)
            run_edges.update((made, u) for u in far)
    # the runtime's edges are the transfers (a plan edge nothing crosses orders nothing); every
    # stage but the sink must feed a later one
    idle = [s for s in range(S) if s != sink and not sends[s]]
    if idle:
        raise PipelineError(
            f"autoshard.pipelined: stage(s) {idle} of the plan's DAG compute nothing a later stage uses (the loss "
            f"has no eqns for them or only dead ones); the runtime needs every stage to feed the sink {sink}. Fix: "
            "plan with fewer stages, or cut a chain (a 'pipe' mesh axis, pipeline='rannc').")
    return stage, sorted(run_edges), sends, sink

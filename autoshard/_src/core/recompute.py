"""A user's rematerialisation, undone (pure: no jax import).

`jax.checkpoint` / `nn.remat` blocks reach the traced step twice: their forward ops, and inside the
backward a recomputation of them (the ops of the block's backward call that read no cotangent) beside
their transposes. A GPU backend runs the recomputation and frees the forward values; XLA:CPU drops the
optimization barriers that keep the recomputation late before it schedules (docs/memory.md), and its
compiled programs hold the same buffers with and without the user's remat (a 6-block Dense/GELU MLP at
batch 256: temp 23,856,128 B with, 23,859,200 B without; a 2-layer post-LN encoder at batch 8:
3,344,452 B both), so a step compiled there is priced as if no block were recomputed. `without_recomputation(graph)` is
that step: every backward read of a recomputed value reads the forward value it recomputes, and the
recomputation itself moves to the forward phase, where nothing reads it (the op and value ids stay, so
the factor analysis numbers the dims as before).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from .attribution import parse_scope
from .graph import OpGraph

_CONSTANTS = ("literal", "const")


def recomputed_values(graph: OpGraph) -> tuple[dict[int, int], set[int]]:
    """(recomputed value -> the forward value it recomputes, the recomputing ops). An op of a backward
    remat call recomputes when each input is a forward value, a program input, a literal or another
    recomputed value, and a forward op applies the same primitive to the corresponding values (a literal
    matches a literal of its shape: each use of a constant is a value of its own)."""
    hit = graph.cache.get("recomputed values")
    if hit is not None:
        return hit
    ops = graph.ops
    calls: dict[int, list[int]] = defaultdict(list)
    for op in ops:
        if op.phase == "backward" and op.remat_eqn >= 0:
            calls[op.top_eqn].append(op.index)
    alias: dict[int, int] = {}
    recomputing: set[int] = set()
    by_module: dict[str, list[int]] = {}        # forward ops per module, for ops of literals alone
    for members in calls.values():
        used: set[int] = set()
        for i in members:
            mapped = _forward_inputs(graph, ops[i].inputs, alias)
            twin = None if mapped is None else _forward_twin(graph, i, mapped, used, by_module)
            if twin is None:
                continue
            used.add(twin)
            recomputing.add(i)
            alias.update(zip(ops[i].outputs, ops[twin].outputs, strict=True))
    graph.cache["recomputed values"] = hit = (alias, recomputing)
    return hit


def _forward_inputs(graph: OpGraph, inputs: tuple[int, ...], alias: dict[int, int]) -> list[int | None] | None:
    """The inputs with recomputed values replaced by their forward originals and literals by None; None
    when one is a value of the backward pass (a cotangent: the op is a transpose)."""
    out: list[int | None] = []
    for x in inputs:
        if x in alias:
            out.append(alias[x])
            continue
        val = graph.values[x]
        if val.kind in _CONSTANTS:
            out.append(None)
            continue
        if val.producer is not None and graph.ops[val.producer].phase == "backward":
            return None
        out.append(x)
    return out


def _forward_twin(graph: OpGraph, i: int, inputs: list[int | None], used: set[int],
                  by_module: dict[str, list[int]]) -> int | None:
    """A forward op computing what op `i` computes from `inputs` (None: a literal of the same shape); for an
    op of literals alone, the first unmatched forward op of its module doing the same (`by_module`: the
    forward ops per module, filled on first use)."""
    op = graph.ops[i]
    anchor = next((x for x in inputs if x is not None), None)
    if anchor is None:
        if not by_module:
            for c, other in enumerate(graph.ops):
                if other.phase == "forward":
                    by_module.setdefault(parse_scope(other.scope)[0], []).append(c)
        candidates = (c for c in by_module.get(parse_scope(op.scope)[0], ()) if c not in used)
    else:
        candidates = iter(graph.values[anchor].consumers)
    for c in candidates:
        twin = graph.ops[c]
        if (twin.phase == "forward" and twin.primitive == op.primitive and twin.out_shapes == op.out_shapes
                and twin.out_dtypes == op.out_dtypes and twin.in_shapes == op.in_shapes
                and all(x == y if x is not None else graph.values[y].kind in _CONSTANTS
                        for x, y in zip(inputs, twin.inputs, strict=True))):
            return c
    return None


def without_recomputation(graph: OpGraph) -> OpGraph | None:
    """The step as if no user remat block were recomputed (module docstring); None when it has none."""
    alias, recomputing = recomputed_values(graph)
    if not recomputing:
        return None
    values = dict(graph.values)
    ops = list(graph.ops)
    moved: dict[int, list[int]] = defaultdict(list)      # forward value -> its new backward readers
    for i, op in enumerate(graph.ops):
        if i in recomputing:
            ops[i] = dataclasses.replace(op, phase="forward")
            continue
        if any(x in alias for x in op.inputs):
            ops[i] = dataclasses.replace(op, inputs=tuple(alias.get(x, x) for x in op.inputs))
            for x in op.inputs:
                if x in alias:
                    moved[alias[x]].append(i)
    for v, readers in moved.items():
        values[v] = dataclasses.replace(values[v], consumers=sorted(set(values[v].consumers) | set(readers)))
    for v in alias:
        kept = [c for c in values[v].consumers if c in recomputing]
        values[v] = dataclasses.replace(values[v], consumers=kept)
    return OpGraph(ops, values, list(graph.inputs), list(graph.outputs), list(graph.output_keypaths),
                   list(graph.output_keypath_parts), graph.name, None, dict(graph.carried))

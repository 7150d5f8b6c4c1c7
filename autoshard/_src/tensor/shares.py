"""Ops that carry the batch but that no factor links to it (pure: no jax import).

A dim takes a factor of its own when no op links it to anything: a constant or iota broadcast to
[batch, heads, q, k] whose new dims meet no elementwise partner. Left alone, the evaluator divides
such an op by nothing and prices it at the whole traced batch on every device, although XLA builds
it per device at the shard's size (its consumers, or the partitioner, split it like the batch).
The fallback: such a dim, of the traced batch's size and linked to no program input, is divided
like the batch factor of that size.
"""

from __future__ import annotations

from ..core.graph import OpGraph, traced_batch
from .experts import batch_factors
from .factors import FactorGraph


def unlinked_batch_loops(graph: OpGraph, fg: FactorGraph) -> dict[int, frozenset[int]]:
    """op -> the batch factor its unlinked batch-sized dims divide like (only ops that need one).
    Cached on `fg` (the evaluators of one space share it)."""
    cached = getattr(fg, "_unlinked_batch", None)
    if cached is not None:
        return cached
    size = traced_batch(graph)
    batch = [f for f in batch_factors(graph, fg) if size in fg.factor_sizes.get(f, ())]
    out: dict[int, frozenset[int]] = {}
    if batch and size > 1:
        # factors some program input carries are real dims (a parameter's rows of the batch's size)
        anchored = {f for v in fg.factored_inputs() for f in fg.value_factors(v) if f is not None}
        for i, of in fg.op_factors.items():
            if of.loop & set(batch) or not of.known:
                continue
            op = graph.ops[i]
            fresh = any(s == size and f is not None and f not in anchored
                        for shape, v in zip(op.out_shapes, op.outputs, strict=True)
                        for s, f in zip(shape, fg.value_factors(v, len(shape)), strict=True))
            if fresh:
                out[i] = frozenset(batch[:1])
    fg._unlinked_batch = out
    return out

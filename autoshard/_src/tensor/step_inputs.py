"""What a step's inputs and its optimizer update weigh, summarised once per traced graph for every evaluator
(pure: no jax import): the parameters' and optimizer state's bytes by the input standing for them, and whether
the update reads a reduction over every gradient (a global norm)."""

from __future__ import annotations

import numpy as np

from ..core.graph import OpGraph
from ..core.optable import PHASE_CODES

_GRADIENT_REDUCTIONS = ("reduce_sum", "reduce_max")      # a global norm (optax.clip_by_global_norm) reads these


def update_reads_all(graph: OpGraph) -> bool:
    """Does the optimizer reduce a gradient-sized tensor (a global norm)? Once per graph: every evaluator
    the 3-D tables build asks."""
    hit = graph.cache.get("update reads all")
    if hit is None:
        t = graph.table()
        reductions = [k for k, p in enumerate(t.primitives) if p in _GRADIENT_REDUCTIONS]
        candidates = np.flatnonzero(np.isin(t.primitive, reductions) & (t.phase == PHASE_CODES["optimizer"]))
        hit = graph.cache["update reads all"] = any(
            graph.ops[i].in_shapes and len(graph.ops[i].in_shapes[0]) > 0 for i in candidates.tolist())
    return hit


def inputs_by_source(graph: OpGraph, in_map: dict[int, int], inputs: list[int]) -> tuple[list, list]:
    """The inputs whose bytes count, summarised once per graph and input map (every evaluator reads them):
    parameters and optimizer state by (role, the input standing for them, shape) as (role, source, shape,
    total bytes, largest bytes) -- a 96-layer model's 4,600 inputs are a few dozen entries -- and the other
    inputs (data, buffers, keys) one by one as (source, shape, bytes), in order."""
    key = ("inputs by source", id(in_map), tuple(inputs))
    hit = graph.cache.get(key)
    if hit is not None and hit[0] is in_map:
        return hit[1]
    stored: dict[tuple, list] = {}
    others = []
    for v in inputs:
        val = graph.values[v]
        src, size = in_map.get(v, v), val.nbytes
        if val.role in ("parameter", "state"):
            entry = stored.setdefault((val.role, src, val.shape), [0, 0])
            entry[0] += size
            entry[1] = max(entry[1], size)
        else:
            others.append((src, val.shape, size))
    out = ([(role, src, shape, float(total), float(big)) for (role, src, shape), (total, big) in stored.items()],
           others)
    graph.cache[key] = (in_map, out)
    return out

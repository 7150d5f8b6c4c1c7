"""Flop estimates per primitive from shapes alone (pure: no jax import).

Conventions follow the usual roofline accounting: a multiply-add is 2 flops, elementwise ops cost
one flop per output element, transcendental ops are counted as one (their cost shows up in the
roofline's bytes term), data movement (reshape, transpose, slicing, broadcasts) costs 0 flops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = tuple[int, ...]

_MOVEMENT = frozenset({
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type",
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "copy",
    "copy_p", "iota", "select_n", "rev", "bitcast_convert_type", "stop_gradient",
    "sharding_constraint", "device_put", "split", "stack", "unstack", "random_bits", "random_wrap", "random_unwrap",
    "random_seed", "random_fold_in", "threefry2x32", "optimization_barrier", "pjit", "reduce_precision",
})
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "reduce_precision",
})


def _size(shape: Shape) -> int:
    return math.prod(shape)   # exact ints (1 for a scalar), and ~20x faster than np.prod per op


def dot_general_flops(lhs: Shape, rhs: Shape, contracting: tuple[Sequence[int], Sequence[int]],
                      batch: tuple[Sequence[int], Sequence[int]]) -> float:
    """2 · batch · free(lhs) · free(rhs) · contracted."""
    (lc, rc), (lb, rb) = contracting, batch
    b = _size(tuple(lhs[i] for i in lb))
    k = _size(tuple(lhs[i] for i in lc))
    m = _size(tuple(d for i, d in enumerate(lhs) if i not in lc and i not in lb))
    n = _size(tuple(d for i, d in enumerate(rhs) if i not in rc and i not in rb))
    return 2.0 * b * m * n * k


def conv_flops(lhs: Shape, rhs: Shape, out: Shape, rhs_in_feature_dim: int,
               rhs_spatial_dims: Sequence[int]) -> float:
    """2 · out elements · (input features per group) · kernel spatial size."""
    per_out = rhs[rhs_in_feature_dim] * _size(tuple(rhs[i] for i in rhs_spatial_dims))
    return 2.0 * _size(out) * per_out


def estimate_flops(primitive: str, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape],
                   params: dict) -> float:
    """Flops of one application of `primitive` (one loop iteration for ops inside loops)."""
    if primitive == "dot_general" and "contracting" in params:
        return dot_general_flops(in_shapes[0], in_shapes[1], params["contracting"], params["batch"])
    if primitive == "conv_general_dilated" and "rhs_in_feature_dim" in params:
        return conv_flops(in_shapes[0], in_shapes[1], out_shapes[0], params["rhs_in_feature_dim"],
                          params["rhs_spatial_dims"])
    if primitive in _MOVEMENT:
        return 0.0
    if primitive in _REDUCTIONS:
        return float(sum(_size(s) for s in in_shapes[:1]))
    if primitive in ("scatter-add", "scatter_add", "scatter", "scatter_mul"):
        return float(_size(in_shapes[-1])) if in_shapes else 0.0
    # elementwise and anything unknown: one flop per output element
    return float(sum(_size(s) for s in out_shapes))

"""How each node computes its part of one inference layer (bridge: imports jax).

A node's part of a layer's output is a *slab*: rows [start, start + length) along one axis, in the
global tensor's coordinates. Lengths are equal on every node (static shapes in an SPMD program): an
uneven split computes max-part rows everywhere and ignores the rows past its own part, and a slab may
overhang the tensor (a fused run's grown region near a border, the padded rows of a window).

`local_rule(layer, eqn, slab)` says, per operand of the layer's eqn, what the node needs:

- an activation: the slab of it to assemble (`Need`, with the value for rows outside the tensor:
  the conv/pool padding value), or the whole tensor (`Need(None)`);
- a weight (computed from the parameters, every node holds it whole): kept, or cut to the node's
  output channels (a conv or dense head split along C);

and the eqn's parameters for the local computation (a window split along its axis gets the padded
rows in its input and no padding of its own there; a split C of a grouped conv gets fewer groups).
Where the local form is not derivable (a flatten split on its joined features, a concat split along
its joined axis, a misaligned grouped conv), `local_rule` returns None: the node computes the whole
layer from whole inputs and keeps its slab, which is always right and costs the gather.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...core.layers import Layer


@dataclasses.dataclass(frozen=True)
class Slab:
    """Rows [starts[node], starts[node] + length) of `axis` on each node, of which the first
    counts[node] matter (a node's part of an uneven split is shorter than the common length; the rest
    is computed on whatever is there and never read)."""

    axis: int
    starts: tuple[int, ...]
    length: int
    counts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.counts is None:
            object.__setattr__(self, "counts", (self.length,) * len(self.starts))

    def shifted(self, scale: int, offset: int, length: int) -> Slab:
        """The input rows a window of stride `scale` reads (padded coordinates), `length` in all."""
        extent = length - (self.length - 1) * scale
        counts = tuple((c - 1) * scale + extent if c > 0 else 0 for c in self.counts)
        return Slab(self.axis, tuple(s * scale + offset for s in self.starts), length, counts)

    def on(self, axis: int) -> Slab:
        return Slab(axis, self.starts, self.length, self.counts)


@dataclasses.dataclass(frozen=True)
class Need:
    """What a node needs of one activation operand: `slab` (None: the whole tensor); rows outside the
    tensor read `fill` (padding)."""

    slab: Slab | None
    fill: float = 0.0


@dataclasses.dataclass(frozen=True)
class Cut:
    """A weight operand cut to the node's slab along `axis` (output channels)."""

    axis: int
    slab: Slab


KEEP = "keep"


@dataclasses.dataclass(frozen=True)
class LocalRule:
    operands: tuple[Any, ...]    # per eqn invar: Need (activation), Cut or KEEP (weight / literal)
    params: dict[str, Any]       # the eqn's params for the local computation


def _pad_fill(primitive: str, dtype: Any) -> float | None:
    """The value a window op pads with: 0 for conv and sums, -inf / +inf for max / min pooling."""
    if primitive in ("conv_general_dilated", "reduce_window_sum"):
        return 0.0
    lo, hi = (-np.inf, np.inf) if np.issubdtype(dtype, np.floating) else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    return {"reduce_window_max": lo, "reduce_window_min": hi}.get(primitive)


def local_rule(layer: Layer, eqn: Any, slab: Slab | None, is_activation: tuple[bool, ...]) -> LocalRule | None:
    """The local form of `eqn` (the layer's op) computing `slab` of its output, or None (compute whole)."""
    if slab is None:
        return None
    kind = layer.kind
    if kind in ("conv", "pool"):
        return _window(layer, eqn, slab, is_activation)
    if kind == "dense":
        return _dense(eqn, slab, is_activation)
    if kind in ("reduce", "global_pool"):
        axes = set(layer.reduce_axes)
        kept = [a for a in range(len(layer.input_shapes[0])) if a not in axes]
        return LocalRule((Need(slab.on(kept[slab.axis])),), dict(eqn.params))
    if kind == "flatten":
        if slab.axis != 0:
            return None
        params = dict(eqn.params, new_sizes=(slab.length, *tuple(eqn.params["new_sizes"])[1:]))
        return LocalRule((Need(slab),), params)
    if kind == "concat":
        if slab.axis == layer.axis:
            return None
        return LocalRule(tuple(Need(slab) for _ in eqn.invars), dict(eqn.params))
    return _broadcasting(layer, eqn, slab, is_activation)


def _window(layer: Layer, eqn: Any, slab: Slab, is_activation: tuple[bool, ...]) -> LocalRule | None:
    prim, p = eqn.primitive.name, dict(eqn.params)
    fill = _pad_fill(prim, eqn.invars[0].aval.dtype)
    rank = len(layer.output_shape)
    if fill is None or not is_activation[0] or any(is_activation[1:]):
        return None
    if 0 < slab.axis < rank - 1:                     # spatial: the padded rows come with the input
        w = slab.axis - 1
        window = layer.window
        assert window is not None
        if window.lhs_dilation[w] != 1:
            return None
        k, s, d = window.kernel[w], window.strides[w], window.dilation[w]
        lo = window.padding[w][0]
        need = slab.shifted(s, -lo, (slab.length - 1) * s + (k - 1) * d + 1)
        key = "padding"
        pads = list(map(tuple, p[key]))
        pads[w if prim == "conv_general_dilated" else slab.axis] = (0, 0)
        p[key] = tuple(pads)
        operands = [Need(need, fill)] + [KEEP] * (len(eqn.invars) - 1)
        return LocalRule(tuple(operands), p)
    if slab.axis == 0 or prim != "conv_general_dilated":    # batch, or a pool's channels: same slab in
        return LocalRule((Need(slab, fill), *[KEEP] * (len(eqn.invars) - 1)), p)
    out_dim = p["dimension_numbers"].rhs_spec[0]             # conv output channels: cut the kernel
    groups = p["feature_group_count"]
    if groups == 1:
        return LocalRule((Need(None), Cut(out_dim, slab)), p)
    per_out = layer.output_shape[-1] // groups
    per_in = layer.input_shapes[0][-1] // groups
    if slab.length % per_out or any(s % per_out for s in slab.starts):
        return None
    need = Slab(slab.axis, tuple(s // per_out * per_in for s in slab.starts), slab.length // per_out * per_in,
                tuple(-(-c // per_out) * per_in for c in slab.counts))
    return LocalRule((Need(need), Cut(out_dim, slab)), dict(p, feature_group_count=slab.length // per_out))


def _dense(eqn: Any, slab: Slab, is_activation: tuple[bool, ...]) -> LocalRule | None:
    (lhs_c, rhs_c), _ = eqn.params["dimension_numbers"]
    rank = len(eqn.outvars[0].aval.shape)
    if not is_activation[0] or is_activation[1]:
        return None
    if slab.axis < rank - 1:
        return LocalRule((Need(slab), KEEP), dict(eqn.params))
    free = [d for d in range(len(eqn.invars[1].aval.shape)) if d not in rhs_c]
    if len(free) != 1:
        return None
    return LocalRule((Need(None), Cut(free[0], slab)), dict(eqn.params))


def _broadcasting(layer: Layer, eqn: Any, slab: Slab, is_activation: tuple[bool, ...]) -> LocalRule | None:
    """Elementwise ops, batch norm, residual adds: each operand gives the same slab where it has the axis
    (a size-1 or missing dim broadcasts: whole); `shape` params follow the local output."""
    out = layer.output_shape
    operands = []
    for var, act in zip(eqn.invars, is_activation, strict=True):
        shape = tuple(getattr(var.aval, "shape", ()))
        dim = slab.axis - (len(out) - len(shape))
        along = dim >= 0 and shape[dim] != 1
        if act:
            operands.append(Need(slab.on(dim)) if along else Need(None))
        else:
            operands.append(Cut(dim, slab) if along else KEEP)
    params = dict(eqn.params)
    if "shape" in params:
        if eqn.primitive.name != "broadcast_in_dim":
            return None
        params["shape"] = tuple(slab.length if a == slab.axis else s for a, s in enumerate(params["shape"]))
    return LocalRule(tuple(operands), params)

"""Inference layers as plain data and what each one's output regions read (pure): BBGraP's
Eq. 3-6 applied per layer kind -- windows (conv, pool), pass-through (elementwise, batch norm,
residual adds), concatenation, reductions and global pooling, dense heads, flatten. The interval and
window arithmetic they use lives in `shapemap`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple, cast

from .errors import ConfigError
from .shapemap import Interval, IntervalSet, ShapeMap, Window, check_int

# ---- layers and what each reads ---------------------------------------------------------------------------


def _shape(value: object, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(value)  # type: ignore[arg-type]
    except TypeError as err:
        raise ConfigError(f"autoshard: {what}={value!r} must be a tuple of ints.") from err
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise ConfigError(f"autoshard: {what}={value!r} has size {d!r}; sizes must be ints >= 0.")
    return tuple(int(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of an inference graph as plain data (channels-last shapes), filled by hand or by a tracer
    from a jaxpr (conv_general_dilated -> kind "conv", reduce_window -> "pool", ...).

    kind: one of LAYER_KINDS. `inputs` names earlier layers (graph inputs are kind "input" layers);
    `input_shapes` holds one shape per input. `window`: conv/pool geometry. `feature_group_count`: lax's,
    for grouped and depthwise convs. `axis`: concat's joined axis. `reduce_axes`: the input axes a
    reduce removes (global_pool: the spatial axes, filled in when omitted); an output of the input's
    rank means keepdims. `itemsize`: bytes per output element.
    """

    name: str
    kind: str
    inputs: tuple[str, ...] = ()
    input_shapes: tuple[tuple[int, ...], ...] = ()
    output_shape: tuple[int, ...] = ()
    window: Window | None = None
    feature_group_count: int = 1
    axis: int | None = None
    reduce_axes: tuple[int, ...] = ()
    itemsize: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"autoshard: layer name {self.name!r} must be a non-empty string.")
        if self.kind not in LAYER_KINDS:
            raise ConfigError(f"autoshard: layer {self.name!r} has kind {self.kind!r}; known kinds: "
                              f"{', '.join(LAYER_KINDS)}.")
        inputs = (self.inputs,) if isinstance(self.inputs, str) else tuple(self.inputs)
        shapes = tuple(_shape(s, f"layer {self.name!r} input shape") for s in self.input_shapes)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "input_shapes", shapes)
        object.__setattr__(self, "output_shape", _shape(self.output_shape, f"layer {self.name!r} output_shape"))
        object.__setattr__(self, "reduce_axes", tuple(sorted(self.reduce_axes)))
        check_int(f"layer {self.name!r} itemsize", self.itemsize, 1)
        check_int(f"layer {self.name!r} feature_group_count", self.feature_group_count, 1)
        if len(inputs) != len(shapes):
            raise self.error(f"{len(inputs)} inputs {inputs} but {len(shapes)} input_shapes",
                             "give one shape per input")
        LAYER_KINDS[self.kind].check(self)

    def error(self, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"autoshard: layer {self.name!r} ({self.kind}): {problem}; {fix}.")

    @property
    def output_nbytes(self) -> int:
        return math.prod(self.output_shape) * self.itemsize


def required_input(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """The part of each operand that computing `region` of the layer's output reads (one per input)."""
    if region.rank != len(layer.output_shape):
        raise layer.error(f"output region {region} has rank {region.rank}, the output {layer.output_shape} "
                          f"rank {len(layer.output_shape)}", "give a region of the output's rank")
    if region.is_empty:
        return tuple(ShapeMap.empty(len(s)) for s in layer.input_shapes)
    return LAYER_KINDS[layer.kind].required(layer, region)


def _arity(layer: Layer, low: int, high: int | None = None) -> None:
    n = len(layer.inputs)
    if n < low or (high is not None and n > high):
        want = f"exactly {low}" if high == low else f"at least {low}" if high is None else f"{low}-{high}"
        raise layer.error(f"{n} inputs", f"this kind takes {want}")


def _check_input(layer: Layer) -> None:
    _arity(layer, 0, 0)


def _check_window(layer: Layer) -> None:
    _arity(layer, 1, 1)
    (shape,), out, window = layer.input_shapes, layer.output_shape, layer.window
    if window is None:
        raise layer.error("no window", "give Window(kernel, strides, padding, dilation)")
    if not len(shape) == len(out) == len(window.kernel) + 2:
        raise layer.error(f"input {shape} / output {out} for a {len(window.kernel)}-D window",
                          "give channels-last shapes with one window entry per spatial dim")
    spatial = window.output_spatial(shape[1:-1])   # raises when the kernel outgrows the padded input
    channels_ok = out[-1] == shape[-1] if layer.kind == "pool" else True
    if out[0] != shape[0] or out[1:-1] != spatial or not channels_ok:
        raise layer.error(f"output {out} does not follow from input {shape} and {window}",
                          f"expected batch {shape[0]}, spatial {spatial}" + (f", channels {shape[-1]}"
                                                                           if layer.kind == "pool" else ""))
    groups = layer.feature_group_count
    if layer.kind == "conv" and (shape[-1] % groups or out[-1] % groups):
        raise layer.error(f"feature_group_count={groups} does not divide input channels {shape[-1]} and output "
                          f"channels {out[-1]}", "use a group count dividing both (depthwise: the input channels)")


def _check_broadcast(layer: Layer) -> None:
    _arity(layer, {"batchnorm": 1, "add": 2}.get(layer.kind, 1), 1 if layer.kind == "batchnorm" else None)
    out = layer.output_shape
    for shape in layer.input_shapes:
        lead = len(out) - len(shape)
        if lead < 0 or any(s not in (1, out[lead + j]) for j, s in enumerate(shape)):
            raise layer.error(f"input shape {shape} does not broadcast to output {out}",
                              "give shapes equal to the output or of size 1 in broadcast dims")


def _check_concat(layer: Layer) -> None:
    _arity(layer, 1)
    out, axis = layer.output_shape, layer.axis
    if axis is None or not 0 <= axis < len(out):
        raise layer.error(f"axis={axis!r}", f"give the joined axis, 0..{len(out) - 1}")
    others = [s[:axis] + s[axis + 1:] for s in layer.input_shapes]
    if any(o != out[:axis] + out[axis + 1:] for o in others) or sum(s[axis] for s in layer.input_shapes) != out[axis]:
        raise layer.error(f"inputs {layer.input_shapes} do not concatenate to {out} along axis {axis}",
                          "fix the shapes or the axis")


def _check_reduce(layer: Layer) -> None:
    _arity(layer, 1, 1)
    (shape,), out = layer.input_shapes, layer.output_shape
    if layer.kind == "global_pool" and not layer.reduce_axes:
        if len(shape) < 3:
            raise layer.error(f"input {shape} has no spatial dims", "global pooling needs NWC or NHWC input")
        object.__setattr__(layer, "reduce_axes", tuple(range(1, len(shape) - 1)))
    axes = layer.reduce_axes
    if not axes or any(not 0 <= a < len(shape) for a in axes) or len(set(axes)) != len(axes):
        raise layer.error(f"reduce_axes={axes!r} for input {shape}", f"give distinct axes in 0..{len(shape) - 1}")
    dropped = tuple(s for a, s in enumerate(shape) if a not in axes)
    kept = tuple(1 if a in axes else s for a, s in enumerate(shape))
    if out not in (dropped, kept):
        raise layer.error(f"output {out} is not input {shape} reduced over {axes}", f"expected {dropped} or {kept}")


def _check_dense(layer: Layer) -> None:
    _arity(layer, 1, 1)
    (shape,), out = layer.input_shapes, layer.output_shape
    if len(shape) < 2 or len(out) != len(shape) or out[:-1] != shape[:-1]:
        raise layer.error(f"input {shape} -> output {out}", "a dense layer maps (..., features_in) to "
                          "(..., features_out) and keeps the leading dims")


def _check_flatten(layer: Layer) -> None:
    _arity(layer, 1, 1)
    (shape,), out = layer.input_shapes, layer.output_shape
    if len(shape) < 1 or out != (shape[0], math.prod(shape[1:])):
        raise layer.error(f"input {shape} -> output {out}", "flatten keeps the batch and joins the rest: "
                          f"expected {(shape[0], math.prod(shape[1:])) if shape else '(N, ...)'}")


def _window_rule(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """Spatial dims through Eq. 4-6; batch passes; pooling keeps channels, a conv reads its group's."""
    (shape,), window = layer.input_shapes, cast(Window, layer.window)   # present: checked at construction
    dims = list(region.dims)
    for i in range(len(shape) - 2):
        dim, size = window.dim(i), shape[1 + i]
        dims[1 + i] = region.dims[1 + i].map(lambda iv, d=dim, n=size: d.input_interval(iv, n))
    if layer.kind == "conv":
        groups = layer.feature_group_count
        per_in, per_out = shape[-1] // groups, layer.output_shape[-1] // groups
        dims[-1] = region.dims[-1].map(lambda iv: Interval(iv.start // per_out * per_in,
                                                           ((iv.stop - 1) // per_out + 1) * per_in))
    return (ShapeMap(tuple(dims)),)


def _broadcast_rule(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """Elementwise ops, inference batch norm (a per-channel affine) and residual adds read the same
    elements they write; a broadcast operand reads its single element along broadcast dims."""
    out, result = layer.output_shape, []
    for shape in layer.input_shapes:
        lead = len(out) - len(shape)
        result.append(ShapeMap(tuple(IntervalSet.range(0, 1) if s == 1 and out[lead + j] != 1
                                     else region.dims[lead + j] for j, s in enumerate(shape))))
    return tuple(result)


def _concat_rule(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """Each operand supplies its slice of the joined axis; a node reads only the operands it overlaps."""
    axis, offset, result = cast(int, layer.axis), 0, []
    for shape in layer.input_shapes:
        part = region.dims[axis].intersect(IntervalSet.range(offset, offset + shape[axis]))
        result.append(region.with_dim(axis, part.map(lambda iv, o=offset: Interval(iv.start - o, iv.stop - o))))
        offset += shape[axis]
    return tuple(result)


def _reduce_rule(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """A reduction (global pooling included) reads its reduced axes whole: a split along one of them
    needs every node's part (full synchronisation or partial results)."""
    (shape,) = layer.input_shapes
    keepdims = len(layer.output_shape) == len(shape)
    out_dims, dims = iter(region.dims), []
    for axis, size in enumerate(shape):
        if axis in layer.reduce_axes:
            dims.append(IntervalSet.range(0, size))
            if keepdims:
                next(out_dims)
        else:
            dims.append(next(out_dims))
    return (ShapeMap(tuple(dims)),)


def _dense_rule(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """A dense head reads every input feature of the rows it computes."""
    return (region.with_dim(region.rank - 1, IntervalSet.range(0, layer.input_shapes[0][-1])),)


def _flatten_rule(layer: Layer, region: ShapeMap) -> tuple[ShapeMap, ...]:
    """Batch rows pass; the joined dims are read whole (exact for a whole feature range, a superset for a
    part of it, which is not a box of the input)."""
    (shape,) = layer.input_shapes
    return (ShapeMap((region.dims[0],) + tuple(IntervalSet.range(0, s) for s in shape[1:])),)


class LayerKind(NamedTuple):
    """What a layer kind accepts (`check` raises ConfigError) and what its output regions read."""

    check: Callable[[Layer], None]
    required: Callable[[Layer, ShapeMap], tuple[ShapeMap, ...]]


LAYER_KINDS: dict[str, LayerKind] = {
    "input": LayerKind(_check_input, lambda layer, region: ()),
    "conv": LayerKind(_check_window, _window_rule),
    "pool": LayerKind(_check_window, _window_rule),
    "elementwise": LayerKind(_check_broadcast, _broadcast_rule),
    "batchnorm": LayerKind(_check_broadcast, _broadcast_rule),
    "add": LayerKind(_check_broadcast, _broadcast_rule),
    "concat": LayerKind(_check_concat, _concat_rule),
    "reduce": LayerKind(_check_reduce, _reduce_rule),
    "global_pool": LayerKind(_check_reduce, _reduce_rule),
    "dense": LayerKind(_check_dense, _dense_rule),
    "flatten": LayerKind(_check_flatten, _flatten_rule),
}

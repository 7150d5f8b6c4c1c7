"""An inference function as BBGraP layers: the jaxpr of `apply_fn(params, images)` turned into the
pure core's `layers.Layer` descriptors (imports jax).

Only values computed from the images are layers; everything computed from the parameters alone
(kernels, batch-norm scales folded into constants) is weight data every node holds whole. Each
eqn on activations maps to a layer kind:

    conv_general_dilated (NHWC / NWC)      conv   (window from strides, padding, rhs_dilation)
    reduce_window_{max,sum,min}            pool   (spatial windows only)
    dot_general on the last dim            dense
    reduce_{sum,max,min} over axes         global_pool (all spatial axes) or reduce
    reshape to (N, rest)                   flatten
    concatenate                            concat
    binary ops of two activations          add (any elementwise combination of two maps)
    anything else shape-preserving         elementwise (activation functions, inference batch norm,
                                           casts, broadcasts of weights onto the map)

Anything else on activations (a transpose, a gather) is a PlanError naming the primitive, so the
partitioner never reasons about a layer it does not understand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ...core.errors import ConfigError, PlanError
from ...core.layers import Layer
from ...core.shapemap import Window
from .. import compat as jc
from ..trace.trace import check_args, make_jaxpr

_POOLS = ("reduce_window_max", "reduce_window_sum", "reduce_window_min", "reduce_window")
_REDUCES = ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin")


@dataclasses.dataclass(frozen=True)
class TracedInference:
    """`fn(*args)` flattened to one program, with the layers it holds."""

    layers: tuple[Layer, ...]
    program: Any                          # compat.FlatProgram
    in_tree: Any                          # treedef of args
    out_tree: Any                         # treedef of the result
    input_keys: dict[Any, str]            # program input key -> its "input" layer name (the data leaves)
    eqn_layers: dict[int, str]            # eqn index -> its layer name (eqns on activations)
    act_keys: frozenset                   # program keys holding activations (computed from the data)

    @property
    def by_name(self) -> dict[str, Layer]:
        return {layer.name: layer for layer in self.layers}


def inference_layers(fn: Callable, *args: Any, data_argnums: Sequence[int] = (1,)) -> tuple[Layer, ...]:
    """The layers of `fn(*args)` (arrays or ShapeDtypeStructs) in program order: one "input" layer per
    leaf of the arguments in `data_argnums`, then one layer per eqn on activations."""
    return trace_inference(fn, *args, data_argnums=data_argnums).layers


def trace_inference(fn: Callable, *args: Any, data_argnums: Sequence[int] = (1,)) -> TracedInference:
    """`inference_layers` with the flat program they come from (for emission)."""
    bad = [i for i in data_argnums if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(args)]
    if bad or not data_argnums:
        raise ConfigError(f"autoshard (inference): data_argnums={tuple(data_argnums)!r} must name at least one of "
                          f"the {len(args)} positional arguments (0-based); the images are usually argument 1.")
    check_args(args)                 # the train mode's argument checks: a typed error naming the leaf
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)), args)
    closed, out_shape = make_jaxpr(fn, structs, getattr(fn, "__qualname__", type(fn).__qualname__))
    prog = jc.flatten_calls(closed)
    leaves_per_arg = [len(jax.tree.leaves(a)) for a in args]
    starts = np.cumsum([0, *leaves_per_arg])
    names: dict[Any, str] = {}
    shapes: dict[Any, tuple[int, ...]] = {}
    layers: list[Layer] = []
    for i in sorted(set(data_argnums)):
        for k in range(int(starts[i]), int(starts[i + 1])):
            key, aval = prog.inputs[k], closed.jaxpr.invars[k].aval
            names[key], shapes[key] = f"input{len(layers)}", tuple(aval.shape)
            layers.append(Layer(names[key], "input", output_shape=tuple(aval.shape), itemsize=aval.dtype.itemsize))
    input_keys = dict(names)
    eqn_layers: dict[int, str] = {}
    for n, fe in enumerate(prog.eqns):
        acts = [a for a in fe.inputs if not jc.is_literal(a) and a in names]
        if not acts:
            continue                          # weights only: held whole by every node
        out = fe.eqn.outvars[0].aval
        name = f"{n}:{fe.eqn.primitive.name}"
        layer = _layer(name, fe.eqn, [names[a] for a in acts], [shapes[a] for a in acts], tuple(out.shape),
                       out.dtype.itemsize)
        layers.append(layer)
        eqn_layers[n] = name
        for k in fe.outputs:
            names[k], shapes[k] = name, tuple(out.shape)
    return TracedInference(tuple(layers), prog, jax.tree.structure(args), jax.tree.structure(out_shape),
                           input_keys, eqn_layers, frozenset(names))


def _layer(name: str, eqn: Any, inputs: list[str], in_shapes: list[tuple[int, ...]], out: tuple[int, ...],
           itemsize: int) -> Layer:
    prim, p = eqn.primitive.name, eqn.params
    common = dict(name=name, inputs=tuple(inputs), input_shapes=tuple(in_shapes), output_shape=out, itemsize=itemsize)
    if prim == "conv_general_dilated":
        return _conv(common, eqn, in_shapes)
    if prim in _POOLS:
        return _pool(common, p, in_shapes[0])
    if prim == "dot_general":
        return _dense(common, eqn, in_shapes)
    if prim in _REDUCES:
        axes = tuple(int(a) for a in p["axes"])
        spatial = tuple(range(1, len(in_shapes[0]) - 1))
        kind = "global_pool" if axes == spatial and len(in_shapes[0]) >= 3 else "reduce"
        return Layer(kind=kind, reduce_axes=axes, **common)
    if prim == "reshape" and len(out) == 2 and out[0] == in_shapes[0][0]:
        return Layer(kind="flatten", **common)
    if prim == "concatenate":
        if len(inputs) != len(eqn.invars):
            raise _unsupported(name, "a concatenation of activations with constants")
        return Layer(kind="concat", axis=int(p["dimension"]), **common)
    if not _elementwise(eqn):
        raise _unsupported(name, f"a {prim} (input shapes {in_shapes} -> {out}), not an elementwise op")
    if len(inputs) == 2 and all(_broadcasts(s, out) for s in in_shapes):
        return Layer(kind="add", **common)
    if len(inputs) == 1 and _broadcasts(in_shapes[0], out):
        return Layer(kind="elementwise", **common)
    raise _unsupported(name, f"a {prim} of input shapes {in_shapes} -> {out}")


# ops that compute each output element from the same element of each operand (broadcast_in_dim: from the
# element it repeats); calls are elementwise when their bodies are
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p cos cosh
    digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log
    log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    """.split())
_CALL_BODIES = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "pjit": "jaxpr", "jit": "jaxpr",
                "closed_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}


def _elementwise(eqn: Any) -> bool:
    prim = eqn.primitive.name
    if prim in _ELEMENTWISE:
        return True
    if prim == "broadcast_in_dim":       # right-aligned broadcasts only (a bias onto a map, a scalar fill)
        shape, dims = eqn.params["shape"], tuple(eqn.params["broadcast_dimensions"])
        return dims == tuple(range(len(shape) - len(dims), len(shape)))
    body = jc.as_open_jaxpr(eqn.params.get(_CALL_BODIES.get(prim, ""), None))
    return body is not None and all(_elementwise(inner) for inner in body[0].eqns)


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    lead = len(out) - len(shape)
    return lead >= 0 and all(s in (1, out[lead + j]) for j, s in enumerate(shape))


def _conv(common: dict, eqn: Any, in_shapes: list[tuple[int, ...]]) -> Layer:
    p = eqn.params
    dn = p["dimension_numbers"]
    rank = len(in_shapes[0])
    channels_last = (0, rank - 1, *range(1, rank - 1))
    if tuple(dn.lhs_spec) != channels_last or tuple(dn.out_spec) != channels_last:
        raise _unsupported(common["name"], f"a convolution in layout lhs {dn.lhs_spec} / out {dn.out_spec} "
                           "(channels-last NHWC / NWC, as Flax writes them, are supported)")
    if len(common["inputs"]) != 1:
        raise _unsupported(common["name"], "a convolution whose kernel is computed from the images")
    if p["batch_group_count"] != 1:
        raise _unsupported(common["name"], f"batch_group_count={p['batch_group_count']}")
    rhs = eqn.invars[1].aval.shape
    kernel = tuple(int(rhs[d]) for d in dn.rhs_spec[2:])
    window = Window(kernel=kernel, strides=tuple(p["window_strides"]), padding=tuple(map(tuple, p["padding"])),
                    dilation=tuple(p["rhs_dilation"]), lhs_dilation=tuple(p["lhs_dilation"]))
    return Layer(kind="conv", window=window, feature_group_count=int(p["feature_group_count"]), **common)


def _pool(common: dict, p: dict, shape: tuple[int, ...]) -> Layer:
    dims, strides = tuple(p["window_dimensions"]), tuple(p["window_strides"])
    pads, base, wdil = tuple(map(tuple, p["padding"])), tuple(p["base_dilation"]), tuple(p["window_dilation"])
    outer = (0, len(shape) - 1)
    if any(dims[d] != 1 or strides[d] != 1 or tuple(pads[d]) != (0, 0) for d in outer):
        raise _unsupported(common["name"], "a pooling window over the batch or channel dims")
    inner = range(1, len(shape) - 1)
    window = Window(kernel=tuple(dims[d] for d in inner), strides=tuple(strides[d] for d in inner),
                    padding=tuple(pads[d] for d in inner), dilation=tuple(wdil[d] for d in inner),
                    lhs_dilation=tuple(base[d] for d in inner))
    return Layer(kind="pool", window=window, **common)


def _dense(common: dict, eqn: Any, in_shapes: list[tuple[int, ...]]) -> Layer:
    (lhs_c, rhs_c), (lhs_b, _) = eqn.params["dimension_numbers"]
    rank = len(in_shapes[0])
    if len(common["inputs"]) != 1 or tuple(lhs_c) != (rank - 1,) or lhs_b:
        raise _unsupported(common["name"], "a matmul that is not activations x weights over the last dim")
    return Layer(kind="dense", **common)


def _unsupported(name: str, what: str) -> PlanError:
    return PlanError(f"autoshard (inference): layer {name} is {what}, which the inference partitioner does not "
                     "split yet. Fix: keep it out of the partitioned function, or file an issue with the model.")

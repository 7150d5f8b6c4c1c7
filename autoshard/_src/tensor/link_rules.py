"""How each primitive links the dims of its operands and results into factors (pure: no jax import).

A rule per primitive (`_LINK_RULES`) unites, in a union-find over (value, dim) keys, the dims that must
be split alike for the op to run without resharding: an elementwise op's equal dims, a matmul's batch,
free and contracting dims, the major dims of each group a reshape merges or splits, a gather's batch
and slice dims, and so on. `tensor.factors` turns the linked classes into factors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.graph import Op

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "select_n", "tanh", "exp",
    "exp2", "log", "log1p", "expm1", "logistic", "erf", "erfc", "erf_inv", "neg", "sign", "abs",
    "floor", "ceil", "round", "convert_element_type", "rsqrt", "sqrt", "cbrt", "square", "clamp",
    "eq", "ne", "lt", "gt", "ge", "le", "and", "or", "not", "xor", "is_finite", "nextafter",
    "atan2", "rem", "stop_gradient", "copy", "copy_p", "reduce_precision", "sharding_constraint",
    "add_any", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
    "atanh", "imag", "real", "conj", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "optimization_barrier", "random_bits",
    "bitcast_convert_type", "cond",
})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "argmax", "argmin"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# ops with no data inputs whose result dims start fresh factors (the PRNG key ops read only a key, which
# is never split: core.attribution.is_prng_key)
SOURCES = frozenset({"iota", "random_seed", "random_wrap", "random_unwrap", "rng_bit_generator", "random_split",
                     "random_fold_in", "random_clone"})


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(self, x):
        parent = self.parent
        root = x
        while (p := parent.get(root, root)) != root:
            root = p
        while (p := parent.get(x, x)) != root:
            parent[x] = root
            x = p
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # deterministic: the smaller key is the root
            if rb < ra:
                ra, rb = rb, ra
            self.parent[rb] = ra


def _key(value: int, dim: int, rank: int) -> tuple[int, int]:
    # dims are keyed from the right: a scan body sees a stacked [L, ...] value without its
    # leading axis, and right alignment makes both views agree
    return (value, dim - rank)


def _dn5(dn) -> tuple:
    dn = tuple(tuple(x) if isinstance(x, tuple | list) else x for x in dn)
    return (dn + ((), (), (), (), ()))[:5]


def _link_same(uf: _UnionFind, a: int, sa: tuple, b: int, sb: tuple, dims_a: Sequence[int],
               dims_b: Sequence[int]) -> None:
    for da, db in zip(dims_a, dims_b, strict=True):
        if sa[da] == sb[db] and sa[da] != 1:
            uf.union(_key(a, da, len(sa)), _key(b, db, len(sb)))


def _link_op(uf: _UnionFind, op: Op, values) -> None:
    """Link the dims of an op's operands and results that must share a factor (rule per primitive)."""
    if not op.outputs:
        return
    rule = _LINK_RULES.get(op.primitive)
    if rule is not None:
        rule(uf, op)


def _link_equal_rank(uf: _UnionFind, op: Op) -> None:
    """Operands of the result's rank link to it dim by dim (equal sizes only)."""
    o, so = op.outputs[0], op.out_shapes[0]
    for v, s in zip(op.inputs, op.in_shapes, strict=True):
        if len(s) == len(so):
            _link_same(uf, v, s, o, so, range(len(s)), range(len(so)))


def _link_extra_outputs(uf: _UnionFind, op: Op) -> None:
    """Further results of the first result's shape link to it dim by dim."""
    o, so = op.outputs[0], op.out_shapes[0]
    for v2, s2 in zip(op.outputs[1:], op.out_shapes[1:], strict=False):
        if s2 == so:
            _link_same(uf, v2, s2, o, so, range(len(s2)), range(len(so)))


def _link_elementwise(uf: _UnionFind, op: Op) -> None:
    _link_equal_rank(uf, op)
    _link_extra_outputs(uf, op)


def _link_same_shape(uf: _UnionFind, op: Op) -> None:
    """Cumulative ops, sort, rev: operands of the result's shape link to it dim by dim."""
    o, so = op.outputs[0], op.out_shapes[0]
    for v, s in zip(op.inputs, op.in_shapes, strict=True):
        if s == so:
            _link_same(uf, v, s, o, so, range(len(s)), range(len(so)))
    _link_extra_outputs(uf, op)  # sort's extra outputs (argsort)


def _link_broadcast_in_dim(uf: _UnionFind, op: Op) -> None:
    bd = op.params.get("broadcast_dimensions", ())
    _link_same(uf, op.inputs[0], op.in_shapes[0], op.outputs[0], op.out_shapes[0],
               range(len(op.in_shapes[0])), bd)


def _link_transpose(uf: _UnionFind, op: Op) -> None:
    perm = op.params.get("permutation", ())
    so = op.out_shapes[0]
    _link_same(uf, op.inputs[0], op.in_shapes[0], op.outputs[0], so, perm, range(len(so)))


def _link_reshape(uf: _UnionFind, op: Op) -> None:
    (i, si), (o, so) = (op.inputs[0], op.in_shapes[0]), (op.outputs[0], op.out_shapes[0])
    for da, db in _reshape_pairs(si, so):
        uf.union(_key(i, da, len(si)), _key(o, db, len(so)))


def _link_dropping(param: str) -> Callable[[_UnionFind, Op], None]:
    """The rule of an op dropping its operand's dims named by `param` (squeeze's "dimensions", a reduction's
    "axes"): the operand's other dims link to the result's in order."""
    def rule(uf: _UnionFind, op: Op) -> None:
        (i, si), (o, so) = (op.inputs[0], op.in_shapes[0]), (op.outputs[0], op.out_shapes[0])
        dropped = set(op.params.get(param, ()))
        _link_same(uf, i, si, o, so, [d for d in range(len(si)) if d not in dropped], range(len(so)))
    return rule


_link_squeeze = _link_dropping("dimensions")
_link_reduction = _link_dropping("axes")


def _link_expand_dims(uf: _UnionFind, op: Op) -> None:
    (i, si), (o, so) = (op.inputs[0], op.in_shapes[0]), (op.outputs[0], op.out_shapes[0])
    dims = set(op.params.get("dimensions", ()))
    kept = [d for d in range(len(so)) if d not in dims]
    _link_same(uf, i, si, o, so, range(len(si)), kept)


def _link_split(uf: _UnionFind, op: Op) -> None:
    axis = op.params.get("axis", 0)
    for v2, s2 in zip(op.outputs, op.out_shapes, strict=True):
        keep = [d for d in range(len(s2)) if d != axis]
        _link_same(uf, op.inputs[0], op.in_shapes[0], v2, s2, keep, keep)


def _link_stack(uf: _UnionFind, op: Op) -> None:
    """jnp.stack (jax >= 0.10: a primitive): every operand's dims are the result's dims around the new
    `axis`, which starts its own factor; jnp.unstack is the same read backwards."""
    (o, so), axis = (op.outputs[0], op.out_shapes[0]), op.params.get("axis", 0)
    kept = [d for d in range(len(so)) if d != axis]
    for v, sv in zip(op.inputs, op.in_shapes, strict=True):
        _link_same(uf, v, sv, o, so, range(len(sv)), kept)


def _link_unstack(uf: _UnionFind, op: Op) -> None:
    (i, si), axis = (op.inputs[0], op.in_shapes[0]), op.params.get("axis", 0)
    kept = [d for d in range(len(si)) if d != axis]
    for v, sv in zip(op.outputs, op.out_shapes, strict=True):
        _link_same(uf, i, si, v, sv, kept, range(len(sv)))


def _link_dot_general(uf: _UnionFind, op: Op) -> None:
    params = op.params
    if "contracting" not in params:
        return
    (lc, rc), (lb, rb) = params["contracting"], params["batch"]
    (lv, sl), (r, sr) = (op.inputs[0], op.in_shapes[0]), (op.inputs[1], op.in_shapes[1])
    o, so = op.outputs[0], op.out_shapes[0]
    _link_same(uf, lv, sl, r, sr, lc, rc)
    _link_same(uf, lv, sl, r, sr, lb, rb)
    lfree = [d for d in range(len(sl)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(sr)) if d not in rc and d not in rb]
    nb = len(lb)
    _link_same(uf, lv, sl, o, so, lb, range(nb))
    _link_same(uf, lv, sl, o, so, lfree, range(nb, nb + len(lfree)))
    _link_same(uf, r, sr, o, so, rfree, range(nb + len(lfree), len(so)))


def _link_gather(uf: _UnionFind, op: Op) -> None:
    params = op.params
    if "dimension_numbers" not in params:
        return
    offset, collapsed, _, obatch, ibatch = _dn5(params["dimension_numbers"])
    (t, st), (ix, si) = (op.inputs[0], op.in_shapes[0]), (op.inputs[1], op.in_shapes[1])
    o, so = op.outputs[0], op.out_shapes[0]
    window = [d for d in range(len(st)) if d not in collapsed and d not in obatch]
    slice_sizes = params.get("slice_sizes", st)
    pairs = [(d, od) for d, od in zip(window, offset, strict=False) if slice_sizes[d] == st[d]]
    _link_same(uf, t, st, o, so, [a for a, _ in pairs], [b for _, b in pairs])
    out_batch = [d for d in range(len(so)) if d not in offset]
    idx_batch = list(range(len(si) - 1))  # index_vector_dim is last in lax.gather
    _link_same(uf, ix, si, o, so, idx_batch, out_batch)
    _link_same(uf, t, st, ix, si, obatch, ibatch)


def _link_scatter(uf: _UnionFind, op: Op) -> None:
    if "dimension_numbers" not in op.params:
        return
    window, inserted, _, obatch, ibatch = _dn5(op.params["dimension_numbers"])
    ins, ish = op.inputs, op.in_shapes
    (t, st), (ix, si), (u, su) = (ins[0], ish[0]), (ins[1], ish[1]), (ins[2], ish[2])
    o, so = op.outputs[0], op.out_shapes[0]
    _link_same(uf, t, st, o, so, range(len(st)), range(len(so)))
    tw = [d for d in range(len(st)) if d not in inserted and d not in obatch]
    _link_same(uf, t, st, u, su, tw, window)
    scat = [d for d in range(len(su)) if d not in window]
    _link_same(uf, u, su, ix, si, scat, range(len(si) - 1))
    _link_same(uf, t, st, ix, si, obatch, ibatch)


def _link_conv(uf: _UnionFind, op: Op) -> None:
    params = op.params
    if "lhs_spec" not in params:
        return
    ls, rs, os_ = params["lhs_spec"], params["rhs_spec"], params["out_spec"]
    (x, sx), (w, sw) = (op.inputs[0], op.in_shapes[0]), (op.inputs[1], op.in_shapes[1])
    o, so = op.outputs[0], op.out_shapes[0]
    _link_same(uf, x, sx, o, so, [ls[0]], [os_[0]])          # batch
    _link_same(uf, w, sw, o, so, [rs[0]], [os_[1]])          # output features
    _link_same(uf, x, sx, o, so, ls[2:], os_[2:])            # spatial (same size only)
    if params.get("feature_group_count", 1) > 1:
        # grouped/depthwise: each output channel reads its own group's input channels
        _link_same(uf, x, sx, o, so, [ls[1]], [os_[1]])
    else:
        _link_same(uf, x, sx, w, sw, [ls[1]], [rs[1]])       # input features (contracted)


_LOOKUPS = frozenset({"gather", "scatter-add", "scatter_add", "scatter"})
_WINDOWED = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
                       "select_and_scatter_add", "select_and_gather_add"})
_KNOWN = (ELEMENTWISE | REDUCTIONS | CUMULATIVE | SOURCES | _WINDOWED | {"split", "stack", "unstack",
    "broadcast_in_dim", "transpose", "reshape", "squeeze", "expand_dims", "dot_general", "sort",
    "rev", "slice", "dynamic_slice", "dynamic_update_slice", "pad", "concatenate", "gather",
    "scatter-add", "scatter_add", "scatter", "conv_general_dilated", "select_and_scatter_add",
    "reduce_window_sum", "reduce_window_max",
})

# primitive -> linking rule, in precedence order: a primitive listed twice ("reduce_precision")
# keeps its first rule. Primitives without a rule (sources, unknown ops) link nothing.
_LINK_RULES: dict[str, Callable[[_UnionFind, Op], None]] = {}
for _names, _rule in (
        (ELEMENTWISE, _link_elementwise),
        (("broadcast_in_dim",), _link_broadcast_in_dim),
        (("transpose",), _link_transpose),
        (("reshape",), _link_reshape),
        (("squeeze",), _link_squeeze),
        (("expand_dims",), _link_expand_dims),
        (("dot_general",), _link_dot_general),
        (REDUCTIONS, _link_reduction),
        ((*CUMULATIVE, "sort", "rev", "reduce_precision"), _link_same_shape),
        (("split",), _link_split),
        (("stack",), _link_stack),
        (("unstack",), _link_unstack),
        # pooling: dims the window leaves whole (batch, channels) keep their factor
        (_WINDOWED, _link_equal_rank),
        # dims that keep their size keep their factor; resized dims start new ones
        (("slice", "dynamic_slice", "dynamic_update_slice", "pad", "concatenate"), _link_equal_rank),
        (("gather",), _link_gather),
        (("scatter-add", "scatter_add", "scatter"), _link_scatter),
        (("conv_general_dilated",), _link_conv)):
    for _name in _names:
        _LINK_RULES.setdefault(_name, _rule)
del _names, _rule, _name


def _reshape_pairs(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[int, int]]:
    """Dims linked by a reshape: the major dims of each group of dims whose products match
    ((B, S, H*hd) → (B, S, H, hd) links B–B, S–S and H*hd–H)."""
    return [(dims_a[0], dims_b[0]) for dims_a, dims_b in _reshape_groups(a, b)]


def _reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[range, range]]:
    """The groups of dims of `a` and of `b` whose products match, in order (size-1 dims between groups
    skipped; each group starts at a dim of size > 1), up to the first that cannot be matched."""
    groups = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == 1:
            i += 1
            continue
        if b[j] == 1:
            j += 1
            continue
        gi, gj = i, j
        pa, pb = a[i], b[j]
        i += 1
        j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                pb *= b[j]
                j += 1
            else:
                return groups
        groups.append((range(gi, i), range(gj, j)))
    return groups

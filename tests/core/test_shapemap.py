"""ShapeMaps (BBGraP §3.1-3.2): the paper's worked examples, Eq. 1-6 against brute force, splits,
pass-through rules per layer kind, and typed errors. Pure: plain data, no jax."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autoshard import ConfigError, PlanError
from autoshard._src.core.layers import LAYER_KINDS, Layer, required_input
from autoshard._src.core.shapemap import (
    Interval,
    IntervalSet,
    ShapeMap,
    Split,
    Window,
    WindowDim,
    direction_axis,
    input_interval_size,
    node_input_intervals,
    split_sizes,
    true_kernel_extent,
    union_size,
)

FAST = settings(max_examples=60, deadline=None)


def conv(name, src, in_shape, features, kernel, strides=None, padding=None, dilation=None, groups=1):
    window = Window(kernel, strides, padding, dilation)
    spatial = window.output_spatial(in_shape[1:-1])
    return Layer(name, "conv", (src,), (in_shape,), (in_shape[0], *spatial, features), window=window,
                 feature_group_count=groups)


# ---- the paper's worked examples -----------------------------------------------------------------------

def test_eq1_eight_by_eight_output_over_three_nodes_is_3x8_3x8_2x8():
    assert split_sizes(8, 3) == (3, 3, 2)
    parts = Split("W", 3).regions((1, 8, 8, 1))            # NHWC, split in width as in §3.2
    assert [(p.extents[2], p.extents[1]) for p in parts] == [(3, 8), (3, 8), (2, 8)]
    assert [p.dims[2] for p in parts] == [IntervalSet.range(0, 3), IntervalSet.range(3, 6), IntervalSet.range(6, 8)]


def test_fig4_input_interval_of_three_outputs_with_3x3_kernel_dilation_2_stride_2():
    assert true_kernel_extent(3, 2) == 5                      # Eq. 2: the dilated 3x3 spans 5
    assert input_interval_size(3, kernel=3, stride=2, dilation=2) == 9   # Eq. 3: (3 - 1) * 2 + 5
    dim = WindowDim(kernel=3, stride=2, dilation=2)
    assert dim.input_interval(Interval(0, 3), input_size=9) == Interval(0, 9)
    assert dim.input_interval(Interval(1, 2), input_size=9) == Interval(2, 7)     # one output: tK = 5
    # the same through a conv layer: a row of three 1x1 outputs of a 9x9 input reads rows 0:5, cols 0:9
    layer = conv("c", "x", (1, 9, 9, 1), 1, (3, 3), strides=(2, 2), dilation=(2, 2))
    assert layer.output_shape == (1, 3, 3, 1)
    (needed,) = required_input(layer, ShapeMap.box((0, 1), (0, 1), (0, 3), (0, 1)))
    assert needed == ShapeMap.box((0, 1), (0, 5), (0, 9), (0, 1))


def _paper_eq4_eq5(sizes, dim: WindowDim):
    """Eq. 3-5 transcribed literally (node 0 and node N-1 crop their side's padding)."""
    tk = true_kernel_extent(dim.kernel, dim.dilation)
    result = []
    for i, size in enumerate(sizes):
        iv = (size - 1) * dim.stride + tk
        left = 0 if i == 0 else dim.stride * sum(sizes[:i]) - dim.pad_lo
        pad = dim.pad_lo if i == 0 else dim.pad_hi if i == len(sizes) - 1 else 0
        result.append(Interval(left, iv + left - pad))
    return result


@FAST
@given(outputs=st.integers(2, 30), kernel=st.integers(1, 5), stride=st.integers(1, 4), dilation=st.integers(1, 3),
       pad_lo=st.integers(0, 3), pad_hi=st.integers(0, 3), nodes=st.integers(2, 5))
def test_eq4_eq5_literal_where_the_paper_applies(outputs, kernel, stride, dilation, pad_lo, pad_hi, nodes):
    # Eq. 5 assumes the last window ends exactly on the right padding (size chosen so), and Eq. 4-5 are
    # the windows' hull: where its ends are elements the windows read, ours (the reads' hull) is equal
    dim = WindowDim(kernel, stride, dilation, pad_lo, pad_hi)
    size = (outputs - 1) * stride + true_kernel_extent(kernel, dilation) - pad_lo - pad_hi
    assume(size >= 1 and nodes <= outputs)
    assert dim.output_size(size) == outputs
    sizes = split_sizes(outputs, nodes)
    paper = _paper_eq4_eq5(sizes, dim)
    offsets = np.cumsum((0,) + sizes)
    reads = [set().union(*(_reads_1d(o, size, dim) for o in range(a, b))) for a, b in itertools.pairwise(offsets)]
    assume(all({iv.start, iv.stop - 1} <= r for iv, r in zip(paper, reads, strict=True)))
    assert list(node_input_intervals(sizes, dim, size)) == paper


def test_our_interval_is_tighter_where_an_edge_window_lies_in_the_padding():
    dim = WindowDim(kernel=1, stride=2, pad_hi=1)            # outputs read 0, 2, 4 and the padding
    assert _paper_eq4_eq5((2, 2), dim) == [Interval(0, 3), Interval(4, 6)]
    assert node_input_intervals((2, 2), dim, input_size=6) == (Interval(0, 3), Interval(4, 5))


def _reads_1d(o, size, dim: WindowDim):
    return {o * dim.stride - dim.pad_lo + k * dim.dilation for k in range(dim.kernel)} & set(range(size))


@FAST
@given(size=st.integers(1, 30), kernel=st.integers(1, 5), stride=st.integers(1, 4), dilation=st.integers(1, 3),
       pad_lo=st.integers(0, 4), pad_hi=st.integers(0, 4), nodes=st.integers(1, 5), data=st.data())
def test_every_receptive_field_lies_in_the_node_input_interval(size, kernel, stride, dilation, pad_lo, pad_hi,
                                                               nodes, data):
    dim = WindowDim(kernel, stride, dilation, pad_lo, pad_hi)
    assume(size + pad_lo + pad_hi >= true_kernel_extent(kernel, dilation))
    outputs = dim.output_size(size)
    assume(nodes <= outputs)
    weights = data.draw(st.none() | st.lists(st.integers(1, 4), min_size=nodes, max_size=nodes))
    sizes = split_sizes(outputs, nodes, weights)
    offsets = np.cumsum((0,) + sizes)
    for (a, b), iv in zip(itertools.pairwise(offsets), node_input_intervals(sizes, dim, size), strict=True):
        reads = set().union(*(_reads_1d(o, size, dim) for o in range(a, b)))
        assert reads <= set(range(iv.start, iv.stop))
        assert (iv.start, iv.stop) == ((min(reads), max(reads) + 1) if reads else (0, 0))   # and their hull


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2), h=st.integers(1, 7), w=st.integers(1, 7), groups=st.integers(1, 2),
       per_group=st.integers(1, 2), features_per_group=st.integers(1, 2), kernel=st.tuples(st.integers(1, 3),
       st.integers(1, 3)), stride=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       padding=st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 2)), st.tuples(st.integers(0, 2),
                                                                                    st.integers(0, 2))),
       direction=st.sampled_from("NHWC"), nodes=st.integers(1, 3))
def test_conv_layer_reads_only_its_required_input(n, h, w, groups, per_group, features_per_group, kernel, stride,
                                                  dilation, padding, direction, nodes):
    in_shape = (n, h, w, groups * per_group)
    window = Window(kernel, stride, padding, dilation)
    assume(all(s + lo + hi >= true_kernel_extent(k, d)
               for s, k, d, (lo, hi) in zip((h, w), kernel, dilation, padding, strict=True)))
    layer = conv("c", "x", in_shape, groups * features_per_group, kernel, stride, padding, dilation, groups)
    assume(nodes <= layer.output_shape[direction_axis(direction, 4)])
    for region in Split(direction, nodes).regions(layer.output_shape):
        (needed,) = required_input(layer, region)
        reads = set()
        for ob, oh, ow, oc in itertools.product(*(range(iv.start, iv.stop) for d in region.dims
                                                  for iv in d.intervals)):
            group = oc // features_per_group
            for kh, kw, ic in itertools.product(range(kernel[0]), range(kernel[1]), range(per_group)):
                ih = oh * stride[0] - padding[0][0] + kh * dilation[0]
                iw = ow * stride[1] - padding[1][0] + kw * dilation[1]
                if 0 <= ih < h and 0 <= iw < w:
                    reads.add((ob, ih, iw, group * per_group + ic))
        for point in reads:
            assert all(d.covers(p, p + 1) for d, p in zip(needed.dims, point, strict=True)), (point, needed)
        hull = [(min(p[i] for p in reads), max(p[i] for p in reads) + 1) for i in range(4)] if reads else None
        assert needed.is_empty if not reads else [tuple(d.hull) for d in needed.dims] == hull   # and no more
        assert window.output_spatial((h, w)) == layer.output_shape[1:3]


# ---- splits ---------------------------------------------------------------------------------------------

@FAST
@given(shape=st.lists(st.integers(1, 9), min_size=2, max_size=4), direction=st.sampled_from("NCHW"),
       nodes=st.integers(1, 6), data=st.data())
def test_split_parts_cover_the_output_without_overlap(shape, direction, nodes, data):
    assume(direction in "NC" or len(shape) >= {"W": 3, "H": 4}[direction])
    assume(nodes <= shape[direction_axis(direction, len(shape))])
    weights = data.draw(st.none() | st.lists(st.floats(0.1, 10), min_size=nodes, max_size=nodes))
    parts = Split(direction, nodes, weights).regions(tuple(shape))
    full = ShapeMap.full(shape)
    assert union_size(parts) == sum(p.num_elements for p in parts) == full.num_elements
    assert all(p.issubset(full) for p in parts)
    assert all(a.intersect(b).is_empty for a, b in itertools.combinations(parts, 2))


@FAST
@given(total=st.integers(1, 200), weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=8))
def test_weighted_split_is_within_one_element_of_the_proportions(total, weights):
    assume(len(weights) <= total)
    sizes = split_sizes(total, len(weights), weights)
    assert sum(sizes) == total and min(sizes) >= 0
    shares = [Fraction(w) / sum(map(Fraction, weights)) * total for w in weights]
    assert all(abs(s - share) < 1 for s, share in zip(sizes, shares, strict=True))
    assert split_sizes(total, len(weights), weights) == sizes                    # deterministic


@FAST
@given(total=st.integers(1, 100), nodes=st.integers(1, 10), weight=st.floats(0.5, 5))
def test_equal_weights_reproduce_eq1_round_robin(total, nodes, weight):
    assume(nodes <= total)
    even = split_sizes(total, nodes)
    base, extra = divmod(total, nodes)
    assert even == tuple([base + 1] * extra + [base] * (nodes - extra))
    assert split_sizes(total, nodes, [weight] * nodes) == even


def test_heterogeneous_split_examples():
    assert split_sizes(8, 3, (2, 1, 1)) == (4, 2, 2)
    assert split_sizes(10, 3, (2, 1, 1)) == (5, 3, 2)          # 5, 2.5, 2.5: the tie goes to the lower node
    assert split_sizes(3, 2, (100, 1)) == (3, 0)              # a share under one element may be zero
    assert Split("H", 2).sizes((1, 7, 4, 2)) == (4, 3)
    assert Split(None, 2).regions((2, 3)) == (ShapeMap.full((2, 3)),) * 2


# ---- intervals and boxes --------------------------------------------------------------------------------

ranges = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)).map(lambda t: (t[0], t[0] + t[1])), max_size=4)


def _points(s: IntervalSet) -> set[int]:
    return {p for iv in s.intervals for p in range(iv.start, iv.stop)}


@FAST
@given(a=ranges, b=ranges)
def test_interval_set_operations_match_python_sets(a, b):
    x, y = IntervalSet(a), IntervalSet(b)
    pa, pb = set().union(*(range(*r) for r in a)), set().union(*(range(*r) for r in b))
    assert _points(x) == pa and x.size == len(pa)
    assert _points(x.union(y)) == pa | pb
    assert _points(x.intersect(y)) == pa & pb
    assert x.issubset(y) == (pa <= pb)
    assert all(iv.stop < nxt.start for iv, nxt in itertools.pairwise(x.intervals))   # merged, sorted


@FAST
@given(boxes=st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=3, max_size=3),
                      max_size=5))
def test_union_size_counts_overlaps_once(boxes):
    maps = [ShapeMap.box(*((a, a + n) for a, n in box)) for box in boxes]
    mask = np.zeros((10, 10, 10), bool)
    for m in maps:
        if not m.is_empty:
            mask[tuple(slice(d.hull.start, d.hull.stop) for d in m.dims)] = True
    assert union_size(maps) == mask.sum()


def test_shape_map_with_several_ranges_per_dim():     # Fig. 2's first example: two ranges in one dim
    m = ShapeMap((IntervalSet(((0, 2), (5, 7))), IntervalSet.range(0, 3)))
    assert m.extents == (4, 3) and m.num_elements == 12 and str(m) == "[0:2|5:7, 0:3]"
    assert m.intersect(ShapeMap.box((1, 6), (0, 1))) == ShapeMap((IntervalSet(((1, 2), (5, 6))), ((0, 1),)))
    assert ShapeMap.box((0, 0), (0, 3)) == ShapeMap.empty(2)


# ---- pass-through rules, one row per layer kind ----------------------------------------------------------

X = (2, 8, 8, 4)
REGION = ShapeMap.box((0, 2), (2, 5), (0, 8), (0, 4))       # rows 2:5 of a NHWC activation
RULE_CASES = {
    "input": (Layer("x", "input", output_shape=X), REGION, ()),
    "conv": (conv("c", "x", X, 6, (3, 3), padding=((1, 1), (1, 1))), ShapeMap.box((0, 2), (2, 5), (0, 8), (0, 6)),
             (ShapeMap.box((0, 2), (1, 6), (0, 8), (0, 4)),)),
    "pool": (Layer("p", "pool", ("x",), (X,), (2, 4, 4, 4), window=Window((2, 2), (2, 2))),
             ShapeMap.box((0, 2), (1, 2), (0, 4), (1, 3)), (ShapeMap.box((0, 2), (2, 4), (0, 8), (1, 3)),)),
    "elementwise": (Layer("e", "elementwise", ("x", "s"), (X, (1, 1, 1, 4)), X), REGION,
                    (REGION, ShapeMap.box((0, 1), (0, 1), (0, 1), (0, 4)))),
    "batchnorm": (Layer("b", "batchnorm", ("x",), (X,), X), REGION, (REGION,)),
    "add": (Layer("a", "add", ("x", "y"), (X, X), X), REGION, (REGION, REGION)),
    "concat": (Layer("k", "concat", ("x", "y"), (X, (2, 8, 8, 2)), (2, 8, 8, 6), axis=3),
               ShapeMap.box((0, 2), (0, 8), (0, 8), (3, 6)),
               (ShapeMap.box((0, 2), (0, 8), (0, 8), (3, 4)), ShapeMap.box((0, 2), (0, 8), (0, 8), (0, 2)))),
    "reduce": (Layer("r", "reduce", ("x",), (X,), (2, 8, 1, 4), reduce_axes=(2,)), ShapeMap.box((1, 2), (2, 5),
               (0, 1), (0, 4)), (ShapeMap.box((1, 2), (2, 5), (0, 8), (0, 4)),)),
    "global_pool": (Layer("g", "global_pool", ("x",), (X,), (2, 4)), ShapeMap.box((0, 2), (1, 3)),
                    (ShapeMap.box((0, 2), (0, 8), (0, 8), (1, 3)),)),
    "dense": (Layer("d", "dense", ("g",), ((2, 4),), (2, 10)), ShapeMap.box((1, 2), (0, 5)),
              (ShapeMap.box((1, 2), (0, 4)),)),
    "flatten": (Layer("f", "flatten", ("x",), (X,), (2, 256)), ShapeMap.box((1, 2), (0, 256)),
                (ShapeMap.box((1, 2), (0, 8), (0, 8), (0, 4)),)),
}


def test_every_layer_kind_has_a_rule_case():
    assert set(RULE_CASES) == set(LAYER_KINDS)


@pytest.mark.parametrize("kind", sorted(RULE_CASES))
def test_pass_through_rules(kind):
    layer, region, expected = RULE_CASES[kind]
    assert layer.kind == kind
    assert required_input(layer, region) == expected
    empty = required_input(layer, ShapeMap.empty(len(layer.output_shape)))
    assert all(m.is_empty for m in empty) and len(empty) == len(layer.inputs)


def test_depthwise_conv_reads_only_its_own_channels():
    layer = conv("dw", "x", X, 8, (3, 3), padding=((1, 1), (1, 1)), groups=4)   # channel multiplier 2
    (needed,) = required_input(layer, ShapeMap.box((0, 2), (0, 8), (0, 8), (2, 5)))
    assert needed.dims[3] == IntervalSet.range(1, 3)


def test_global_pool_keepdims_and_reduction_over_the_split_dim_reads_it_whole():
    g = Layer("g", "global_pool", ("x",), (X,), (2, 1, 1, 4))
    assert g.reduce_axes == (1, 2)
    (needed,) = required_input(g, ShapeMap.box((0, 1), (0, 1), (0, 1), (0, 4)))
    assert needed == ShapeMap.box((0, 1), (0, 8), (0, 8), (0, 4))


# ---- typed errors: name the value and the fix -------------------------------------------------------------

ERROR_CASES = [
    (lambda: Layer("x", "input", output_shape=(1, -8, 8, 1)), ConfigError, "-8"),
    (lambda: IntervalSet.range(5, 3), ConfigError, "negative size"),
    (lambda: conv("c", "x", (1, 2, 2, 1), 1, (5, 5)), ConfigError, "more than the padded input"),
    (lambda: conv("c", "x", (1, 2, 2, 1), 1, (3, 3), dilation=(2, 2), padding=((1, 1), (1, 1))), ConfigError,
     "pad more"),
    (lambda: split_sizes(2, 3), PlanError, "more nodes than elements"),
    (lambda: Split("W", 9).regions((1, 8, 8, 1)), PlanError, "at most 8 nodes"),
    (lambda: Split("X", 3), ConfigError, "'X' is unknown"),
    (lambda: Split("H", 2).regions((4, 10)), ConfigError, "rank-2"),
    (lambda: Split("H", 2, weights=(1, 0)), PlanError, "> 0"),
    (lambda: Split("H", 2, weights=(1, 2, 3)), PlanError, "one weight"),
    (lambda: Window((3, 3), lhs_dilation=(2, 2)), ConfigError, "transposed"),
    (lambda: Window((3, 3), strides=(0, 1)), ConfigError, "strides"),
    (lambda: Window((3, 3), padding=((1, 1),)), ConfigError, "pairs"),
    (lambda: Layer("l", "lstm"), ConfigError, "known kinds"),
    (lambda: Layer("c", "conv", ("x",), ((1, 8, 8, 1),), (1, 7, 8, 1), window=Window((3, 3), padding=((1, 1),) * 2)),
     ConfigError, "expected batch 1, spatial (8, 8)"),
    (lambda: conv("c", "x", (1, 8, 8, 3), 4, (3, 3), groups=2), ConfigError, "feature_group_count=2"),
    (lambda: Layer("a", "add", ("x",), (X,), X), ConfigError, "at least 2"),
    (lambda: Layer("e", "elementwise", ("x",), ((2, 8, 8, 3),), X), ConfigError, "broadcast"),
    (lambda: Layer("k", "concat", ("x", "y"), (X, X), (2, 8, 8, 9), axis=3), ConfigError, "concatenate"),
    (lambda: Layer("r", "reduce", ("x",), (X,), (2, 8, 5), reduce_axes=(2,)), ConfigError, "expected (2, 8, 4)"),
    (lambda: Layer("d", "dense", ("x",), ((2, 4),), (3, 10)), ConfigError, "leading dims"),
    (lambda: Layer("f", "flatten", ("x",), (X,), (2, 255)), ConfigError, "expected (2, 256)"),
    (lambda: required_input(Layer("b", "batchnorm", ("x",), (X,), X), ShapeMap.box((0, 1))), ConfigError, "rank"),
]


@pytest.mark.parametrize("make, error, words", ERROR_CASES, ids=[str(i) for i in range(len(ERROR_CASES))])
def test_invalid_input_raises_typed_errors(make, error, words):
    with pytest.raises(error, match=None) as info:
        make()
    assert words in str(info.value), str(info.value)

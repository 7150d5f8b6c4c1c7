"""Factor rules (autoshard._factors) on hand-built OpGraphs: pure Python, no jax, milliseconds.

Each test builds a few ops with the params exactly as the tracer records them and checks which
tensor dims `analyze` puts in one factor (logical dim), which factors an op loops and reduces over,
and the bookkeeping around them (repeated factors, co-occurrence, unknown ops, divisibility).
Sizes are picked pairwise distinct where possible, so a link can never come from equal sizes alone.
"""

from __future__ import annotations

import pytest

from autoshard._src.core.graph import nbytes
from autoshard._src.tensor.regions import analyze

from ..core._synthetic import GraphBuilder


def analyze_all(g: GraphBuilder, same_ops=()):
    graph = g.build()
    return graph, analyze(graph, range(len(graph.ops)), same_ops)


def gather_embedding(g: GraphBuilder, table: int, idx: int) -> int:
    """table[V, D] indexed by idx[B, S, 1] → [B, S, D] (jnp.take / nn.Embed)."""
    (_, d), (b, s, _) = g.values[table].shape, g.values[idx].shape
    params = {"dimension_numbers": ((2,), (0,), (0,), (), ()), "slice_sizes": (1, d),
              "indices_are_sorted": False, "unique_indices": False, "fill_value": None}
    return g.op("gather", [table, idx], [(b, s, d)], params=params)


CONV_NCHW = {"lhs_spec": (0, 1, 2, 3), "rhs_spec": (0, 1, 2, 3), "out_spec": (0, 1, 2, 3),
             "rhs_in_feature_dim": 1, "rhs_spatial_dims": (2, 3), "window_strides": (1, 1),
             "feature_group_count": 1, "batch_group_count": 1}


# matmuls --------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [(8, 16, 32), (16, 16, 16)], ids=["distinct", "all-equal"])
def test_matmul_links_contracting_and_free_dims(sizes):
    B, K, N = sizes
    g = GraphBuilder()
    x, w = g.input((B, K)), g.input((K, N))
    y = g.dot(x, w)
    graph, fg = analyze_all(g)
    fx, fw, fy = fg.value_factors(x), fg.value_factors(w), fg.value_factors(y)
    assert fx[1] == fw[0]                          # the contracting dims are one factor
    assert fy == (fx[0], fw[1])                    # out [B, N]
    assert len({fx[0], fx[1], fw[1]}) == 3         # equal sizes do not merge factors
    of = fg.op_factors[0]
    assert of.reduced == {fx[1]}
    assert of.loop == {fx[0], fx[1], fw[1]}
    assert of.out_factors == fy and of.known and of.gathered == ()
    assert of.out_bytes == nbytes((B, N), "float32")
    assert fg.unknown_ops == [] and fg.repeated == frozenset()
    # factor ids are dense, in order of first appearance (the first op's inputs first)
    assert (*fx, fw[1]) == (0, 1, 2)


def test_matmul_with_batch_dims_and_transposed_rhs():
    G, B, K, N = 3, 8, 16, 32
    g = GraphBuilder()
    x, w = g.input((G, B, K)), g.input((G, N, K))
    y = g.dot(x, w, ((2,), (2,)), ((0,), (0,)))
    assert g.values[y].shape == (G, B, N)
    _, fg = analyze_all(g)
    fx, fw, fy = fg.value_factors(x), fg.value_factors(w), fg.value_factors(y)
    assert fx[0] == fw[0] == fy[0]                 # batch
    assert fx[2] == fw[2]                          # contracted
    assert fy == (fx[0], fx[1], fw[1])
    assert fg.op_factors[0].reduced == {fx[2]}     # batch dims are not reduced
    assert fg.op_factors[0].loop == {fx[0], fx[1], fx[2], fw[1]}


# elementwise ----------------------------------------------------------------------------------

def test_elementwise_broadcast_links_equal_dims_not_size_one():
    B, N = 8, 16
    g = GraphBuilder()
    a, b = g.input((B, N)), g.input((1, N))
    s = g.literal(())
    y = g.op("add", [a, b])
    z = g.op("mul", [y, s])
    _, fg = analyze_all(g)
    fa, fb, fy, fz = (fg.value_factors(v) for v in (a, b, y, z))
    assert fb == (None, fa[1])                     # size-1 dim: no factor; N linked
    assert fy == fa == fz
    assert fg.value_factors(s) == ()
    assert fg.op_factors[1].loop == set(fa) and fg.op_factors[1].reduced == frozenset()
    assert set(fg.factor_sizes[fa[0]]) == {B}


def test_elementwise_chain_and_select_with_scalar_predicate():
    g = GraphBuilder()
    x = g.input((4, 6))
    y = g.op("select_n", [g.literal((), "bool"), g.op("tanh", [x]), g.op("exp", [x])], [(4, 6)])
    _, fg = analyze_all(g)
    assert fg.value_factors(y) == fg.value_factors(x)
    assert len(set(fg.value_factors(x))) == 2


# layout ops -----------------------------------------------------------------------------------

def test_reshape_split_heads_links_major_dim_and_back():
    B, S, H, hd = 2, 5, 4, 8
    g = GraphBuilder()
    x = g.input((B, S, H * hd))
    y = g.op("reshape", [x], [(B, S, H, hd)], params={"new_sizes": (B, S, H, hd), "dimensions": None})
    z = g.op("reshape", [y], [(B, S, H * hd)], params={"new_sizes": (B, S, H * hd), "dimensions": None})
    _, fg = analyze_all(g)
    fx, fy, fz = fg.value_factors(x), fg.value_factors(y), fg.value_factors(z)
    assert fy[:2] == fx[:2]
    assert fy[2] == fx[2]                          # H*hd ~ H (the major dim)
    assert fy[3] not in fx                         # hd is a fresh factor
    assert fz == fx                                # and the merge links back to the same factors
    assert set(fg.factor_sizes[fx[2]]) == {H, H * hd}
    assert fg.divides(fx[2], H) and not fg.divides(fx[2], 2 * H)   # limited by the smaller H
    assert fg.factor_size(fx[2]) == H * hd


def test_reshape_merge_batch_and_sequence_links_batch():
    B, S, D = 2, 6, 16
    g = GraphBuilder()
    x = g.input((B, S, D))
    y = g.op("reshape", [x], [(B * S, D)], params={"new_sizes": (B * S, D), "dimensions": None})
    _, fg = analyze_all(g)
    fx, fy = fg.value_factors(x), fg.value_factors(y)
    assert fy == (fx[0], fx[2])                    # B*S ~ B (major), S is not linked


def test_reshape_skips_size_one_dims():
    g = GraphBuilder()
    x = g.input((4, 1, 6))
    y = g.op("reshape", [x], [(1, 4, 6)], params={"new_sizes": (1, 4, 6), "dimensions": None})
    _, fg = analyze_all(g)
    fx, fy = fg.value_factors(x), fg.value_factors(y)
    assert fx[1] is None and fy[0] is None
    assert fy[1:] == (fx[0], fx[2])


def test_transpose_follows_permutation():
    g = GraphBuilder()
    x = g.input((2, 3, 5))
    y = g.op("transpose", [x], [(5, 2, 3)], params={"permutation": (2, 0, 1)})
    _, fg = analyze_all(g)
    fx = fg.value_factors(x)
    assert fg.value_factors(y) == (fx[2], fx[0], fx[1])


def test_broadcast_in_dim_maps_operand_dims():
    B, N = 8, 16
    g = GraphBuilder()
    v = g.input((N,))
    y = g.op("broadcast_in_dim", [v], [(B, N)],
             params={"shape": (B, N), "broadcast_dimensions": (1,), "sharding": None})
    r = g.input((1, N))
    z = g.op("broadcast_in_dim", [r], [(B, N)],
             params={"shape": (B, N), "broadcast_dimensions": (0, 1), "sharding": None})
    _, fg = analyze_all(g)
    fv, fy, fr, fz = (fg.value_factors(u) for u in (v, y, r, z))
    assert fy[1] == fv[0] and fy[0] not in fv      # new dim: fresh factor
    assert fr == (None, fz[1])                     # size-1 dim broadcast: not linked
    assert fz[0] not in fr


def test_squeeze_drops_dims():
    g = GraphBuilder()
    x = g.input((4, 1, 6))
    y = g.op("squeeze", [x], [(4, 6)], params={"dimensions": (1,)})
    _, fg = analyze_all(g)
    fx = fg.value_factors(x)
    assert fg.value_factors(y) == (fx[0], fx[2])


def test_concatenate_keeps_other_dims_and_starts_fresh_concat_dim():
    B = 4
    g = GraphBuilder()
    a, b = g.input((B, 3)), g.input((B, 5))
    y = g.op("concatenate", [a, b], [(B, 8)], params={"dimension": 1})
    _, fg = analyze_all(g)
    fa, fb, fy = fg.value_factors(a), fg.value_factors(b), fg.value_factors(y)
    assert fy[0] == fa[0] == fb[0]
    assert fy[1] not in (fa[1], fb[1]) and fa[1] != fb[1]


def test_cumsum_links_all_dims():
    g = GraphBuilder()
    x = g.input((4, 6))
    y = g.op("cumsum", [x], params={"axis": 1, "reverse": False})
    _, fg = analyze_all(g)
    assert fg.value_factors(y) == fg.value_factors(x)
    assert fg.op_factors[0].known


# reductions -----------------------------------------------------------------------------------

def test_reduce_sum_links_kept_dims_and_reduces_the_others():
    B, S, D = 2, 5, 16
    g = GraphBuilder()
    x = g.input((B, S, D))
    y = g.op("reduce_sum", [x], [(B, D)], params={"axes": (1,), "out_sharding": None})
    _, fg = analyze_all(g)
    fx = fg.value_factors(x)
    assert fg.value_factors(y) == (fx[0], fx[2])
    of = fg.op_factors[0]
    assert of.reduced == {fx[1]} and of.loop == set(fx)


def test_reduce_max_and_full_reduction():
    B, S, D = 2, 5, 16
    g = GraphBuilder()
    x = g.input((B, S, D))
    m = g.op("reduce_max", [x], [(B, S)], params={"axes": (2,), "out_sharding": None})
    total = g.op("reduce_sum", [x], [()], params={"axes": (0, 1, 2), "out_sharding": None})
    _, fg = analyze_all(g)
    fx = fg.value_factors(x)
    assert fg.value_factors(m) == fx[:2]
    assert fg.op_factors[0].reduced == {fx[2]}
    assert fg.value_factors(total) == ()
    assert fg.op_factors[1].reduced == set(fx) and fg.op_factors[1].out_bytes == 4


# gather / scatter -----------------------------------------------------------------------------

def test_embedding_gather_reduces_over_the_vocabulary():
    V, D, B, S = 64, 16, 2, 5
    g = GraphBuilder()
    table = g.input((V, D))
    idx = g.input((B, S, 1), dtype="int32")
    y = gather_embedding(g, table, idx)
    _, fg = analyze_all(g)
    ft, fi, fy = fg.value_factors(table), fg.value_factors(idx), fg.value_factors(y)
    assert fy[2] == ft[1]                          # D
    assert fy[:2] == fi[:2] and fi[2] is None      # B, S from the indices
    assert ft[0] not in fy                         # V is indexed, not carried
    of = fg.op_factors[0]
    assert of.reduced == {ft[0]}
    assert of.loop == {*ft, *fy}


def test_take_along_axis_gather_links_batching_dims_without_reducing_them():
    B, N, K = 4, 32, 6
    g = GraphBuilder()
    x = g.input((B, N))
    idx = g.input((B, K, 1), dtype="int32")
    y = g.op("gather", [x, idx], [(B, K)], params={
        "dimension_numbers": ((), (1,), (1,), (0,), (0,)), "slice_sizes": (1, 1),
        "indices_are_sorted": False, "unique_indices": False, "fill_value": None})
    _, fg = analyze_all(g)
    fx, fi, fy = fg.value_factors(x), fg.value_factors(idx), fg.value_factors(y)
    assert fx[0] == fi[0] == fy[0]                 # operand batching dim ~ indices batching dim
    assert fy[1] == fi[1]
    assert fg.op_factors[0].reduced == {fx[1]}     # the gathered axis only
    assert fx[0] not in fg.op_factors[0].reduced


def test_scatter_add_with_batching_dims_reduces_only_scatter_dims():
    """The transpose of take_along_axis: updates [B, K] scattered into [B, N] per batch row."""
    B, N, K = 4, 32, 6
    g = GraphBuilder()
    zeros = g.input((B, N))
    idx = g.input((B, K, 1), dtype="int32")
    upd = g.input((B, K))
    y = g.op("scatter-add", [zeros, idx, upd], [(B, N)], params={
        "dimension_numbers": ((), (1,), (1,), (0,), (0,)), "indices_are_sorted": False,
        "unique_indices": False, "update_consts": ()})
    _, fg = analyze_all(g)
    fz, fi, fu, fy = (fg.value_factors(v) for v in (zeros, idx, upd, y))
    assert fy == fz
    assert fu[0] == fz[0] == fi[0]
    assert fu[1] == fi[1]
    of = fg.op_factors[0]
    assert of.reduced == {fu[1]}
    assert fu[0] not in of.reduced


def test_embedding_gradient_scatter_add_reduces_over_batch_and_sequence():
    V, D, B, S = 64, 16, 2, 5
    g = GraphBuilder()
    zeros = g.input((V, D))
    idx = g.input((B, S, 1), dtype="int32")
    upd = g.input((B, S, D))
    y = g.op("scatter-add", [zeros, idx, upd], [(V, D)], params={
        "dimension_numbers": ((2,), (0,), (0,), (), ()), "indices_are_sorted": False,
        "unique_indices": False, "update_consts": ()})
    _, fg = analyze_all(g)
    fz, fi, fu, fy = (fg.value_factors(v) for v in (zeros, idx, upd, y))
    assert fy == fz
    assert fu[2] == fz[1]                          # D
    assert fu[:2] == fi[:2]
    assert fg.op_factors[0].reduced == {fu[0], fu[1]}
    assert fz[0] not in fg.op_factors[0].reduced


def test_gather_then_scatter_share_the_embedding_factors():
    """Forward lookup and its gradient: the table and its gradient get the same factors."""
    V, D, B, S = 64, 16, 2, 5
    g = GraphBuilder()
    table = g.input((V, D))
    idx = g.input((B, S, 1), dtype="int32")
    y = gather_embedding(g, table, idx)
    zeros = g.op("broadcast_in_dim", [g.literal(())], [(V, D)],
                 params={"shape": (V, D), "broadcast_dimensions": (), "sharding": None})
    dt = g.op("scatter-add", [zeros, idx, g.op("mul", [y])], [(V, D)],
              params={"dimension_numbers": ((2,), (0,), (0,), (), ())})
    new = g.op("sub", [table, dt])
    _, fg = analyze_all(g)
    assert fg.value_factors(new) == fg.value_factors(table) == fg.value_factors(dt)


# convolution ----------------------------------------------------------------------------------

def test_conv_links_batch_features_and_same_size_spatial_dims():
    N, C, H, W, Co = 2, 3, 16, 12, 8
    g = GraphBuilder()
    x, w = g.input((N, C, H, W)), g.input((Co, C, 3, 3))
    y = g.op("conv_general_dilated", [x, w], [(N, Co, H, W)], params={**CONV_NCHW, "padding": ((1, 1), (1, 1))})
    _, fg = analyze_all(g)
    fx, fw, fy = fg.value_factors(x), fg.value_factors(w), fg.value_factors(y)
    assert fy[0] == fx[0]                          # batch
    assert fx[1] == fw[1]                          # in-features (contracted)
    assert fy[1] == fw[0]                          # out-features
    assert fy[2:] == fx[2:]                        # "SAME" spatial dims
    of = fg.op_factors[0]
    assert of.reduced == {fx[1], fw[2], fw[3]}     # in-features and the window's positions
    assert {fx[0], fx[1], fw[0]} <= of.loop


def test_a_window_wider_than_one_keeps_its_spatial_dims_whole():
    # splitting a 3 x 3 convolution's rows needs halo rows from the neighbouring devices (XLA's SPMD
    # partitioner adds collective-permutes no cost here prices): never split; a 1 x 1 one is elementwise
    # over positions, and a pooling window's dims are like a convolution's
    N, C, H, W, Co = 2, 3, 16, 12, 8
    g = GraphBuilder()
    x, w3, w1 = g.input((N, C, H, W)), g.input((Co, C, 3, 3)), g.input((Co, Co, 1, 1))
    y = g.op("conv_general_dilated", [x, w3], [(N, Co, H, W)], params={**CONV_NCHW, "padding": ((1, 1), (1, 1))})
    z = g.op("conv_general_dilated", [y, w1], [(N, Co, H, W)], params={**CONV_NCHW, "padding": ((0, 0), (0, 0))})
    v = g.input((N, C, H, W))
    p = g.op("reduce_window_max", [v], [(N, C, H // 2, W)],
             params={"window_dimensions": (1, 1, 2, 1), "window_strides": (1, 1, 2, 1), "padding": ((0, 0),) * 4})
    _, fg = analyze_all(g)
    fy, fz, fv = fg.value_factors(y), fg.value_factors(z), fg.value_factors(v)
    assert fy[2] in fg.repeated and fy[3] in fg.repeated          # the 3 x 3 window's rows and columns
    assert fz[2:] == fy[2:]                                       # the 1 x 1 conv keeps them (still whole)
    assert fy[0] not in fg.repeated and fy[1] not in fg.repeated  # batch and features split as before
    assert fv[2] in fg.repeated and fv[3] not in fg.repeated      # pooled along H only
    assert p is not None


def test_a_one_by_one_conv_alone_may_split_positions():
    g = GraphBuilder()
    images = g.input((4, 5, 10, 6))
    y = g.op("conv_general_dilated", [images, g.input((7, 5, 1, 1))], [(4, 7, 10, 6)],
             params={**CONV_NCHW, "padding": ((0, 0), (0, 0))})
    fg = analyze_all(g)[1]
    assert fg.value_factors(y)[2:] == fg.value_factors(images)[2:]
    assert not set(fg.value_factors(y)[2:]) & fg.repeated


def test_conv_valid_padding_does_not_link_resized_spatial_dims():
    N, C, H, W, Co = 2, 3, 16, 12, 8
    g = GraphBuilder()
    x, w = g.input((N, C, H, W)), g.input((Co, C, 3, 3))
    y = g.op("conv_general_dilated", [x, w], [(N, Co, H - 2, W - 2)],
             params={**CONV_NCHW, "padding": ((0, 0), (0, 0))})
    _, fg = analyze_all(g)
    fx, fy = fg.value_factors(x), fg.value_factors(y)
    assert fy[0] == fx[0]
    assert fy[2] not in fx and fy[3] not in fx
    # rows split on the input only would leave partial sums of every output row: reduced
    assert {fx[2], fx[3]} <= fg.op_factors[0].reduced


def test_weight_gradient_conv_sums_over_image_positions():
    """The kernel gradient of a conv is a conv of the image with the output cotangent whose 'output'
    is the kernel window: it sums over the batch and every image position."""
    N, H, W, C, Co = 2, 16, 12, 3, 8
    g = GraphBuilder()
    x, dy = g.input((N, H, W, C)), g.input((N, H, W, Co))
    # jax's transpose rule: lhs = x as (C, H, W, N) "batch C", rhs = dy as (Co, H, W, N) "out features Co"
    dw = g.op("conv_general_dilated", [x, dy], [(3, 3, C, Co)], params={
        "lhs_spec": (3, 0, 1, 2), "rhs_spec": (3, 0, 1, 2), "out_spec": (2, 3, 0, 1),
        "rhs_in_feature_dim": 0, "rhs_spatial_dims": (1, 2), "feature_group_count": 1,
        "padding": ((1, 1), (1, 1))})
    _, fg = analyze_all(g)
    fx, fdy = fg.value_factors(x), fg.value_factors(dy)
    # the batch and the rows and columns of both (in a whole step they are one factor each: the
    # forward conv links the cotangent's positions to the image's)
    assert fg.op_factors[0].reduced == {fx[0], fx[1], fx[2], fdy[1], fdy[2]}
    assert fdy[0] == fx[0] and fg.value_factors(dw)[3] == fdy[3]


def test_conv_nhwc_specs():
    N, H, W, C, Co = 2, 16, 12, 3, 8
    g = GraphBuilder()
    x, w = g.input((N, H, W, C)), g.input((3, 3, C, Co))        # NHWC, HWIO
    y = g.op("conv_general_dilated", [x, w], [(N, H, W, Co)], params={
        "lhs_spec": (0, 3, 1, 2), "rhs_spec": (3, 2, 0, 1), "out_spec": (0, 3, 1, 2),
        "rhs_in_feature_dim": 2, "rhs_spatial_dims": (0, 1), "feature_group_count": 1})
    _, fg = analyze_all(g)
    fx, fw, fy = fg.value_factors(x), fg.value_factors(w), fg.value_factors(y)
    assert fy == (fx[0], fx[1], fx[2], fw[3])
    assert fx[3] == fw[2]
    assert fg.op_factors[0].reduced == {fx[3], fw[0], fw[1]}


def test_depthwise_conv_channels_are_carried_not_reduced():
    N, C, H, W = 2, 8, 16, 12
    g = GraphBuilder()
    x, w = g.input((N, C, H, W)), g.input((C, 1, 3, 3))
    y = g.op("conv_general_dilated", [x, w], [(N, C, H, W)],
             params={**CONV_NCHW, "feature_group_count": C, "padding": ((1, 1), (1, 1))})
    _, fg = analyze_all(g)
    fx, fw, fy = fg.value_factors(x), fg.value_factors(w), fg.value_factors(y)
    assert fy[1] == fx[1] == fw[0]
    assert fx[1] not in fg.op_factors[0].reduced


# repeated factors, co-occurrence, divisibility ------------------------------------------------

def attention_scores(B=2, S=16, H=4, hd=8):
    g = GraphBuilder()
    D = H * hd
    x = g.input((B, S, D), (2, "x"), role="data")

    def heads(w):
        h = g.dot(x, w, ((2,), (0,)))
        h = g.op("reshape", [h], [(B, S, H, hd)], params={"new_sizes": (B, S, H, hd), "dimensions": None})
        return g.op("transpose", [h], [(B, H, S, hd)], params={"permutation": (0, 2, 1, 3)})

    wq, wk = g.input((D, D)), g.input((D, D))
    q, k = heads(wq), heads(wk)
    s = g.dot(q, k, ((3,), (3,)), ((0, 1), (0, 1)))
    return g, x, wq, wk, s


def test_attention_scores_repeat_the_sequence_factor():
    g, x, wq, wk, s = attention_scores()
    _, fg = analyze_all(g)
    fx, fs = fg.value_factors(x), fg.value_factors(s)
    assert len(fs) == 4
    assert fs[2] == fs[3] == fx[1]                 # both S dims come from the one S of x
    assert fx[1] in fg.repeated
    assert fx[0] not in fg.repeated and fs[1] not in fg.repeated
    assert fs[0] == fx[0]
    assert fg.value_factors(wq)[1] == fg.value_factors(wk)[1] == fs[1]   # heads of q and k linked
    assert fg.cooccur[fx[1]] >= {fx[0], fs[1], fx[1]}


def test_cooccur_lists_factors_sharing_a_tensor():
    g = GraphBuilder()
    x = g.input((4, 6))
    y = g.op("tanh", [x])
    z = g.op("exp", [g.input((10,))])
    _, fg = analyze_all(g)
    (fb, fk), (fn,) = fg.value_factors(y), fg.value_factors(z)
    assert fg.cooccur[fb] == fg.cooccur[fk] == {fb, fk}
    assert fg.cooccur[fn] == {fn}
    assert fg.repeated == frozenset()


def test_divides_checks_every_size_of_a_factor():
    g = GraphBuilder()
    x = g.input((12, 8))
    g.op("reshape", [x], [(6, 2, 8)], params={"new_sizes": (6, 2, 8), "dimensions": None})
    _, fg = analyze_all(g)
    f, d = fg.value_factors(x)
    assert set(fg.factor_sizes[f]) == {12, 6}
    assert fg.divides(f, 3) and fg.divides(f, 6) and fg.divides(f, 1)
    assert not fg.divides(f, 4) and not fg.divides(f, 12)
    assert fg.divides(d, 8) and not fg.divides(d, 3)
    assert fg.factor_size(f) == 12
    assert fg.divides(10_000, 7)                   # a factor with no dims divides anything
    assert fg.factor_size(10_000) == 1


# unknown ops, same_ops, subgraphs -------------------------------------------------------------

def test_unknown_primitive_needs_its_operands_whole():
    B, D = 8, 16
    g = GraphBuilder()
    x = g.input((B, D))
    ones = g.input((1, 1))
    s = g.literal(())
    y = g.op("my_custom_call", [x, ones, s], [(B, D)])
    z = g.op("tanh", [y])
    graph, fg = analyze_all(g)
    assert fg.unknown_ops == [0]
    of = fg.op_factors[0]
    assert not of.known
    assert of.loop == frozenset() and of.reduced == frozenset()
    fx = fg.value_factors(x)
    assert of.gathered == ((nbytes((B, D), "float32"), fx),)   # size-1 and scalar operands skipped
    assert set(fg.value_factors(y)).isdisjoint(fx)              # no links through the unknown op
    assert fg.value_factors(z) == fg.value_factors(y)
    assert fg.op_factors[1].known


def test_same_ops_link_outputs_and_inputs_of_corresponding_ops():
    B, D, F = 8, 16, 32

    def build():
        g = GraphBuilder()
        xa, xb = g.input((B, D)), g.input((B, D))
        wa, wb = g.input((D, F)), g.input((D, F))
        ha, hb = g.dot(xa, wa), g.dot(xb, wb)
        return g, (xa, wa, ha), (xb, wb, hb)

    g, a, b = build()
    _, fg = analyze_all(g)
    for va, vb in zip(a, b, strict=True):
        assert set(fg.value_factors(va)).isdisjoint(fg.value_factors(vb))
    g, a, b = build()
    _, fg = analyze_all(g, same_ops=[(0, 1)])
    for va, vb in zip(a, b, strict=True):
        assert fg.value_factors(va) == fg.value_factors(vb)


def test_analyze_covers_only_the_given_ops():
    g = GraphBuilder()
    x, w = g.input((8, 16)), g.input((16, 32))
    y = g.dot(x, w)
    z = g.op("tanh", [y])
    graph = g.build()
    fg = analyze(graph, [1])
    assert set(fg.op_factors) == {1}
    assert fg.value_factors(x) == (None, None)     # not seen by the subgraph
    assert fg.value_factors(z) == fg.value_factors(y) and None not in fg.value_factors(y)


def test_analyze_is_deterministic():
    def run():
        g, *_ = attention_scores()
        graph, fg = analyze_all(g)
        return fg.factor_of, fg.factor_sizes, fg.repeated, fg.cooccur, fg.op_factors

    assert run() == run()


# gaps found while writing these tests ---------------------------------------------------------

def test_split_links_the_unsplit_dims():
    B, D = 8, 16
    g = GraphBuilder()
    x = g.input((B, 2 * D))
    a, b = g.op("split", [x], [(B, D), (B, D)], params={"sizes": (D, D), "axis": 1})
    _, fg = analyze_all(g)
    fx = fg.value_factors(x)
    assert fg.op_factors[0].known
    assert fg.value_factors(a)[0] == fg.value_factors(b)[0] == fx[0]


def test_max_pool_keeps_batch_and_channel_factors():
    N, H, W, C = 2, 16, 12, 3
    g = GraphBuilder()
    x = g.input((N, H, W, C))
    y = g.op("reduce_window_max", [x], [(N, H // 2, W // 2, C)], params={
        "window_dimensions": (1, 2, 2, 1), "window_strides": (1, 2, 2, 1),
        "padding": ((0, 0),) * 4, "base_dilation": (1,) * 4, "window_dilation": (1,) * 4})
    _, fg = analyze_all(g)
    fx, fy = fg.value_factors(x), fg.value_factors(y)
    assert fy[0] == fx[0] and fy[3] == fx[3]


def test_argsort_second_output_keeps_the_batch_factor():
    B, N = 4, 32
    g = GraphBuilder()
    x = g.input((B, N))
    iota = g.input((B, N), dtype="int32")
    _, perm = g.op("sort", [x, iota], [(B, N), (B, N)], params={"dimension": 1, "is_stable": True, "num_keys": 1})
    _, fg = analyze_all(g)
    assert fg.value_factors(perm)[0] == fg.value_factors(x)[0]

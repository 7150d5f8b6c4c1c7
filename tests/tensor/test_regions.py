"""Tensor-parallel regions and the residual stream (sequence parallelism) on a hand-built pre-norm
residual MLP block: pure Python, no jax, milliseconds.

x[B, S, D] -> norm (a stand-in elementwise op) -> h @ W1[D, F] -> tanh -> @ W2[F, D] -> + x. The FFN
hidden dim F is the tensor-parallel factor; the stream (x, the norm, the residual add) reads the
sequence under a factor of its own, so a plan can split it over the tensor-parallel axis, with an
all-gather where the stream enters the region and a reduce-scatter where the partial sum leaves.
"""

from __future__ import annotations

import numpy as np

from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.hardware import get_hardware
from autoshard._src.core.mesh import mesh_spec
from autoshard._src.tensor.evaluator import SearchOptions, _Evaluator
from autoshard._src.tensor.regions import analyze

from ..core._synthetic import GraphBuilder

B, S, D, F = 4, 6, 8, 16
MATMUL3 = {"contracting": ((2,), (0,)), "batch": ((), ())}


def block(with_mask: bool = False):
    g = GraphBuilder()
    x = g.input((B, S, D), (2, "x"), role="data")
    w1, w2 = g.param("fc1", (D, F)), g.param("fc2", (F, D))
    h = g.op("mul", [x, x])
    a = g.op("dot_general", [h, w1], [(B, S, F)], params=MATMUL3)
    if with_mask:          # an integer value read by the region (token ids, a mask): never cut
        ids = g.input((B, S, F), (2, "ids"), role="data", dtype="int32")
        a = g.op("mul", [a, ids])
    r = g.op("tanh", [a])
    z = g.op("dot_general", [r, w2], [(B, S, D)], params=MATMUL3)
    y = g.op("add", [x, z])
    g.op("reduce_sum", [y], [()], params={"axes": (0, 1, 2)})
    return g.build(), dict(x=x, h=h, a=a, z=z, y=y, w1=w1)


def analysed(with_mask=False):
    graph, v = block(with_mask)
    ops = range(len(graph.ops))
    plain = analyze(graph, ops)
    ffn = plain.value_factors(v["a"])[2]
    return graph, v, plain, ffn, analyze(graph, ops, tensor_parallel=(plain, [ffn]))


def test_stream_is_cut_from_the_region_on_its_sequence_only():
    graph, v, plain, ffn, fg = analysed()
    bx, sx, dx = plain.value_factors(v["x"])
    assert plain.value_factors(v["a"]) == (bx, sx, ffn)     # uncut: one sequence everywhere
    cuts = {c[0]: c[1:] for c in fg.cuts}
    assert set(cuts) == {v["h"], v["z"]}                     # entering the region, leaving it
    (hb, hs, hd), (eb, es, ed) = cuts[v["h"]]
    (zb, zs, zd), (lb, ls, ld) = cuts[v["z"]]
    assert hb == eb and hd == ed and hs != es                # batch and model dim stay linked
    assert es == zs                                           # the region's one sequence factor
    assert hs == ls == fg.value_factors(v["x"])[1]           # the stream's, through the residual add
    assert fg.sequence == {hs}
    assert fg.value_factors(v["w1"]) == (ed, fg.value_factors(v["a"])[2])  # weights untouched


def test_integer_values_and_parameters_are_never_cut():
    graph, v, plain, ffn, fg = analysed(with_mask=True)
    cut_values = {c[0] for c in fg.cuts}
    ids = next(i for i in graph.inputs if graph.values[i].dtype == "int32")
    assert ids not in cut_values and v["w1"] not in cut_values
    assert cut_values == {v["h"], v["z"]}


def test_sequence_parallel_prices_all_gather_in_and_reduce_scatter_out():
    graph, v, plain, ffn, fg = analysed()
    mesh, hw = mesh_spec({"m": 2}), get_hardware("h100-sxm")
    region_ffn = fg.value_factors(v["a"])[2]
    stream_seq = next(iter(fg.sequence))
    cands = tuple(sorted({region_ffn, stream_seq}))
    weights = {i: 1.0 for i in range(len(graph.ops))}
    ev = _Evaluator(graph, fg, weights, frozenset(), cands, mesh, hw, AnalyticalCostModel(mesh, hw),
                    SearchOptions(), {})
    ev.budget, ev.bwd_share = float("inf"), 0.0
    megatron = ev.evaluate_one({region_ffn: ("m",)}, "replicated")
    sp = ev.evaluate_one({region_ffn: ("m",), stream_seq: ("m",)}, "replicated")
    out_bytes = B * S * D * 4
    assert megatron.comm_bytes == {"all-reduce@m": out_bytes}
    # the same partial sum, reduce-scattered; the stream gathered back before the column matmul (and
    # the loss, summing the split sequence, all-reduces its scalar)
    assert sp.comm_bytes == {"reduce-scatter@m": out_bytes, "all-gather@m": out_bytes, "all-reduce@m": 4}
    # the stream's activations (the norm's output, kept for the backward pass) are halved: here
    # there is no backward pass, so compare the work instead: the stream's ops split in two
    assert sp.breakdown["compute"] < megatron.breakdown["compute"]
    assert np.isclose(sp.memory["data"], megatron.memory["data"] / 2)

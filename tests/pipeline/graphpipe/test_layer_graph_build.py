"""layer_graph: GraphPipe's coarse DAG from traced debug models (jax only here, for tracing)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import autoshard
import models
from autoshard import PipelineError
from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.fusion import fusion
from autoshard._src.core.liveness import live_ops
from autoshard._src.pipeline.graphpipe.layer_graph_build import layer_graph


def _trace(name: str, **overrides):
    m = models.get(name, "debug", **overrides)
    args = m.abstract_state()      # ShapeDtypeStructs: params via jax.eval_shape(m.init), optax state
    return m, args, autoshard.trace(m.train_step, *args)


@pytest.fixture(scope="module", params=["mmt", "dlrm", "candle_uno"])
def traced(request):
    return request.param, *_trace(request.param)


def _reach(lg) -> list[set[int]]:
    """Descendants of each node (the graph is listed topologically)."""
    out: list[set[int]] = [set() for _ in lg.nodes]
    for i in reversed(range(len(lg.nodes))):
        for s in lg.succ[i]:
            out[i] |= {s} | out[s]
    return out


def _branch_of(name: str) -> str:
    return name.split("/")[1]


@pytest.mark.slow
def test_structure(traced):
    name, m, _, graph = traced
    lg = layer_graph(graph, "v100-sxm")
    c = m.config
    names = [n.name for n in lg.nodes]
    assert len(set(names)) == len(names)
    assert lg.batch_size == c.batch_size
    assert all(u < v for u, v in lg.edges)            # topological order, forward edges only
    assert len(lg.sinks) == 1                          # everything ends in the loss
    reach = _reach(lg)
    if name == "mmt":
        # per branch one node per layer (in_proj/pos_emb and ln_f/pooling merged into the first and
        # last), plus the join: concatenation + head + loss in a node of its own
        assert len(lg) == c.num_branches * c.num_layers + 1
        assert names[-1] == "MMT/head"
        assert names[:c.num_layers] == [f"MMT/branch_0/layer_{i}" for i in range(c.num_layers)]
        assert len(lg.sources) == c.num_branches
        assert len(lg.pred[lg.sinks[0]]) == c.num_branches
    elif name == "dlrm":
        assert len(lg) == c.num_dense * c.dense_layers + c.num_sparse + c.top_layers + 1
        assert len(lg.sources) == c.num_dense + c.num_sparse
        top0 = names.index("DLRM/top/fc_0")           # the concatenation is merged into it
        assert len(lg.pred[top0]) == c.num_dense + c.num_sparse
        emb = lg.nodes[names.index("DLRM/embedding_0")]
        assert emb.output_bytes == c.emb_dim * 4      # the bag is summed inside the embedding node
    else:
        assert len(lg) == c.num_branches * c.branch_layers + c.top_layers + 1
        assert len(lg.sources) == c.num_branches
    # branches are parallel, not a chain: no node of one branch reaches a node of another
    branch = [_branch_of(n) for n in names]
    for i in range(len(lg)):
        for j in reach[i]:
            if branch[i] != branch[j]:
                assert branch[j] in ("head", "top"), (names[i], names[j])
    for n in lg.nodes:
        assert n.forward > 0 and n.backward > 0 and n.activation_bytes > 0
        assert n.branch == "/".join(n.name.split("/")[:2])


def test_costs_and_bytes_add_up(traced):
    _, _, args, graph = traced
    roofline = {"base": "v100-sxm", "kernels": None}     # per-op roofline costs add up exactly
    lg = layer_graph(graph, roofline)
    cm = AnalyticalCostModel({"stage": 1}, roofline)
    live = live_ops(graph)          # XLA deletes dead code: the nodes price live ops only
    fused = fusion(graph, gpu=False).bytes          # the HBM bytes each op is priced for after XLA's fusion
    total = {ph: sum(cm.compute(op.flops * op.repeat, fused[op.index] * op.repeat,
                                op.out_dtypes[0] if op.out_dtypes else "float32")
                     for op in graph.ops if op.phase == ph and live[op.index])
             for ph in ("forward", "backward", "optimizer")}
    nodes_fb = lg.batch_size * sum(n.forward + n.backward for n in lg.nodes)
    assert nodes_fb == pytest.approx(total["forward"] + total["backward"], rel=0.01)
    assert sum(n.update for n in lg.nodes) == pytest.approx(total["optimizer"], rel=0.01)
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(args[0]))
    assert sum(n.param_bytes for n in lg.nodes) == param_bytes
    # adam: two moments per parameter (plus a few saved constants)
    assert sum(n.state_bytes for n in lg.nodes) == pytest.approx(2 * param_bytes, rel=0.05)
    # every edge carries something, and a node sends at most what it produces
    for u, _ in lg.edges:
        assert lg.nodes[u].output_bytes > 0


@pytest.mark.slow
def test_deterministic_and_hardware(traced):
    _, _, _, graph = traced
    a, b = layer_graph(graph, "v100-sxm"), layer_graph(graph, "v100-sxm")
    assert a == b
    fast = layer_graph(graph, "a100-sxm")
    assert fast.edges == a.edges and [n.name for n in fast.nodes] == [n.name for n in a.nodes]
    assert sum(n.forward for n in fast.nodes) < sum(n.forward for n in a.nodes)


@pytest.mark.slow
def test_depth_override():
    m, _, graph = _trace("mmt")
    auto = layer_graph(graph, "v100-sxm")
    # depth=3 cuts every module at 3 components: the layers (the automatic level) and, as nodes
    # of their own, the branches' in_proj and ln_f (pos_emb is constant: no data flows through it)
    fine = {n.name for n in layer_graph(graph, "v100-sxm", depth=3).nodes}
    assert fine == {n.name for n in auto.nodes} | {f"MMT/branch_{b}/{x}" for b in range(4)
                                                   for x in ("in_proj", "ln_f")}
    coarse = layer_graph(graph, "v100-sxm", depth=2)               # whole branches: 4 parallel nodes and the head
    assert [n.name for n in coarse.nodes] == [f"MMT/branch_{b}" for b in range(4)] + ["MMT/head"]
    assert coarse.edges == tuple((b, 4) for b in range(4))
    assert sum(n.forward for n in coarse.nodes) == pytest.approx(sum(n.forward for n in auto.nodes))


def test_branch_count_follows_the_config():
    m, _, graph = _trace("candle_uno", num_branches=3)
    lg = layer_graph(graph, "v100-sxm")
    assert len(lg.sources) == 3 and len(lg) == 3 * 4 + 5


def test_sequential_model_is_a_chain():
    m, _, graph = _trace("mmt", num_branches=1, num_layers=3)
    lg = layer_graph(graph, "v100-sxm")
    # one branch: the head has one producer, so it is merged into the last layer
    assert [n.name for n in lg.nodes] == [f"MMT/branch_0/layer_{i}" for i in range(3)]
    assert lg.edges == ((0, 1), (1, 2))
    m, _, graph = _trace("gpt")
    lg = layer_graph(graph, "v100-sxm")
    assert lg.edges == tuple((i, i + 1) for i in range(len(lg) - 1))
    assert [n.name for n in lg.nodes] == [f"GPT/block_{i}" for i in range(m.config.num_layers)]


def test_errors_name_the_argument():
    _, _, graph = _trace("candle_uno")
    with pytest.raises(PipelineError, match="depth=0"):
        layer_graph(graph, "v100-sxm", depth=0)
    with pytest.raises(PipelineError, match="depth=9 is deeper"):
        layer_graph(graph, "v100-sxm", depth=9)
    with pytest.raises(PipelineError, match="batch_size=0"):
        layer_graph(graph, "v100-sxm", batch_size=0)
    with pytest.raises(PipelineError, match="OpGraph"):
        layer_graph("not a graph", "v100-sxm")
    for op in graph.ops:            # no repeated modules: no layer level to cut at
        op.module = "CandleUno/x" if op.module else ""
    with pytest.raises(PipelineError, match="pass depth="):
        layer_graph(graph, "v100-sxm")


KERNELS = {"base": "v100-sxm", "kernels": "v100"}       # tile and wave quantization, launches


@pytest.mark.parametrize("hw", ["v100-sxm", KERNELS], ids=["roofline", "kernels"])
@pytest.mark.parametrize("name, kw", [("candle_uno", {"hidden": 512, "feature_dim": 512}),
                                      pytest.param("mmt", {"hidden": 128, "d_ff": 512}, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_curves_match_the_step_traced_at_smaller_batches(name, kw, hw):
    """A node's curve at micro-batch b equals its cost in the step traced at batch b (the batch
    factor splits each op's shapes exactly: the roofline's flops and bytes, the kernel model's tiles).
    Batch 1 is left out: jax traces a different program there (size-1 dims are squeezed)."""
    full = layer_graph(_trace(name, batch_size=8, **kw)[2], hw)
    assert full.curve_sizes == 4                                   # 1, 2, 4, 8
    for i, b in ((1, 2), (2, 4)):
        small = layer_graph(_trace(name, batch_size=b, **kw)[2], hw)
        assert [n.name for n in small.nodes] == [n.name for n in full.nodes]
        for nf, ns in zip(full.nodes, small.nodes, strict=True):
            # 5 %: fusion is decided at the traced batch and scaled; XLA (and the model) may fuse a
            # smaller batch differently (recomputing a producer pays off at some sizes, not others:
            # MMT's layers differ by up to 3.1 %)
            assert nf.forward_curve[i] == pytest.approx(ns.forward * b, rel=0.05), nf.name
            assert nf.backward_curve[i] == pytest.approx(ns.backward * b, rel=0.05), nf.name
    for nf in full.nodes:                                          # at the traced batch: the totals
        assert nf.forward_curve[-1] == pytest.approx(nf.forward * 8, rel=1e-9)


def test_nodes_hold_every_op(traced):
    name, m, args, graph = traced
    lg = layer_graph(graph, "v100-sxm")
    held = [o for n in lg.nodes for o in n.ops]
    assert set(held) == set(range(len(graph.ops)))


def test_kernel_overhead_is_paid_per_micro_batch(traced):
    name, m, args, graph = traced
    base = layer_graph(graph, {"base": "v100-sxm", "kernels": None})       # the pure roofline
    slow = layer_graph(graph, "v100-sxm", kernel_overhead=5e-6)
    for a, b in zip(base.nodes, slow.nodes, strict=True):
        extra = [y - x for x, y in zip(a.forward_curve, b.forward_curve, strict=True)]
        assert extra[0] == pytest.approx(extra[-1]) and extra[0] >= 0      # the same at every size
        assert a.forward == b.forward                                       # per-sample roofline unchanged
    assert any(b.forward_curve[0] > a.forward_curve[0] for a, b in zip(base.nodes, slow.nodes, strict=True))
    with pytest.raises(PipelineError, match="kernel_overhead=-1"):
        layer_graph(graph, "v100-sxm", kernel_overhead=-1)


def test_measured_op_curves_drive_the_micro_batch_size():
    """Given per-op seconds at each micro-batch size (profile="measured"), the node curves are their
    sums, and GraphPipe follows them: flat costs (a kernel costs the same at any size) want large
    micro-batches, linear costs (no per-micro-batch overhead) small ones (a shorter fill/drain)."""
    from autoshard._src.pipeline.graphpipe.layer_graph_build import curve_sizes
    from pipeline.graphpipe import graphpipe_partition

    m, _, graph = _trace("candle_uno")
    sizes = curve_sizes(m.config.batch_size)
    n, K = len(graph.ops), len(sizes)
    flat = np.full((n, K), 1e-4)
    linear = 1e-4 * np.tile(np.array(sizes, dtype=float), (n, 1))
    chosen = {}
    for name, cur in (("flat", flat), ("linear", linear)):
        lg = layer_graph(graph, "v100-sxm", op_curves=cur, op_time=cur[:, -1])
        for node in lg.nodes:
            # dead ops (XLA deletes them) cost nothing, measured or not
            fwd = [o for o in node.ops if graph.ops[o].phase == "forward" and live_ops(graph)[o]]
            assert node.forward_curve[0] == pytest.approx(1e-4 * len(fwd), rel=1e-9), node.name
            assert node.forward_curve[-1] == pytest.approx(node.forward_curve[0] * (1 if name == "flat" else sizes[-1]))
            assert node.forward == pytest.approx(node.forward_curve[-1] / m.config.batch_size)
        chosen[name] = graphpipe_partition(lg, 4, "v100-sxm").stages[0].microbatch_size
    assert chosen["flat"] > chosen["linear"] == 1


def test_measured_op_curves_are_checked():
    _, _, graph = _trace("candle_uno")
    n = len(graph.ops)
    with pytest.raises(PipelineError, match=rf"shape \(3, 4\); the graph has {n} ops and batch 8, so give \({n}, 4\)"):
        layer_graph(graph, "v100-sxm", op_curves=np.ones((3, 4)))
    bad = np.ones((n, 4))
    bad[5, 2] = -1.0
    with pytest.raises(PipelineError, match=r"op_curves\[5, 2\] = -1.0"):
        layer_graph(graph, "v100-sxm", op_curves=bad)
    with pytest.raises(PipelineError, match="kernel_overhead=5e-06 .* pass one"):
        layer_graph(graph, "v100-sxm", op_curves=np.ones((n, 4)), kernel_overhead=5e-6)


def test_kernel_model_makes_small_micro_batches_cost_more_per_sample():
    """On the kernel model a node's time per sample falls as its micro-batch grows, and faster than on
    the roofline (which already pays the weights' bytes per micro-batch): launches and partly filled
    waves are amortised too."""
    graph = _trace("candle_uno", batch_size=64, hidden=512, feature_dim=512)[2]
    curves, heavy = {}, None
    for name, hw in (("roofline", {"base": "v100-sxm", "kernels": None}), ("kernels", KERNELS)):
        lg = layer_graph(graph, hw)
        sizes = [2 ** j for j in range(lg.curve_sizes)]
        if heavy is None:       # the same node on both models
            heavy = max(range(len(lg.nodes)), key=lambda i: lg.nodes[i].forward_curve[-1])
        per_sample = [t / s for t, s in zip(lg.nodes[heavy].forward_curve, sizes, strict=True)]
        assert all(a >= b * (1 - 1e-9) for a, b in zip(per_sample, per_sample[1:], strict=False)), per_sample
        curves[name] = per_sample
    small, large = (curves["kernels"][j] / curves["roofline"][j] for j in (1, -1))
    assert small > 1.5 * large, curves

"""search() on hand-built training steps: pure Python, no jax, milliseconds.

`mlp_step` (tests/core/_synthetic.py) builds an MLP training step as plain data: a data input,
kernels (role "parameter"), the forward chain and loss, the backward pass (weight gradients
contracting over the batch, input gradients) and an optimizer update with one moment per kernel
(role "state"). The search must find data parallelism, tensor parallelism or ZeRO storage as the
shapes and the memory budget dictate.
"""

from __future__ import annotations

import pytest

from autoshard import group
from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.graph import Loop, nbytes
from autoshard._src.core.hardware import get_hardware
from autoshard._src.core.mesh import mesh_spec
from autoshard._src.tensor.search import SearchOptions, search

from ..core._synthetic import GraphBuilder, mlp_step, remainder_grouping

H100 = get_hardware({"base": "h100-sxm", "kernels": None})   # synthetic graphs on the roofline
MESH8 = mesh_spec({"x": 8})


def run(graph, mesh=MESH8, hw=H100, grouped=False, **options):
    grouping = group(graph) if grouped else remainder_grouping(graph)
    return search(graph, grouping, mesh, hw, SearchOptions(**options))


def by_role(graph, role):
    return [v for v in graph.inputs if graph.values[v].role == role]


def weight_factors(graph, res) -> set[int]:
    return {f for w in by_role(graph, "parameter") for f in res.factors.value_factors(w) if f is not None}


def batch_factor(graph, res) -> int:
    return res.factors.value_factors(by_role(graph, "data")[0])[0]


def weight_grad_ops(graph) -> list[int]:
    return [op.index for op in graph.ops if op.phase == "backward" and op.primitive == "dot_general"
            and op.params["contracting"] == ((0,), (0,))]


# the synthetic step itself ------------------------------------------------------------------

def test_mlp_step_shape():
    graph = mlp_step(16, [8, 12, 4])
    assert [graph.values[v].shape for v in by_role(graph, "parameter")] == [(8, 12), (12, 4)]
    assert [graph.values[v].shape for v in by_role(graph, "state")] == [(8, 12), (12, 4)]
    assert graph.ops_by_phase() == {"forward": 6, "backward": 6, "optimizer": 4, "other": 0}
    grouping = remainder_grouping(graph)
    assert grouping.block_types == () and grouping.remainder == tuple(range(len(graph.ops)))
    # one block type when the layers have equal shapes
    bt, = group(mlp_step(16, [8, 8, 8])).block_types
    assert (bt.name, bt.count) == ("M/dense_*", 2)


def test_weight_gradients_link_to_their_parameters():
    graph = mlp_step(16, [8, 12, 4])
    res = run(graph)
    fg = res.factors
    ws = by_role(graph, "parameter")
    for w, i in zip(ws[::-1], weight_grad_ops(graph), strict=True):
        op = graph.ops[i]
        assert fg.value_factors(op.outputs[0]) == fg.value_factors(w)
        assert fg.op_factors[i].reduced == {batch_factor(graph, res)}
        assert i in res.grad_ops
    for w, m in zip(ws, by_role(graph, "state"), strict=True):
        assert fg.value_factors(m) == fg.value_factors(w)


# physics ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("grouped", [False, True], ids=["remainder", "grouped"])
def test_large_batch_tiny_weights_is_data_parallel(grouped):
    # batch large enough that the activations' (fused) HBM traffic outweighs two collectives' latency
    graph = mlp_step(262144, [64, 64, 64])
    res = run(graph, grouped=grouped)
    assert res.periods == ((2,) if grouped else ())
    best = res.best
    assert best.feasible and best.storage == "replicated"
    assert best.factor_axes == {batch_factor(graph, res): ("x",)}, best
    assert not weight_factors(graph, res) & set(best.factor_axes)
    assert best.breakdown["grad_sync"] > 0


def test_tiny_batch_huge_weight_gets_the_axis():
    graph = mlp_step(8, [16384, 16384])
    res = run(graph)
    best = res.best
    split = set(best.factor_axes)
    assert split & weight_factors(graph, res), best
    assert batch_factor(graph, res) not in split
    assert all(axes == ("x",) for axes in best.factor_axes.values())
    assert best.breakdown["grad_sync"] == 0.0


@pytest.mark.parametrize("grouped", [False, True], ids=["remainder", "grouped"])
def test_two_huge_layers_split_column_then_row(grouped):
    """Megatron: the hidden dim between the two kernels is split, so the first kernel is split by
    columns and the second by rows, and neither the batch nor the outer dims are split."""
    graph = mlp_step(8, [16384] * 3)
    res = run(graph, grouped=grouped)
    w0, w1 = by_role(graph, "parameter")
    f0, f1 = res.factors.value_factors(w0), res.factors.value_factors(w1)
    assert f0[1] == f1[0]
    assert res.best.factor_axes == {f0[1]: ("x",)}, res.best


# memory -----------------------------------------------------------------------------------------

def state_bytes(choice):
    return choice.memory["params"] + choice.memory["grads"] + choice.memory["optimizer"]


def test_tight_memory_budget_shards_parameters_or_optimizer_state():
    graph = mlp_step(8192, [2048] * 5)
    roomy = run(graph).best
    assert roomy.storage == "replicated" and roomy.feasible
    replicated = sum(graph.values[v].nbytes for v in by_role(graph, "parameter") + by_role(graph, "state"))
    budget = roomy.memory["total"] - 0.5 * roomy.memory["optimizer"]
    assert budget < replicated + roomy.memory["grads"] + roomy.memory["activations"]  # replicated state cannot fit
    res = run(graph, memory_budget=budget)
    tight = res.best
    assert res.budget == budget
    assert tight.feasible and tight.memory["total"] <= budget
    assert tight.storage in ("zero1", "zero3") or set(tight.factor_axes) & weight_factors(graph, res), tight
    assert state_bytes(tight) < state_bytes(roomy)
    assert tight.step_time >= roomy.step_time                # memory is paid for in time


def test_budget_nothing_meets_is_infeasible_and_minimises_memory():
    graph = mlp_step(8192, [2048] * 5)
    roomy = run(graph).best
    best = run(graph, memory_budget=1000).best
    assert not best.feasible
    assert best.memory["total"] > 1000
    assert best.memory["total"] < roomy.memory["total"]      # the least memory found, not the fastest


def test_without_zero_a_tight_budget_splits_the_weights():
    graph = mlp_step(4096, [2048] * 5)      # weights and their gradients outweigh the activations
    roomy = run(graph).best
    assert roomy.factor_axes == {batch_factor(graph, run(graph)): ("x",)}   # data parallel
    budget = 0.95 * roomy.memory["total"]
    res = run(graph, memory_budget=budget, storage_modes=("replicated",))
    best = res.best
    assert best.storage == "replicated" and best.feasible and best.memory["total"] <= budget
    assert set(best.factor_axes) & weight_factors(graph, res), best
    assert best.memory["params"] < roomy.memory["params"]


# communication accounting -----------------------------------------------------------------------

def test_data_parallel_gradient_all_reduce_is_grad_sync():
    dims = [64, 96, 128]           # distinct kernel shapes, packed into one bucket (under 25 MiB)
    graph = mlp_step(65536, dims)
    res = run(graph)
    best = res.best
    assert best.factor_axes == {batch_factor(graph, res): ("x",)}
    cost = AnalyticalCostModel(MESH8, H100)
    grads = sum(nbytes((a, b), "float32") for a, b in zip(dims, dims[1:], strict=False))
    expected = cost.collective("all-reduce", grads, ("x",))
    assert best.breakdown["grad_sync"] == pytest.approx(expected, rel=1e-9)
    assert best.breakdown["bwd_comm"] == 0.0
    assert set(weight_grad_ops(graph)) <= res.grad_ops
    # the same numbers through evaluate()
    again = res.evaluate({batch_factor(graph, res): ("x",)}, "replicated")
    assert again.breakdown == best.breakdown and again.memory == best.memory


def test_data_parallel_memory_split():
    graph = mlp_step(65536, [64, 96, 128])
    res = run(graph)
    best = res.best
    params = sum(graph.values[v].nbytes for v in by_role(graph, "parameter"))
    state = sum(graph.values[v].nbytes for v in by_role(graph, "state"))
    data = sum(graph.values[v].nbytes for v in by_role(graph, "data"))
    assert best.memory["params"] == params                                # replicated
    # the update is in the step: the gradient all-reduces combine after the backward pass, so every
    # gradient and its reduced copy are alive then, in the place of the freed activations
    assert best.memory["activations"] > 0
    assert best.memory["grads"] == pytest.approx(max(0.0, 2 * params - best.memory["activations"]))
    small_graph = mlp_step(64, [64, 96, 128])           # gradients outweigh a small batch's activations
    small = run(small_graph)
    dp = small.evaluate({batch_factor(small_graph, small): ("x",)}, "replicated")
    assert dp.memory["grads"] + dp.memory["activations"] == pytest.approx(2 * params)
    assert best.memory["optimizer"] == state
    assert best.memory["data"] == data / 8                                # batch split
    zero1 = res.evaluate(best.factor_axes, "zero1")
    assert zero1.memory["optimizer"] == state / 8 and zero1.memory["params"] == params
    zero3 = res.evaluate(best.factor_axes, "zero3")
    assert zero3.memory["params"] == params / 8 and zero3.memory["optimizer"] == state / 8


# determinism, divisibility ----------------------------------------------------------------------

@pytest.mark.parametrize("grouped", [False, True], ids=["remainder", "grouped"])
def test_search_is_deterministic(grouped):
    graph = mlp_step(512, [1024] * 4)
    a = run(graph, grouped=grouped)
    b = run(graph, grouped=grouped)
    c = run(mlp_step(512, [1024] * 4), grouped=grouped)
    assert a.best == b.best == c.best
    assert a.candidates == b.candidates == c.candidates


@pytest.mark.parametrize("hw", ["h100-sxm", {"base": "h100-sxm", "intra_node_latency": 0.0}])
def test_indivisible_factor_never_gets_the_axis(hw):
    hw = get_hardware(hw)
    graph = mlp_step(8, [2**20, 6], act=None)   # kernel [2**20, 6]
    w, = by_role(graph, "parameter")
    # on a 3-device axis the size-6 dim is the one worth splitting (nothing else divides by 3) ...
    res3 = run(graph, mesh=mesh_spec({"x": 3}), hw=hw)
    six = res3.factors.value_factors(w)[1]
    assert set(res3.factors.factor_sizes[six]) == {6}
    assert res3.best.factor_axes == {six: ("x",)}
    # ... on a 4-device axis it must never be, whatever else is
    res4 = run(graph, mesh=mesh_spec({"x": 4}), hw=hw)
    assert res4.factors.value_factors(w)[1] == six
    assert six not in res4.best.factor_axes
    for f in res4.best.factor_axes:
        assert res4.factors.divides(f, 4)
    # a size-6 batch is never split on 4 either
    graph6 = mlp_step(6, [4096, 4096])
    res = run(graph6, mesh=mesh_spec({"x": 4}), hw=hw)
    assert res.factors.factor_size(batch_factor(graph6, res)) == 6
    assert batch_factor(graph6, res) not in res.best.factor_axes


# gaps found while writing these tests -----------------------------------------------------------

def test_column_parallel_input_gradient_all_reduce_is_backward_comm():
    B, D = 8, 64
    graph = mlp_step(B, [D] * 4)                 # three layers
    res = run(graph)
    ws = by_role(graph, "parameter")
    hidden = res.factors.value_factors(ws[1])[1]  # layer 1 column-parallel, layer 2 row-parallel
    assert res.factors.value_factors(ws[2])[0] == hidden
    megatron = res.evaluate({hidden: ("x",)}, "replicated")
    # dX of layer 1 = g[B, D/8] @ W1[D, D/8]^T contracts over the split dim: partial sums of [B, D]
    cost = AnalyticalCostModel(MESH8, H100)
    assert megatron.breakdown["bwd_comm"] == pytest.approx(
        cost.collective("all-reduce", nbytes((B, D), "float32"), ("x",)), rel=1e-9)
    assert megatron.breakdown["grad_sync"] == 0.0   # no weight gradient is reduced


def test_each_repetition_of_a_reducing_op_pays_collective_latency():
    B, K, N = 8, 1024, 512
    g = GraphBuilder()
    x = g.input((B, K), (2, "x"), role="data")
    w = g.param("M/dense", (K, N))
    g.output(g.dot(x, w, loops=(Loop(1, "scan", 4),)), (2,))
    graph = g.build()
    res = run(graph)
    row = res.evaluate({res.factors.value_factors(w)[0]: ("x",)}, "replicated")   # row-parallel
    one = AnalyticalCostModel(MESH8, H100).collective("all-reduce", nbytes((B, N), "float32"), ("x",))
    assert row.breakdown["fwd_comm"] == pytest.approx(4 * one, rel=1e-9)


def test_zero3_memory_matches_what_the_planner_can_shard():
    g = GraphBuilder()
    x = g.input((16, 12), (2, "x"), role="data")
    w = g.param("M/dense", (12, 5))
    g.output(g.op("reduce_sum", [g.dot(x, w)], [()], params={"axes": (0, 1)}), (2,))
    graph = g.build()
    res = run(graph, mesh=mesh_spec({"x": 2, "y": 4}))
    f = res.factors.value_factors(w)[0]
    zero3 = res.evaluate({f: ("y",)}, "zero3")
    assert zero3.memory["params"] == graph.values[w].nbytes / 4


def test_kernel_model_prices_narrow_shards_above_their_share():
    """On a GPU kernel model a matmul split 8 ways runs in partly filled waves: its shard costs more
    than 1/8 of the whole (on the roofline exactly 1/8), and every kernel still pays its launch."""
    graph = mlp_step(16, [512, 512, 512])
    kernels = get_hardware({"base": "h100-sxm", "kernels": "h100"})
    ratios = {}
    for name, hw in (("roofline", H100), ("kernels", kernels)):
        res = run(graph, hw=hw)
        w0 = by_role(graph, "parameter")[0]
        hidden = res.factors.value_factors(w0)[1]
        whole = res.evaluate({}, "replicated").breakdown["compute"]
        split = res.evaluate({hidden: ("x",)}, "replicated").breakdown["compute"]
        ratios[name] = split / whole
    assert ratios["kernels"] > 1.5 * ratios["roofline"], ratios
    assert ratios["roofline"] < 0.5


def test_gradient_buckets_count_per_device_bytes():
    """Issue 30 item 4: gradients travel in buckets of `bucket_bytes` of the per-device buffer. Two
    2048 x 2048 float32 weights (16 MiB each) split 8 ways over "t" leave 2 MiB per device each: at
    1 MiB buckets, two all-reduces over "d" each, not the sixteen their unsharded bytes would fill."""
    dims = [2048, 2048, 2048]
    graph = mlp_step(64, dims, adam=False)
    mesh = mesh_spec({"d": 2, "t": 8})
    res = run(graph, mesh=mesh, bucket_bytes=2**20)
    hidden = res.factors.value_factors(by_role(graph, "parameter")[0])[1]
    plan = res.evaluate({batch_factor(graph, res): ("d",), hidden: ("t",)}, "replicated")
    cost = AnalyticalCostModel(mesh, H100)
    per_device = nbytes((2048, 2048), "float32") / 8
    latency = cost.collective("all-reduce", 0.0, ("d",))
    one_weight = cost.collective("all-reduce", per_device, ("d",)) + latency     # 2 buckets: 2 latencies
    assert plan.breakdown["grad_sync"] == pytest.approx(2 * one_weight, rel=1e-9)
    # unsplit over "t", each weight fills sixteen buckets
    whole = res.evaluate({batch_factor(graph, res): ("d",)}, "replicated")
    full = cost.collective("all-reduce", 8 * per_device, ("d",)) + 15 * latency
    assert whole.breakdown["grad_sync"] == pytest.approx(2 * full, rel=1e-9)


def test_the_plan_space_cap_names_the_dim_it_leaves_whole_and_the_option_to_raise():
    # on 8 devices each factor doubles the plans (whole or split): a cap of 4 keeps two factors
    graph = mlp_step(64, (256, 1024, 256))
    capped = run(graph, max_plans=4)
    assert len(capped.candidates) == 2 and len(capped.notes) == 2, capped.notes
    note = capped.notes[0]
    assert note.startswith("[0]['M']['dense_1']['kernel'] dim 1 (a logical dim of size 256) left unsplit"), note
    assert 'Fix: raise the cap, search={"max_plans": 8}' in note, note
    # what leaving it whole keeps per device: 7/8 of the 1 MiB kernel that carries it
    assert "keeps up to 896 KiB per device of the 1 MiB" in note, note     # 7/8 of 1024 x 256 float32
    # the advice is right: with the cap it names, the search splits that dim too
    raised = run(graph, max_plans=8)
    assert len(raised.candidates) == 3 and len(raised.notes) == 1, raised.notes
    assert "[0]['M']['dense_1']['kernel'] dim 1" not in raised.notes[0]

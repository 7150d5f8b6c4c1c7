"""RaNNC atomic-level partitioning (pipeline/_atomic.py) on synthetic OpGraphs: pure, no jax."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard import AutoshardError, PipelineError
from autoshard._src.pipeline.atomic import atomic_partition
from autoshard._src.pipeline.costs import PipelineCosts

from ...core._synthetic import GraphBuilder, mlp_step
from ._rannc_graphs import B, D, component_dag, convex, random_step

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def non_constant_by_networkx(graph) -> set[int]:
    """Forward ops reachable from the data inputs through forward ops (independent of the code)."""
    fwd = {op.index for op in graph.ops if op.phase == "forward"}
    dag = graph.to_networkx().subgraph(fwd)
    roots = {c for v in graph.inputs if graph.values[v].role == "data" for c in graph.values[v].consumers} & fwd
    return roots.union(*(nx.descendants(dag, r) for r in roots))


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(1, 60), n_params=st.integers(1, 5),
       p_const=st.floats(0.0, 0.6), p_skip=st.floats(0.0, 0.5))
def test_one_non_constant_task_per_component(seed, n, n_params, p_const, p_skip):
    graph = random_step(seed, n, n_params, p_const, p_skip)
    atomic = atomic_partition(graph)
    ops = graph.ops
    nonconst = non_constant_by_networkx(graph)
    assert set(atomic.tasks) == nonconst
    assert list(atomic.tasks) == sorted(atomic.tasks)
    for c in range(len(atomic)):
        held = [o for o in atomic.ops(c) if ops[o].phase == "forward" and o in nonconst]
        assert held == [atomic.tasks[c]]
        assert not set(atomic.constants[c]) & nonconst
        assert all(ops[o].phase != "forward" or o not in nonconst for o in atomic.attached[c])
    # every op is somewhere; only cloned constants are in several components
    seen: dict[int, int] = {}
    for c in range(len(atomic)):
        for o in atomic.ops(c):
            seen[o] = seen.get(o, 0) + 1
    assert set(seen) == set(range(len(ops)))
    assert {o for o, k in seen.items() if k > 1} == set(atomic.clones)
    # a constant goes where its forward consumers are (cloned when they differ)
    for c in range(len(atomic)):
        for o in atomic.constants[c]:
            consumers = {d for v in ops[o].outputs for d in graph.values[v].consumers if ops[d].phase == "forward"}
            homes = set().union(*(atomic.components_of(d) for d in consumers))
            assert set(atomic.components_of(o)) == homes
    # components are numbered topologically; edges join non-constant tasks only
    for a, b in atomic.edges:
        assert a < b
    dag = component_dag(atomic)
    assert nx.is_directed_acyclic_graph(dag)


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(2, 40), picks=st.lists(st.integers(0, 10**6), min_size=1,
                                                                        max_size=6))
def test_is_convex_agrees_with_networkx(seed, n, picks):
    atomic = atomic_partition(random_step(seed, n, p_skip=0.4))
    dag = component_dag(atomic)
    nodes = {p % len(atomic) for p in picks}
    assert atomic.is_convex(nodes) == convex(dag, nodes)


def test_parameter_transpose_is_cloned_and_counted_in_each_component():
    g = GraphBuilder()
    x = g.input((B, D), (2, "x"), role="data")
    w = g.param("M/fc", (D, D))
    # constant, two consumers (a cast: a transpose read by matmuls is only a layout, free after fusion)
    wt = g.op("convert_element_type", [w], module="M/fc")
    y1 = g.dot(x, wt, module="M/fc")
    y2 = g.dot(g.op("tanh", [y1], module="M/act"), wt, module="M/fc")
    g.output(g.op("reduce_sum", [y2], [()], params={"axes": (0, 1)}), (2,))
    graph = g.build()
    atomic = atomic_partition(graph)
    assert [graph.ops[t].primitive for t in atomic.tasks] == ["dot_general", "tanh", "dot_general", "reduce_sum"]
    assert atomic.clones == {0: (0, 2)}                         # op 0 is the cast
    assert atomic.constants[0] == atomic.constants[2] == (0,)
    costs = PipelineCosts(atomic, "v100-sxm")
    t = costs.op_time[0]
    assert t > 0
    assert costs.component_work()[0] == pytest.approx(costs.op_time[1] + t)
    assert costs.component_work()[2] == pytest.approx(costs.op_time[3] + t)
    # in a union of both components the clone and the parameter count once
    both = costs.totals([0, 1, 2])
    assert both["fwd_const"] == pytest.approx(t)
    assert both["params"] == graph.values[w].nbytes
    assert costs.totals([0])["params"] == costs.totals([2])["params"] == graph.values[w].nbytes


def test_backward_and_optimizer_ops_join_the_forward_op_they_differentiate():
    graph = mlp_step(16, [8, 12, 4])
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, "v100-sxm")
    ops = graph.ops
    params = [v for v in graph.inputs if graph.values[v].role == "parameter"]
    states = [v for v in graph.inputs if graph.values[v].role == "state"]
    for w, m in zip(params, states, strict=True):
        fwd_dot = next(c for c in graph.values[w].consumers if ops[c].phase == "forward")
        home = atomic.component_of[fwd_dot]
        assert atomic.tasks[home] == fwd_dot
        mod = graph.values[w].module
        grads = [o.index for o in ops if o.phase == "backward" and o.primitive == "dot_general" and o.module == mod
                 and o.params["contracting"] == ((0,), (0,))]
        updates = [o.index for o in ops if o.phase == "optimizer" and o.module == mod]
        assert grads and updates
        for o in grads + updates:
            assert atomic.component_of[o] == home, (ops[o].primitive, ops[o].phase, mod)
        assert costs.totals([home])["state"] == graph.values[m].nbytes
        assert costs.totals([home])["params"] == graph.values[w].nbytes
    assert atomic.rule_counts["fallback"] == 0


def test_graph_without_data_dependence_is_a_typed_error():
    g = GraphBuilder()
    w = g.param("M/fc", (D, D))
    g.output(g.op("reduce_sum", [g.op("tanh", [w], module="M/fc")], [()], params={"axes": (0, 1)}), (2,))
    with pytest.raises(PipelineError, match="no forward op") as err:
        atomic_partition(g.build())
    assert isinstance(err.value, AutoshardError)

"""Series-parallel decomposition of LayerGraphs (GraphPipe §5): covers every node once, keeps edges."""

from __future__ import annotations

import random

import pytest

from autoshard import PipelineError
from autoshard._src.pipeline.graphpipe.layer_graph import LayerGraph, LayerNode
from autoshard._src.pipeline.graphpipe.sp import SPTree, sp_decompose


def _node(i: int) -> LayerNode:
    return LayerNode(f"n{i}", 1.0, 2.0, 10.0, 10.0, 1.0, 1.0)


def _graph(n: int, edges) -> LayerGraph:
    return LayerGraph(tuple(_node(i) for i in range(n)), tuple(sorted(set(edges))), 8, "g")


def _paths(tree: SPTree, prefix=()) -> dict[int, tuple]:
    """node -> path of (tree node id, kind, child index) from the root."""
    if tree.kind == "leaf":
        return {tree.node: prefix}
    out = {}
    for i, c in enumerate(tree.children):
        out.update(_paths(c, prefix + ((id(tree), tree.kind, i),)))
    return out


def _check(graph: LayerGraph, tree: SPTree) -> None:
    paths = _paths(tree)
    assert sorted(paths) == list(range(len(graph)))                  # every node once
    assert len(tree.nodes) == len(graph)
    for u, v in graph.edges:                                            # u runs before v
        pu, pv = paths[u], paths[v]
        k = 0
        while pu[k][:2] == pv[k][:2] and pu[k][2] == pv[k][2]:
            k += 1
        assert pu[k][0] == pv[k][0] and pu[k][1] == "series" and pu[k][2] < pv[k][2], (u, v, str(tree))
    _check_shape(tree)


def _check_shape(tree: SPTree) -> None:
    if tree.kind == "leaf":
        return
    assert len(tree.children) >= 2
    for c in tree.children:  # canonical: no series directly in series, no parallel in parallel
        assert c.kind != tree.kind
        _check_shape(c)


def test_branches_give_series_of_parallel():
    # 0 -> three branches (1,2) (3,4) (5,6) -> 7
    edges = [(0, 1), (1, 2), (0, 3), (3, 4), (0, 5), (5, 6), (2, 7), (4, 7), (6, 7)]
    tree = sp_decompose(_graph(8, edges))
    assert str(tree) == "S(0 ; P(S(1 ; 2) | S(3 ; 4) | S(5 ; 6)) ; 7)"
    assert not tree.artificial and tree.height == 4


def test_skip_edge_is_implied_by_order():
    tree = sp_decompose(_graph(3, [(0, 1), (1, 2), (0, 2)]))
    assert str(tree) == "S(0 ; 1 ; 2)"


def test_n_graph_is_serialised_keeping_every_node():
    g = _graph(4, [(0, 2), (1, 2), (1, 3)])   # the "N": not series-parallel
    tree = sp_decompose(g)
    assert tree.artificial and str(tree) == "S*(P(0 | 1) ; P(2 | 3))"
    _check(g, tree)


def test_independent_nodes_and_single_node():
    assert str(sp_decompose(_graph(3, []))) == "P(0 | 1 | 2)"
    assert sp_decompose(_graph(1, [])) == SPTree("leaf", node=0)


@pytest.mark.parametrize("seed", range(40))
def test_random_dags(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 14)
    p = rng.choice([0.15, 0.3, 0.5])
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < p]
    g = _graph(n, edges)
    tree = sp_decompose(g)
    _check(g, tree)
    assert sp_decompose(g) == tree   # deterministic


def test_bad_input():
    with pytest.raises(PipelineError, match="LayerGraph"):
        sp_decompose([1, 2])

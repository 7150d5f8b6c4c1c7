"""RaNNC block-level partitioning (pipeline/_blocks.py) on random DAGs: pure, no jax."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard._src.pipeline.atomic import atomic_partition
from autoshard._src.pipeline.costs import PipelineCosts
from autoshard._src.pipeline.rannc.blocks import partition_blocks

from ...core._synthetic import model
from ._rannc_graphs import component_dag, convex, random_step

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_blocks(atomic, bp, budget=None):
    dag = component_dag(atomic)
    flat = [c for b in bp.blocks for c in b]
    assert sorted(flat) == list(range(len(atomic))), "blocks must partition the components"
    block_of = bp.block_of()
    for b in bp.blocks:
        assert convex(dag, b)
    for u, v in atomic.edges:                 # topological order of blocks
        assert block_of[u] <= block_of[v]
    if budget is not None:
        assert max(bp.memory) <= budget


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(1, 80), k=st.integers(1, 12),
       p_skip=st.floats(0.0, 0.6), p_const=st.floats(0.0, 0.5), rebalance=st.sampled_from([None, 0.0, 0.05, 1.0]))
def test_blocks_partition_convex_topological_and_exactly_k(seed, n, k, p_skip, p_const, rebalance):
    atomic = atomic_partition(random_step(seed, n, p_const=p_const, p_skip=p_skip))
    bp = partition_blocks(atomic, k, hardware="v100-sxm", rebalance=rebalance)
    check_blocks(atomic, bp)
    assert len(bp) == min(k, len(atomic))     # memory is no constraint here: compaction reaches k


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(5, 80), k=st.integers(1, 10), q=st.floats(0.0, 1.0),
       max_visits=st.sampled_from([1, 3, 2000]), refine=st.booleans(), rebalance=st.sampled_from([None, 0.05]))
def test_blocks_fit_memory_and_stay_convex_under_a_tiny_search_budget(seed, n, k, q, max_visits, refine,
                                                                       rebalance):
    atomic = atomic_partition(random_step(seed, n, p_skip=0.3))
    costs = PipelineCosts(atomic, "v100-sxm")
    mem = costs.component_memory()
    budget = float(mem.max() + q * (mem.sum() - mem.max()))
    bp = partition_blocks(atomic, k, costs=costs, memory_budget=budget, max_visits=max_visits, refine=refine,
                          rebalance=rebalance)
    check_blocks(atomic, bp, budget)
    assert len(bp) >= min(k, len(atomic))
    assert np.isclose(sum(bp.work), costs.component_work().sum())


def test_transformer_blocks_are_balanced():
    graph = model([f"M/block_{i}" for i in range(48)])
    atomic = atomic_partition(graph)
    paper = partition_blocks(atomic, 16, hardware="v100-sxm", rebalance=None)
    check_blocks(atomic, paper)
    assert len(paper) == 16
    assert paper.stats["levels"] >= 1
    assert paper.stats["merges"] == len(atomic) - 16 - paper.stats["compaction_merges"]
    bp = partition_blocks(atomic, 16, hardware="v100-sxm")
    check_blocks(atomic, bp)
    work, before = np.array(bp.work), np.array(paper.work)
    assert bp.stats["rebalanced"] and len(bp) == 16
    assert work.max() <= before.max() * (1 + 1e-9)
    assert work.max() <= 1.1 * work.mean(), work / work.mean()     # 3 layers each (48 / 16)


def test_rebalancing_keeps_the_least_communication_among_balanced_cuts():
    """A chain whose values alternate big/small: balanced cuts exist at every other position and
    the cut must pick the small tensors."""
    from ...core._synthetic import GraphBuilder

    g = GraphBuilder()
    h = g.input((8, 16), (2, "x"), role="data")
    for i in range(16):
        shape = (8, 64) if i % 2 == 0 else (8, 16)
        h = g.op("tanh", [h], [shape], module=f"M/l{i}")
    g.output(g.op("reduce_sum", [h], [()], params={"axes": (0, 1)}), (2,))
    atomic = atomic_partition(g.build())
    costs = PipelineCosts(atomic, "v100-sxm")
    bp = partition_blocks(atomic, 4, costs=costs, rebalance=1.0)
    check_blocks(atomic, bp)
    tables = costs.range_tables(bp.blocks)
    small = 8 * 16 * 4
    assert all(tables.cut[j] == small for j in range(1, 4)), tables.cut


def test_rebalancing_spends_no_block_on_a_cheap_cut():
    """200 equal kernels, then a scalar loss: a cut before the loss crosses 4 bytes, so with only a cap
    the fewest-bytes cut made the loss a block of its own (0.0x the mean) and the layers 31 blocks;
    the lower bound of the balance band keeps every block near the mean."""
    from ...core._synthetic import GraphBuilder

    g = GraphBuilder()
    h = g.input((8, 64), (2, "x"), role="data")
    for i in range(200):     # kernels of their own (a chain of tanh would fuse into one kernel)
        h = g.op("cumsum", [h], [(8, 64)], module=f"M/l{i}")
    h = g.op("reduce_sum", [h], [()], params={"axes": (0, 1)})
    for _ in range(3):
        h = g.op("tanh", [h], [()], module="M/loss")
    g.output(h, (2,))
    atomic = atomic_partition(g.build())
    bp = partition_blocks(atomic, 32, costs=PipelineCosts(atomic, {"base": "v100-sxm", "kernels": None}))
    check_blocks(atomic, bp)
    work = np.array(bp.work)
    assert bp.stats["rebalanced"] and len(bp) == 32
    assert work.min() >= 0.9 * work.mean() and work.max() <= 1.15 * work.mean(), work / work.mean()

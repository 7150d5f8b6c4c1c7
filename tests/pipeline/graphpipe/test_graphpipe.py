"""GraphPipe partitioner and its SPP baseline on synthetic LayerGraphs (pure: no jax)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import networkx as nx
import numpy as np
import pytest

import pipeline
from autoshard import InfeasiblePlanError, PipelineError, get_hardware
from autoshard._src.pipeline.graphpipe.layer_graph import LayerGraph, LayerNode, chain_graph, curve_seconds
from autoshard._src.pipeline.graphpipe.partition import _Costs, _microbatch_sizes, _Problem, _search_b
from autoshard._src.pipeline.graphpipe.sp import SPTree, sp_decompose
from autoshard._src.pipeline.graphpipe.spp import linear_tree
from pipeline.graphpipe import GraphPipePlan, graphpipe_partition, spp_partition

MS = 1e-3


def node(name, f=1 * MS, params=1e6, act=1e6, out=0.0) -> LayerNode:
    return LayerNode(name, f, 2 * f, params, 2 * params, act, out)


def branchy(n_branches: int, length: int, batch: int, join_f: float, out: float = 0.0, name="branchy") -> LayerGraph:
    """Branches of `length` equal nodes joined by one node of forward time `join_f`."""
    nodes, edges, lasts = [], [], []
    for b in range(n_branches):
        for i in range(length):
            nodes.append(node(f"b{b}.{i}", out=out))
            if i:
                edges.append((len(nodes) - 2, len(nodes) - 1))
        lasts.append(len(nodes) - 1)
    nodes.append(node("join", f=join_f, out=out))
    edges += [(u, len(nodes) - 1) for u in lasts]
    return LayerGraph(tuple(nodes), tuple(sorted(edges)), batch, name)


def check_plan(graph: LayerGraph, plan: GraphPipePlan, budget: float | None = None) -> None:
    owner = {}
    for s in plan.stages:
        for v in s.nodes:
            assert v not in owner, f"node {v} in two stages"
            owner[v] = s.index
    assert sorted(owner) == list(range(len(graph)))                        # stages partition the nodes
    assert [s.index for s in plan.stages] == list(range(len(plan.stages)))
    g = nx.DiGraph(list(plan.edges))
    g.add_nodes_from(range(len(plan.stages)))
    assert nx.is_directed_acyclic_graph(g)
    for u, v in graph.edges:                                                 # consistent with node edges
        if owner[u] != owner[v]:
            assert nx.has_path(g, owner[u], owner[v])
    assert sum(s.devices for s in plan.stages) <= plan.devices
    for s in plan.stages:
        assert s.num_microbatches * s.microbatch_size == graph.batch_size
        assert s.microbatch_size >= s.devices
        if budget is not None:
            assert s.memory <= budget
    pipeline.validate(plan.schedule)
    assert plan.schedule.edges == plan.edges
    assert plan.depth == (nx.dag_longest_path_length(g) + 1)
    assert math.isclose(plan.throughput, graph.batch_size / plan.step_time)
    sim = pipeline.simulate(plan.schedule, [s.forward for s in plan.stages], [s.backward for s in plan.stages])
    assert math.isclose(sim.makespan, plan.step_time)
    assert plan.time_per_sample == pytest.approx(max((s.forward + s.backward) / s.microbatch_size
                                                     for s in plan.stages))
    d = plan.to_dict()
    assert d["method"] == plan.method and len(d["stages"]) == len(plan.stages)


def test_figure2_depth_two_vs_four():
    # Fig. 2: three 2-node branches and a join as heavy as a branch, on 4 devices: GraphPipe runs
    # the branches as concurrent stages (depth 2); SPP linearises them into a chain of 4.
    g = branchy(3, 2, 64, join_f=2 * MS, name="fig2")
    gp, spp = graphpipe_partition(g, 4, "v100-sxm"), spp_partition(g, 4, "v100-sxm")
    check_plan(g, gp)
    check_plan(g, spp)
    assert gp.method == "graphpipe" and spp.method == "spp"
    assert gp.depth == 2 and len(gp.stages) == 4
    assert spp.depth == 4 and len(spp.stages) == 4
    assert gp.time_per_sample == pytest.approx(spp.time_per_sample)
    assert gp.throughput > spp.throughput                   # shorter warm-up and cool-down
    assert set(gp.edges) == {(0, 3), (1, 3), (2, 3)}


def test_chain_graph_graphpipe_equals_spp():
    nodes = [node(f"l{i}", f=(1 + (i % 3)) * MS, out=2e5) for i in range(9)]
    g = chain_graph(nodes, 64, "chain")
    for devices in (2, 4, 6):
        gp, spp = graphpipe_partition(g, devices, "v100-sxm"), spp_partition(g, devices, "v100-sxm")
        check_plan(g, gp)
        check_plan(g, spp)
        assert gp.throughput == spp.throughput
        assert [(s.nodes, s.devices, s.microbatch_size) for s in gp.stages] == \
               [(s.nodes, s.devices, s.microbatch_size) for s in spp.stages]


@pytest.mark.parametrize("devices", [4, 5, 8])
def test_equal_branches_graphpipe_at_least_spp(devices):
    g = branchy(4, 3, 128, join_f=3 * MS, out=1e5)
    gp, spp = graphpipe_partition(g, devices, "v100-sxm"), spp_partition(g, devices, "v100-sxm")
    check_plan(g, gp)
    check_plan(g, spp)
    assert gp.throughput >= spp.throughput * (1 - 1e-9)
    assert gp.depth <= spp.depth


def test_memory_budget_respected_and_binding():
    g = branchy(3, 3, 64, join_f=1 * MS)
    free = graphpipe_partition(g, 4, "v100-sxm", memory_budget=1e12)
    budget = 0.5 * max(s.memory for s in free.stages) + 1e7
    tight = graphpipe_partition(g, 4, "v100-sxm", memory_budget=budget)
    check_plan(g, tight, budget)
    for fn in (graphpipe_partition, spp_partition):
        check_plan(g, fn(g, 3, "v100-sxm", memory_budget=budget), budget)


def test_max_microbatch_size():
    g = branchy(2, 2, 64, join_f=1 * MS)
    plan = graphpipe_partition(g, 4, "v100-sxm", max_microbatch_size=2)
    check_plan(g, plan)
    assert all(s.microbatch_size <= 2 for s in plan.stages)
    assert _microbatch_sizes(48, None) == [1, 2, 4, 8, 16]


def test_infeasible_names_graph_budget_and_best():
    g = branchy(2, 2, 16, join_f=1 * MS, name="tiny-mem")
    with pytest.raises(InfeasiblePlanError) as err:
        graphpipe_partition(g, 2, "v100-sxm", memory_budget=1e6)
    e = err.value
    assert e.budget == 1e6 and e.min_memory > 1e6 and math.isfinite(e.min_memory)
    msg = str(e)
    assert "tiny-mem" in msg and "2 devices" in msg and "memory_budget" in msg
    # the reported least memory is achievable: with that budget a plan exists
    roomy = e.min_memory * (1 + 1e-9)
    check_plan(g, graphpipe_partition(g, 2, "v100-sxm", memory_budget=roomy), roomy)


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=0), "devices=0"),
    (dict(devices=2.5), "devices=2.5"),
    (dict(devices=True), "devices=True"),
    (dict(devices=2, memory_budget=-1.0), "memory_budget=-1.0"),
    (dict(devices=2, memory_budget=math.inf), "memory_budget=inf"),
    (dict(devices=2, max_microbatch_size=0), "max_microbatch_size=0"),
])
def test_bad_arguments(kwargs, match):
    g = branchy(2, 1, 8, join_f=1 * MS)
    for fn in (graphpipe_partition, spp_partition):
        with pytest.raises(PipelineError, match=match):
            fn(g, hardware="v100-sxm", **kwargs)
    with pytest.raises(PipelineError, match="LayerGraph"):
        graphpipe_partition("not a graph", 2, "v100-sxm")


# --- brute force: the DP is optimal over the space it searches ---------------------------------

def _brute_force(graph: LayerGraph, tree, devices: int, b: int, budget: float) -> float:
    """Least bottleneck TPS over every split of the nodes into the pieces of a concrete tree
    (unions of consecutive SP children, and leaves), every device count per stage (sum <=
    devices), with memory at 1 + depth below in the stage DAG of the tree's order (SPP: the chain)."""
    prob = _Problem(graph, tree, variants=False)
    order = _tree_order(tree)
    costs = _Costs(prob, get_hardware("v100-sxm"), devices, b, graph.batch_size, budget)
    pieces = {prob._collect_nodes(sig): row for sig, row in prob.single_index.items()}
    n, best = len(graph), math.inf
    for labels in _set_partitions(list(range(n))):
        blocks = [tuple(sorted(x)) for x in labels]
        if any(bl not in pieces for bl in blocks):
            continue
        owner = {v: i for i, bl in enumerate(blocks) for v in bl}
        sg = nx.DiGraph()
        sg.add_nodes_from(range(len(blocks)))
        sg.add_edges_from((owner[u], owner[v]) for u, v in order if owner[u] != owner[v])
        if not nx.is_directed_acyclic_graph(sg):
            continue
        below = {}
        for s in reversed(list(nx.topological_sort(sg))):
            below[s] = max((1 + below[t] for t in sg.successors(s)), default=0)
        for devs in itertools.product(range(1, devices + 1), repeat=len(blocks)):
            if sum(devs) > devices:
                continue
            worst = 0.0
            for i, (bl, d) in enumerate(zip(blocks, devs, strict=True)):
                row = pieces[bl]
                r = min(below[i], prob.R)
                if not (math.isfinite(costs.tps[row, d]) and costs.fits[row, d, r]):
                    worst = math.inf
                    break
                worst = max(worst, costs.tps[row, d])
            best = min(best, worst)
    return best


def _concrete_trees(tree, work):
    """The space GraphPipe searches (spec): the SP tree and, at every series node, each variant
    children list (one series branch of a parallel child with its last k children moved after
    the parallel child when its next sibling has less work than the branch's last child, or its
    first k moved before it when its previous sibling has less work than the branch's first
    child, 1 <= k < branch length; a parallel remainder's branches join the parallel child's),
    recursively in every child of every list."""
    def w(t):
        return sum(work[v] for v in t.nodes)

    if tree.kind == "leaf":
        yield tree
        return
    if tree.kind == "parallel":
        for kids in itertools.product(*(list(_concrete_trees(c, work)) for c in tree.children)):
            yield SPTree("parallel", kids)
        return
    lists = [list(tree.children)]
    for j, par in enumerate(tree.children):
        if par.kind != "parallel":
            continue
        for bi, br in enumerate(par.children):
            if br.kind != "series":
                continue
            for k in range(1, len(br.children)):
                for after in (True, False):
                    nb = j + 1 if after else j - 1
                    if not 0 <= nb < len(tree.children) or w(tree.children[nb]) >= w(br.children[-1 if after else 0]):
                        continue
                    cut = len(br.children) - k if after else k
                    keep, moved = (br.children[:cut], br.children[cut:]) if after else (br.children[cut:],
                                                                                       br.children[:cut])
                    rest = keep[0] if len(keep) == 1 else SPTree("series", keep)
                    others = par.children[:bi] + par.children[bi + 1:]
                    par2 = SPTree("parallel", others + (rest.children if rest.kind == "parallel" else (rest,)))
                    mid = [par2, *moved] if after else [*moved, par2]
                    lists.append(list(tree.children[:j]) + mid + list(tree.children[j + 1:]))
    for kids in lists:
        for combo in itertools.product(*(list(_concrete_trees(c, work)) for c in kids)):
            yield SPTree("series", combo)


def _tree_order(tree) -> list[tuple[int, int]]:
    """Pairs (u, v) with u before v in the SP tree: a series ancestor puts u's child first."""
    if tree.kind == "leaf":
        return []
    out = [p for c in tree.children for p in _tree_order(c)]
    if tree.kind == "series":
        for i, a in enumerate(tree.children):
            for c in tree.children[i + 1:]:
                out += [(u, v) for u in a.nodes for v in c.nodes]
    return out


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


TINY = {
    "chain3": (3, [(0, 1), (1, 2)]),
    "diamond": (4, [(0, 1), (0, 2), (1, 3), (2, 3)]),
    "fork5": (5, [(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4)]),
    "two-chains": (4, [(0, 1), (2, 3)]),
    "skip": (4, [(0, 1), (1, 2), (2, 3), (0, 3), (0, 2)]),
    "join5": (5, [(0, 1), (2, 3), (1, 4), (3, 4)]),            # branch tails can join the join
    "source5": (5, [(0, 1), (1, 2), (0, 3), (3, 4)]),          # branch heads can join the source
    "nested5": (5, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]),  # no series branch: no variants
}


def _tiny_graph(name: str, curves: bool) -> LayerGraph:
    n, edges = TINY[name]
    fs = [1.0, 2.5, 1.5, 3.0, 0.5]

    def curve(f, i):   # memory-bound up to a size that differs per node, then linear
        return tuple(max(f * (1 + i) * 2 * MS, f * MS * 2 ** k) for k in range(4)) if curves else ()

    nodes = tuple(LayerNode(f"n{i}", fs[i] * MS, 2 * fs[i] * MS, (1 + i) * 4e6, 8e6, (5 - i) * 2e6, 3e5,
                            forward_curve=curve(fs[i], i), backward_curve=curve(2 * fs[i], i))
                  for i in range(n))
    return LayerGraph(nodes, tuple(edges), 8, name)


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize("curves", [False, True])
def test_dp_matches_brute_force(name, devices, curves):
    g = _tiny_graph(name, curves)
    for tree in (sp_decompose(g), linear_tree(g)):
        trees = list(_concrete_trees(tree, [nd.forward + nd.backward for nd in g.nodes]))
        assert len(trees) == len(set(trees))
        for budget in (math.inf, 60e6):
            prob = _Problem(g, tree)
            for b in _microbatch_sizes(8, None):
                costs = _Costs(prob, get_hardware("v100-sxm"), devices, b, 8, budget)
                res = _search_b(prob, costs, devices)
                want = min(_brute_force(g, t, devices, b, budget) for t in trees)
                got = math.inf if res is None else res[0]
                assert got == pytest.approx(want), (name, devices, budget, b)


def test_variants_reach_branch_tails_and_heads():
    def count(name):
        g = _tiny_graph(name, False)
        return len(list(_concrete_trees(sp_decompose(g), [nd.forward + nd.backward for nd in g.nodes])))
    assert (count("join5"), count("source5"), count("nested5")) == (3, 3, 1)
    # a heavy join (more work than a branch's last node) gets no variants
    g = branchy(2, 2, 8, join_f=5 * MS)
    assert len(list(_concrete_trees(sp_decompose(g), [nd.forward + nd.backward for nd in g.nodes]))) == 1


# --- micro-batch curves and light joins ------------------------------------------------------

def ff_node(name, f=1 * MS, w=16 * MS, params=1e6) -> LayerNode:
    """A memory-bound layer: reading its weights costs w per micro-batch until the per-sample
    compute f x b exceeds it (curve[i] = max(w, f 2**i)); per-sample costs are the linear view."""
    fc = tuple(max(w, f * 2 ** i) for i in range(8))
    return LayerNode(name, f, 2 * f, params, 2 * params, 1e5, 0.0, forward_curve=fc,
                     backward_curve=tuple(2 * x for x in fc))


def test_curves_set_stage_costs_and_favour_larger_microbatches():
    nodes = [ff_node(f"l{i}") for i in range(4)]
    g = chain_graph(nodes, 256, "ff")
    linear = chain_graph([dataclasses.replace(n, forward_curve=(), backward_curve=()) for n in nodes], 256)
    for devices in (1, 2, 4):
        plan, flat = graphpipe_partition(g, devices, "v100-sxm"), graphpipe_partition(linear, devices, "v100-sxm")
        check_plan(g, plan)
        for s in plan.stages:   # compute at the replica's share of the micro-batch, from the curves
            p = -(-s.microbatch_size // s.devices)
            want = sum(float(curve_seconds(np.array(g.nodes[v].forward_curve), g.nodes[v].forward, p))
                       for v in s.nodes)
            assert s.forward >= want and s.forward == pytest.approx(want, rel=1e-3, abs=1e-6)
            assert p >= 16                      # the weight reads are amortised: >= 16 samples per replica
        assert plan.step_time >= flat.step_time  # curves only add cost at small sizes
        assert min(s.microbatch_size for s in flat.stages) <= min(s.microbatch_size for s in plan.stages)
        if devices > 1:                         # linear costs: small micro-batches, short fill/drain
            assert max(s.microbatch_size for s in flat.stages) < 16


def test_light_join_shares_a_stage_with_a_branch_end():
    # MMT-like: 4 branches of 4 layers and a join of ~0 work on 16 devices. Without variants the
    # join needs a stage (and a device) of its own; with them it rides with a branch's last layer.
    g = branchy(4, 4, 256, join_f=1e-4 * MS, out=1e5)
    join = len(g) - 1
    plan = graphpipe_partition(g, 16, "v100-sxm")
    check_plan(g, plan)
    host = next(s for s in plan.stages if join in s.nodes)
    assert len(host.nodes) > 1 and plan.depth > 1
    prob = _Problem(g, sp_decompose(g), variants=False)
    assert prob.R < _Problem(g, sp_decompose(g)).R   # the variants' moved tails deepen the tree
    assert plan.throughput >= spp_partition(g, 16, "v100-sxm").throughput * (1 - 1e-9)


# --- per-stage micro-batch sizes (opt-in) ------------------------------------------------------

def saturating_node(name: str, sat: int, f: float = 1 * MS) -> LayerNode:
    """Efficient only from `sat` samples per micro-batch on: seconds = f x max(b, sat); weights so
    large that every node needs a device of its own (the budget below holds one)."""
    fc = tuple(f * max(2 ** i, sat) for i in range(6))
    return LayerNode(name, f, 2 * f, 4e9, 8e9, 1e5, 0.0, forward_curve=fc, backward_curve=tuple(2 * x for x in fc))


@pytest.mark.parametrize("sats, want", [((1, 1, 8), (1, 1, 8)), ((4, 1, 1), (4, 1, 1)), ((1, 2, 4), (2, 2, 4))])
def test_per_stage_microbatch_sizes_shorten_the_fill(sats, want):
    # Fig. 5: stages efficient at different micro-batch sizes. One size for all (the default) pays
    # the largest stage's size in fill and drain everywhere; per-stage sizes let the others run
    # small micro-batches, so the step is shorter (Table 2 schedules the unequal sizes).
    g = chain_graph([saturating_node(f"s{i}", s) for i, s in enumerate(sats)], 16, "fig5")
    budget = 30e9
    uniform = graphpipe_partition(g, 3, "v100-sxm", memory_budget=budget)
    per = graphpipe_partition(g, 3, "v100-sxm", memory_budget=budget, per_stage_microbatch=True)
    check_plan(g, uniform, budget)
    check_plan(g, per, budget)
    assert len({s.microbatch_size for s in uniform.stages}) == 1
    assert tuple(s.microbatch_size for s in per.stages) == want
    assert [s.nodes for s in per.stages] == [s.nodes for s in uniform.stages]     # same stages and devices
    assert per.step_time < uniform.step_time * 0.95
    assert list(per.schedule.num_microbatches) == [16 // b for b in want]


@pytest.mark.parametrize("seed", range(6))
def test_per_stage_microbatch_never_slower(seed):
    rng = np.random.default_rng(seed)
    g = branchy(int(rng.integers(2, 4)), int(rng.integers(1, 4)), 64, join_f=float(rng.uniform(0.5, 3)) * MS)
    g = LayerGraph(tuple(ff_node(n.name, f=n.forward, w=float(rng.uniform(1, 20)) * MS) for n in g.nodes),
                   g.edges, g.batch_size, g.name)
    for fn in (graphpipe_partition, spp_partition):
        base, per = fn(g, 6, "v100-sxm"), fn(g, 6, "v100-sxm", per_stage_microbatch=True)
        check_plan(g, per)
        assert per.step_time <= base.step_time * (1 + 1e-12)
    with pytest.raises(PipelineError, match="per_stage_microbatch='yes' must be True or False"):
        graphpipe_partition(g, 6, "v100-sxm", per_stage_microbatch="yes")

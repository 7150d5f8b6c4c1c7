"""RaNNC stage-level DP (pipeline/_stages.py, Algorithms 1 and 2) and the uniform baseline: pure."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard import AutoshardError, InfeasiblePlanError, PipelineError
from autoshard._src.core.grouping import group
from autoshard._src.pipeline.atomic import atomic_partition
from autoshard._src.pipeline.costs import PipelineCosts
from autoshard._src.pipeline.rannc.blocks import partition_blocks
from autoshard._src.pipeline.rannc.stages import StageProblem, form_stage, form_stage_dp, min_peak_memory, plan_stages
from autoshard._src.pipeline.rannc.uniform import best_uniform, uniform_split

from ...core._synthetic import model
from ._rannc_graphs import check_plan, random_step

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
V100 = {"base": "v100-sxm", "kernels": None}   # synthetic layers priced on the roofline


def compositions(total: int, parts: int):
    for cut in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cut, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def objective(problem, splits, D, R, MB):
    S = len(splits)
    costs = [problem.stage(lo, hi, r, D=D, R=R, MB=MB, s=s, S=S) for s, (lo, hi, r) in enumerate(splits, 1)]
    if any(not math.isfinite(f) or m > problem.budget for f, _, m in costs):
        return math.inf
    return max(f for f, _, _ in costs) + max(b for _, b, _ in costs)


def brute_force(problem, S, D, R, MB):
    """Least max-forward + max-backward over every contiguous split and replica assignment."""
    best = math.inf
    for sizes in compositions(problem.n, S):
        starts = np.cumsum([0, *sizes])
        for reps in compositions(D, S):
            splits = [(int(starts[i]), int(starts[i + 1]), reps[i]) for i in range(S)]
            best = min(best, objective(problem, splits, D, R, MB))
    return best


def problem_for(seed, n, k, schedule="1f1b", recompute=False, q=1.0, batch_size=32):
    atomic = atomic_partition(random_step(seed, n, p_skip=0.3))
    costs = PipelineCosts(atomic, V100)
    bp = partition_blocks(atomic, k, costs=costs)
    problem = StageProblem(costs, bp.blocks, batch_size=batch_size, schedule=schedule, recompute=recompute)
    return problem, q


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(3, 40), k=st.integers(1, 7), D=st.integers(1, 8),
       R=st.sampled_from([1, 2]), MB=st.sampled_from([1, 2, 4]), schedule=st.sampled_from(["1f1b", "gpipe"]),
       recompute=st.booleans(), q=st.floats(0.0, 1.0))
def test_dp_equals_brute_force(seed, n, k, D, R, MB, schedule, recompute, q):
    problem, _ = problem_for(seed, n, k, schedule, recompute)
    # a memory budget between the smallest and the largest single-stage need: some splits fail
    T = problem.tables(D, R, MB)
    mem = (T.m0 + T.m1 * MB)[np.isfinite(T.tf)]
    problem.budget = float(np.quantile(mem, q))
    for S in range(1, min(problem.n, D) + 1):
        want = brute_force(problem, S, D, R, MB)
        got = form_stage_dp(problem, S, D, R, MB, prune=False)
        if math.isinf(want):
            assert got is None
            continue
        assert got is not None
        assert [lo for lo, _, _ in got][1:] == [hi for _, hi, _ in got][:-1]
        assert got[0][0] == 0 and got[-1][1] == problem.n and sum(r for _, _, r in got) == D
        assert objective(problem, got, D, R, MB) == pytest.approx(want, rel=1e-12)
        pruned = form_stage_dp(problem, S, D, R, MB, prune=True)
        if pruned is not None:                      # d_min pruning: never better, always valid
            assert objective(problem, pruned, D, R, MB) >= want * (1 - 1e-12)


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(3, 40), k=st.integers(1, 7), D=st.integers(1, 8),
       R=st.sampled_from([1, 2]), MB=st.sampled_from([1, 4]), recompute=st.booleans(), data=st.data())
def test_range_tables_match_direct_unions(seed, n, k, D, R, MB, recompute, data):
    problem, _ = problem_for(seed, n, k, recompute=recompute)
    lo = data.draw(st.integers(0, problem.n - 1))
    hi = data.draw(st.integers(lo + 1, problem.n))
    r = data.draw(st.integers(1, D))
    S = data.draw(st.integers(1, 4))
    s = data.draw(st.integers(1, S))
    table = problem.stage(lo, hi, r, D=D, R=R, MB=MB, s=s, S=S)
    direct = problem.stage(lo, hi, r, D=D, R=R, MB=MB, s=s, S=S, direct=True)
    assert table == pytest.approx(direct, rel=1e-9, abs=1e-18)


def test_min_peak_memory_matches_brute_force():
    problem, _ = problem_for(7, 30, 6)
    D, MB = 6, 2
    for S in range(1, 7):
        want = math.inf
        for sizes in compositions(problem.n, S):
            starts = np.cumsum([0, *sizes])
            for reps in compositions(D, S):
                mems = [problem.stage(int(starts[i]), int(starts[i + 1]), reps[i], D=D, R=1, MB=MB, s=i + 1, S=S)[2]
                        for i in range(S)]
                want = min(want, max(mems))
        assert min_peak_memory(problem, S, D, 1, MB) == pytest.approx(want)


@SETTINGS
@given(seed=st.integers(0, 10**6), n=st.integers(3, 60), k=st.integers(2, 12),
       devices=st.sampled_from([1, 2, 4, 8, 16]), q=st.floats(0.0, 1.0),
       schedule=st.sampled_from(["1f1b", "gpipe"]), use_blocks=st.booleans())
def test_plans_are_valid_partitions_that_fit(seed, n, k, devices, q, schedule, use_blocks):
    graph = random_step(seed, n, p_skip=0.3)
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, V100)
    mem = costs.component_memory()
    budget = float(mem.max() * (1 + 20 * q))
    try:
        plan = plan_stages(graph, devices, V100, k=k, batch_size=16, schedule=schedule, memory_budget=budget,
                           use_blocks=use_blocks, atomic=atomic)
    except InfeasiblePlanError as err:
        assert err.min_memory > budget and err.budget == budget
        return
    check_plan(plan, atomic, budget)
    assert plan.devices == devices and plan.search_seconds > 0
    assert plan.objective == pytest.approx(max(plan.predicted_forward) + max(plan.predicted_backward))


def test_exhaustive_search_is_never_worse_and_more_stages_when_memory_is_tight():
    graph = model([f"M/block_{i}" for i in range(12)])
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, V100)
    total = costs.totals(range(len(atomic)))
    static = 2 * total["params"] + total["state"]
    loose = plan_stages(graph, 8, V100, k=12, atomic=atomic, search="stage")
    assert len(loose.stages) == 1 and loose.stages[0].replicas == 8     # fits: pure data parallelism
    # the default also tries the node's other stage counts, never predicted slower
    assert plan_stages(graph, 8, V100, k=12, atomic=atomic).step_time <= loose.step_time * (1 + 1e-12)
    tight = plan_stages(graph, 8, V100, k=12, atomic=atomic, memory_budget=static / 3)
    check_plan(tight, atomic, static / 3)
    assert len(tight.stages) >= 3
    best = plan_stages(graph, 8, V100, k=12, atomic=atomic, memory_budget=static / 3, exhaustive=True)
    assert best.step_time <= tight.step_time * (1 + 1e-12)


def test_two_nodes_replicate_the_pipeline_across_nodes():
    graph = model([f"M/block_{i}" for i in range(12)])
    atomic = atomic_partition(graph)
    total = PipelineCosts(atomic, V100).totals(range(len(atomic)))
    budget = (2 * total["params"] + total["state"]) / 3
    plan = plan_stages(graph, 16, V100, k=12, atomic=atomic, memory_budget=budget, batch_size=64, search="node")
    check_plan(plan, atomic, budget)
    assert plan.pipelines == 2 and all(st.replicas % 2 == 0 for st in plan.stages)
    assert sum(st.replicas for st in plan.stages) == 16
    # the default search also tries one pipeline over both nodes (every stage count at n = 2)
    full = plan_stages(graph, 16, V100, k=12, atomic=atomic, memory_budget=budget, batch_size=64)
    check_plan(full, atomic, budget)
    assert full.step_time <= plan.step_time * (1 + 1e-12)


def test_infeasible_is_a_typed_error_with_the_smallest_memory_found():
    graph = model([f"M/block_{i}" for i in range(4)])
    atomic = atomic_partition(graph)
    budget = float(PipelineCosts(atomic, V100).component_memory().max()) / 2
    with pytest.raises(InfeasiblePlanError, match="memory budget") as err:
        plan_stages(graph, 4, V100, k=6, atomic=atomic, memory_budget=budget)
    assert isinstance(err.value, InfeasiblePlanError) and isinstance(err.value, AutoshardError)
    assert err.value.min_memory > budget
    assert "Fixes:" in str(err.value)


def test_no_block_dp_beats_the_uniform_split_it_contains():
    """The uniform split is a contiguous range split of the components: the no-block DP over the
    same stage count, devices and micro-batches can only do as well or better."""
    graph = model([f"M/block_{i}" for i in range(8)])
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, V100)
    grouping = group(graph)
    for S, MB in [(2, 1), (2, 4), (4, 2), (8, 1)]:
        uni = uniform_split(costs, S, 8, MB, grouping=grouping, batch_size=32)
        problem = StageProblem(costs, [(c,) for c in range(len(atomic))], batch_size=32)
        splits = form_stage_dp(problem, S, 8, 1, MB, prune=False)
        assert splits is not None
        dp = problem.plan(splits, D=8, R=1, MB=MB, method="rannc-no-blocks")
        assert dp.objective <= uni.objective * (1 + 1e-12)
        check_plan(uni, atomic, math.inf)
        # layers are split evenly: each stage starts at a layer's first component
        assert all(len({graph.ops[o].module.split("/")[1] for o in st.ops if graph.ops[o].phase == "forward"
                        and graph.ops[o].module.startswith("M/block_")}) == 8 // S for st in uni.stages)


def test_heavy_last_layer_defeats_the_uniform_split_but_not_rannc():
    """The last layer holds most parameters: every uniform split puts it, whole, in the last stage
    with the head, over budget; RaNNC's blocks split it and give stages their own replica counts."""
    graph = model([f"M/block_{i}" for i in range(16)], widths={"M/block_15": (16, 1024)})
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, V100)
    total = costs.totals(range(len(atomic)))
    budget = (2 * total["params"] + total["state"]) / 4
    grouping = group(graph)
    assert best_uniform(costs, 8, grouping=grouping, memory_budget=budget) is None
    rannc = plan_stages(graph, 8, V100, k=16, atomic=atomic, memory_budget=budget)
    check_plan(rannc, atomic, budget)
    # with memory to spare both work and are costed alike
    uni = best_uniform(costs, 8, grouping=grouping)
    assert uni is not None and uni.method == "uniform" and len({st.replicas for st in uni.stages}) == 1
    check_plan(uni, atomic, uni.memory_budget)


def test_uniform_split_rejects_empty_micro_batches():
    graph = model(["M/block_0", "M/block_1"])
    costs = PipelineCosts(atomic_partition(graph), V100)
    with pytest.raises(ValueError, match="micro-batch"):
        uniform_split(costs, 2, 8, 4, grouping=group(graph))          # batch 8 / 4 micro-batches / 4 replicas


def test_form_stage_skips_stage_counts_beyond_the_units():
    problem, _ = problem_for(3, 20, 2)
    plan = form_stage(problem, 1, 8)
    assert len(plan.stages) <= 2 and plan.dp_calls >= 1


def test_bad_arguments_are_typed_errors():
    graph = model(["M/block_0", "M/block_1"])
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, V100)
    with pytest.raises(PipelineError, match="k=0"):
        partition_blocks(atomic, 0, hardware="v100-sxm")
    with pytest.raises(PipelineError, match="multiple of the 8 devices per node"):
        plan_stages(graph, 12, V100, atomic=atomic)
    with pytest.raises(PipelineError, match="schedule"):
        StageProblem(costs, [(c,) for c in range(len(atomic))], schedule="interleaved")
    with pytest.raises(PipelineError, match="multiple of num_stages"):
        uniform_split(costs, 3, 8, 1, grouping=group(graph))
    assert issubclass(PipelineError, AutoshardError)


def test_replicas_not_dividing_a_micro_batch_cost_the_busiest_replica():
    """8 samples per micro-batch on 5 replicas: 3 replicas compute 2 samples and bound the stage
    (the paper's ⌊8/5⌋ = 1 costed 5 of the 8 samples and overstated throughput)."""
    problem, _ = problem_for(5, 20, 2, batch_size=64)
    R, MB = 1, 8                                                   # 8 samples per micro-batch
    assert [problem.mbs(R, MB, r) for r in (1, 2, 3, 4, 5, 8, 9)] == [8, 4, 3, 2, 2, 1, 0]
    two = problem.stage(0, problem.n, 4, D=8, R=R, MB=MB, s=1, S=1)
    five = problem.stage(0, problem.n, 5, D=8, R=R, MB=MB, s=1, S=1)
    assert five[0] == pytest.approx(two[0])                       # same busiest share: same forward
    # every plan's replicas cover each micro-batch: replicas x share >= samples per micro-batch
    plan = form_stage(problem, 1, 8)
    q = plan.batch_size // plan.pipelines // plan.microbatches
    assert all(st.replicas // plan.pipelines * st.microbatch_size >= q for st in plan.stages)


def test_node_search_improves_on_the_first_memory_feasible_stage_count():
    """The least stage count memory allows leaves every stage nearly full (the paper stops there);
    trying the other stage counts of that node count finds a faster plan, and "all" never loses."""
    graph = model([f"M/block_{i}" for i in range(16)])
    atomic = atomic_partition(graph)
    total = PipelineCosts(atomic, V100).totals(range(len(atomic)))
    budget = (2 * total["params"] + total["state"]) / 5
    plans = {se: plan_stages(graph, 8, V100, k=16, atomic=atomic, memory_budget=budget, recompute=True, search=se)
             for se in ("stage", "node", "all")}
    for plan in plans.values():
        check_plan(plan, atomic, budget)
    assert len(plans["stage"].stages) < len(plans["node"].stages)
    assert plans["node"].step_time < 0.9 * plans["stage"].step_time
    assert plans["all"].step_time <= plans["node"].step_time * (1 + 1e-12)
    assert plans["node"].dp_calls > plans["stage"].dp_calls
    with pytest.raises(PipelineError, match="search='first'"):
        plan_stages(graph, 8, V100, k=16, atomic=atomic, search="first")

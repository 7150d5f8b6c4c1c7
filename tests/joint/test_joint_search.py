"""The 3-D search on hand-built steps: pure Python, no jax.

`model()` (tests/core/_synthetic.py) is embedding -> blocks -> head -> loss with its backward pass
and an update per parameter; the search splits its blocks into stages, each with a submesh and
tensor plan, and must find what the shapes and the memory budget dictate.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autoshard import group
from autoshard._src.core.hardware import get_hardware
from autoshard._src.joint.partition import best_split
from autoshard._src.joint.search import joint_search
from autoshard._src.joint.space import JointOptions, simulated, submesh
from autoshard._src.joint.units import build_units
from autoshard._src.tensor.search import SearchOptions, analysis, search

from ..core._synthetic import model

H100 = get_hardware({"base": "h100-sxm", "kernels": None})   # synthetic graphs on the roofline
BLOCKS = [f"M/block_{i}" for i in range(8)]


def brute_force(cost, M):
    S, n = len(cost), cost[0].shape[0] - 1
    best = math.inf
    for cuts in itertools.combinations(range(1, n), S - 1):
        b = [0, *cuts, n]
        v = [cost[s][b[s], b[s + 1]] for s in range(S)]
        if all(np.isfinite(v)):
            best = min(best, sum(v) + (M - 1) * max(v))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_is_exact(seed):
    rng = np.random.default_rng(seed)
    n, S, M = int(rng.integers(2, 9)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 3, 8]))
    S = min(S, n)
    cost = []
    for _ in range(S):
        c = np.triu(rng.random((n + 1, n + 1)) * 10, 1)
        c[np.tril_indices(n + 1)] = np.inf
        c[rng.random(c.shape) < 0.15] = np.inf            # some ranges do not fit
        cost.append(c)
    obj, bounds = best_split(cost, M)
    want = brute_force(cost, M)
    assert obj == pytest.approx(want) if np.isfinite(want) else not bounds
    if bounds:
        v = [cost[s][bounds[s], bounds[s + 1]] for s in range(S)]
        assert sum(v) + (M - 1) * max(v) == pytest.approx(obj)


def test_units_follow_the_blocks_with_embedding_first_and_head_last():
    g = model(BLOCKS)
    gr = group(g)
    units = build_units(g, gr, analysis(g, gr))
    assert len(units) == 8 and units.labels[0] == "M/block_0"
    embed = {o for o in range(len(g.ops)) if g.ops[o].module == "M/embed"}
    head = {o for o in range(len(g.ops)) if g.ops[o].module in ("M/head", "")}
    assert embed <= set(units.ops[0]) and head <= set(units.ops[-1])
    # every op in exactly one unit; middle blocks share one kind
    assert sorted(o for ops in units.ops for o in ops) == list(range(len(g.ops)))
    assert len(set(units.kind_of[2:-1])) == 1 and len(units.kinds) <= 4
    assert units.cut_dep[0] == units.cut_dep[-1] == 0 and (units.cut_dep[1:-1] > 0).all()


@pytest.mark.slow
def test_one_stage_is_the_tensor_search():
    g = model(BLOCKS)
    gr = group(g)
    res = joint_search(g, gr, 4, H100, joint=JointOptions(stages=1))
    p = res.best
    assert p.num_stages == 1 and p.data * p.model == 4
    want = search(g, gr, submesh(p.data, p.model), H100).best
    # same ops, same evaluator: the step and memory agree up to how the sync overlap is shared out
    assert p.step_time == pytest.approx(want.step_time, rel=0.05)
    assert res.tensor_only is not None and res.tensor_only.step_time <= p.step_time * (1 + 1e-9)


@pytest.mark.slow
def test_tight_memory_needs_stages_or_remat_and_nothing_fits_names_the_least():
    g = model(BLOCKS)
    gr = group(g)
    loose = joint_search(g, gr, 4, H100)
    assert loose.best is not None
    need = loose.best.memory
    tight = joint_search(g, gr, 4, H100, SearchOptions(memory_budget=need * 0.5))
    assert tight.best is not None and tight.best.memory <= need * 0.5
    assert tight.best.step_time >= loose.best.step_time * (1 - 1e-9)
    none = joint_search(g, gr, 4, H100, SearchOptions(memory_budget=1.0))
    assert none.best is None and none.least_memory is not None and none.least_memory.memory > 1.0


def test_fixed_stage_count_and_data_parallel_stages():
    g = model(BLOCKS)
    gr = group(g)
    res = joint_search(g, gr, 8, H100, joint=JointOptions(stages=4, tensor_in_stages=False))
    p = res.best
    assert p.num_stages == 4 and p.model == 1 and p.data == 2
    assert [s.start for s in p.stages][0] == 0 and p.stages[-1].stop == 8
    assert all(a.stop == b.start for a, b in zip(p.stages[:-1], p.stages[1:], strict=True))
    again = simulated(p)
    assert again.step_time == p.step_time


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,M", [(1, 1), (2, 1), (3, 5), (4, 8), (6, 2)])
def test_chain_simulation_equals_the_event_simulator(schedule, S, M):
    from autoshard._src.joint.chain_sim import chain_makespan
    from autoshard._src.pipeline.schedules.registry import schedule as make
    from autoshard._src.pipeline.schedules.simulate import simulate

    rng = np.random.default_rng(S * 100 + M)
    f, b = list(rng.random(S) + 0.1), list(rng.random(S) * 2 + 0.1)
    want = simulate(make(schedule, num_stages=S, num_microbatches=M), forward=f, backward=b).makespan
    assert chain_makespan(schedule, f, b, M) == pytest.approx(want)

"""The 3-D space of issue 31 on hand-built steps (pure Python, no jax): every micro-batch count the
batch allows, searched in order of a lower bound that never changes the result, and interleaved
1F1B points (v virtual stages per rank)."""

from __future__ import annotations

import numpy as np
import pytest

from autoshard import group
from autoshard._src.core.hardware import get_hardware
from autoshard._src.joint import search as search_mod
from autoshard._src.joint.search import _candidates, joint_search
from autoshard._src.joint.space import INTERLEAVED, JointOptions, SearchState, microbatch_counts, simulated
from autoshard._src.tensor.search import SearchOptions

from ..core._synthetic import model

H100 = get_hardware({"base": "h100-sxm", "kernels": None})
BLOCKS = [f"M/block_{i}" for i in range(8)]


def test_microbatch_counts_are_every_even_split():
    assert microbatch_counts(12, 512) == [1, 2, 3, 4, 6, 12]
    assert microbatch_counts(2160, 512)[-3:] == [270, 360, 432]
    assert 144 in microbatch_counts(2160, 512, replicas=15)           # SC'21 310B: 2160 / (15 x 1)
    assert microbatch_counts(12, 512, replicas=3) == [1, 2, 4]         # 12 / M splits over 3 replicas
    assert microbatch_counts(12, 4) == [1, 2, 3, 4]
    assert microbatch_counts(12, 512, fixed=5) == [] and microbatch_counts(12, 512, fixed=6) == [6]


@pytest.fixture(scope="module")
def graph():
    g = model(BLOCKS)
    return g, group(g)


def _summary(res):
    p = res.best
    return (p.num_stages, p.data, p.model, p.microbatches, p.schedule, p.virtual, p.step_time,
            tuple((s.start, s.stop, s.row, s.storage, s.remat, s.sequence_parallel) for s in p.stages))


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0.5])
def test_pruning_by_the_lower_bound_never_changes_the_result(graph, monkeypatch, budget):
    g, gr = graph
    loose = joint_search(g, gr, 4, H100)
    options = SearchOptions(memory_budget=None if budget is None else loose.best.memory * budget)
    pruned = joint_search(g, gr, 4, H100, options)
    monkeypatch.setattr(search_mod._Bounds, "prunes", lambda self, c: False)
    full = joint_search(g, gr, 4, H100, options)
    assert _summary(pruned) == _summary(full)
    assert pruned.points <= full.points and pruned.candidates == full.candidates


def test_the_bound_is_below_every_point_of_its_candidate(graph):
    g, gr = graph
    srch = SearchState(g, gr, 4, H100, SearchOptions(), JointOptions(),
                       lambda mesh: search_mod.AnalyticalCostModel(mesh, H100), default_cost=True)
    checked = 0
    for S, (d, t) in ((1, (4, 1)), (2, (2, 1)), (2, (1, 2)), (4, (1, 1))):
        tables = srch.table(d, t)
        for c in _candidates(srch, S, d, t, tables):
            valid = (srch.batch // c.M) % tables.batch_split.astype(np.int64) == 0
            ct = search_mod.choice_table(srch.combos[(d, t)], c.M, float("inf"), srch.joint.remat, valid, 0.0)
            p = search_mod._point(srch, tables, ct, d, t, S, c.M, c.schedule, c.virtual)
            if p is not None:
                assert c.bound <= p.objective * (1 + 1e-9), (c, p.objective)
                checked += 1
    assert checked > 10


def test_interleaved_point_places_stage_k_on_rank_k_mod_ranks(graph):
    g, gr = graph
    joint = JointOptions(stages=2, schedules=(INTERLEAVED,), virtual=(2,), microbatches=4)
    res = joint_search(g, gr, 4, H100, joint=joint)
    p = res.best
    assert p.schedule == INTERLEAVED and p.virtual == 2 and p.num_stages == 4 and p.ranks == 2
    assert [s.start for s in p.stages][0] == 0 and p.stages[-1].stop == len(res.units)
    assert all(a.stop == b.start for a, b in zip(p.stages[:-1], p.stages[1:], strict=True))
    # a rank holds both of its stages: the point's memory is the fuller rank's sum
    assert p.memory == pytest.approx(max(p.stages[0].memory + p.stages[2].memory,
                                         p.stages[1].memory + p.stages[3].memory))
    assert p.devices == 4
    assert simulated(p).step_time == pytest.approx(p.step_time)
    assert "v 2" in p.describe()


def test_interleaving_needs_microbatches_divisible_by_the_ranks(graph):
    g, gr = graph
    joint = JointOptions(stages=2, schedules=(INTERLEAVED,), virtual=(2,), microbatches=3)
    res = joint_search(g, gr, 4, H100, joint=joint)
    assert res.runnable is None or res.runnable.schedule != INTERLEAVED or res.runnable.microbatches % 2 == 0


def test_sends_scatter_over_the_model_axis_and_gather_inside_the_node(graph):
    """Megatron's scatter/gather: each of t model-axis devices sends 1/t of the boundary activation over
    its own link, the receivers all-gather it over the node's links."""
    g, gr = graph
    srch = SearchState(g, gr, 16, H100, SearchOptions(), JointOptions(),
                       lambda mesh: search_mod.AnalyticalCostModel(mesh, H100))
    whole_f, whole_b = srch.sends(2, 4, 8)
    split_f, split_b = srch.sends(2, 4, 8, model=4)
    inner = srch.units.cut_dep > 0
    alpha, beta = srch.p2p(8)
    a_g, b_g = srch.gather(4)
    per = srch.units.cut_dep[inner] / (4 * 2)
    scattered = alpha + beta * per / 4 + a_g + b_g * per
    assert split_b[inner] == pytest.approx(np.minimum(scattered, alpha + beta * per))
    assert (split_b[inner] <= whole_b[inner]).all() and (split_b[~inner] == 0).all()
    assert (split_f[inner] <= whole_f[inner]).all()
    # a large activation (the published runs': seq 2048 x hidden 20480 in fp16) goes scattered
    big = 2048 * 20480 * 2.0
    assert alpha + beta * big / 8 + srch.gather(8)[0] + srch.gather(8)[1] * big < alpha + beta * big

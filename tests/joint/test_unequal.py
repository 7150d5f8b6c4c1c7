"""Stages on unequal submeshes: the DP on plain arrays (as Alpa's test_dynamic_programming feeds
random cost arrays to its stage DP) and its place in the 3-D search (synthetic steps, no jax)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from autoshard import group
from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.hardware import get_hardware
from autoshard._src.joint import unequal_points
from autoshard._src.joint.search import _point, joint_search
from autoshard._src.joint.space import JointOptions, SearchState, inflight
from autoshard._src.joint.stage_choice import choice_table
from autoshard._src.joint.unequal import ChainProblem, objective, solve, stage_times
from autoshard._src.tensor.search import SearchOptions

from ..core._synthetic import model

H100 = get_hardware("h100-sxm")
SHAPES = ((1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (8, 1))


def chain(rng, U, N, shapes, schedule, M, node=4, positions=()) -> ChainProblem:
    """Random stage times (growing with the micro-batches in flight, some not fitting) and cuts."""
    i, j = np.triu_indices(U + 1, 1)
    comp_id = np.full((U + 1, U + 1), -1)
    comp_id[i, j] = np.arange(i.size)
    levels = tuple(range(1, min(M, U) + 1)) if schedule == "1f1b" else (M,)
    values = rng.random((len(shapes), 1, i.size)) * 3 + 0.5
    values = values + np.cumsum(rng.random((len(shapes), len(levels), i.size)) * 0.3, axis=1)
    values[rng.random(values.shape) < 0.1] = np.inf
    values = np.maximum.accumulate(values, axis=1)
    dep, const = np.r_[0, rng.random(U - 1) * 1e3, 0], np.r_[0, rng.random(U - 1) * 10, 0]
    return ChainProblem(tuple(shapes), values, comp_id, levels, schedule, M, N, node, dep, const, (0.01, 1e-4),
                        (0.05, 5e-4), positions)


def state(g, devices: int, joint: JointOptions | None = None) -> SearchState:
    return SearchState(g, group(g), devices, H100, SearchOptions(), joint or JointOptions(),
                       lambda m: AnalyticalCostModel(m, H100))


def brute_force(pb: ChainProblem) -> float:
    """Every split over the allowed boundaries x every shape per stage whose devices sum to N."""
    U, best = pb.units, math.inf
    inner = [b for b in (pb.positions or range(U + 1)) if 0 < b < U]
    for S in range(1, U + 1):
        for cuts in itertools.combinations(inner, S - 1):
            bounds = [0, *cuts, U]
            for ks in itertools.product(range(len(pb.shapes)), repeat=S):
                if sum(pb.shapes[k][0] * pb.shapes[k][1] for k in ks) == pb.devices:
                    best = min(best, objective(pb, [(bounds[s], bounds[s + 1], ks[s]) for s in range(S)]))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    U, N = int(rng.integers(1, 6)), int(rng.choice([2, 4, 8]))
    shapes = [SHAPES[k] for k in sorted(rng.choice(len(SHAPES), size=int(rng.integers(1, 5)), replace=False))]
    schedule, M = str(rng.choice(["1f1b", "gpipe"])), int(rng.choice([1, 2, 3, 16]))
    positions = ()
    if seed % 3 == 0 and U > 2:                 # stages only at some boundaries (the search's coarse chains)
        positions = tuple(sorted({0, U, *map(int, rng.choice(range(1, U), size=U // 2, replace=False))}))
    pb = chain(rng, U, N, shapes, schedule, M, node=int(rng.choice([2, 4, 8])), positions=positions)
    want, got = brute_force(pb), solve(pb)
    if not math.isfinite(want):
        assert got is None
        return
    assert got is not None and got.objective == pytest.approx(want, rel=1e-12)
    assert sum(pb.shapes[k][0] * pb.shapes[k][1] for _, _, k in got.stages) == N
    assert [s[0] for s in got.stages[1:]] == [s[1] for s in got.stages[:-1]]
    # a bound keeps only what beats it
    assert solve(pb, want * (1 + 1e-9)) is not None and solve(pb, want) is None


def test_a_heavy_stage_gets_more_devices_as_in_alpa():
    """Units of work 1, 2, 1 on 8 devices, a stage's time work / n plus a per-device overhead: the
    equal splits leave one stage with twice the work of the others; stages of 2, 4 and 2 devices
    balance them."""
    work, N, M = np.array([1.0, 2.0, 1.0]), 8, 16
    shapes = ((1, 1), (2, 1), (4, 1), (8, 1))
    i, j = np.triu_indices(4, 1)
    comp_id = np.full((4, 4), -1)
    comp_id[i, j] = np.arange(i.size)
    span = np.array([work[a:b].sum() for a, b in zip(i, j, strict=True)])
    values = np.stack([(span / (d * t) + 0.02 * d * t)[None] for d, t in shapes])
    pb = ChainProblem(shapes, values, comp_id, (M,), "gpipe", M, N, 8, np.zeros(4), np.zeros(4), (0, 0), (0, 0))
    best = solve(pb)
    assert [(a, b, shapes[k]) for a, b, k in best.stages] == [(0, 1, (2, 1)), (1, 2, (4, 1)), (2, 3, (2, 1))]
    equal = min(filter(None, (solve(dataclasses.replace(pb, shapes=(s,), values=values[k:k + 1]))
                              for k, s in enumerate(shapes))), key=lambda r: r.objective)
    assert best.objective < equal.objective
    assert max(stage_times(pb, best.stages)) < max(stage_times(pb, equal.stages))


@pytest.mark.parametrize("schedule,M", [("1f1b", 4), ("gpipe", 2)])
def test_one_shape_reproduces_the_equal_search(schedule, M):
    """The unequal DP restricted to one submesh prices a split exactly as the equal search: same
    choice tables, same transfers; so its best is the equal search's point of that shape."""
    srch = state(model([f"M/block_{i}" for i in range(6)]), 8, JointOptions(schedules=(schedule,)))
    for d, t in ((2, 1), (1, 2), (4, 1)):
        S = 8 // (d * t)
        tables = srch.table(d, t)
        valid = (srch.batch // M) % tables.batch_split.astype(np.int64) == 0
        ct = choice_table(srch.combos[(d, t)], M, srch.budget, srch.joint.remat, valid, srch.options.overlap)
        want = _point(srch, tables, ct, d, t, S, M, schedule)
        got = unequal_points.best_unequal(srch, [(d, t)], M, schedule, math.inf)
        assert (want is None) == (got is None)
        if want is not None:
            assert got.objective == pytest.approx(want.objective, rel=1e-9)
            assert [s.inflight for s in got.stages] == inflight(schedule, S, M)


def test_results_carry_the_best_and_the_best_runnable_point():
    g = model([f"M/block_{i}" for i in range(4)])
    gr = group(g)
    free = joint_search(g, gr, 2, H100, joint=JointOptions(max_microbatches=8))
    equal = joint_search(g, gr, 2, H100, joint=JointOptions(max_microbatches=8, equal_submeshes=True))
    assert free.runnable is not None and free.runnable.runnable
    assert free.best.step_time <= free.runnable.step_time
    assert equal.best.runnable and equal.best == equal.runnable
    assert equal.best.step_time == pytest.approx(free.runnable.step_time)
    assert all(s.data == equal.best.data and s.model == equal.best.model for s in equal.best.stages)


def test_stage_shapes_are_alpas_powers_of_two_around_the_balanced_count():
    srch = state(model([f"M/block_{i}" for i in range(4)]), 64)
    shapes = unequal_points.stage_shapes(srch, 16)
    assert {d * t for d, t in shapes} == {8, 16, 32}
    assert all(t <= H100.devices_per_node for _, t in shapes)
    assert (1, 8) in shapes and (32, 1) in shapes and (2, 16) not in shapes
    data_only = dataclasses.replace(srch.joint, tensor_in_stages=False)
    srch.joint = data_only
    assert unequal_points.stage_shapes(srch, 16) == [(8, 1), (16, 1), (32, 1)]

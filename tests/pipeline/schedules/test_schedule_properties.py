"""Properties of every registered schedule on random chains and (graph-1f1b) random stage DAGs:
they validate, simulate without deadlock, and any corruption fails with the marked grid."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from autoshard import ScheduleError
from autoshard._src.pipeline.schedules.graph_1f1b import static_inflight
from pipeline import Schedule, Task

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def stage_dags(draw, ragged: bool = False):
    """A random DAG with one sink (the loss stage): every other stage feeds at least one later
    stage. Stage ids are shuffled so rank order is not a topological order. Micro-batch counts are
    powers of two (GraphPipe's compatible sizes) or, with `ragged`, any count 1..9."""
    p = draw(st.integers(1, 7))
    edges = []
    for s in range(p - 1):
        later = list(range(s + 1, p))
        edges += [(s, v) for v in draw(st.lists(st.sampled_from(later), min_size=1, max_size=3, unique=True))]
    perm = draw(st.permutations(range(p)))
    edges = sorted((perm[u], perm[v]) for u, v in edges)
    count = st.integers(1, 9) if ragged else st.sampled_from([1, 2, 4, 8, 16])
    counts = draw(st.lists(count, min_size=p, max_size=p))
    k = draw(st.one_of(st.just(1), st.lists(st.sampled_from([1, 1, 2]), min_size=p, max_size=p)))
    return p, edges, counts, k


def _check_runs(sched: Schedule, durations) -> pipeline.SimResult:
    pipeline.validate(sched)
    forward, backward = durations
    sim = pipeline.simulate(sched, forward=forward, backward=backward, transfer=0.25)
    assert len(sim.timings) == sum(2 * n for n in sched.num_microbatches)
    busiest = max(n * (f + b) for n, f, b in zip(sched.num_microbatches, forward, backward, strict=True))
    assert sim.makespan >= busiest - 1e-9
    assert 0.0 <= sim.bubble_fraction < 1.0 or sim.makespan == 0
    return sim


def _durations(p):
    times = st.lists(st.floats(0.1, 4.0), min_size=p, max_size=p)
    return st.tuples(times, times)


@pytest.mark.parametrize("name", pipeline.schedule_names())
@SETTINGS
@given(data=st.data())
def test_every_registered_schedule_on_random_chains(name, data):
    p = data.draw(st.integers(1, 8), label="num_stages")
    m = data.draw(st.integers(1, 16), label="num_microbatches")
    opts = {}
    if name == "interleaved-1f1b":   # p ranks, v chunks each; micro-batches in groups of p
        m = p * data.draw(st.integers(1, 4), label="groups")
        opts["virtual_stages"] = data.draw(st.integers(1, 3), label="virtual_stages")
    sched = pipeline.schedule(name, num_stages=p, num_microbatches=m, **opts)
    sim = _check_runs(sched, data.draw(_durations(sched.num_stages)))
    assert all(1 <= peak <= m * opts.get("virtual_stages", 1) for peak in sim.peak_inflight)
    if name == "1f1b":
        assert sim.peak_inflight == [min(p - s, m) for s in range(p)]
        assert sched.ranks == pipeline.schedule("graph-1f1b", num_stages=p, num_microbatches=m).ranks
    if name == "gpipe":
        assert sim.peak_inflight == [m] * p


@SETTINGS
@given(dag=stage_dags(), data=st.data())
def test_graph_1f1b_on_random_dags(dag, data):
    p, edges, counts, k = dag
    sched = pipeline.schedule("graph-1f1b", num_stages=p, num_microbatches=counts, edges=edges, k=k)
    sim = _check_runs(sched, data.draw(_durations(p)))
    # The Table 2 caps alone are deadlock-free here: the builder never had to raise one.
    assert sim.peak_inflight == static_inflight(counts, edges, k)
    assert Schedule.from_json(sched.to_json()) == sched


@SETTINGS
@given(dag=stage_dags(ragged=True))
def test_graph_1f1b_on_ragged_microbatch_counts(dag):
    p, edges, counts, k = dag
    sched = pipeline.schedule("graph-1f1b", num_stages=p, num_microbatches=counts, edges=edges, k=k)
    _check_runs(sched, ([1.0] * p, [2.0] * p))


def _corrupt(sched: Schedule, how: str, data) -> Schedule:
    r = data.draw(st.integers(0, len(sched.ranks) - 1), label="rank")
    rank = list(sched.ranks[r])
    if how == "swap":  # put a backward before its own forward
        s = data.draw(st.sampled_from(sched.stages_on(r)), label="stage")
        m = data.draw(st.integers(0, sched.num_microbatches[s] - 1), label="microbatch")
        i, j = rank.index(Task(s, m, "F")), rank.index(Task(s, m, "B"))
        rank[i], rank[j] = rank[j], rank[i]
    elif how == "drop":
        rank.pop(data.draw(st.integers(0, len(rank) - 1), label="dropped"))
    else:
        task = data.draw(st.sampled_from(rank), label="duplicated")
        rank.insert(data.draw(st.integers(0, len(rank)), label="at"), task)
    return dataclasses.replace(sched, ranks=sched.ranks[:r] + (tuple(rank),) + sched.ranks[r + 1 :])


@pytest.mark.parametrize("how", ["swap", "drop", "duplicate"])
@SETTINGS
@given(dag=stage_dags(), name=st.sampled_from(pipeline.schedule_names()), data=st.data())
def test_corrupted_schedules_fail_with_the_marked_grid(how, dag, name, data):
    p, edges, counts, k = dag
    if name == "graph-1f1b":
        sched = pipeline.schedule(name, num_stages=p, num_microbatches=counts, edges=edges, k=k)
    elif name == "interleaved-1f1b":
        sched = pipeline.schedule(name, num_stages=p, num_microbatches=p * counts[0], virtual_stages=2)
    else:
        sched = pipeline.schedule(name, num_stages=p, num_microbatches=counts[0])
    bad = _corrupt(sched, how, data)
    with pytest.raises(ScheduleError) as err:
        pipeline.validate(bad)
    msg = str(err.value)
    assert "tick x rank grid" in msg
    grid = msg.split("tick x rank grid", 1)[1]
    assert "[F" in grid or "[B" in grid, msg
    with pytest.raises(ScheduleError):
        pipeline.simulate(bad)

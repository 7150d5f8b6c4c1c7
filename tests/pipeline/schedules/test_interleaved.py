"""Interleaved 1F1B (virtual stages): placement, Megatron's order, bubble, in-flight peaks, JSON, errors."""

from __future__ import annotations

import dataclasses

import pytest

import pipeline
from autoshard import ScheduleError
from pipeline import Schedule, Task

GRID = [(S, v, M) for S in (1, 2, 3, 4) for v in (1, 2, 3) for M in (S, 2 * S, 4 * S)]


def _build(S, v, M):
    return pipeline.schedule("interleaved-1f1b", num_stages=S, num_microbatches=M, virtual_stages=v)


@pytest.mark.parametrize(("S", "v", "M"), GRID)
def test_validates_and_places_stage_k_on_rank_k_mod_S(S, v, M):
    sched = _build(S, v, M)
    pipeline.validate(sched)
    assert sched.num_stages == S * v and len(sched.ranks) == S
    assert sched.rank_of == tuple(k % S for k in range(S * v))
    for r, rank in enumerate(sched.ranks):
        assert {t.stage % S for t in rank} == {r}
        assert len(rank) == 2 * M * v
    assert len(pipeline.tick_table(sched)) == S


@pytest.mark.parametrize(("S", "v", "M"), GRID)
def test_bubble_shrinks_by_v(S, v, M):
    """Per-rank forward f and backward b split evenly over v chunks: the makespan is exactly
    M*(f+b) + (S-1)*(f+b)/v, against 1F1B's (M+S-1)*(f+b): the bubble term is 1/v of 1F1B's."""
    f, b = 1.0, 2.0
    inter = pipeline.simulate(_build(S, v, M), forward=f / v, backward=b / v)
    plain = pipeline.simulate(pipeline.schedule("1f1b", num_stages=S, num_microbatches=M), forward=f, backward=b)
    assert plain.makespan == pytest.approx((M + S - 1) * (f + b))
    assert inter.makespan == pytest.approx(M * (f + b) + (S - 1) * (f + b) / v)
    assert inter.makespan - M * (f + b) == pytest.approx((plain.makespan - M * (f + b)) / v)
    busy = M * (f + b)
    assert inter.bubble_fraction == pytest.approx(1 - busy / inter.makespan)


def test_unit_times_makespan_and_gantt():
    """Unit forward and backward per virtual stage: (S-1)*2 ticks of bubble instead of 1F1B's (S-1)*2*v."""
    S, v, M = 4, 2, 8
    inter = pipeline.simulate(_build(S, v, M), forward=1.0, backward=1.0)
    plain = pipeline.simulate(pipeline.schedule("1f1b", num_stages=S, num_microbatches=M), forward=v, backward=v)
    assert inter.makespan == 2 * M * v + 2 * (S - 1) == 38
    assert plain.makespan == 2 * M * v + 2 * (S - 1) * v == 44
    assert inter.gantt().count("rank") == S


def test_v1_is_plain_1f1b():
    for S, M in [(1, 1), (2, 4), (4, 8), (5, 10), (8, 32)]:
        one, inter = pipeline.schedule("1f1b", num_stages=S, num_microbatches=M), _build(S, 1, M)
        assert inter.ranks == one.ranks and inter.placement is None and inter.edges == one.edges


def test_megatron_order_rank0():
    """S=2, v=2, M=4: rank 0 warms up with Megatron's 2*(S-1) + (v-1)*S = 4 forwards (chunk 0 of
    micro-batches 0,1, chunk 1 of the same), then one forward and one backward (backward groups run
    the chunks in reverse), then the drain; rank 1 (the last) with (v-1)*S = 2."""
    sched = _build(2, 2, 4)
    got = [(t.kind, t.stage, t.microbatch) for t in sched.ranks[0]]
    assert got[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1)]
    assert got[4:8] == [("F", 0, 2), ("B", 2, 0), ("F", 0, 3), ("B", 2, 1)]
    assert got[-2:] == [("B", 0, 2), ("B", 0, 3)]
    last = [(t.kind, t.stage, t.microbatch) for t in sched.ranks[1][:4]]
    assert last == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0)]


@pytest.mark.parametrize(("S", "v", "M"), [(4, 2, 8), (4, 3, 16), (2, 2, 2), (8, 2, 16), (4, 2, 4)])
def test_peak_inflight_per_rank(S, v, M):
    """Rank r holds Megatron's warm-up 2*(S-1-r) + (v-1)*S plus one activations (capped by M*v)."""
    sim = pipeline.simulate(_build(S, v, M))
    assert sim.peak_inflight == [min(M * v, 2 * (S - 1 - r) + (v - 1) * S + 1) for r in range(S)]
    act = pipeline.simulate(_build(S, v, M), activation_bytes=[10.0] * (S * v))
    assert act.peak_activation_bytes == [10.0 * p for p in sim.peak_inflight]


def test_megatron_warmup_hides_transfers():
    """With a transfer time per message, the steady state's extra S-1-r forwards keep ranks busy:
    the step stays within the transfers the fill and drain cross of the free-transfer step."""
    S, v, M, lag = 4, 2, 16, 0.1
    free = pipeline.simulate(_build(S, v, M), forward=0.5, backward=1.0).makespan
    slow = pipeline.simulate(_build(S, v, M), forward=0.5, backward=1.0, transfer=lag).makespan
    assert slow - free <= 2 * (S * v - 1) * lag + 1e-6


def test_json_round_trip_keeps_placement():
    sched = _build(3, 2, 6)
    data = sched.to_dict()
    assert data["placement"] == [0, 1, 2, 0, 1, 2]
    assert Schedule.from_json(sched.to_json()) == sched
    plain = pipeline.schedule("1f1b", num_stages=3, num_microbatches=6)
    assert "placement" not in plain.to_dict()          # old format unchanged, old dicts still load
    assert Schedule.from_dict(plain.to_dict()) == plain
    assert dataclasses.replace(plain, placement=(0, 1, 2)) == plain


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"num_stages": 4, "num_microbatches": 6, "virtual_stages": 2}, "num_microbatches=8 or 4"),
        ({"num_stages": 4, "num_microbatches": 3, "virtual_stages": 2}, "not a multiple of num_stages=4"),
        ({"num_stages": 2, "num_microbatches": 4, "virtual_stages": 0}, "virtual_stages must be a positive int"),
        ({"num_stages": 0, "num_microbatches": 4, "virtual_stages": 2}, "num_stages must be a positive int"),
        ({"num_stages": 2, "num_microbatches": [4, 4, 2, 4], "virtual_stages": 2}, "one count for every stage"),
    ],
)
def test_bad_arguments_are_typed_errors(opts, match):
    with pytest.raises(ScheduleError, match=match):
        pipeline.schedule("interleaved-1f1b", **opts)


def test_validator_checks_the_placement():
    sched = _build(2, 2, 4)
    moved = list(sched.ranks[0])
    moved[0] = Task(1, 0, "F")   # stage 1 lives on rank 1
    bad = dataclasses.replace(sched, ranks=(tuple(moved), sched.ranks[1]))
    with pytest.raises(ScheduleError, match=r"stage 1, but rank 0 runs stages 0, 2\. Fix: move it to rank 1"):
        pipeline.validate(bad)
    with pytest.raises(ScheduleError, match="tick x rank grid"):
        pipeline.validate(bad)
    with pytest.raises(ScheduleError, match=r"placement=\(0, 1, 0\) must give"):
        pipeline.validate(dataclasses.replace(sched, placement=(0, 1, 0)))
    with pytest.raises(ScheduleError, match=r"placement=\(0, 5, 0, 1\) must give"):
        pipeline.validate(dataclasses.replace(sched, placement=(0, 5, 0, 1)))
    three = dataclasses.replace(sched, ranks=sched.ranks + ((),))
    with pytest.raises(ScheduleError, match=r"leaves ranks \[2\] without a stage"):
        pipeline.validate(three)
    with pytest.raises(ScheduleError, match="4 rank task lists for 4 stages|2 rank task lists for 4 stages"):
        pipeline.validate(dataclasses.replace(sched, placement=None))

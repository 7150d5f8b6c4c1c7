"""The lean chain simulator against the general one, including interleaved 1F1B (virtual stages)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pipeline
from autoshard import ScheduleError
from autoshard._src.joint.chain_sim import (
    chain_makespan,
    interleaved_inflight,
    interleaved_peak_bytes,
)

GRID = [(1, 2, 3), (2, 2, 4), (3, 3, 6), (4, 2, 8), (4, 3, 12), (2, 1, 6), (5, 2, 5)]


@pytest.mark.parametrize(("S", "v", "M"), GRID)
def test_interleaved_makespan_equals_the_event_simulator(S, v, M):
    rng = np.random.default_rng(S * 100 + v * 10 + M)
    sched = pipeline.schedule("interleaved-1f1b", num_stages=S, num_microbatches=M, virtual_stages=v)
    for _ in range(3):
        f, b = rng.uniform(0.1, 3.0, S * v).tolist(), rng.uniform(0.1, 3.0, S * v).tolist()
        want = pipeline.simulate(sched, forward=f, backward=b).makespan
        assert chain_makespan("interleaved-1f1b", f, b, M, virtual=v) == pytest.approx(want, rel=1e-12)


def test_interleaved_v1_equals_1f1b():
    rng = np.random.default_rng(0)
    f, b = rng.uniform(0.1, 2.0, 4).tolist(), rng.uniform(0.1, 2.0, 4).tolist()
    assert chain_makespan("interleaved-1f1b", f, b, 8) == chain_makespan("1f1b", f, b, 8)


@pytest.mark.parametrize(("S", "v", "M"), [(1, 3, 2), (2, 2, 4), (4, 2, 8), (3, 3, 3), (4, 1, 4), (8, 2, 16)])
def test_inflight_and_peak_bytes_equal_the_simulator(S, v, M):
    sched = pipeline.schedule("interleaved-1f1b", num_stages=S, num_microbatches=M, virtual_stages=v)
    a = np.random.default_rng(S + v + M).uniform(1.0, 5.0, S * v).tolist()
    sim = pipeline.simulate(sched, activation_bytes=a)
    assert interleaved_inflight(S, v, M) == sim.peak_inflight
    assert interleaved_peak_bytes(S, v, M, a) == pytest.approx(sim.peak_activation_bytes)


def test_fast_at_the_search_scale():
    """64 ranks x 3 chunks x 512 micro-batches (the 3-D search's largest): after the first call for a
    shape (which builds and caches its tick tables), a call is a few milliseconds."""
    f = np.linspace(0.5, 1.5, 64 * 3).tolist()
    b = [2 * x for x in f]
    chain_makespan("interleaved-1f1b", f, b, 512, virtual=3)
    start = time.perf_counter()
    for _ in range(3):
        chain_makespan("interleaved-1f1b", b, f, 512, virtual=3)
    assert (time.perf_counter() - start) / 3 < 0.1


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("interleaved-1f1b", [1.0] * 4, [1.0] * 4, 3, 2), "3 is not a multiple of 2"),
        (("1f1b", [1.0] * 4, [1.0] * 4, 4, 2), "virtual > 1 only for 'interleaved-1f1b'"),
        (("interleaved-1f1b", [1.0] * 5, [1.0] * 5, 4, 2), "5 forward"),
        (("zigzag", [1.0], [1.0], 1, 1), "not one of"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ScheduleError, match=match):
        chain_makespan(*args)

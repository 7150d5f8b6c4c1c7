"""MeasuredCostModel: alpha-beta lines fitted to timings, analytical fallback, typed errors."""

from __future__ import annotations

import pytest

from autoshard import ConfigError
from autoshard._src.core.collectives import KINDS
from autoshard._src.core.cost import AnalyticalCostModel, CollectiveSample, MeasuredCostModel
from autoshard._src.core.hardware import get_hardware
from autoshard._src.core.mesh import mesh_spec
from autoshard._src.tensor.search import search

from ._synthetic import mlp_step, remainder_grouping


def _line(kind, axes, alpha, beta, sizes=(1e3, 1e5, 1e7)):
    return [CollectiveSample(kind, axes, b, alpha + beta * b) for b in sizes]


def test_fit_recovers_latency_and_bandwidth():
    cost = MeasuredCostModel({"data": 8, "model": 2}, "h100-sxm",
                             _line("all-reduce", ("data",), 2e-5, 1e-10) + _line("all-gather", ("model",), 5e-6, 3e-11))
    alpha, beta = cost.fitted()[("all-reduce", ("data",))]
    assert alpha == pytest.approx(2e-5, rel=1e-6) and beta == pytest.approx(1e-10, rel=1e-6)
    assert cost.collective("all-gather", 1e6, ["model"]) == pytest.approx(5e-6 + 3e-11 * 1e6)
    analytical = AnalyticalCostModel({"data": 8, "model": 2}, "h100-sxm")
    assert cost.collective("all-to-all", 1e6, ("data",)) == analytical.collective("all-to-all", 1e6, ("data",))
    assert cost.compute(1e12, 1e9) == analytical.compute(1e12, 1e9)
    fast = MeasuredCostModel({"data": 8}, "h100-sxm", flop_rate=1e15, memory_bandwidth=1e12)
    assert fast.compute(1e12, 1e9) == pytest.approx(max(1e-3, 1e-3))


def test_a_slow_measured_axis_steers_the_tensor_search_off_it():
    graph = mlp_step(8, [4096, 4096, 4096])
    mesh, hw = mesh_spec({"data": 2, "model": 4}), get_hardware("h100-sxm")
    base = search(graph, remainder_grouping(graph), mesh, hw)
    assert any("model" in key for key in base.best.comm_bytes), base.best.comm_bytes
    measured = [s for k in KINDS for s in _line(k, ("model",), 1.0, 1e-3) + _line(k, ("data",), 1e-5, 1e-11)]
    cost = MeasuredCostModel(mesh, hw, measured)
    # two measured axes together: slowest link, largest per-step latency, ring over 8 devices
    assert cost.collective("all-reduce", 1e6, ("data", "model")) > cost.collective("all-reduce", 1e6, ("model",))
    best = search(graph, remainder_grouping(graph), mesh, hw, cost=cost).best
    assert not any("model" in key for key in best.comm_bytes), best.comm_bytes


def test_bad_samples_are_refused():
    with pytest.raises(ConfigError, match="two sizes"):
        MeasuredCostModel({"data": 8}, "h100-sxm", [CollectiveSample("all-reduce", ("data",), 1e3, 1e-5)] * 2)
    with pytest.raises(ConfigError, match="unknown"):
        MeasuredCostModel({"data": 8}, "h100-sxm", _line("all-reduce", ("pipe",), 1e-5, 1e-10))
    with pytest.raises(ConfigError, match="flop_rate"):
        MeasuredCostModel({"data": 8}, "h100-sxm", flop_rate=-1.0)

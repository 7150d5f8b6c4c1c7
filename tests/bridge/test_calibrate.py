"""Measured collective times on the local devices fit a MeasuredCostModel the tensor search uses."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

from autoshard import ConfigError
from autoshard._src.bridge.audit.calibrate import measure_collectives
from autoshard._src.core.collectives import KINDS
from autoshard._src.core.cost import CostModel, MeasuredCostModel


def test_measured_collectives_fit_a_cost_model_on_the_local_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    samples = measure_collectives(mesh, sizes=(2**12, 2**16), runs=2)
    assert {(s.kind, s.axes) for s in samples} == {(k, (a,)) for k in KINDS for a in ("data", "model")}
    assert all(s.seconds > 0 for s in samples)
    # full-buffer bytes as the CostModel counts them, within one element of what was asked
    assert {round(s.nbytes, -2) for s in samples if s.axes == ("data",)} == {round(4096, -2), round(65536, -2)}
    cost = MeasuredCostModel({"data": 4, "model": 2}, "cpu-sim", samples)
    assert isinstance(cost, CostModel)
    assert set(cost.fitted()) == {(k, (a,)) for k in KINDS for a in ("data", "model")}
    for kind in KINDS:
        alpha, beta = cost.fitted()[(kind, ("data",))]
        assert alpha >= 0 and beta >= 0
        assert cost.collective(kind, 2**16, ("data",)) == pytest.approx(alpha + beta * 2**16)
    # both axes together combine the single-axis fits; a kind never timed falls back to the analytical model
    assert cost.collective("all-reduce", 2**16, ("data", "model")) > 0
    partial = MeasuredCostModel({"data": 4, "model": 2}, "cpu-sim", [s for s in samples if s.kind != "all-to-all"])
    assert partial.collective("all-to-all", 2**16, ("data",)) == \
        partial.fallback.collective("all-to-all", 2**16, ("data",))


def test_measure_collectives_rejects_bad_arguments():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(ConfigError, match="two distinct sizes"):
        measure_collectives(mesh, sizes=(2**12,))
    with pytest.raises(ConfigError, match="kinds"):
        measure_collectives(mesh, kinds=("broadcast",))

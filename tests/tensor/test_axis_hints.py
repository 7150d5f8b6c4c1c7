"""Mesh axis names as hints (issue 34): where plans predict the same step, the batch goes on the axis named for
data and the tensor-parallel splits on the one named for the model, whatever the axis order; never against a
cost difference beyond `TIE`."""

from __future__ import annotations

import numpy as np
import pytest

import autoshard
import models
from autoshard._src.core.mesh import mesh_spec
from autoshard._src.tensor.axis_hints import TIE, axis_kind, break_tie, row_hints

MESH = mesh_spec({"model": 2, "data": 2})       # bit 0: model, bit 1: data
BATCH, HEADS = 7, 9                             # factor ids
# plan A: batch on model, heads on data (the names reversed); plan B: its mirror
ROWS = np.array([[1, 2], [2, 1]], dtype=np.int64)


def test_axis_kinds_are_read_from_the_words_of_a_name():
    assert [axis_kind(n) for n in ("data", "batch", "dp", "fsdp", "replica", "dp_replica", "DATA")] == [1] * 7
    assert [axis_kind(n) for n in ("model", "tensor", "tp", "mp", "tensor_parallel")] == [-1] * 5
    assert [axis_kind(n) for n in ("pipe", "x", "expert", "datamodel")] == [0] * 4
    assert row_hints(ROWS, (BATCH, HEADS), {BATCH}, MESH).tolist() == [-2, 2]


@pytest.mark.parametrize(("mirror_extra", "chosen"), [(0.0, 1), (1e-12, 1), (-1e-12, 1), (10 * TIE, 0)])
def test_the_hint_breaks_ties_only(mirror_extra, chosen):
    # plan A comes first in enumeration order; the named mirror B wins while it predicts the same step
    # (within TIE, either side) and never when it is slower by more
    t = np.array([1e-3, 1e-3 * (1 + mirror_extra)])
    i0 = int(np.argmin(np.round(t, 12)))
    assert break_tie(i0, t, np.ones(2, bool), ROWS, (BATCH, HEADS), {BATCH}, MESH) == chosen
    assert break_tie(i0, t, np.array([True, False]), ROWS, (BATCH, HEADS), {BATCH}, MESH) == 0   # infeasible B


@pytest.fixture(scope="module")
def gpt():
    # batch 2: data parallelism fits one axis only, so one axis takes the batch and the names can decide
    m = models.get("gpt", "debug", num_layers=2, batch_size=2)
    return m, m.abstract_state()


def _batch_axes(plan):
    return plan.specs_by_keypath()["[2]['inputs']"][0]


@pytest.mark.parametrize("sizes", [(2, 4), (2, 2)], ids=["data2-model4", "data2-model2"])
def test_a_flax_transformer_gets_its_batch_on_data_in_either_axis_order(gpt, sizes):
    m, args = gpt
    d, k = sizes
    first = autoshard.plan(m.train_step, *args, mesh={"data": d, "model": k}, hardware="cpu-sim")
    second = autoshard.plan(m.train_step, *args, mesh={"model": k, "data": d}, hardware="cpu-sim")
    assert _batch_axes(first) == _batch_axes(second) == ("data",), (first.explain(), second.explain())
    assert first.specs_by_keypath() == second.specs_by_keypath()           # the same plan, not a mirror
    assert second.predicted["step_time"] == pytest.approx(first.predicted["step_time"], rel=TIE)
    if d == k:      # equal sizes: the mirror plan ties, and the model-first order needed the names to decide
        assert "batch on 'data' (axis-name hint; same predicted step as the mirror plan with the batch on " \
               "'model')" in second.explain(), second.explain()
    assert "axis-name hint" not in first.explain()        # enumeration order already agreed with the names

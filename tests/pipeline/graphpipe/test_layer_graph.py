"""LayerGraph validation and micro-batch cost curves (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from autoshard import PipelineError
from autoshard._src.pipeline.graphpipe.layer_graph import LayerGraph, LayerNode, chain_graph, curve_seconds


def test_curve_interpolates_and_extends_with_the_last_slope():
    c = np.array([1.0, 1.0, 1.0, 2.0, 4.0])       # sizes 1, 2, 4, 8, 16: memory-bound up to 4
    got = [float(curve_seconds(c, 0.25, b)) for b in (1, 2, 3, 4, 6, 8, 12, 16, 32)]
    assert got == [1.0, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0]
    # broadcasting: two curves x three sizes
    out = curve_seconds(np.stack([c, 2 * c])[:, None, :], np.array([0.25, 0.5])[:, None], np.array([[1, 3, 32]]))
    assert out.tolist() == [[1.0, 1.0, 8.0], [2.0, 2.0, 16.0]]
    # no curve: linear; one size: its value then per-sample slope
    assert curve_seconds(np.zeros((2, 0)), np.array([1.0, 2.0]), 3).tolist() == [3.0, 6.0]
    assert float(curve_seconds(np.array([2.0]), 0.5, 5)) == 4.0


def test_curves_must_agree_and_not_decrease():
    a = LayerNode("a", 1, 2, 0, 0, 0, 0, forward_curve=(1, 2), backward_curve=(2, 4))
    b = LayerNode("b", 1, 2, 0, 0, 0, 0, forward_curve=(1, 2, 4), backward_curve=(2, 4, 8))
    assert chain_graph([a, a], 8).curve_sizes == 2
    with pytest.raises(PipelineError, match="same sizes"):
        chain_graph([a, b], 8)
    bad = LayerNode("c", 1, 2, 0, 0, 0, 0, forward_curve=(2, 1), backward_curve=(2, 4))
    with pytest.raises(PipelineError, match="decreasing"):
        chain_graph([bad], 8)
    with pytest.raises(PipelineError, match="forward=nan"):
        chain_graph([LayerNode("n", float("nan"), 2, 0, 0, 0, 0)], 8)
    with pytest.raises(PipelineError, match="batch_size=6.0"):
        chain_graph([a], 6.0)
    with pytest.raises(PipelineError, match="not forward"):
        LayerGraph((a, a), ((1, 0),), 8)

"""The fusion of a window (the tensor search's analysed ops padded by the neighbouring layers) gives
every live analysed op the whole graph's fusion: its group, bytes, values moved and kernels, on each
zoo model deep enough to have a window, for XLA:GPU's and XLA:CPU's fusion; where a fusion reaches
the window's edge (T5's encoder-output gradient, summed over every decoder layer in one kernel) the
whole graph is fused instead."""

from __future__ import annotations

import pytest

import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.fusion import _Fuser, window_fusion
from autoshard._src.core.grouping import group
from autoshard._src.tensor import search
from autoshard._src.tensor.search import analysis, fusion_window

# (model, overrides, whether the window settles every priced op)
CASES = [
    ("gpt", {"num_layers": 12}, True),
    ("gpt", {"num_layers": 12, "scan_layers": True}, None),
    ("gpt-gpu", {"num_layers": 12}, True),
    ("bert", {"num_layers": 12}, True),
    ("t5", {"num_layers": 12}, False),
    ("moe", {"num_layers": 12}, True),
    ("mmt", {"num_layers": 12}, True),
    ("gpt_nnx", {"num_layers": 12}, True),
]


def _traced(name, kw):
    m = models.get(name, "debug", **kw)
    g = trace(m.train_step, *m.abstract_state())
    return g, group(g)


# gpt and t5 (the fallback) in the default run, the rest in the slow step
FAST = ("gpt", "t5")
PARAMS = [pytest.param(*c, marks=() if c[0] in FAST and len(c[1]) == 1 else pytest.mark.slow,
                       id=f"{c[0]}{'-scan' if len(c[1]) > 1 else ''}") for c in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("name,kw,settles", PARAMS)
def test_window_fusion_matches_the_whole_graph_on_priced_ops(name, kw, settles, monkeypatch):
    monkeypatch.setattr(search, "WINDOW_SHARE", 1.0)      # windows of any size (12 layers: most of the graph)
    g, grouping = _traced(name, kw)
    window = fusion_window(g, grouping)
    if settles is None:           # a scanned stack: one body, the whole graph is small
        assert window is None
        return
    scope, core = window
    assert len(scope) < len(g.ops)
    a = analysis(g, grouping)
    assert core == tuple(sorted(i for i, w in a.weights.items() if w > 0)) and set(a.weights) <= set(scope)
    for gpu in (True, False):
        full = _Fuser(g, gpu).run()
        fz = _Fuser(g, gpu, scope)
        win = fz.run()
        assert fz.settled(core) == settles
        got = window_fusion(g, gpu, scope, core)
        assert (("fusion", gpu) in g.cache) == (not settles)      # the whole graph fused instead
        if settles:
            assert got.bytes.tolist() == win.bytes.tolist()
        for i in core:
            assert (got.group[i], got.bytes[i], got.launches[i], got.moved[i]) == \
                   (full.group[i], full.bytes[i], full.launches[i], full.moved[i]), (name, gpu, i, g.ops[i])


@pytest.mark.slow
def test_window_fusion_defers_to_a_cached_whole_graph_fusion():
    g, grouping = _traced("gpt", {"num_layers": 12})
    scope, core = fusion_window(g, grouping)
    win = window_fusion(g, True, scope, core)
    outside = sorted(set(range(len(g.ops))) - set(scope))
    assert win.bytes[outside].sum() == 0 and win.launches[outside].sum() == 0
    g.cache.clear()
    g.cache[("fusion", True)] = full = _Fuser(g, True).run()
    assert window_fusion(g, True, scope, core) is full


def test_op_keys_of_some_ops_are_their_whole_graph_keys():
    from autoshard._src.core.graph import op_keys, op_keys_of

    g, _ = _traced("gpt", {"num_layers": 2})
    full = op_keys(g)
    some = list(range(0, len(g.ops), 7))
    assert op_keys_of(g, some) == {i: full[i] for i in some}

"""A tensor plan analyses its step once: representative ops, periods, factor linking and the
sequence-parallel cut are shared by the search, the expert comparison and the plan's construction."""

from __future__ import annotations

import autoshard
import models
from autoshard._src.tensor import regions, search


def test_each_analysis_runs_once_per_plan(monkeypatch):
    calls: dict[str, int] = {}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("_find_analysed_ops", "_analysis", "_sequence_parallel_analysis"):
        counted(search, name)
    counted(regions, "link_factors")
    m = models.get("gpt", "debug", num_layers=4)
    p = autoshard.plan(m.train_step, *m.abstract_state(), mesh={"data": 2, "model": 4}, hardware="h100-sxm",
                       search={"sequence_parallel": "on"})
    assert any("sequence parallel" in f[1] for f in p.factors), p.explain()
    assert calls["_find_analysed_ops"] == calls["_analysis"] == calls["_sequence_parallel_analysis"] == 1, calls
    # the analysed ops (their linking also shows the period is 1: no pair of instances is linked apart)
    # and their sequence-parallel cut
    assert calls["link_factors"] == 2, calls

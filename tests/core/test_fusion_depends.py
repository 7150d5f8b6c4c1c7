"""Fusion's dependence test (a reduction taking in a producer others read; the normalisation fusion)
answers as the whole ancestor set would, on a traced step with forward values read again backward."""

from __future__ import annotations

import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.fusion import _Fuser


def _ancestors(graph, r: int) -> set[int]:
    seen: set[int] = set()
    stack = [r]
    while stack:
        for v in graph.ops[stack.pop()].inputs:
            q = graph.values[v].producer
            if q is not None and q not in seen:
                seen.add(q)
                stack.append(q)
    return seen


def test_depends_matches_the_ancestor_sets():
    m = models.get("gpt", "debug", num_layers=3)
    g = trace(m.train_step, *m.abstract_state())
    fz = _Fuser(g, gpu=True)
    answers = set()
    for op in g.ops:
        if op.primitive not in ("reduce_sum", "reduce_max") or op.index % 3:
            continue
        r = op.index
        anc = _ancestors(g, r)
        # single ops and spread-out sets just before `r` and far back (forward ops read backward)
        for targets in ({r - 1}, {r - 7}, set(range(r - 60, r, 13)), set(range(r // 3, r // 2, 29)), set()):
            targets = {t for t in targets if 0 <= t < r}
            got = fz.depends(r, targets)
            assert got == bool(targets & anc), (r, sorted(targets))
            answers.add(got)
    assert answers == {True, False}

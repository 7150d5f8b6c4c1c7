"""The op table (core/optable.py): its columns say what the ops say, and what reads them (op keys, flops by
phase, the fingerprint) gives what the per-op definitions give."""

from __future__ import annotations

import random

from autoshard._src.core.graph import PHASES, Loop, fingerprint, op_keys, op_keys_of
from autoshard._src.core.optable import PHASE_CODES, build_table

from ._synthetic import model

LOOP = Loop(uid=7, kind="scan", trip_count=3)


def _graph():
    g = model(["M/block_0", "M/block_1", "M/block_2"], loops=(LOOP,))
    g.ops[5].nested = True
    g.ops[6].nested, g.ops[6].remat_eqn = True, 0
    return g


def test_columns_match_the_ops():
    g = _graph()
    t = build_table(g.ops)
    for op in g.ops:
        i = op.index
        assert t.phase[i] == PHASE_CODES[op.phase]
        assert t.modules[t.module[i]] == op.module
        assert t.sigs[t.sig[i]] == (op.primitive, op.in_shapes, op.in_dtypes, op.out_shapes, op.out_dtypes)
        assert t.kinds[t.kind[i]] == (op.primitive, op.in_shapes, op.out_shapes)
        assert t.primitives[t.primitive[i]] == op.primitive
        assert t.flops[i] == op.flops * op.repeat
        assert (t.nested[i], t.in_remat[i], t.looped[i]) == (op.nested, op.remat_eqn >= 0, bool(op.loops))
    assert list(PHASE_CODES) == list(PHASES)


def test_op_keys_of_any_subset_agrees_with_op_keys():
    g = _graph()
    every = op_keys(g)
    rng = random.Random(0)
    for size in (0, 1, 5, len(g.ops) // 2, len(g.ops)):
        ops = rng.sample(range(len(g.ops)), size)
        assert op_keys_of(g, ops) == {i: every[i] for i in ops}


def test_flops_by_phase_sums_each_op_once_in_program_order():
    g = _graph()
    want = dict.fromkeys(PHASES, 0.0)
    for op in g.ops:
        want[op.phase] += op.flops * op.repeat
    assert g.flops_by_phase() == want
    assert any(op.loops for op in g.ops)       # the loop's trip count is in the sums


def test_fingerprint_sees_modules_shapes_and_outputs():
    base = fingerprint(_graph())
    assert fingerprint(_graph()) == base            # the same program: the same fingerprint

    renamed = _graph()
    renamed.ops[3].module = "M/other"
    renamed._table = None                           # a graph changed after its table: rebuilt
    assert fingerprint(renamed) != base

    reshaped = _graph()
    v = reshaped.outputs[0]
    reshaped.values[v].shape = (*reshaped.values[v].shape, 1)
    assert fingerprint(reshaped) != base

    fewer = _graph()
    fewer.outputs, fewer.output_keypaths = fewer.outputs[:-1], fewer.output_keypaths[:-1]
    assert fingerprint(fewer) != base

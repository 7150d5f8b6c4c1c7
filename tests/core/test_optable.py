"""The op table (core/optable.py): its columns say what the ops say, and what reads them (op keys, flops by
phase, the fingerprint) gives what the per-op definitions give."""

from __future__ import annotations

import random

import numpy as np

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


def test_edges_are_what_the_ops_read():
    g = _graph()
    t = build_table(g.ops)
    for op in g.ops:
        i = op.index
        entries = range(t.operand_ptr[i], t.operand_ptr[i + 1])
        want = [g.values[v].producer for v in op.inputs]
        assert [int(t.operand_src[e]) for e in entries] == [-1 if p is None else p for p in want]
        for v in op.outputs:
            assert t.producer[v] == i


def test_traced_edges_equal_the_ops_edges():
    """The trace records the edges as it adds ops; the table built from the ops alone agrees."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from autoshard._src.bridge.trace.trace import trace
    from autoshard._src.core.grouping import group

    def step(w, x):       # also returns a literal: a value made after every op
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w), 3.0

    g = trace(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
    recorded, rebuilt = g.table(), build_table(g.ops)
    for col in ("operand_ptr", "operand_src"):
        assert np.array_equal(getattr(recorded, col), getattr(rebuilt, col)), col
    want = [-1 if (p := g.values[v].producer) is None else p for v in g.outputs]
    assert recorded.producers_of(g.outputs).tolist() == want == rebuilt.producers_of(g.outputs).tolist()
    assert want[-1] == -1
    assert group(g).remainder         # grouping's walk from the outputs' writers takes the literal too


def test_feeding_is_a_walk_up_the_edges_within_the_mask():
    g = _graph()
    t = build_table(g.ops)
    rng = random.Random(1)
    for _ in range(20):
        within = np.array([rng.random() < 0.7 for _ in g.ops])
        targets = [i for i in range(len(g.ops)) if within[i] and rng.random() < 0.2]
        want = set(targets)
        for i in reversed(range(len(g.ops))):     # a reader comes after what it reads
            if within[i] and any(c in want for v in g.ops[i].outputs for c in g.values[v].consumers):
                want.add(i)
        got = t.feeding(np.array(targets, dtype=np.int32), within)
        assert set(np.flatnonzero(got).tolist()) == want

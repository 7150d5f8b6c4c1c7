"""The vocabulary and grouped-query attention's kv heads, found from structure (tensor/vocab.py,
regions._repeat_cuts) on hand-built OpGraphs: pure Python, no jax, milliseconds.

Keypaths are neutral ("table", "learned", "proj"): only what the program does with a parameter can
make it the vocabulary. Sizes are pairwise distinct, so no link comes from equal sizes alone except
where the size is the link (an untied head's columns and its table's rows).
"""

from __future__ import annotations

import pytest

from autoshard._src.core.mesh import mesh_spec
from autoshard._src.tensor.experts import expert_assignments, tensor_parallel_parts
from autoshard._src.tensor.regions import analyze
from autoshard._src.tensor.vocab import lookup_tables, vocab_factors

from ..core._synthetic import GraphBuilder

B, S, D, V = 8, 6, 12, 24
MATMUL3 = {"contracting": ((2,), (0,)), "batch": ((), ())}


def _gather(g: GraphBuilder, table: int, idx: int, out_shape) -> int:
    """table[R, D] indexed by idx[..., 1] (jnp.take on axis 0)."""
    d = g.values[table].shape[1]
    params = {"dimension_numbers": ((len(out_shape) - 1,), (0,), (0,), (), ()), "slice_sizes": (1, d)}
    return g.op("gather", [table, idx], [out_shape], params=params)


def lm(*, tied: bool = False, one_hot: bool = False, positions: str = "iota", pos_rows: int = S):
    """ids -> token lookup + position lookup -> head -> log-softmax's max: (graph, values by name).
    positions: "iota" (computed in the step), "data" (passed in with the batch) or "none"."""
    g = GraphBuilder()
    ids = g.input((B, S), (2, "ids"), role="data", dtype="int32")
    table = g.param("table", (V, D), leaf="t")
    if one_hot:
        iota = g.op("iota", [], [(1, 1, V)])
        col = g.op("broadcast_in_dim", [ids], [(B, S, 1)], params={"broadcast_dimensions": (0, 1)})
        cmp = g.op("eq", [col, iota], [(B, S, V)])
        x = g.op("dot_general", [g.op("convert_element_type", [cmp]), table], [(B, S, D)], params=MATMUL3)
    else:
        x = _gather(g, table, g.op("reshape", [ids], [(B, S, 1)]), (B, S, D))
    out = dict(table=table)
    if positions != "none":
        pos = g.param("learned", (pos_rows, D), leaf="t")
        if positions == "iota":
            p_idx = g.op("reshape", [g.op("iota", [], [(S,)])], [(S, 1)])
            p = g.op("broadcast_in_dim", [_gather(g, pos, p_idx, (S, D))], [(B, S, D)],
                     params={"broadcast_dimensions": (1, 2)})
        else:
            p_ids = g.input((B, S), (2, "positions"), role="data", dtype="int32")
            p = _gather(g, pos, g.op("reshape", [p_ids], [(B, S, 1)]), (B, S, D))
        x = g.op("add", [x, p])
        out["pos"] = pos
    if tied:
        logits = g.op("dot_general", [x, table], [(B, S, V)], params={"contracting": ((2,), (1,)), "batch": ((), ())})
    else:
        out["head"] = head = g.param("proj", (D, V), leaf="w")
        logits = g.op("dot_general", [x, head], [(B, S, V)], params=MATMUL3)
    g.op("reduce_max", [logits], [(B, S)], params={"axes": (2,)})
    graph = g.build()
    return graph, analyze(graph, range(len(graph.ops))), out


def _dims(graph, fg, factors):
    """{param keypath: [dims holding one of `factors`]}."""
    out = {}
    for v in graph.inputs:
        val = graph.values[v]
        if val.role == "parameter":
            dims = [d for d, f in enumerate(fg.value_factors(v)) if f in factors]
            if dims:
                out[val.keypath] = dims
    return out


@pytest.mark.parametrize("one_hot", [False, True], ids=["gather", "one-hot matmul"])
def test_untied_vocabulary_is_the_table_the_ids_index_and_the_head_over_its_rows(one_hot):
    graph, fg, _ = lm(one_hot=one_hot)
    vocab = _dims(graph, fg, vocab_factors(graph, fg))
    # the table's rows and the head's columns; the learned positions (indexed by an iota) are not
    assert vocab == {"[0]['table']['t']": [0], "[0]['proj']['w']": [1]}, vocab
    tables = lookup_tables(graph, fg)
    assert [t.data_indexed for t in tables] == [True, False]     # the token table, then the positions


def test_tied_head_shares_the_table_rows():
    graph, fg, _ = lm(tied=True)
    assert _dims(graph, fg, vocab_factors(graph, fg)) == {"[0]['table']['t']": [0]}


def test_positions_passed_as_data_are_not_the_vocabulary_when_the_logits_name_it():
    graph, fg, _ = lm(positions="data")
    tables = lookup_tables(graph, fg)
    assert all(t.data_indexed for t in tables) and len(tables) == 2      # both indexed by the batch
    # the position table's rows (6) are not the logits' (24): not linked, not the vocabulary
    assert _dims(graph, fg, vocab_factors(graph, fg)) == {"[0]['table']['t']": [0], "[0]['proj']['w']": [1]}


def test_no_head_and_no_table():
    g = GraphBuilder()
    x = g.input((B, D), (2, "x"), role="data")
    w = g.param("w", (D, 7))
    y = g.op("dot_general", [x, w], [(B, 7)], params={"contracting": ((1,), (0,)), "batch": ((), ())})
    g.op("reduce_sum", [y], [()], params={"axes": (0, 1)})      # a regression loss: no log-softmax
    graph = g.build()
    fg = analyze(graph, range(len(graph.ops)))
    assert vocab_factors(graph, fg) == []


# grouped-query attention -----------------------------------------------------------------------

H, KV, HD = 4, 2, 5                # query heads, kv heads (each repeated H // KV times), head dim


def gqa(kv: int = KV, backward: bool = True):
    """q = x @ Wq, k = x @ Wk repeated (jnp.repeat: broadcast + reshape) to the query heads, their
    product read by o = . @ Wo; with its backward's transpose of the repeat (reshape + sum)."""
    g = GraphBuilder()
    x = g.input((B, S, D), (2, "x"), role="data")
    wq, wk, wo = g.param("q", (D, H * HD)), g.param("k", (D, kv * HD)), g.param("o", (H * HD, D))
    q = g.op("reshape", [g.op("dot_general", [x, wq], [(B, S, H * HD)], params=MATMUL3)], [(B, S, H, HD)])
    k = g.op("reshape", [g.op("dot_general", [x, wk], [(B, S, kv * HD)], params=MATMUL3)], [(B, S, kv, HD)])
    rep = g.op("broadcast_in_dim", [k], [(B, S, kv, H // kv, HD)], params={"broadcast_dimensions": (0, 1, 2, 4)})
    k_rep = g.op("reshape", [rep], [(B, S, H, HD)])
    a = g.op("reshape", [g.op("mul", [q, k_rep])], [(B, S, H * HD)])
    y = g.op("dot_general", [a, wo], [(B, S, D)], params=MATMUL3)
    g.op("reduce_sum", [y], [()], params={"axes": (0, 1, 2)})
    if backward:
        ct = g.op("mul", [q, q], phase="backward")
        split = g.op("reshape", [ct], [(B, S, kv, H // kv, HD)], phase="backward")
        dk = g.op("reduce_sum", [split], [(B, S, kv, HD)], params={"axes": (3,)}, phase="backward")
        g.op("add", [dk, k], phase="backward")          # k's cotangent: as k
    graph = g.build()
    return graph, analyze(graph, range(len(graph.ops))), dict(wq=wq, wk=wk, k_rep=k_rep, ct=ct if backward else None)


def test_repeated_kv_heads_are_cut_from_the_query_heads():
    graph, fg, v = gqa()
    assert fg.repeat_cuts == {v["k_rep"], v["ct"]}      # the forward repeat and its backward transpose
    q_heads, kv_heads = fg.value_factors(v["wq"])[1], fg.value_factors(v["wk"])[1]
    assert q_heads != kv_heads
    assert sorted(set(fg.factor_sizes[kv_heads])) == [KV, H, KV * HD]   # the repeat reads it as produced
    assert KV not in fg.factor_sizes[q_heads]       # the query heads no longer need the kv heads to divide
    chosen, twins, vocab = tensor_parallel_parts(graph, fg, {})
    assert q_heads in chosen and twins == (kv_heads,) and vocab == ()


@pytest.mark.parametrize("mesh,kv_split", [({"data": 2, "model": 4}, False), ({"data": 4, "model": 2}, True)])
def test_query_heads_split_where_the_kv_heads_do_not_divide(mesh, kv_split):
    graph, fg, v = gqa()
    q_heads, kv_heads = fg.value_factors(v["wq"])[1], fg.value_factors(v["wk"])[1]
    fa, _ = expert_assignments(graph, fg, {}, mesh_spec(mesh))["data-megatron"]
    assert fa[q_heads] == ("model",)
    assert fa.get(kv_heads) == (("model",) if kv_split else None)      # Megatron-LM replicates k/v


def test_multi_query_attention_needs_no_cut():
    graph, fg, v = gqa(kv=1)
    assert not fg.repeat_cuts         # one kv head: a size-1 dim links nothing
    fa, _ = expert_assignments(graph, fg, {}, mesh_spec({"data": 2, "model": 4}))["data-megatron"]
    assert fa[fg.value_factors(v["wq"])[1]] == ("model",)


def test_a_verdict_names_the_parameter_dim_that_stops_it():
    graph, fg, _ = gqa()
    why = expert_assignments(graph, fg, {}, mesh_spec({"model": 5}))["megatron"]
    assert isinstance(why, str)
    # the query heads (4 of the 20-wide projection) cannot split 5 ways; the kv heads would stay whole
    assert why.startswith("tensor-parallel dims do not divide axes ('model',) (5 devices): "), why
    assert "[0]['q']['kernel'] dim 1 (and 1 more parameter): of size [4] (parts of the dim of size 20)" in why, why
    assert "[0]['k']" not in why, why
    assert "Fix:" in why.fix

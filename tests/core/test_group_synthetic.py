"""Grouping and attribution on hand-built OpGraphs: pure Python, no tracing, milliseconds."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import autoshard
from autoshard import group
from autoshard._src.core.attribution import attribute_modules, infer_phases, join_modules, parse_scope
from autoshard._src.core.graph import Loop

from ._synthetic import MATMUL, B, D, GraphBuilder, block, model

SCAN6 = (Loop(1, "scan", 6),)


def paths(n, stem="M/block_"):
    return [f"{stem}{i}" for i in range(n)]


def only_type(grouping):
    assert len(grouping.block_types) == 1, grouping.table()
    return grouping.block_types[0]


def ops_under(graph, prefix):
    return {op.index for op in graph.ops if op.module == prefix or op.module.startswith(prefix + "/")}


def assert_partition(graph, grouping):
    """Non-scanned instances and the remainder partition the op indices."""
    seen = [o for bt in grouping.block_types for inst in bt.instances for o in inst.ops]
    seen += list(grouping.remainder)
    assert sorted(seen) == list(range(len(graph.ops)))


# 1. numbered blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("L", [2, 3, 7])
def test_numbered_blocks_one_type(L):
    graph = model(paths(L))
    grouping = group(graph)
    bt = only_type(grouping)
    assert (bt.name, bt.depth, bt.count, bt.scanned) == ("M/block_*", 2, L, False)
    assert [inst.path for inst in bt.instances] == paths(L)
    assert bt.ops_per_phase["forward"] == 13 and len(bt.params) == 7
    for i, inst in enumerate(bt.instances):
        assert set(inst.ops) == ops_under(graph, f"M/block_{i}")
        assert inst.iteration is None and inst.missing_forward_ops == inst.extra_forward_ops == 0
    assert {graph.ops[i].module for i in grouping.remainder} == {"", "M/embed", "M/head"}
    assert_partition(graph, grouping)
    for op in graph.ops:
        parts = op.module.split("/")
        want = (0, int(parts[1][len("block_"):])) if parts[1:2] and parts[1].startswith("block_") \
            else None
        assert grouping.block_of(op.index) == want


def test_instances_in_numeric_order():
    bt = only_type(group(model(paths(12), backward=False)))
    assert [inst.path for inst in bt.instances] == paths(12)


# 2. tolerance ---------------------------------------------------------------------------------

def test_tolerated_extra_forward_op():
    L = 4
    graph = model(paths(L), extra_add={"M/block_3"})
    bt = only_type(group(graph))
    assert bt.count == L
    assert [(i.missing_forward_ops, i.extra_forward_ops) for i in bt.instances] == \
        [(0, 0)] * (L - 1) + [(0, 1)]
    # 1 extra op of 13 exceeds a zero tolerance: the last block stays out
    bt = only_type(group(graph, tolerance=0.0))
    assert [i.path for i in bt.instances] == paths(L - 1)


def test_very_different_instance_not_merged():
    graph = model(paths(4), repeat={"M/block_2": 2})   # same parameters, twice the ops
    grouping = group(graph)
    bt = grouping.block_types[0]
    assert [i.path for i in bt.instances] == ["M/block_0", "M/block_1", "M/block_3"]
    # block_2's own ln1/ln2 (2 ops each there) may form a small type; the rest is remainder
    assert not any(i.path == "M/block_2" for t in grouping.block_types for i in t.instances)
    assert ops_under(graph, "M/block_2") - ops_under(graph, "M/block_2/ln1") \
        - ops_under(graph, "M/block_2/ln2") <= set(grouping.remainder)
    assert_partition(graph, grouping)


def test_ops_per_phase_is_the_reference_composition():
    bt = only_type(group(model(paths(3), extra_add={"M/block_0"})))
    assert bt.instances[0].extra_forward_ops == 1
    assert bt.ops_per_phase["forward"] == 13


# 3. backward is not part of the signature -----------------------------------------------------

def test_first_block_missing_backward_ops():
    graph = model(paths(4), skip_backward={"M/block_0"})
    bwd = [sum(graph.ops[o].phase == "backward" for o in ops_under(graph, p)) for p in paths(4)]
    assert bwd[0] < bwd[1] == bwd[2] == bwd[3]
    bt = only_type(group(graph))
    assert bt.count == 4 and all(i.extra_forward_ops == i.missing_forward_ops == 0
                                 for i in bt.instances)


# 4. two block kinds ---------------------------------------------------------------------------

def test_encoder_decoder_two_types_and_unnumbered_siblings():
    g = GraphBuilder()
    x = g.input((B, D), (2, "x"), role="data")
    for i in range(3):
        x, _ = block(g, f"T/encoder/block_{i}", x)
    x = g.op("mul", [x, g.param("T/encoder/final_ln", (D,), "scale")], module="T/encoder/final_ln")
    for i in range(2):   # same parameters, different composition: same bucket, two clusters
        x, _ = block(g, f"T/decoder/block_{i}", x, repeat=2)
    g.op("mul", [x, g.param("T/decoder/final_ln", (D,), "scale")], module="T/decoder/final_ln")
    graph = g.build()
    grouping = group(graph)
    assert [(bt.name, bt.depth, bt.count) for bt in grouping.block_types] == \
        [("T/encoder/block_*", 3, 3), ("T/decoder/block_*", 3, 2)]
    assert [i.path for i in grouping.block_types[1].instances] == paths(2, "T/decoder/block_")
    assert all("final_ln" not in c.name for c in grouping.levels)
    final = ops_under(graph, "T/encoder/final_ln") | ops_under(graph, "T/decoder/final_ln")
    assert final <= set(grouping.remainder)


# 5. multi-branch ------------------------------------------------------------------------------

def test_branches_made_of_layers_report_layers():
    layer_paths = [f"M/branch_{b}/layer_{i}" for b in range(4) for i in range(8)]
    grouping = group(model(layer_paths))
    bt = only_type(grouping)
    assert (bt.name, bt.depth, bt.count) == ("M/branch_*/layer_*", 3, 32)
    assert [i.path for i in bt.instances] == layer_paths
    levels = {(c.name, c.depth): c for c in grouping.levels}
    branch = levels["M/branch_*", 2]
    assert branch.count == 4 and not branch.selected
    assert levels["M/branch_*/layer_*", 3].selected


# 6. scanned blocks ----------------------------------------------------------------------------

def test_scanned_block_with_hoisted_op():
    graph = model(["M/blocks"], loops=SCAN6, hoisted=True)
    grouping = group(graph)
    bt = only_type(grouping)
    assert bt.scanned and bt.count == 6 and bt.depth == 2
    assert bt.name.startswith("M/blocks")
    assert [i.iteration for i in bt.instances] == list(range(6))
    assert {i.path for i in bt.instances} == {"M/blocks"}
    assert len({i.ops for i in bt.instances}) == 1
    hoisted = next(op for op in graph.ops if op.primitive == "convert_element_type")
    assert hoisted.index in bt.instances[0].ops and grouping.block_of(hoisted.index) == (0, 0)
    assert set(bt.instances[0].ops) == ops_under(graph, "M/blocks")
    assert set(grouping.remainder) == set(range(len(graph.ops))) - ops_under(graph, "M/blocks")


def test_scanned_body_dominating_its_parent():
    graph = model(["M/blocks"], loops=SCAN6, repeat={"M/blocks": 2})   # 26 scanned vs 2 ops
    bt = only_type(group(graph))
    assert bt.name == "M/blocks[scan x6]"
    assert set(bt.instances[0].ops) == ops_under(graph, "M/blocks")


def test_sibling_scans_with_equal_trip_counts():
    g = GraphBuilder()
    x = g.op("mul", [g.input((B, D), (2, "x"), role="data")], module="T/embed")
    x, _ = block(g, "T/encoder", x, loops=(Loop(1, "scan", 6),))
    block(g, "T/decoder", x, loops=(Loop(2, "scan", 6),), repeat=2)
    grouping = group(g.build())
    assert sorted((bt.name, bt.count, bt.scanned) for bt in grouping.block_types) == \
        [("T/decoder[scan x6]", 6, True), ("T/encoder[scan x6]", 6, True)]


def test_layer_scan_inside_microbatch_loop():
    graph = model(["M/blocks"], loops=SCAN6, outer=(Loop(0, "scan", 4),))
    bt = only_type(group(graph))
    assert (bt.name, bt.count) == ("M/blocks[scan x6]", 6)


# 7. options -----------------------------------------------------------------------------------

def test_min_duplicate_and_tolerance_validation():
    graph = model(paths(3), backward=False)
    # above L the blocks are no type; their ln1/ln2 (2 per block, 6 in all) still are, up to 6
    assert [bt.name for bt in group(graph, min_duplicate=4).block_types] == ["M/block_*/ln*"]
    assert group(graph, min_duplicate=7).block_types == ()
    assert only_type(group(graph, min_duplicate=3)).count == 3
    for bad in (1, 0, 2.0, "2", None):
        with pytest.raises(autoshard.GroupingError, match="min_duplicate"):
            group(graph, min_duplicate=bad)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(autoshard.GroupingError, match="tolerance"):
            group(graph, tolerance=bad)
    assert issubclass(autoshard.GroupingError, autoshard.AutoshardError)
    assert issubclass(autoshard.GroupingError, ValueError)


# 8. determinism -------------------------------------------------------------------------------

def test_deterministic_summary_and_signature():
    graph = model(paths(3))
    first, second = group(graph).summary(), group(graph).summary()
    assert first == second
    assert group(model(paths(3))).summary() == first          # a fresh, identical graph
    sig = first["block_types"][0]["signature"]
    assert len(sig) == 12 and int(sig, 16) >= 0
    assert only_type(group(model(paths(5)))).signature == sig  # L does not enter it


def test_signature_independent_of_unrelated_ops():
    sig = only_type(group(model(paths(3)))).signature
    assert only_type(group(model(paths(3), embed_ops=2))).signature == sig


# 9. parameter shapes --------------------------------------------------------------------------

def test_parameter_shapes_split_types():
    wide = (D, 2 * 64)
    widths = {"M/dense_1": wide, "M/dense_3": wide}
    grouping = group(model(paths(4, "M/dense_"), widths=widths))
    assert [[i.path for i in bt.instances] for bt in grouping.block_types] == \
        [["M/dense_0", "M/dense_2"], ["M/dense_1", "M/dense_3"]]
    a, b = grouping.block_types
    assert a.signature != b.signature and a.params != b.params
    # one instance each: no dense type (only their identical ln1/ln2 sub-modules repeat)
    lone = group(model(paths(2, "M/dense_"), widths={"M/dense_1": wide}))
    assert [bt.name for bt in lone.block_types] == ["M/dense_*/ln*"]


# 10. scopes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scope, want", [
    ("transpose(jvp(GPT))/block_3/fc1", ("GPT/block_3/fc1", ("transpose", "jvp"))),
    ("jvp()", ("", ("jvp",))),
    ("", ("", ())),
    ("jvp(GPT)/block_0/attn/bqhd,bkhd->bhqk", ("GPT/block_0/attn", ("jvp",))),
    ("jvp(GPT)/rematted_computation/block_2/fc2", ("GPT/block_2/fc2", ("jvp",))),
    ("transpose(jvp(GPT))/jvp(GPT)/rematted_computation/block_1/ln1",
     ("GPT/block_1/ln1", ("transpose", "jvp", "jvp"))),
])
def test_parse_scope(scope, want):
    assert parse_scope(scope) == want


def test_join_modules():
    assert join_modules("M", "blocks/fc1") == "M/blocks/fc1"
    assert join_modules("GPT", "GPT/block_0") == "GPT/block_0"
    assert join_modules("GPT/block_1", "block_1/ln1") == "GPT/block_1/ln1"
    assert join_modules("", "a") == "a" and join_modules("a", "") == "a"


# 11. attribution without name scopes ----------------------------------------------------------

def test_attribution_from_parameters_nnx_like():
    L, fwd, bwd = 3, "jvp()", "transpose(jvp())"
    g = GraphBuilder()
    kernel = lambda i: (0, "blocks", i, "fc", "kernel")   # noqa: E731
    mu_parts = lambda i: (1, 0, ".mu", "blocks", i, "fc", "kernel")   # noqa: E731
    ws = [g.input((D, D), kernel(i)) for i in range(L)]
    mus = [g.input((D, D), mu_parts(i)) for i in range(L)]
    x, y = g.input((B, D), (2, 0)), g.input((B, D), (2, 1))
    hs, mm = [x], {}
    for i, w in enumerate(ws):
        z = g.op("dot_general", [hs[-1], w], [(B, D)], scope=fwd, params=MATMUL)
        mm[("fwd", i)] = len(g.ops) - 1
        hs.append(g.op("tanh", [z], scope=fwd))
    diff = g.op("sub", [hs[-1], y], scope=fwd)
    loss = g.op("reduce_sum", [g.op("mul", [diff, diff], scope=fwd)], [()], scope=fwd)
    loss_ops = list(range(len(g.ops) - 3, len(g.ops)))
    grad, dws = g.op("mul", [diff], scope=bwd), {}
    for i in reversed(range(L)):
        grad = g.op("mul", [grad, hs[i + 1]], scope=bwd)
        dws[i] = g.op("dot_general", [hs[i], grad], [(D, D)], scope=bwd)
        grad = g.op("dot_general", [grad, ws[i]], [(B, D)], scope=bwd)
        mm[("bwd", i)] = len(g.ops) - 1
    opt = {}
    for i in range(L):
        new_mu = g.op("add", [mus[i], dws[i]], scope="optimizer")
        new_w = g.op("sub", [ws[i], new_mu], scope="optimizer")
        opt[i] = (len(g.ops) - 2, len(g.ops) - 1)
        g.output(new_w, kernel(i))
        g.output(new_mu, mu_parts(i))
    g.output(loss, (2,))
    graph = g.build()

    infer_phases(graph)
    attribute_modules(graph)
    ops = graph.ops
    assert [op.phase for op in ops[:loss_ops[-1] + 1]] == ["forward"] * (loss_ops[-1] + 1)
    assert {op.phase for op in ops[loss_ops[-1] + 1:]} == {"backward", "optimizer"}
    assert [ops[i].phase for pair in opt.values() for i in pair] == ["optimizer"] * 2 * L
    for i in range(L):
        mod = f"blocks/{i}/fc"
        assert ops[mm["fwd", i]].module == ops[mm["bwd", i]].module == mod
        assert [ops[j].module for j in opt[i]] == [mod, mod]
        assert ops[graph.values[dws[i]].producer].module == mod   # the gradient only feeds W_i
        assert (graph.values[ws[i]].role, graph.values[ws[i]].module) == ("parameter", mod)
        assert (graph.values[mus[i]].role, graph.values[mus[i]].module) == ("state", mod)
    assert graph.values[x].role == graph.values[y].role == "data"
    assert [ops[i].module for i in loss_ops] == ["", "", ""]
    # nnx-style numbered paths group; the tanh applied to a block's matmul joins that block (not the
    # next block reading it), so every block holds matmul + tanh and all three group
    assert all(ops[graph.values[h].producer].module == f"blocks/{i}/fc" for i, h in enumerate(hs[1:]))
    bt = only_type(group(graph))
    assert (bt.name, [i.path for i in bt.instances]) == ("blocks/*", ["blocks/0", "blocks/1", "blocks/2"])


# 12. property: random block compositions -----------------------------------------------------

PRIMS = ["add", "mul", "tanh", "exp", "dot_general", "reduce_sum"]
SHAPES = [(4,), (4, 8), (8, 8)]
step = st.tuples(st.sampled_from(PRIMS), st.sampled_from(SHAPES),
                 st.sampled_from(["", "attn", "mlp", "mlp/out"]),
                 st.sampled_from(["forward", "forward", "backward", "optimizer"]))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(2, 12), body=st.lists(step, min_size=1, max_size=10),
       rest=st.lists(st.tuples(st.sampled_from(PRIMS), st.sampled_from(["", "M/head", "emb"])),
                     max_size=6))
def test_random_blocks_partition(L, body, rest):
    if all(phase != "forward" for *_, phase in body):
        body = [body[0][:3] + ("forward",)] + body[1:]
    g = GraphBuilder()
    x = g.input((4, 8), (2,), role="data")
    half = len(rest) // 2
    for prim, mod in rest[:half]:
        x = g.op(prim, [x], module=mod)
    for i in range(L):
        x = g.input((4, 8), (3, i), role="data")   # same input shapes in every instance
        for prim, shape, sub, phase in body:
            mod = f"M/block_{i}" + (f"/{sub}" if sub else "")
            x = g.op(prim, [x], [shape], module=mod, phase=phase)
    for prim, mod in rest[half:]:
        x = g.op(prim, [x], module=mod)
    graph = g.build()
    grouping = group(graph)
    bt = only_type(grouping)
    assert bt.count == L and bt.name == "M/block_*"
    assert sorted(i.path for i in bt.instances) == sorted(paths(L))
    assert_partition(graph, grouping)
    for inst in bt.instances:
        assert set(inst.ops) == ops_under(graph, inst.path)

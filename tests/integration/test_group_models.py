"""group() on traced zoo models: linen, nnx, nn.scan, remat, encoder-decoder, plain jax."""

from __future__ import annotations

from collections import Counter

import pytest

import autoshard
import models

from ._toy_models import plain_mlp_step_and_args, t5_step_and_args


def _group(name: str, **overrides):
    m = models.get(name, "debug", **overrides)
    graph = autoshard.trace(m.train_step, *m.abstract_state())
    return graph, autoshard.group(graph)


@pytest.mark.parametrize("layers", [2, 5])
def test_linen_gpt_one_block_type_with_L_instances(layers):
    graph, grouping = _group("gpt", num_layers=layers)
    assert len(grouping.block_types) == 1
    bt = grouping.block_types[0]
    assert bt.name == "GPT/block_*" and bt.depth == 2
    assert [inst.path for inst in bt.instances] == [f"GPT/block_{i}" for i in range(layers)]
    # embedding, head, loss and the shared optimizer scalars stay in the remainder
    rem_modules = {graph.ops[i].module for i in grouping.remainder}
    assert {"GPT/wte", "GPT/wpe", "GPT/ln_f", ""} <= rem_modules
    assert not any("block_" in m for m in rem_modules)


@pytest.mark.parametrize("layers", [2, 4])
def test_nnx_gpt_groups_like_linen(layers):
    graph, grouping = _group("gpt_nnx", num_layers=layers)
    assert not any(op.scope_module for op in graph.ops if op.phase == "forward"), \
        "the nnx program should carry no module names (attribution is what is tested)"
    assert len(grouping.block_types) == 1
    bt = grouping.block_types[0]
    assert bt.count == layers and bt.name == "blocks/*"
    _, linen = _group("gpt", num_layers=layers)
    ref = linen.block_types[0]
    # same forward composition per block as the name-scoped linen program; block 0 also takes
    # the embedding sum (its first consumer is block 0's layer norm), a tolerated boundary effect
    later = [sum(graph.ops[i].phase == "forward" for i in inst.ops) for inst in bt.instances[1:]]
    assert later == [ref.ops_per_phase["forward"]] * (layers - 1)
    assert bt.instances[0].missing_forward_ops + bt.instances[0].extra_forward_ops <= 3
    assert len(bt.params) == len(ref.params)


def test_scan_gpt_one_block_type_with_trip_count_instances():
    _, grouping = _group("gpt", num_layers=6, scan_layers=True)
    assert len(grouping.block_types) == 1
    bt = grouping.block_types[0]
    assert bt.scanned and bt.count == 6
    assert [inst.iteration for inst in bt.instances] == list(range(6))
    assert len({inst.ops for inst in bt.instances}) == 1   # one body, shared
    # stacked parameters: leading layer axis
    assert all(shape[0] == 6 for _, shape, _ in bt.params)


def test_remat_gpt_keeps_recomputation_in_the_block():
    graph, grouping = _group("gpt", num_layers=3, remat=True)
    assert [bt.count for bt in grouping.block_types] == [3]
    bt = grouping.block_types[0]
    # recomputed forward ops run in the backward pass and belong to the block
    assert bt.ops_per_phase["backward"] > bt.ops_per_phase["forward"]
    assert not any("GPT/GPT" in op.module for op in graph.ops)


def test_instances_own_forward_backward_and_optimizer_ops():
    graph, grouping = _group("gpt", num_layers=3)
    bt = grouping.block_types[0]
    for inst in bt.instances:
        phases = Counter(graph.ops[i].phase for i in inst.ops)
        assert phases["forward"] and phases["backward"] and phases["optimizer"]
        assert all(graph.ops[i].module.startswith(inst.path + "/") or graph.ops[i].module == inst.path
                   for i in inst.ops)
    # every op is in exactly one instance or in the remainder
    seen = [i for inst in bt.instances for i in inst.ops] + list(grouping.remainder)
    assert sorted(seen) == list(range(len(graph.ops)))
    assert grouping.block_of(bt.instances[2].ops[0]) == (0, 2)
    assert grouping.block_of(grouping.remainder[0]) is None


def test_encoder_decoder_two_block_types():
    step, args = t5_step_and_args(layers=3)
    grouping = autoshard.group(autoshard.trace(step, *args))
    names = sorted(bt.name for bt in grouping.block_types)
    assert names == ["TinyT5/decoder_block_*", "TinyT5/encoder_block_*"]
    assert all(bt.count == 3 for bt in grouping.block_types)


def test_plain_jax_program_groups_by_parameter_keypaths():
    step, args = plain_mlp_step_and_args(layers=5)
    graph = autoshard.trace(step, *args)
    grouping = autoshard.group(graph)
    assert [(bt.name, bt.count) for bt in grouping.block_types] == [("layers/*", 5)]
    # the hand-written SGD update is recognised as the optimizer phase by data flow
    upd = graph.find(module="layers/2", phase="optimizer")
    assert upd and all(op.primitive in ("mul", "sub") for op in upd)


def test_bert_and_mlp_group():
    _, bert = _group("bert", num_layers=3)
    assert [(bt.name, bt.count) for bt in bert.block_types] == [("BERT/layer_*", 3)]
    # Alpa MLP: relu is applied by the parent module, so all L dense layers match (last included)
    _, mlp = _group("mlp")
    layers = models.get("mlp", "debug").config.num_layers
    assert [(bt.name, bt.count) for bt in mlp.block_types] == [("MLP/dense_*", layers)]


def test_min_duplicate_and_depth_report():
    _, grouping = _group("gpt", num_layers=3)
    levels = {(c.depth, c.name): c for c in grouping.levels}
    assert levels[(2, "GPT/block_*")].selected and levels[(2, "GPT/block_*")].count == 3
    assert not levels[(3, "GPT/block_*/fc1")].selected
    m = models.get("gpt", "debug", num_layers=3)
    graph = autoshard.trace(m.train_step, *m.abstract_state())
    # TAP's minDuplicate: 3 blocks are too few, the 6 layer norms inside them are enough
    four = autoshard.group(graph, min_duplicate=4)
    assert [(bt.name, bt.count) for bt in four.block_types] == [("GPT/block_*/ln*", 6)]
    assert autoshard.group(graph, min_duplicate=7).block_types == ()
    table = grouping.table()
    assert "GPT/block_*" in table and "(remainder)" in table
    with pytest.raises(autoshard.GroupingError, match="min_duplicate"):
        autoshard.group(graph, min_duplicate=1)

"""BBGraP's graph optimiser (§3.3, Fig. 5-6): which transfers remain, per layer and per node pair.
Pure: plain data, no jax."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autoshard import ConfigError, PlanError
from autoshard._src.core.layers import Layer
from autoshard._src.core.shapemap import ShapeMap, Split, Window, union_size
from autoshard._src.core.transfers import Case, analyse_transfers, classify


def conv(name, src, in_shape, features, kernel=(3, 3), strides=None, padding=((1, 1), (1, 1)), dilation=None):
    window = Window(kernel, strides, padding, dilation)
    return Layer(name, "conv", (src,), (in_shape,), (in_shape[0], *window.output_spatial(in_shape[1:-1]), features),
                 window=window)


def same(shape, name, kind, *inputs, **kw):
    return Layer(name, kind, inputs, (shape,) * len(inputs), shape, **kw)


def toy_network():
    """Our reading of Fig. 6(a), whose sizes the text does not give: two convolutions over an 8x8 image
    on three nodes, split in width as §3.2's example (3, 3, 2 columns). conv1 is a 3x3 'SAME' conv;
    conv2 a 3x3 stride-2 conv padded (2, 1), whose parts (2, 2, 1 columns) make the outer nodes read
    exactly their own conv1 output and the middle node one column more on each side (§4.1: transfers
    removed for nodes 1 and 3, kept for node 2)."""
    x = Layer("x", "input", output_shape=(1, 8, 8, 3))
    conv1 = conv("conv1", "x", (1, 8, 8, 3), 4)
    conv2 = conv("conv2", "conv1", (1, 8, 8, 4), 4, strides=(2, 2), padding=((2, 1), (2, 1)))
    return [x, conv1, conv2], {name: Split("W", 3) for name in ("x", "conv1", "conv2")}


def cols(start, stop, channels=4):
    return ShapeMap.box((0, 1), (0, 8), (start, stop), (0, channels))


# ---- Fig. 6: the toy network -------------------------------------------------------------------------------

def test_fig6_toy_network_keeps_exactly_the_halo_transfers_per_node():
    layers, splits = toy_network()
    analysis = analyse_transfers(layers, splits)
    conv1 = analysis.layer("conv1")
    assert conv1.outputs == (cols(0, 3), cols(3, 6), cols(6, 8))
    assert analysis.layer("conv2").outputs[2].extents == (1, 5, 1, 4)
    (edge,) = analysis.inputs_of("conv2")
    assert edge.required == (cols(0, 3), cols(2, 7), cols(6, 8))
    assert edge.cases == (Case.LOCAL, Case.HALO, Case.LOCAL)
    # nodes 0 and 2 (the paper's 1 and 3) receive nothing; node 1 one column from each neighbour
    kept = {(p.src, p.dst): p for p in conv1.kept}
    assert set(kept) == {(0, 1), (2, 1)}
    assert kept[0, 1].regions == (cols(2, 3),) and kept[2, 1].regions == (cols(6, 7),)
    assert kept[0, 1].elements == kept[2, 1].elements == 8 * 4 and kept[0, 1].nbytes == 8 * 4 * 4
    assert kept[0, 1].removed_nbytes == (3 - 1) * 8 * 4 * 4          # cropped from node 0's 3 columns
    assert {(p.src, p.dst) for p in conv1.removed} == {(1, 0), (2, 0), (0, 2), (1, 2)}
    assert conv1.nbytes == 2 * 128 and conv1.initial_nbytes == 2 * (3 + 3 + 2) * 8 * 4 * 4
    # the first convolution reads halos of the input: one column from each neighbour, none further away
    (first,) = analysis.inputs_of("conv1")
    assert first.cases == (Case.HALO,) * 3
    assert {(p.src, p.dst): p.regions for p in analysis.layer("x").kept} == {
        (1, 0): (cols(3, 4, 3),), (0, 1): (cols(2, 3, 3),), (2, 1): (cols(6, 7, 3),), (1, 2): (cols(5, 6, 3),)}
    assert analysis.layer("conv2").pairs == ()                       # the output: nothing to send on


def test_every_transfer_whose_required_input_is_the_local_output_is_removed():
    layers, splits = toy_network()
    analysis = analyse_transfers(layers, splits)
    for lt in analysis.layers:
        for edge in lt.edges:
            for dst, case in enumerate(edge.cases):
                received = [p for p in lt.kept if p.dst == dst]
                assert (case in (Case.LOCAL, Case.CROP, Case.NOTHING)) == (not received), (lt.layer, dst, case)
                assert all(abs(p.src - dst) == 1 for p in received)    # halos come from neighbours only
    assert analysis.pair_nbytes() == {(0, 1): 8 * 3 * 4 + 128, (1, 0): 8 * 3 * 4, (2, 1): 8 * 3 * 4 + 128,
                                      (1, 2): 8 * 3 * 4}
    assert "conv1" in analysis.summary() and "local,halo,local" in analysis.summary()


# ---- the other Fig. 5 cases -----------------------------------------------------------------------------

BATCH = (3, 8, 8, 4)


def test_batch_split_sends_nothing():
    layers = [Layer("x", "input", output_shape=BATCH), conv("c", "x", BATCH, 4),
              same(BATCH, "bn", "batchnorm", "c"), same(BATCH, "add", "add", "bn", "x"),
              Layer("p", "pool", ("add",), (BATCH,), (3, 4, 4, 4), window=Window((2, 2), (2, 2)))]
    analysis = analyse_transfers(layers, {layer.name: Split("N", 3) for layer in layers})
    assert analysis.nbytes == 0 and analysis.initial_nbytes > 0
    assert all(set(e.cases) == {Case.LOCAL} for lt in analysis.layers for e in lt.edges)
    assert all(len(lt.removed) == 6 for lt in analysis.layers if lt.edges)


def test_crop_when_the_next_layer_reads_less_than_the_local_output():
    x = Layer("x", "input", output_shape=(1, 8, 4, 1))
    crop = conv("c", "x", (1, 8, 4, 1), 1, kernel=(1, 1), strides=(2, 1), padding=((0, 0), (0, 0)))
    analysis = analyse_transfers([x, crop], {"x": Split("H", 2), "c": Split("H", 2)})
    # x rows 0:4 | 4:8; c's rows 0:2 | 2:4 read rows 0, 2 | 4, 6: inside each node's own part
    assert analysis.inputs_of("c")[0].cases == (Case.CROP, Case.CROP)
    assert analysis.nbytes == 0


def test_channel_split_needs_full_synchronisation():
    layers = [Layer("x", "input", output_shape=(1, 8, 8, 6)), conv("c1", "x", (1, 8, 8, 6), 6),
              conv("c2", "c1", (1, 8, 8, 6), 6)]
    analysis = analyse_transfers(layers, {"x": Split(None, 3), "c1": Split("C", 3), "c2": Split("C", 3)})
    assert analysis.inputs_of("c1")[0].cases == (Case.LOCAL,) * 3          # a replicated input is local
    assert analysis.layer("x").pairs[0].initial_elements == 0 and analysis.layer("x").nbytes == 0
    assert analysis.inputs_of("c2")[0].cases == (Case.GATHER,) * 3         # the paper's Fig. 7 limit
    c1 = analysis.layer("c1")
    assert len(c1.kept) == 6 and c1.nbytes == c1.initial_nbytes == 6 * 8 * 8 * 2 * 4


def test_direction_change_crops_and_fetches():
    layers = [Layer("x", "input", output_shape=BATCH), same(BATCH, "relu", "elementwise", "x")]
    analysis = analyse_transfers(layers, {"x": Split("H", 3), "relu": Split("N", 3)})
    assert analysis.inputs_of("relu")[0].cases == (Case.CROP_FETCH,) * 3
    pair = analysis.layer("x").pair(0, 1)                 # node 1 needs batch row 1 of node 0's rows 0:3
    assert pair.regions == (ShapeMap.box((1, 2), (0, 3), (0, 8), (0, 4)),) and pair.elements == 3 * 8 * 4


def test_reduction_over_the_split_dim_and_a_replicated_dense_head():
    layers = [Layer("x", "input", output_shape=BATCH), conv("c", "x", BATCH, 4),
              Layer("g", "global_pool", ("c",), (BATCH,), (3, 4)), Layer("d", "dense", ("g",), ((3, 4),), (3, 10))]
    splits = {"x": Split("H", 2), "c": Split("H", 2), "g": Split("C", 2), "d": Split(None, 2)}
    analysis = analyse_transfers(layers, splits)
    assert analysis.inputs_of("g")[0].cases == (Case.CROP_FETCH,) * 2      # its channels, every row
    assert analysis.inputs_of("d")[0].cases == (Case.GATHER,) * 2          # every feature on every node
    assert analysis.layer("c").pair(1, 0).regions == (ShapeMap.box((0, 3), (4, 8), (0, 8), (0, 2)),)


def test_concat_operands_outside_a_node_part_are_not_read():
    a, b = (1, 4, 4, 2), (1, 4, 4, 4)
    layers = [Layer("a", "input", output_shape=a), Layer("b", "input", output_shape=b),
              Layer("k", "concat", ("a", "b"), (a, b), (1, 4, 4, 6), axis=3)]
    analysis = analyse_transfers(layers, {"a": Split(None, 3), "b": Split("C", 3), "k": Split("C", 3)})
    first, second = analysis.inputs_of("k")        # k channels 0:2 | 2:4 | 4:6 = a | b 0:2 | b 2:4
    assert first.cases == (Case.LOCAL, Case.NOTHING, Case.NOTHING)
    assert second.cases == (Case.NOTHING, Case.CROP_FETCH, Case.HALO)    # b's parts: 0:2 | 2:3 | 3:4
    assert {(p.src, p.dst) for p in analysis.layer("b").kept} == {(0, 1), (1, 2)}


def test_a_layer_read_twice_sends_the_union_once():
    x = Layer("x", "input", output_shape=(1, 9, 4, 2))
    layers = [x, conv("c3", "x", (1, 9, 4, 2), 2), conv("c5", "x", (1, 9, 4, 2), 2, kernel=(5, 5),
                                                          padding=((2, 2), (2, 2))), same((1, 9, 4, 2), "add", "add",
                                                                                          "c3", "c5")]
    analysis = analyse_transfers(layers, {layer.name: Split("H", 3) for layer in layers})
    pair = analysis.layer("x").pair(0, 1)          # node 1 (rows 3:6) reads row 2 for c3, rows 1:3 for c5
    assert pair.regions == (ShapeMap.box((0, 1), (2, 3), (0, 4), (0, 2)), ShapeMap.box((0, 1), (1, 3), (0, 4), (0, 2)))
    assert pair.elements == 2 * 4 * 2 == union_size(pair.regions)


def test_heterogeneous_nodes_get_proportional_parts_and_their_halos():
    layers, _ = toy_network()
    splits = {name: Split("W", 3, weights=(2, 1, 1)) for name in ("x", "conv1", "conv2")}
    analysis = analyse_transfers(layers, splits)
    assert [o.extents[2] for o in analysis.layer("conv1").outputs] == [4, 2, 2]
    assert [o.extents[2] for o in analysis.layer("conv2").outputs] == [3, 1, 1]    # 5 * 2/4 = 2.5 -> 3
    # conv2 node 0 (cols 0:3) reads conv1 cols 0:5; node 1 (col 3) cols 4:7; node 2 (col 4) cols 6:8
    assert analysis.inputs_of("conv2")[0].required == (cols(0, 5), cols(4, 7), cols(6, 8))
    assert analysis.inputs_of("conv2")[0].cases == (Case.HALO, Case.HALO, Case.LOCAL)
    assert {(p.src, p.dst): p.regions for p in analysis.layer("conv1").kept} == {(1, 0): (cols(4, 5),),
                                                                                  (2, 1): (cols(6, 7),)}


def test_classify_matches_fig5():
    full = ShapeMap.box((0, 10))
    part = ShapeMap.box((3, 6))
    assert classify(ShapeMap.box((3, 6)), part, full) == Case.LOCAL
    assert classify(ShapeMap.box((4, 5)), part, full) == Case.CROP
    assert classify(ShapeMap.box((2, 7)), part, full) == Case.HALO
    assert classify(ShapeMap.box((4, 8)), part, full) == Case.CROP_FETCH
    assert classify(full, part, full) == Case.GATHER
    assert classify(ShapeMap.empty(1), part, full) == Case.NOTHING


@settings(max_examples=40, deadline=None)
@given(width=st.integers(3, 16), depth=st.integers(1, 3), nodes=st.integers(1, 4), data=st.data())
def test_received_plus_local_is_exactly_what_each_node_reads(width, depth, nodes, data):
    layers, shape = [Layer("l0", "input", output_shape=(1, 4, width, 2))], (1, 4, width, 2)
    for i in range(1, depth + 1):
        k = data.draw(st.integers(1, 3))
        s = data.draw(st.integers(1, 2))
        layers.append(conv(f"l{i}", f"l{i - 1}", shape, 2, kernel=(1, k), strides=(1, s),
                           padding=((0, 0), (k // 2, k // 2))))
        shape = layers[-1].output_shape
    assume(nodes <= shape[2])
    splits = {layer.name: Split(data.draw(st.sampled_from(["W", "H", "C", None])), nodes) for layer in layers}
    assume(all(s.direction is None or nodes <= layer.output_shape["NHWC".index(s.direction)]
               for layer, s in zip(layers, splits.values(), strict=True)))
    analysis = analyse_transfers(layers, splits)
    for lt in analysis.layers:
        for edge in lt.edges:
            for dst in range(nodes):
                local = edge.required[dst].intersect(lt.outputs[dst]).num_elements
                fetched = sum(r.num_elements for r in edge.fetched[dst])
                own_covers = edge.required[dst].issubset(lt.outputs[dst])
                assert (fetched == 0) if own_covers else (local + fetched == edge.required[dst].num_elements)
        assert all(p.elements <= p.initial_elements for p in lt.pairs)


# ---- typed errors ----------------------------------------------------------------------------------------

def test_invalid_graphs_and_splits_raise_typed_errors():
    layers, splits = toy_network()
    with pytest.raises(ConfigError, match="not an earlier layer"):
        analyse_transfers(layers[1:], splits)
    with pytest.raises(ConfigError, match="unique name"):
        analyse_transfers(layers + layers[-1:], splits)
    with pytest.raises(ConfigError, match=r"outputs \(1, 8, 8, 3\)"):
        analyse_transfers([Layer("x", "input", output_shape=(1, 8, 8, 3)), conv("c", "x", (1, 8, 8, 4), 4)],
                          {"x": Split("W", 2), "c": Split("W", 2)})
    with pytest.raises(PlanError, match=r"no split for layers \['conv2'\]"):
        analyse_transfers(layers, {k: v for k, v in splits.items() if k != "conv2"})
    with pytest.raises(PlanError, match="different node counts"):
        analyse_transfers(layers, {**splits, "conv2": Split("W", 2)})
    with pytest.raises(PlanError, match="layer 'conv2' output .* at most 5 nodes"):
        analyse_transfers(layers, {k: Split("W", 6) for k in splits})
    with pytest.raises(PlanError, match="no transfer 1 -> 1"):
        analyse_transfers(layers, splits).layer("conv1").pair(1, 1)

"""The inference partitioner (BBGraP §3, mixed directions, heterogeneous nodes): cost model and DP on
synthetic layer graphs. Pure: plain data, no jax."""

from __future__ import annotations

import itertools

import pytest

from autoshard import ConfigError, PlanError, get_hardware
from autoshard._src.core.layers import Layer
from autoshard._src.core.shapemap import Window
from autoshard._src.inference.partition import CostModel, describe, flops_per_element, partition

# the paper's setting (§4.2): desktop CPU nodes joined by gigabit Ethernet
CPU_ETH = get_hardware({"base": "cpu-sim", "flops": {"float32": 500e9}, "inter_node_bandwidth": 125e6,
                        "inter_node_latency": 50e-6})
SAME3 = Window((3, 3), padding=((1, 1), (1, 1)))


def conv(name, src, in_shape, features, window=SAME3):
    out = (in_shape[0], *window.output_spatial(in_shape[1:-1]), features)
    return Layer(name, "conv", (src,), (in_shape,), out, window=window)


def toy_cnn(batch=1, size=16, channels=8, classes=10):
    """conv 3x3 SAME x3, global average pool, dense head."""
    shape = (batch, size, size, channels)
    image = (batch, size, size, 3)
    return [Layer("x", "input", output_shape=image), conv("c1", "x", image, channels),
            conv("c2", "c1", shape, channels), conv("c3", "c2", shape, channels),
            Layer("pool", "global_pool", ("c3",), (shape,), (batch, channels)),
            Layer("head", "dense", ("pool",), ((batch, channels),), (batch, classes))]


def resnet_block(batch=1, size=16, channels=8):
    """A bottleneck-free ResNet block with a 1x1 projection shortcut and a residual add."""
    shape = (batch, size, size, channels)
    one = Window((1, 1))
    return [Layer("x", "input", output_shape=(batch, size, size, 4)), conv("c1", "x", (batch, size, size, 4), channels),
            Layer("bn1", "batchnorm", ("c1",), (shape,), shape), conv("c2", "bn1", shape, channels),
            conv("proj", "x", (batch, size, size, 4), channels, one),
            Layer("add", "add", ("c2", "proj"), (shape, shape), shape),
            Layer("pool", "global_pool", ("add",), (shape,), (batch, channels))]


def brute_force(model):
    names = list(model.by_name)
    return min(model.plan_latency(dict(zip(names, combo, strict=True)))
               for combo in itertools.product(*(model.options(n) for n in names)))


def segmentations(model, start=0):
    """Every way to cut layers[start:] into single layers and fusable runs."""
    if start == len(model.layers):
        yield ()
        return
    for run in ((model.layers[start].name,), *model.fusable_runs(start)):
        for rest in segmentations(model, start + len(run)):
            yield (run, *rest)


def brute_force_fused(model):
    best = float("inf")
    for steps in segmentations(model):
        choices = [model.options(run[0]) if len(run) == 1 else ("H", "W") for run in steps]
        for combo in itertools.product(*choices):
            directions = {n: d for run, d in zip(steps, combo, strict=True) for n in run}
            best = min(best, model.plan_latency(directions, [run for run in steps if len(run) > 1]))
    return best


# ---- the cost model -------------------------------------------------------------------------------------

def test_flops_per_output_element():
    layers = {layer.name: layer for layer in toy_cnn(channels=8, classes=10)}
    assert flops_per_element(layers["c1"]) == 2 * 9 * 3
    assert flops_per_element(layers["c2"]) == 2 * 9 * 8
    assert flops_per_element(layers["pool"]) == 16 * 16
    assert flops_per_element(layers["head"]) == 2 * 8
    assert flops_per_element(layers["x"]) == 0


def test_options_follow_the_tensor():
    model = CostModel(toy_cnn(batch=1), CPU_ETH, 2)
    assert model.options("c1") == ("C", "H", "W", None)          # batch 1 cannot split over 2 nodes
    assert model.options("head") == ("C", None)                  # a dense output: N or C only
    assert CostModel(toy_cnn(batch=4), CPU_ETH, 2).options("head") == ("N", "C", None)


def test_removed_transfers_cost_nothing_and_kept_ones_are_serial_per_node():
    """Fig. 6: two convs split in width over 3 nodes; only the middle node receives (two 1-column halos)."""
    window2 = Window((3, 3), (2, 2), ((2, 1), (2, 1)))
    layers = [Layer("x", "input", output_shape=(1, 8, 8, 3)), conv("conv1", "x", (1, 8, 8, 3), 4),
              conv("conv2", "conv1", (1, 8, 8, 4), 4, window2)]
    model = CostModel(layers, CPU_ETH, 3)
    plan = describe(model, {"x": "W", "conv1": "W", "conv2": "W"})
    conv2 = plan.layer("conv2")
    halo = 8 * 4 * 4                                              # one column of 8 rows x 4 channels, float32
    assert conv2.received_nbytes == (0, 2 * halo, 0)
    assert conv2.receive[0] == conv2.receive[2] == 0
    assert conv2.receive[1] == pytest.approx(2 * (model.alpha + model.beta * halo))
    assert conv2.latency == pytest.approx(max(r + c for r, c in zip(conv2.receive, conv2.compute, strict=True)))
    conv1 = plan.layer("conv1")
    assert conv1.extents == ((1, 8, 3, 4), (1, 8, 3, 4), (1, 8, 2, 4))
    assert conv1.kept_nbytes == 2 * halo and conv1.removed_nbytes == 2 * 8 * 8 * 4 * 4 - 2 * halo
    assert plan.latency == pytest.approx(sum(lp.latency for lp in plan.layers))


# ---- the DP ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [toy_cnn, resnet_block])
@pytest.mark.parametrize(("batch", "size", "nodes", "speeds"),
                         [(1, 16, 2, None), (4, 8, 2, None), (2, 12, 3, (1, 2, 1))])
def test_dp_equals_brute_force(build, batch, size, nodes, speeds):
    layers = build(batch=batch, size=size)
    plan = partition(layers, CPU_ETH, nodes, speeds, max_fuse=1)
    model = CostModel(layers, CPU_ETH, nodes, speeds)
    assert plan.exact
    assert plan.latency == pytest.approx(brute_force(model), rel=1e-12)
    assert plan.latency == pytest.approx(model.plan_latency(plan.directions), rel=1e-12)


@pytest.mark.parametrize("build", [toy_cnn, resnet_block])
@pytest.mark.parametrize(("batch", "size", "nodes"), [(1, 32, 2), (8, 8, 2), (10, 16, 3), (1, 24, 4)])
def test_dp_is_never_worse_than_a_single_direction_plan(build, batch, size, nodes):
    plan = partition(build(batch=batch, size=size), CPU_ETH, nodes)
    assert set(plan.baselines) == {"N", "C", "H", "W", "replicated"}
    assert all(plan.latency <= base * (1 + 1e-12) for base in plan.baselines.values()), plan.summary()


def test_large_batch_small_images_split_the_batch():
    """N needs no transfer at all (every layer reads its own samples) and divides compute evenly."""
    plan = partition(toy_cnn(batch=64, size=8), CPU_ETH, 4)
    assert all(plan.layer(n).direction == "N" for n in ("c1", "c2", "c3", "pool")), plan.summary()
    assert plan.latency == pytest.approx(plan.baselines["N"])


def test_batch_one_big_images_split_space():
    """At batch 1, a channel split gathers every activation before each conv (the paper's Fig. 7 limit);
    a spatial split exchanges only one-row halos, cheaper than the compute it divides (a fully
    convolutional net: its output stays split)."""
    layers = toy_cnn(batch=1, size=128, channels=64)[:4]
    plan = partition(layers, CPU_ETH, 3)
    assert all(plan.layer(n).direction in ("H", "W") for n in ("c2", "c3")), plan.summary()
    assert "C" not in plan.directions.values()
    assert plan.latency < 0.1 * plan.baselines["C"]
    assert plan.latency < 0.5 * plan.baselines["replicated"]


def test_global_pool_gathers_a_spatial_split():
    """A global pool reads its spatial axes whole (core.shapemap's reduce rule: no partial sums yet), so
    behind a small network the DP keeps its input unsplit in space rather than gather it."""
    plan = partition(toy_cnn(batch=1, size=96, channels=16), CPU_ETH, 3)
    assert plan.layer("c3").direction not in ("H", "W")
    assert plan.latency < min(plan.baselines["H"], plan.baselines["W"])


def test_residual_block_splits_both_branches_alike():
    """The DP may replicate a cheap producer so that the next split reads it locally (no halo); the add
    then reads both branches split alike and receives nothing."""
    plan = partition(resnet_block(batch=1, size=32, channels=16), CPU_ETH, 2)
    assert plan.layer("c2").direction == plan.layer("proj").direction == plan.layer("add").direction
    assert plan.layer("add").received_nbytes == (0, 0)
    assert plan.latency < min(plan.baselines.values()), plan.summary()


def test_heterogeneous_nodes_get_proportional_parts_and_finish_sooner():
    layers = toy_cnn(batch=30, size=8)
    plan = partition(layers, CPU_ETH, 2, speeds=(2, 1))
    assert plan.layer("c2").direction == "N"
    assert plan.layer("c2").extents == ((20, 8, 8, 8), (10, 8, 8, 8))
    c2 = plan.layer("c2")
    assert c2.compute[0] == pytest.approx(c2.compute[1])          # twice the work at twice the speed
    even = CostModel(layers, CPU_ETH, 2, speeds=(2, 1), uneven=False)
    assert plan.latency < even.plan_latency(plan.directions)
    assert plan.latency < partition(layers, CPU_ETH, 2).latency   # the faster node helps


def test_a_beam_cut_is_never_worse_than_the_baselines():
    plan = partition(resnet_block(batch=2, size=8), CPU_ETH, 2, max_states=1)
    assert not plan.exact
    assert all(plan.latency <= base * (1 + 1e-12) for base in plan.baselines.values())
    assert "predicted latency" in plan.summary()


def test_ties_break_deterministically():
    first = partition(toy_cnn(batch=8, size=8), CPU_ETH, 2).directions
    assert all(partition(toy_cnn(batch=8, size=8), CPU_ETH, 2).directions == first for _ in range(3))


# ---- fused layers ------------------------------------------------------------------------------------------

SLOW_LINK = get_hardware({"base": "cpu-sim", "flops": {"float32": 500e9}, "inter_node_bandwidth": 125e6,
                          "inter_node_latency": 2e-3})


def conv_stack(depth=4, size=64, channels=16):
    shape = (1, size, size, channels)
    layers = [Layer("x", "input", output_shape=shape)]
    for i in range(depth):
        layers.append(conv(f"c{i}", layers[-1].name, shape, channels))
    return layers


@pytest.mark.parametrize(("hardware", "nodes"), [(CPU_ETH, 2), (SLOW_LINK, 3)])
def test_dp_with_fusion_equals_brute_force(hardware, nodes):
    layers = conv_stack(depth=3, size=16, channels=8)
    plan = partition(layers, hardware, nodes, max_fuse=3)
    model = CostModel(layers, hardware, nodes, max_fuse=3)
    assert plan.latency == pytest.approx(brute_force_fused(model), rel=1e-12)
    assert plan.latency == pytest.approx(model.plan_latency(plan.directions, plan.fused), rel=1e-12)


def test_fusion_pays_on_a_slow_link_and_grows_the_halo():
    """Per-message latency dominates: one exchange of a grown halo beats one halo per conv."""
    layers = conv_stack(depth=4)
    plan = partition(layers, SLOW_LINK, 2)
    assert plan.fused == (("c0", "c1", "c2", "c3"),), plan.summary()
    assert plan.latency < partition(layers, SLOW_LINK, 2, max_fuse=1).latency
    head, last = plan.layer("c0"), plan.layer("c3")
    axis = {"H": 1, "W": 2}[head.direction]
    assert [e[axis] for e in last.extents] == [32, 32]
    assert [e[axis] for e in head.extents] == [35, 35]             # 3 more rows/columns: one per later conv
    run = plan.fused[0]
    costs = CostModel(layers, SLOW_LINK, 2).run_cost(run, "H", {"x": "H"})
    assert costs[0].received_nbytes == (4 * 64 * 16 * 4,) * 2     # an H-split input: its 4-deep halo, once
    assert all(c.received_nbytes == (0, 0) for c in costs[1:])
    assert all(plan.layer(n).received_nbytes == (0, 0) for n in ("c1", "c2", "c3"))
    assert sum(lp.latency for lp in plan.layers) == pytest.approx(plan.latency)
    assert "fused from c0" in plan.summary()


def test_bad_fused_runs_are_plan_errors():
    model = CostModel(toy_cnn(), CPU_ETH, 2)
    directions = {"x": None, "c1": "H", "c2": "H", "c3": "H", "pool": None, "head": None}
    with pytest.raises(PlanError, match="cannot be fused"):
        model.plan_latency({**directions, "pool": "H"}, [("c3", "pool")])
    with pytest.raises(PlanError, match="overlap"):
        model.plan_latency(directions, [("c1", "c2"), ("c2", "c3")])
    with pytest.raises(PlanError, match="several directions"):
        model.plan_latency({**directions, "c2": "W"}, [("c1", "c2")])


# ---- bad input ------------------------------------------------------------------------------------------

def test_bad_input_raises_typed_errors():
    layers = toy_cnn()
    with pytest.raises(ConfigError, match="num_nodes"):
        partition(layers, CPU_ETH, 0)
    with pytest.raises(ConfigError, match="HardwareSpec"):
        partition(layers, "cpu-sim", 2)
    with pytest.raises(PlanError, match="weights"):
        partition(layers, CPU_ETH, 2, speeds=(1, 1, 1))
    with pytest.raises(PlanError, match="weights"):
        partition(layers, CPU_ETH, 2, speeds=("fast", 1))
    with pytest.raises(ConfigError, match="max_fuse"):
        partition(layers, CPU_ETH, 2, max_fuse=0)
    with pytest.raises(PlanError, match="no layers"):
        partition([], CPU_ETH, 2)
    with pytest.raises(PlanError, match="no direction"):
        CostModel(layers, CPU_ETH, 2).plan_latency({"x": None})
    with pytest.raises(PlanError, match="layer 'c1' .* cannot be split 'N'"):
        CostModel(layers, CPU_ETH, 2).plan_latency({n: "N" if n == "c1" else None for n in ("x", "c1", "c2", "c3",
                                                                                            "pool", "head")})
    with pytest.raises(ConfigError, match="not an earlier layer"):
        partition(layers[1:], CPU_ETH, 2)


def test_heterogeneous_nodes_take_even_parts_when_those_predict_faster():
    """With speeds (2, 1, 1, 1) the DP prices proportional and even parts and keeps the faster; the
    result says which, and is never slower than either search alone."""
    layers = [Layer("in", "input", output_shape=(1, 7, 7, 64)),
              Layer("c", "conv", ("in",), ((1, 7, 7, 64),), (1, 7, 7, 64), Window((3, 3), padding=((1, 1), (1, 1))))]
    hw = get_hardware("cpu-sim")
    speeds = (2, 1, 1, 1)
    both = partition(layers, hw, 4, speeds=speeds)
    proportional = describe(*_dp(CostModel(layers, hw, 4, speeds)))
    even = describe(*_dp(CostModel(layers, hw, 4, speeds, uneven=False)))
    assert both.latency == min(proportional.latency, even.latency)
    assert both.proportional == (proportional.latency <= even.latency)
    assert both.weights == (both.speeds if both.proportional else None)


def _dp(model):
    from autoshard._src.inference.partition import _search
    steps, _ = _search(model)
    return model, {n: d for run, d in steps for n in run}, None, True, tuple(r for r, _ in steps if len(r) > 1)

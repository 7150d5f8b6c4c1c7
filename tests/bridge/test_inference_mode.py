"""Inference mode end to end: `autoshard.autoshard(mode="inference", mesh={"x": n})(apply_fn)` equals
`apply_fn` on the BBGraP toy network (Fig. 6) and ResNet (debug width) under every split direction,
the DP's mixed plan, fused runs, uneven splits over 3 nodes and heterogeneous nodes; the compiled
exchanges deliver exactly the halo bytes the plan predicts; bad input gets typed errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
import models
from autoshard import ConfigError, MeshError, PlanError
from autoshard._src.bridge.inference.api import audit_inference
from autoshard._src.inference.plan import InferencePlan

pytestmark = pytest.mark.slow     # heavy: CI's second step (`pytest -m slow`)


TOL = 1e-5
SLOW_NET = {"base": "cpu-sim", "inter_node_latency": 2e-3, "inter_node_bandwidth": 1e8}   # fusion pays (toy)
SLOW_NODES = {"base": "cpu-sim", "flops": {"float32": 1e9}, "inter_node_latency": 1e-4}  # fusion pays (ResNet)


def _model(name, config, batch=None):
    m = models.get(name, config)
    params = m.init(jax.random.key(0))
    images = m.batch()["images"]
    if batch is not None:
        images = jax.random.normal(jax.random.key(1), (batch, *images.shape[1:]), images.dtype)
    return m.apply, params, images


@pytest.fixture(scope="module")
def toy():
    apply, params, images = _model("convnet_toy", "bbgrap", batch=4)
    return apply, params, images, apply(params, images)


@pytest.fixture(scope="module")
def resnet():
    apply, params, images = _model("resnet", "debug")
    return apply, params, images, apply(params, images)


def _run(net, n, **options):
    apply, params, images, ref = net
    fast = autoshard.autoshard(mode="inference", mesh={"x": n}, hardware=options.pop("hardware", "cpu-sim"),
                               **options)(apply)
    out = fast(params, images)
    assert out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL, rtol=0)
    return fast


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("direction", ["N", "C", "H", "W", None])
def test_toy_every_direction_equals_one_device(toy, n, direction):
    fast = _run(toy, n, direction=direction)
    plan = fast.plan
    conv_dirs = {lp.direction for lp in plan.layers if lp.kind == "conv"}
    if direction is not None:
        assert conv_dirs == {direction}
    if direction in ("N", "H", "W"):     # batch 4, 16x16 -> 8x8 maps: even over 2 and 4, never over 3
        assert plan.emission == ("explicit" if n == 3 else "constrained")


def test_toy_three_nodes_is_uneven_and_explicit(toy):
    plan = _run(toy, 3, direction="W").plan
    conv = [lp for lp in plan.layers if lp.kind == "conv"][-1]
    assert [e[2] for e in conv.extents] == [3, 3, 2]          # §3.2: 8 wide over 3 nodes
    assert plan.emission == "explicit"


def test_toy_fused_run_equals_one_device():
    apply, params, images = _model("convnet_toy", "bbgrap")                # batch 1: no N split
    toy = (apply, params, images, apply(params, images))
    fast = _run(toy, 2, hardware=SLOW_NET)
    plan = fast.plan
    assert plan.partition.fused, plan.explain()
    assert plan.emission == "explicit"
    head = plan.partition.fused[0][0]
    assert all(lp.fused == head for lp in plan.layers if lp.name in plan.partition.fused[0])
    _run(toy, 3, hardware=SLOW_NET)                              # fused and uneven


@pytest.mark.parametrize("n", [2, 3, 4])
def test_resnet_mixed_plan_equals_one_device(resnet, n):
    _run(resnet, n)


@pytest.mark.parametrize("direction", ["H", "C"])
def test_resnet_single_direction_equals_one_device(resnet, direction):
    _run(resnet, 4, direction=direction)


def test_resnet_fused_and_heterogeneous():
    apply, params, images = _model("resnet", "debug", batch=1)              # batch 1: no N split
    fast = _run((apply, params, images, apply(params, images)), 3, hardware=SLOW_NODES, speeds=(2, 1, 1))
    assert fast.plan.partition.fused and fast.plan.emission == "explicit"


def test_heterogeneous_parts_follow_speeds(toy):
    plan = _run(toy, 3, direction="H", speeds=(2, 1, 1)).plan
    first = next(lp for lp in plan.layers if lp.kind == "conv")
    assert [e[1] for e in first.extents] == [8, 4, 4]           # 16 rows at speeds 2:1:1
    assert plan.partition.speeds == (2.0, 1.0, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("direction", ["N", "C", "H", "W"])
def test_resnet_every_direction_equals_one_device(resnet, n, direction):
    _run(resnet, n, direction=direction)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_resnet_heterogeneous_every_direction(resnet, n):
    for direction in ("N", "C", "H", "W", None):
        _run(resnet, n, direction=direction, speeds=(3,) + (1,) * (n - 1))


class PlainConv:
    """A plain-jax network: a parameter dict, lax convolutions in NHWC, no Flax."""

    @staticmethod
    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {"w1": jax.random.normal(k1, (3, 3, 3, 8)) * 0.2, "b1": jnp.zeros((8,)),
                "w2": jax.random.normal(k2, (5, 5, 8, 8)) * 0.1, "head": jax.random.normal(k3, (8, 4))}

    @staticmethod
    def apply(params, x):
        dn = ("NHWC", "HWIO", "NHWC")
        x = jax.lax.conv_general_dilated(x, params["w1"], (1, 1), "SAME", dimension_numbers=dn) + params["b1"]
        x = jnp.tanh(x)
        x = jax.lax.conv_general_dilated(x, params["w2"], (2, 2), ((1, 2), (2, 1)), rhs_dilation=(1, 2),
                                         dimension_numbers=dn)
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
        return jnp.mean(x, axis=(1, 2)) @ params["head"]


@pytest.mark.parametrize("direction", ["H", "W", None])
def test_plain_jax_function(direction):
    params = PlainConv.init(jax.random.key(0))
    images = jax.random.normal(jax.random.key(1), (2, 15, 13, 3))
    net = (PlainConv.apply, params, images, PlainConv.apply(params, images))
    _run(net, 3, direction=direction)
    _run(net, 2, direction=direction, hardware=SLOW_NET)


@pytest.mark.parametrize("direction, n", [("H", 4), ("W", 2), ("H", 2)])
def test_audited_halo_bytes_equal_predicted(toy, direction, n):
    apply, params, images, _ = toy
    fast = autoshard.autoshard(mode="inference", mesh={"x": n}, direction=direction)(apply)
    report = audit_inference(fast, params, images)
    assert report["emission"] == "constrained"
    assert report["predicted_by_layer"], "a spatial plan of a 3x3 conv has halos"
    assert report["audited_by_layer"].get("output", 0) == report["output_nbytes"]
    audited = {k: v for k, v in report["audited_by_layer"].items() if k != "output"}
    assert audited == report["predicted_by_layer"]


def test_plan_api_explain_and_json(toy):
    apply, params, images, _ = toy
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, images))
    plan = autoshard.plan(apply, *abstract, mode="inference", mesh={"x": 3}, hardware="cpu-sim")
    assert isinstance(plan, InferencePlan) and plan.num_nodes == 3 and plan.mesh == {"x": 3}
    text = plan.explain()
    for lp in plan.layers:
        assert lp.name in text
    assert "single-direction plans" in text
    assert plan.latency <= min(plan.baselines.values()) + 1e-15
    assert InferencePlan.from_json(plan.to_json()) == plan


def test_new_shapes_are_planned_again(toy):
    apply, params, images, _ = toy
    fast = autoshard.autoshard(mode="inference", mesh={"x": 2})(apply)
    with pytest.raises(PlanError, match="no plan yet"):
        _ = fast.plan
    fast(params, images)
    first = fast.plan
    small = images[:2]
    np.testing.assert_allclose(fast(params, small), apply(params, small), atol=TOL)
    assert fast.plan is not first and fast.plan.signature != first.signature


def test_bad_input_gets_typed_errors(toy):
    apply, params, images, _ = toy
    with pytest.raises(ConfigError, match="one axis"):
        autoshard.autoshard(mode="inference", mesh={"a": 2, "b": 2})(apply)
    with pytest.raises(ConfigError, match="unknown options"):
        autoshard.autoshard(mode="inference", mesh={"x": 2}, fuse=3)(apply)
    with pytest.raises(ConfigError, match="mode="):
        autoshard.autoshard(mode="serve", mesh={"x": 2})
    with pytest.raises(ConfigError, match="speeds"):
        autoshard.autoshard(mode="inference", mesh={"x": 2}, speeds=(1, 0))(apply)
    with pytest.raises(ConfigError, match="direction"):
        autoshard.plan(apply, params, images, mode="inference", mesh={"x": 2}, direction="D")
    with pytest.raises(MeshError, match="needs 16 devices"):
        autoshard.autoshard(mode="inference", mesh={"x": 16})(apply)(params, images)
    with pytest.raises(ConfigError, match="emission='constrained'"):
        autoshard.plan(apply, params, images, mode="inference", mesh={"x": 3}, direction="H", emission="constrained")


def test_unsupported_op_is_a_plan_error():
    def transposing(params, x):            # same shape in and out, but not elementwise
        return jnp.transpose(x, (0, 2, 1, 3)) * params

    def squeeze_excite(params, x):         # (N, C) broadcast back onto the map: not a right-aligned broadcast
        return x * jnp.mean(x, axis=(1, 2), keepdims=True) * params

    for fn, what in ((transposing, "transpose"), (squeeze_excite, "broadcast_in_dim")):
        with pytest.raises(PlanError, match=what):
            autoshard.autoshard(mode="inference", mesh={"x": 2})(fn)(jnp.float32(2), jnp.ones((2, 4, 4, 3)))


def test_hardware_node_speeds_give_uneven_parts(toy):
    hardware = {"base": "cpu-sim", "node_speeds": (1, 3)}
    plan = _run(toy, 2, direction="H", hardware=hardware).plan
    first = next(lp for lp in plan.layers if lp.kind == "conv")
    assert [e[1] for e in first.extents] == [4, 12] and plan.emission == "explicit"
    with pytest.raises(ConfigError, match="node_speeds for 2 nodes"):
        autoshard.plan(toy[0], *toy[1:3], mode="inference", mesh={"x": 3}, hardware=hardware)


def test_nnx_model():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
            self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
            self.head = nnx.Linear(8, 5, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn(self.conv1(x)))
            x = nn.max_pool(self.conv2(x), (2, 2), strides=(2, 2))
            return self.head(x.mean(axis=(1, 2)))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def apply(state, images):
        return nnx.merge(graphdef, state)(images)

    images = jax.random.normal(jax.random.key(3), (2, 16, 16, 3))
    net = (apply, state, images, apply(state, images))
    for direction in ("H", "W", "C", None):
        _run(net, 3, direction=direction)


@pytest.mark.parametrize("direction, n", [("H", 2), ("W", 4)])
def test_resnet_audited_halo_bytes_equal_predicted(direction, n):
    apply, params, images = _model("resnet", "debug", batch=1)
    fast = autoshard.autoshard(mode="inference", mesh={"x": n}, direction=direction)(apply)
    report = audit_inference(fast, params, images)
    audited = {k: v for k, v in report["audited_by_layer"].items() if k != "output"}
    assert report["emission"] == "constrained" and audited == report["predicted_by_layer"]
    assert sum(audited.values()) > 0

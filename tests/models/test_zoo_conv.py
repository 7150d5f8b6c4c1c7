"""Convolutional zoo models: resnet (BatchNorm state), wide_classifier, convnet_toy.

Real computation on debug configs only; paper-sized configs are only traced abstractly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
import models

pytestmark = pytest.mark.slow     # heavy: CI's second step (`pytest -m slow`)


def _size(tree):
    return sum(x.size for x in jax.tree.leaves(tree))


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize(
    "name,config,expected",
    [
        ("resnet", "resnet50", 25.6e6),
        ("resnet", "resnet101", 44.5e6),
        ("resnet", "resnet152", 60.2e6),
        ("resnet", "resnet152x8", 3.7e9),  # RaNNC's largest enlarged ResNet
        ("wide_classifier", "wide-100k", 25.6e6 - 2048 * 1000 - 1000 + 2048 * 100_000 + 100_000),
    ],
)
def test_param_counts(name, config, expected):
    n = models.get(name, config).num_params()
    assert abs(n - expected) / expected < 0.02, n


def test_wide_head():
    params = models.get("wide_classifier", "wide-100k").abstract_params()["params"]
    assert params["head"]["kernel"].shape == (2048, 100_000)
    assert _size(params["head"]) == 2048 * 100_000 + 100_000
    # The backbone is ResNet-50's: only the head differs.
    r50 = models.get("resnet", "resnet50").abstract_params()["params"]
    assert _shapes({k: v for k, v in params.items() if k != "head"}) == _shapes(
        {k: v for k, v in r50.items() if k != "head"})


def test_width_factor_scales_everything():
    # Width x k multiplies every conv's in and out channels (stem included): ~k^2 conv params.
    p1 = models.get("resnet", "resnet152").abstract_params()["params"]
    p8 = models.get("resnet", "resnet152x8").abstract_params()["params"]
    assert p8["stem"]["conv"]["kernel"].shape == (7, 7, 3, 512)
    assert p8["stage_3"]["block_2"]["conv3"]["kernel"].shape == (1, 1, 4096, 16384)
    assert p8["head"]["kernel"].shape == (16384, 1000)
    k1 = p1["stage_2"]["block_5"]["conv2"]["kernel"].size
    assert p8["stage_2"]["block_5"]["conv2"]["kernel"].size == 64 * k1


def test_module_names_and_variables():
    m = models.get("resnet", "debug", depths=(1, 2, 1, 1))
    variables = m.abstract_params()
    assert set(variables) == {"params", "batch_stats"}
    p = variables["params"]
    assert set(p) == {"stem", "stage_0", "stage_1", "stage_2", "stage_3", "head"}
    assert set(p["stem"]) == {"conv", "bn"}
    assert set(p["stage_1"]) == {"block_0", "block_1"}
    assert set(p["stage_1"]["block_0"]) == {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "proj_conv", "proj_bn"}
    assert set(p["stage_1"]["block_1"]) == {"conv1", "bn1", "conv2", "bn2", "conv3", "bn3"}
    assert set(variables["batch_stats"]["stage_1"]["block_0"]["bn1"]) == {"mean", "var"}
    # num_params counts trainable parameters only, not the BN running statistics.
    assert m.num_params() == _size(p) < _size(variables)
    # The optimizer state covers the trainable parameters only.
    _, opt_state, _ = m.abstract_state()
    assert _size(opt_state) == 2 * _size(p) + 1  # adamw: mu, nu, count


@pytest.fixture(scope="module")
def resnet_step():
    m = models.get("resnet", "debug")
    variables = jax.jit(m.init)(jax.random.key(0))
    opt_state = jax.jit(m.init_opt_state)(variables)
    step = jax.jit(m.train_step)
    batch = m.batch()
    return m, variables, opt_state, batch, step(variables, opt_state, batch), step(variables, opt_state, batch)


def test_batch_stats_updated_by_train_step(resnet_step):
    m, variables, _, batch, (new_vars, _, loss), _ = resnet_step
    assert _shapes(new_vars) == _shapes(variables)
    old, new = variables["batch_stats"], new_vars["batch_stats"]
    for (path, o), n in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new), strict=True):
        assert not np.allclose(o, n), path  # every running mean/var moved
    np.testing.assert_allclose(old["stem"]["bn"]["mean"], 0.0)  # init: mean 0, var 1
    np.testing.assert_allclose(old["stem"]["bn"]["var"], 1.0)
    # The loss reported is the train-mode loss of the incoming variables.
    np.testing.assert_allclose(loss, jax.jit(m.loss)(variables, batch), rtol=1e-5)
    assert not np.allclose(new_vars["params"]["head"]["kernel"], variables["params"]["head"]["kernel"])


def test_train_step_deterministic(resnet_step):
    *_, first, second = resnet_step
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)


def test_inference_uses_running_stats(resnet_step):
    m, variables, _, batch, (new_vars, _, _), _ = resnet_step
    apply = jax.jit(m.apply)
    logits = apply(new_vars, batch["images"])
    assert logits.shape == (m.config.batch_size, m.config.num_classes)
    # Inference reads the running statistics, so different stats give different logits.
    assert not np.allclose(logits, apply(variables, batch["images"]))


@pytest.mark.parametrize("name,config", [("resnet", "resnet50"), ("wide_classifier", "wide-1m")])
def test_abstract_train_step(name, config):
    m = models.get(name, config)
    variables, opt_state, batch = m.abstract_state()
    new_vars, new_opt_state, loss = jax.eval_shape(m.train_step, variables, opt_state, batch)
    assert _shapes(new_vars) == _shapes(variables)
    assert _shapes(new_opt_state) == _shapes(opt_state)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert batch["images"].shape == (m.config.batch_size, 224, 224, 3)


def test_convnet_toy_paper_shapes():
    m = models.get("convnet_toy", "bbgrap")
    c = m.config
    # conv_1 is BBGraP's Fig. 4 kernel (3x3, stride 2, dilation 2); its output is the 8x8 map of §3.2.
    assert c.feature_sizes() == (16, 16, 8)
    assert (c.kernel_sizes[1], c.strides[1], c.dilations[1]) == (3, 2, 2)
    params = m.abstract_params()
    assert set(params) == {"conv_0", "conv_1"}
    assert params["conv_0"]["kernel"].shape == (3, 3, 3, 16)
    assert params["conv_1"]["kernel"].shape == (3, 3, 16, 16)
    batch = m.batch(abstract=True)
    out = jax.eval_shape(m.apply, params, batch["images"])
    assert batch["images"].shape == (1, 16, 16, 3)
    assert out.shape == batch["targets"].shape == (1, 8, 8, 16)


def test_convnet_toy_matches_lax_reference():
    m = models.get("convnet_toy", "debug")
    params = jax.jit(m.init)(jax.random.key(0))
    images = m.batch()["images"]
    c = m.config
    x = images
    for i in range(2):
        if i:
            x = jax.nn.relu(x)
        p, s, d = c.paddings[i], c.strides[i], c.dilations[i]
        x = jax.lax.conv_general_dilated(x, params[f"conv_{i}"]["kernel"], (s, s), ((p, p), (p, p)),
                                         rhs_dilation=(d, d), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = x + params[f"conv_{i}"]["bias"]
    np.testing.assert_allclose(jax.jit(m.apply)(params, images), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["resnet", "wide_classifier", "convnet_toy"])
def test_autoshard_traces_debug(name):
    m = models.get(name, "debug")
    graph = autoshard.trace(m.train_step, *m.abstract_state())
    phases = graph.ops_by_phase()
    assert phases["forward"] and phases["backward"] and phases["optimizer"], phases
    if name != "convnet_toy":
        assert graph.find(primitive="conv_general_dilated", module="ResNet/stage_1/block_0/conv2")

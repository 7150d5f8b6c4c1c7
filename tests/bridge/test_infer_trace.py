"""An inference function's jaxpr as BBGraP layers (bridge/inference/trace.py): Flax convolutions,
pooling, inference batch norm, a residual add, global pooling and a dense head map to the pure
core's Layer descriptors with the windows lax computes; what the partitioner cannot split is a
PlanError naming it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from autoshard import PlanError
from autoshard._src.bridge.inference.trace import inference_layers
from autoshard._src.core.layers import required_input
from autoshard._src.core.shapemap import ShapeMap


class Toy(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), padding="SAME")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        y = nn.Conv(8, (3, 3), kernel_dilation=(2, 2), padding="SAME")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(y) + x)          # residual
        x = nn.Conv(16, (3, 3), strides=(2, 2), padding=((1, 0), (1, 0)))(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


@pytest.mark.slow
def test_flax_cnn_layers_and_windows():
    images = jnp.ones((2, 16, 16, 3))
    params = Toy().init(jax.random.key(0), images)
    layers = inference_layers(lambda p, x: Toy().apply(p, x), params, images)
    kinds = [lay.kind for lay in layers]
    assert kinds[0] == "input" and kinds.count("conv") == 3 and kinds.count("pool") == 1
    assert "add" in kinds and "global_pool" in kinds and kinds.count("dense") == 1
    convs = [lay for lay in layers if lay.kind == "conv"]
    assert convs[0].window.kernel == (3, 3) and convs[0].window.padding == ((1, 1), (1, 1))
    assert convs[1].window.dilation == (2, 2) and convs[1].window.padding == ((2, 2), (2, 2))
    assert convs[2].window.strides == (2, 2) and convs[2].window.padding == ((1, 0), (1, 0))
    assert convs[2].output_shape == (2, 4, 4, 16)
    pool = next(lay for lay in layers if lay.kind == "pool")
    assert pool.window.kernel == (2, 2) and pool.window.strides == (2, 2) and pool.output_shape == (2, 8, 8, 8)
    by_name = {lay.name: lay for lay in layers}
    for lay in layers:                          # a connected graph over earlier layers
        assert all(i in by_name for i in lay.inputs)
    # the descriptors work with the core's arithmetic: the middle third of the first conv's output
    # rows needs one halo row either side
    (need,) = required_input(convs[0], ShapeMap.box((0, 2), (5, 10), (0, 16), (0, 8)))
    assert need.extents[1] == 7 and need.extents[3] == 3      # rows 4..10, all input channels


def test_what_the_partitioner_cannot_split_is_named():
    x = jnp.ones((2, 8, 8, 3))
    with pytest.raises(PlanError, match="transpose"):
        inference_layers(lambda p, x: jnp.transpose(x, (0, 3, 1, 2)) * p, 1.0, x)
    nchw = jnp.ones((2, 3, 8, 8))
    kernel = jnp.ones((4, 3, 3, 3))
    with pytest.raises(PlanError, match="layout"):
        inference_layers(lambda k, x: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME"), kernel, nchw)

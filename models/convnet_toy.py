"""BBGraP's two-convolution toy network (Fig. 6), for inference partitioning.

The paper gives the toy network only as a figure; its text fixes these shapes, which the
`bbgrap` config uses:
  * the second convolution is the Fig. 4 example: a 3x3 kernel "with dilation and stride of 2"
    (true kernel size 5, Eq. 2);
  * the output feature map is 8x8 (§3.2: "an 8x8 output feature map partitioned to three nodes
    in width direction" -> 3x8, 3x8, 2x8);
  * the first convolution keeps its input size (3x3, stride 1, padding 1), so the second one
    reads a 16x16 map (padding 2: (16 + 4 - 5) // 2 + 1 = 8).
Channel counts (3 -> 16 -> 16), the batch of 1 (latency inference) and the ReLU between the
convolutions are not given in the text and are our choice. All are config fields.

Inference: `apply(params, images)`. For the zoo contract the model also has a training loss
(MSE of the output feature map to a random target) and the default train step.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register


@dataclasses.dataclass(frozen=True)
class ConvNetToyConfig:
    image_size: int = 8
    in_channels: int = 3
    channels: tuple[int, int] = (4, 4)  # output channels of conv_0, conv_1
    kernel_sizes: tuple[int, int] = (3, 3)
    strides: tuple[int, int] = (1, 2)
    dilations: tuple[int, int] = (1, 2)
    paddings: tuple[int, int] = (1, 2)  # symmetric, on both spatial dims
    batch_size: int = 2
    dtype: str = "float32"
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        for f in ("channels", "kernel_sizes", "strides", "dilations", "paddings"):
            if len(getattr(self, f)) != 2:
                raise ValueError(f"{f}={getattr(self, f)} must have one entry per convolution (2)")

    def layers(self) -> list[tuple[int, int, int, int, int]]:
        """(channels, kernel, stride, dilation, padding) of conv_0 and conv_1."""
        return list(zip(self.channels, self.kernel_sizes, self.strides, self.dilations, self.paddings, strict=True))

    def feature_sizes(self) -> tuple[int, int, int]:
        """Spatial size of the input, conv_0 output and conv_1 output (BBGraP Eqs. 2-3 inverted)."""
        sizes = [self.image_size]
        for _, k, s, d, p in self.layers():
            true_k = (k - 1) * d + 1
            sizes.append((sizes[-1] + 2 * p - true_k) // s + 1)
        return sizes[0], sizes[1], sizes[2]


CONFIGS = {
    "debug": ConvNetToyConfig(),  # 8x8 -> 8x8 -> 4x4
    "bbgrap": ConvNetToyConfig(image_size=16, channels=(16, 16), batch_size=1),  # 16x16 -> 16x16 -> 8x8
}


class ConvNetToy(nn.Module):
    config: ConvNetToyConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        """images [B, H, W, in_channels] -> feature map [B, H', W', channels[1]]."""
        c = self.config
        dt = to_dtype(c.dtype)
        x = images.astype(dt)
        for i, (f, k, s, d, p) in enumerate(c.layers()):
            if i:
                x = nn.relu(x)
            x = nn.Conv(f, (k, k), strides=(s, s), kernel_dilation=(d, d), padding=((p, p), (p, p)),
                        dtype=dt, param_dtype=dt, name=f"conv_{i}")(x)
        return x


@register("convnet_toy", CONFIGS)
class ConvNetToyModel(Model):
    """Batch: {"images": float [B, H, W, C], "targets": float [B, H', W', channels[1]]}."""

    @property
    def module(self) -> ConvNetToy:
        return ConvNetToy(self.config)

    def init(self, key: jax.Array) -> PyTree:
        c = self.config
        x = jnp.zeros((1, c.image_size, c.image_size, c.in_channels), to_dtype(c.dtype))
        return self.module.init(key, x)["params"]

    def apply(self, params: PyTree, images: jax.Array) -> jax.Array:
        """Inference: params, images [B, H, W, C] -> output feature map."""
        return self.module.apply({"params": params}, images)

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        pred = self.apply(params, batch["images"])
        return jnp.mean(jnp.square(pred.astype(jnp.float32) - batch["targets"].astype(jnp.float32)))

    def _make_batch(self, key: jax.Array) -> Batch:
        c = self.config
        dt = to_dtype(c.dtype)
        _, _, out = c.feature_sizes()
        ki, kt = jax.random.split(key)
        return {
            "images": jax.random.normal(ki, (c.batch_size, c.image_size, c.image_size, c.in_channels), dt),
            "targets": jax.random.normal(kt, (c.batch_size, out, out, c.channels[1]), dt),
        }

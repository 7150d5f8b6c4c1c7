"""Bottleneck ResNet (linen, BatchNorm) with BiT-style width factors.

Architecture: torchvision's ResNet v1.5 (stride on the 3x3 conv, projection shortcut at the
first block of every stage), which is what RaNNC enlarged: "we used the model description
available at PyTorch's official repository" and scaled "the number of filters of convolutions
by certain width factors" following BiT. `width_factor` multiplies every channel count,
including the stem, as in BiT; ResNet152x8 then has ~3.7B parameters as RaNNC reports.

Module names: `stem` (conv 7x7/2 + bn + max pool 3x3/2), `stage_{s}` / `block_{b}` (bottleneck
units with conv1/bn1, conv2/bn2, conv3/bn3 and, at shape changes, proj_conv/proj_bn), `head`
(Dense on globally average-pooled features).

BatchNorm state: the pytree this Model calls `params` (what `init` returns and `train_step`
carries) is the full linen variables dict {"params": ..., "batch_stats": ...}. The optimizer
only sees variables["params"] (`init_opt_state`), gradients are taken w.r.t. it alone, and
`train_step` returns the batch statistics updated by the forward pass inside the new variables.
`num_params()` counts trainable parameters only (variables["params"], BN scale/bias included,
running mean/var excluded), the convention of torch's `parameters()` that published counts use.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ._base import Batch, Model, PyTree, to_dtype
from ._registry import register

BN_MOMENTUM = 0.9  # running = 0.9 * running + 0.1 * batch (torch momentum=0.1)
BN_EPS = 1e-5
EXPANSION = 4  # bottleneck output channels = 4 * bottleneck width
CONV_INIT = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # torchvision's kaiming init


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    depths: tuple[int, ...] = (1, 1, 1, 1)  # bottleneck units per stage
    base_channels: int = 8  # stem channels; stage s has bottleneck width base * 2**s (x width_factor)
    width_factor: int = 1  # BiT width multiplier on every channel count, stem included
    image_size: int = 16
    num_classes: int = 10
    batch_size: int = 4
    dtype: str = "float32"  # params and compute; BN running stats and the loss are f32
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        if not self.depths or min(self.depths) < 1:
            raise ValueError(f"depths={self.depths} must be a non-empty tuple of positive ints")
        if self.width_factor < 1 or self.base_channels < 1:
            raise ValueError(f"width_factor={self.width_factor} and base_channels={self.base_channels} must be >= 1")


DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def imagenet_config(layers: int, width_factor: int = 1, **kw) -> ResNetConfig:
    """ResNet-`layers` (50/101/152) x `width_factor` at 224x224 with 1000 classes."""
    # Batch 128: RaNNC's single-node (8 GPU) effective batch size for the enlarged ResNets.
    kw = {"image_size": 224, "num_classes": 1000, "batch_size": 128, **kw}
    return ResNetConfig(depths=DEPTHS[layers], base_channels=64, width_factor=width_factor, **kw)


CONFIGS = {
    "debug": ResNetConfig(),
    "resnet50": imagenet_config(50),  # 25.6M
    "resnet101": imagenet_config(101),  # 44.5M
    "resnet152": imagenet_config(152),  # 60.2M
    "resnet50x2": imagenet_config(50, 2),
    "resnet101x4": imagenet_config(101, 4),
    "resnet152x2": imagenet_config(152, 2),
    "resnet152x4": imagenet_config(152, 4),
    "resnet152x8": imagenet_config(152, 8),  # ~3.7B (RaNNC's largest): abstract use only
}


def _conv(features: int, kernel: int, stride: int, dt: jnp.dtype, name: str) -> nn.Conv:
    pad = (kernel - 1) // 2  # torchvision padding: 7x7 -> 3, 3x3 -> 1, 1x1 -> 0
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding=((pad, pad), (pad, pad)),
                   use_bias=False, dtype=dt, param_dtype=dt, kernel_init=CONV_INIT, name=name)


def _bn(train: bool, dt: jnp.dtype, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, momentum=BN_MOMENTUM, epsilon=BN_EPS,
                        dtype=dt, param_dtype=dt, name=name)


class Stem(nn.Module):
    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.relu(_bn(train, self.dtype, "bn")(_conv(self.features, 7, 2, self.dtype, "conv")(x)))
        return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class Bottleneck(nn.Module):
    width: int  # bottleneck (3x3) channels; output has EXPANSION * width
    stride: int = 1
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        dt, out = self.dtype, EXPANSION * self.width
        h = nn.relu(_bn(train, dt, "bn1")(_conv(self.width, 1, 1, dt, "conv1")(x)))
        h = nn.relu(_bn(train, dt, "bn2")(_conv(self.width, 3, self.stride, dt, "conv2")(h)))
        h = _bn(train, dt, "bn3")(_conv(out, 1, 1, dt, "conv3")(h))
        if self.stride != 1 or x.shape[-1] != out:
            x = _bn(train, dt, "proj_bn")(_conv(out, 1, self.stride, dt, "proj_conv")(x))
        return nn.relu(x + h)


class Stage(nn.Module):
    depth: int
    width: int
    stride: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for b in range(self.depth):
            x = Bottleneck(self.width, self.stride if b == 0 else 1, self.dtype, name=f"block_{b}")(x, train)
        return x


class ResNet(nn.Module):
    config: ResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        """images [B, H, W, 3] -> logits [B, num_classes]."""
        c = self.config
        dt = to_dtype(c.dtype)
        channels = c.base_channels * c.width_factor
        x = Stem(channels, dt, name="stem")(images.astype(dt), train)
        for s, depth in enumerate(c.depths):
            x = Stage(depth, channels * 2**s, 1 if s == 0 else 2, dt, name=f"stage_{s}")(x, train)
        x = jnp.mean(x, axis=(1, 2))  # global average pool
        return nn.Dense(c.num_classes, dtype=dt, param_dtype=dt, name="head")(x)


def image_batch(key: jax.Array, c: ResNetConfig) -> Batch:
    """{"images": [B, H, W, 3] (config dtype), "labels": int32 [B]}."""
    ki, kl = jax.random.split(key)
    return {
        "images": jax.random.normal(ki, (c.batch_size, c.image_size, c.image_size, 3), to_dtype(c.dtype)),
        "labels": jax.random.randint(kl, (c.batch_size,), 0, c.num_classes, jnp.int32),
    }


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


@register("resnet", CONFIGS)
class ResNetModel(Model):
    """Batch: {"images": float [B, H, W, 3], "labels": int32 [B]}.

    `params` here is the linen variables dict {"params", "batch_stats"} (see the module doc)."""

    @property
    def module(self) -> ResNet:
        return ResNet(self.config)

    def init(self, key: jax.Array) -> PyTree:
        c = self.config
        x = jnp.zeros((1, c.image_size, c.image_size, 3), to_dtype(c.dtype))
        return dict(self.module.init(key, x, train=False))  # {"params", "batch_stats"}

    def _loss_and_stats(self, params: PyTree, batch_stats: PyTree, batch: Batch) -> tuple[jax.Array, PyTree]:
        """Train-mode loss (batch statistics) and the updated running statistics."""
        logits, state = self.module.apply({"params": params, "batch_stats": batch_stats}, batch["images"],
                                          train=True, mutable=["batch_stats"])
        return classification_loss(logits, batch["labels"]), state["batch_stats"]

    def loss(self, params: PyTree, batch: Batch) -> jax.Array:
        """Train-mode loss of the variables dict `params` (updated BN stats are discarded)."""
        return self._loss_and_stats(params["params"], params["batch_stats"], batch)[0]

    def apply(self, params: PyTree, images: jax.Array) -> jax.Array:
        """Inference logits with the running BN statistics: variables, images -> [B, classes]."""
        return self.module.apply(params, images, train=False)

    def num_params(self) -> int:
        """Trainable parameters only (variables["params"]); BN running statistics are state."""
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params()["params"]))

    def init_opt_state(self, params: PyTree) -> PyTree:
        return self.optimizer.init(params["params"])

    def train_step(self, params: PyTree, opt_state: PyTree, batch: Batch) -> tuple[PyTree, PyTree, jax.Array]:
        grad_fn = jax.value_and_grad(functools.partial(self._loss_and_stats, batch=batch), has_aux=True)
        (loss, batch_stats), grads = grad_fn(params["params"], params["batch_stats"])
        with jax.named_scope("optimizer"):
            updates, opt_state = self.optimizer.update(grads, opt_state, params["params"])
            new_params = optax.apply_updates(params["params"], updates)
        return {"params": new_params, "batch_stats": batch_stats}, opt_state, loss

    def _make_batch(self, key: jax.Array) -> Batch:
        return image_batch(key, self.config)

"""TAP's large-scale classification model: a ResNet-50 backbone and a very wide FC head.

TAP (§2, Fig. 3a) motivates tensor parallelism with product-image classification over
"hundreds of thousands to millions" of classes: the FC layer (205M floats at 100K classes,
2048 x 100000) dwarfs the 24M-parameter feature extractor. Its ResNet-50 runs use batch size
1024 (Fig. 12); the image size is not stated, so the ImageNet 224x224 is used.

Same module and BatchNorm handling as `resnet` (variables dict as `params`, module names
`stem`, `stage_{s}/block_{b}`, `head`); only the configs differ.
"""

from __future__ import annotations

from ._registry import register
from .resnet import ResNetConfig, ResNetModel, imagenet_config

CONFIGS = {
    "debug": ResNetConfig(num_classes=1000),  # tiny backbone (2048 -> 256 features), 1000 classes
    "wide-100k": imagenet_config(50, num_classes=100_000, batch_size=1024),  # head 204.9M params
    "wide-1m": imagenet_config(50, num_classes=1_000_000, batch_size=1024),  # head 2.05B: abstract only
}


@register("wide_classifier", CONFIGS)
class WideClassifierModel(ResNetModel):
    """Batch: {"images": float [B, 224, 224, 3], "labels": int32 [B]}; head is `head` (Dense)."""

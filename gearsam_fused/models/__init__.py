"""Model definitions kept in the repository: the paper's CIFAR networks, layouts that mirror torchvision/timm (ResNet-50
and EfficientNet-B0 to the parameter name: torchvision's ImageNet state dicts load into them), and the demo's small
ResNet for 8x8 digits.

Every factory takes size knobs (``width``, ``depth``, ...) so tests and demos can build tiny versions quickly.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .efficientnet import EfficientNet, efficientnet_b0
from .pyramidnet import PyramidNet, pyramidnet110
from .resnet import BottleneckResNet, ResNet, digits_resnet, resnet18, resnet50, tv_resnet18
from .vit import VisionTransformer, vit_b16
from .wideresnet import WideResNet, wrn28_10

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "wrn28_10": wrn28_10,
    "pyramidnet110": pyramidnet110,
    "tv_resnet18": tv_resnet18,
    "resnet50": resnet50,
    "efficientnet_b0": efficientnet_b0,
    "vit_b16": vit_b16,
    "digits_resnet": digits_resnet,
}


def get_model(name: str, **kwargs) -> nn.Module:
    """Build an in-repo model by name (see ``MODELS``)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}") from None
    return factory(**kwargs)


__all__ = [
    "MODELS", "get_model", "ResNet", "BottleneckResNet", "WideResNet", "PyramidNet", "EfficientNet",
    "VisionTransformer", "resnet18", "tv_resnet18", "resnet50", "wrn28_10", "pyramidnet110", "efficientnet_b0",
    "vit_b16", "digits_resnet",
]  # fmt: skip

"""ResNets: with BasicBlocks, the CIFAR variant of the paper (3x3 stem, no max-pool) and the ImageNet layout (7x7
stem + max-pool), module names after torchvision's (``conv1, bn1, layer1..4, fc``; the projection shortcut is
``shortcut``); and ResNet-50, torchvision's to the parameter name (:class:`BottleneckResNet`, projection
``downsample``), so that torchvision's ImageNet state dict loads into it with ``strict=True``."""

from __future__ import annotations

import torch
from torch import nn

from .common import activation, conv3x3


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: str):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act = activation(act)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class ResNet(nn.Module):
    """``blocks`` residual units per stage; stage ``i`` has ``width * 2**i`` channels and stride 2 from stage 2 on."""

    def __init__(
        self,
        blocks: tuple[int, ...] = (2, 2, 2, 2),
        width: int = 64,
        num_classes: int = 10,
        in_channels: int = 3,
        act: str = "relu",
        imagenet_stem: bool = False,
    ):
        super().__init__()
        if imagenet_stem:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = conv3x3(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.act = activation(act)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1) if imagenet_stem else nn.Identity()
        cin = width
        for i, count in enumerate(blocks):
            cout = width * 2**i
            units = [
                BasicBlock(cin if j == 0 else cout, cout, 2 if (i > 0 and j == 0) else 1, act) for j in range(count)
            ]
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
            cin = cout
        self.num_stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.act(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2), **kw) -> ResNet:
    """CIFAR ResNet-18 (about 11.2M parameters at width 64, 62 tensors)."""
    return ResNet(blocks, width, num_classes, **kw)


def tv_resnet18(num_classes: int = 1000, width: int = 64, **kw) -> ResNet:
    """ResNet-18 with torchvision's ImageNet stem and module names."""
    return ResNet((2, 2, 2, 2), width, num_classes, imagenet_stem=True, **kw)


def digits_resnet(num_classes: int = 10, in_channels: int = 1, width: int = 16, **kw) -> ResNet:
    """The demo's network: three stages, sized for 8x8 inputs."""
    return ResNet(blocks=(1, 1, 1), width=width, num_classes=num_classes, in_channels=in_channels, **kw)


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 unit (v1.5: the stride on the 3x3 convolution): 1x1, 3x3, 1x1 to ``4 * planes``
    channels, a ``downsample`` projection (1x1 convolution and BatchNorm) where the shape changes."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class BottleneckResNet(nn.Module):
    """torchvision's ``ResNet`` with :class:`Bottleneck` units: ``conv1`` (7x7, stride 2), ``bn1``, ``maxpool``,
    ``layer1..4`` (``blocks`` units each, ``width * 2**i`` planes, stride 2 from the second on), ``fc``. Its state
    dict has torchvision's names and shapes, BatchNorm buffers included."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000,
                 in_channels: int = 3):  # fmt: skip
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = width
        for i, count in enumerate(blocks):
            planes = width * 2**i
            units = [Bottleneck(cin if j == 0 else planes * 4, planes, 2 if (i > 0 and j == 0) else 1)
                     for j in range(count)]  # fmt: skip
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
            cin = planes * Bottleneck.expansion
        self.num_stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(
    num_classes: int = 1000, width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), **kw
) -> BottleneckResNet:
    """ResNet-50 as torchvision builds it (about 25.6M parameters at 1000 classes, 161 tensors): torchvision's
    ``resnet50`` ImageNet state dict loads into it with ``strict=True``. ``width`` and ``blocks`` make small versions
    for tests."""
    return BottleneckResNet(blocks, width, num_classes, **kw)

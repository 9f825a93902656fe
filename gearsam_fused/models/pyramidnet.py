"""PyramidNet (Han et al.) for CIFAR with additive widening and basic units: ``conv1, bn1, layer1..3, bn, fc``.

Channels grow by ``alpha / (3n)`` per unit; shortcuts are identity (average-pooled when striding) with the extra
channels zero-padded, as in the original design.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import activation, conv3x3


class PyramidBasic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: str):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.act = activation(act)
        self.stride = stride
        self.extra = cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(self.bn1(x))
        out = self.bn3(self.conv2(self.act(self.bn2(out))))
        shortcut = F.avg_pool2d(x, 2) if self.stride != 1 else x
        if self.extra:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra))
        return out + shortcut


class PyramidNet(nn.Module):
    def __init__(
        self, depth: int = 110, alpha: int = 270, num_classes: int = 10, act: str = "relu", in_channels: int = 3
    ):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"PyramidNet depth must be 6n+2 for basic units, got {depth}")
        n = (depth - 2) // 6
        step = alpha / (3 * n)
        width = 16.0
        self.conv1 = conv3x3(in_channels, 16)
        self.bn1 = nn.BatchNorm2d(16)
        cin = 16
        for i in range(3):
            units = []
            for j in range(n):
                width += step
                units.append(PyramidBasic(cin, round(width), 2 if (i > 0 and j == 0) else 1, act))
                cin = round(width)
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
        self.bn = nn.BatchNorm2d(cin)
        self.act = activation(act)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn1(self.conv1(x))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(self.act(self.bn(x))), 1))


def pyramidnet110(num_classes: int = 10, depth: int = 110, alpha: int = 270, **kw) -> PyramidNet:
    """PyramidNet-110 with alpha = 270 (about 28M parameters)."""
    return PyramidNet(depth, alpha, num_classes, **kw)

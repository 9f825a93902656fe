"""Pre-activation WideResNet (Zagoruyko & Komodakis) for CIFAR: ``conv1, layer1..3, bn, fc``."""

from __future__ import annotations

import torch
from torch import nn

from .common import activation, conv3x3


class WideBasic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, dropout: float, act: str):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn2 = nn.BatchNorm2d(cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = conv3x3(cout, cout)
        self.act = activation(act)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act(self.bn1(x))
        out = self.conv1(pre)
        out = self.conv2(self.dropout(self.act(self.bn2(out))))
        return out + (x if self.shortcut is None else self.shortcut(pre))


class WideResNet(nn.Module):
    def __init__(
        self, depth: int = 28, widen_factor: int = 10, num_classes: int = 10, dropout: float = 0.0,
        base: int = 16, act: str = "relu", in_channels: int = 3,
    ):  # fmt: skip
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WideResNet depth must be 6n+4, got {depth}")
        n = (depth - 4) // 6
        widths = [base * widen_factor * 2**i for i in range(3)]
        self.conv1 = conv3x3(in_channels, base)
        cin = base
        for i, cout in enumerate(widths):
            units = [
                WideBasic(cin if j == 0 else cout, cout, (2 if i else 1) if j == 0 else 1, dropout, act)
                for j in range(n)
            ]
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
            cin = cout
        self.bn = nn.BatchNorm2d(cin)
        self.act = activation(act)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.act(self.bn(x))), 1))


def wrn28_10(num_classes: int = 10, depth: int = 28, widen_factor: int = 10, **kw) -> WideResNet:
    """WideResNet-28-10 (about 36.5M parameters)."""
    return WideResNet(depth, widen_factor, num_classes, **kw)

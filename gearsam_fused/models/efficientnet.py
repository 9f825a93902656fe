"""EfficientNet-B0 with torchvision's layout: ``features.0`` stem, ``features.1..7`` MBConv stages,
``features.8`` 1x1 head conv, ``classifier`` (dropout + linear)."""

from __future__ import annotations

import math

import torch
from torch import nn


class ConvNormActivation(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True):
        layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            layers.append(nn.SiLU())
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(nn.functional.silu(self.fc1(s))))


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvNormActivation(cin, hidden, 1))
        layers += [
            ConvNormActivation(hidden, hidden, kernel, stride, groups=hidden),
            SqueezeExcitation(hidden, max(1, cin // 4)),
            ConvNormActivation(hidden, cout, 1, act=False),
        ]
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_residual else out


# (expand ratio, kernel, stride, channels, repeats) of EfficientNet-B0's seven stages
_B0_STAGES = [
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
]


class EfficientNet(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, depth_mult: float = 1.0, in_channels: int = 3):
        super().__init__()

        def ch(c: int) -> int:
            return max(8, int(c * width_mult + 4) // 8 * 8)

        stem = ch(32)
        layers: list[nn.Module] = [ConvNormActivation(in_channels, stem, 3, 2)]
        cin = stem
        for expand, kernel, stride, cout, repeats in _B0_STAGES:
            cout = ch(cout)
            n = max(1, math.ceil(repeats * depth_mult))
            layers.append(
                nn.Sequential(
                    *[MBConv(cin if i == 0 else cout, cout, kernel, stride if i == 0 else 1, expand) for i in range(n)]
                )
            )
            cin = cout
        head = ch(1280)
        layers.append(ConvNormActivation(cin, head, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(head, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0(num_classes: int = 1000, **kw) -> EfficientNet:
    """EfficientNet-B0 (about 5.3M parameters)."""
    return EfficientNet(num_classes, **kw)

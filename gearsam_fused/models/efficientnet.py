"""EfficientNet-B0 as torchvision builds it: ``features.0`` stem, ``features.1..7`` MBConv stages, ``features.8`` 1x1
head conv, ``classifier`` (dropout + linear), with torchvision's parameter names and shapes, so that torchvision's
``efficientnet_b0`` ImageNet state dict loads with ``strict=True``; and its stochastic depth (a residual branch
dropped per image in training, with a probability growing linearly to ``stochastic_depth`` over the blocks)."""

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


class StochasticDepth(nn.Module):
    """torchvision's ``StochasticDepth(p, "row")``: in training, each image's input is zeroed with probability ``p``
    and the others scaled by ``1 / (1 - p)``; the identity in eval mode. No parameters."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep) if keep > 0.0 else x * mask


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int, drop: float = 0.0):
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
        self.stochastic_depth = StochasticDepth(drop)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return self.stochastic_depth(out) + x if self.use_residual else out


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
    def __init__(
        self, num_classes: int = 1000, width_mult: float = 1.0, depth_mult: float = 1.0, in_channels: int = 3,
        stochastic_depth: float = 0.2,
    ):  # fmt: skip
        super().__init__()

        def ch(c: int) -> int:
            return max(8, int(c * width_mult + 4) // 8 * 8)

        stem = ch(32)
        layers: list[nn.Module] = [ConvNormActivation(in_channels, stem, 3, 2)]
        cin = stem
        repeats = [max(1, math.ceil(r * depth_mult)) for *_, r in _B0_STAGES]
        done, total = 0, sum(repeats)  # the blocks before this one, and in all: the drop probability grows with depth
        for (expand, kernel, stride, cout, _), n in zip(_B0_STAGES, repeats):
            cout = ch(cout)
            stage = []
            for i in range(n):
                drop = stochastic_depth * (done + i) / total
                stage.append(MBConv(cin if i == 0 else cout, cout, kernel, stride if i == 0 else 1, expand, drop))
            layers.append(nn.Sequential(*stage))
            cin, done = cout, done + n
        head = ch(1280)
        layers.append(ConvNormActivation(cin, head, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(head, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0(num_classes: int = 1000, **kw) -> EfficientNet:
    """EfficientNet-B0 (about 5.3M parameters), torchvision's to the parameter name, stochastic depth 0.2 as in
    torchvision (``stochastic_depth=0`` turns it off)."""
    return EfficientNet(num_classes, **kw)

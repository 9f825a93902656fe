"""Small pieces shared by the in-repo model definitions."""

from __future__ import annotations

from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU}


def activation(name: str) -> nn.Module:
    """A fresh activation module by name; smooth ones (``silu``, ``gelu``) make tiny nets well conditioned."""
    try:
        return ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}") from None


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)

"""Parameter sets the benchmarks run on: real shapes, from the repository's models or from shape lists.

Each set is built on a device with a gradient on every parameter and comes with the partition GEAR-SAM uses. Sets
too large for a CPU run scale down there (their name says how); quick mode scales every set to at most about a
million parameters.

=========================  ====================================================  =================  ===========
set                        shapes                                                full size           tensors
=========================  ====================================================  =================  ===========
ResNet-18                  CIFAR ResNet-18 (``gearsam_fused.models.resnet18``)   11.2M              62
WRN-28-10                  CIFAR WideResNet-28-10                                36.5M              80
ViT-B/16                   ViT-B/16 at 224 px                                    86.6M              152
GPT-2-medium shapes        24 transformer layers, d=1024, 50257-token vocab      354.5M             292
2048 small tensors         64 to 1024 elements each                              0.8M               2048
2000 tensors x 4096        4096 elements each, in 16 blocks (whole step only)    8.2M               2000
=========================  ====================================================  =================  ===========

:data:`SET_KEYS` are the sets of the SAM-step benchmark; :data:`WHOLE_STEP_SET_KEYS` adds the last one for the
whole-step benchmark (quick mode builds it with 512 elements per tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from gearsam_fused.models import resnet18, vit_b16, wrn28_10

#: Largest set a CPU run builds at full size; larger ones shrink their width.
CPU_MAX_PARAMS = 110_000_000
QUICK_MAX_PARAMS = 1_200_000


@dataclass
class ParamSet:
    name: str
    model: nn.Module
    partition: str | dict  # what GEARSAM gets as ``partition=``

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


class ShapeList(nn.Module):
    """Parameters with the given shapes, grouped into named blocks (a model's layers without its forward)."""

    def __init__(self, blocks: dict[str, list[tuple[int, ...]]]):
        super().__init__()
        self.blocks = nn.ModuleDict(
            {
                name: nn.ParameterList(nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes)
                for name, shapes in blocks.items()
            }
        )

    def partition(self) -> dict[str, list[nn.Parameter]]:
        return {name: list(params) for name, params in self.blocks.items()}


def gpt2_medium_shapes(width: int = 1024, layers: int = 24, vocab: int = 50257, context: int = 1024) -> ShapeList:
    """The parameter shapes of a GPT-2-medium-like decoder: embeddings, then per layer two norms, a fused QKV
    projection, an output projection and a 4x MLP, then the final norm (the output head shares the embedding)."""
    blocks = {"embeddings": [(vocab, width), (context, width)]}
    for i in range(layers):
        blocks[f"layer{i}"] = [
            (width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
            (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,),
        ]  # fmt: skip
    blocks["final_norm"] = [(width,), (width,)]
    return ShapeList(blocks)


def many_small_tensors(n: int = 2048) -> ShapeList:
    """``n`` tensors of 64 to 1024 elements (biases, norms, small heads) in 16 blocks: where per-tensor loops pay most."""
    sizes = (64, 128, 256, 512, 1024)
    per_block = n // 16
    return ShapeList(
        {f"group{b}": [(sizes[(b * per_block + i) % len(sizes)],) for i in range(per_block)] for b in range(16)}
    )


def many_equal_tensors(n: int = 2000, size: int = 4096) -> ShapeList:
    """``n`` tensors of ``size`` elements each in 16 blocks: mid-sized tensors, many of them, where a per-tensor base
    step pays its per-tensor overhead (a launch each on CUDA) and a fused one streams."""
    return ShapeList({f"group{b}": [(size,)] * (n // 16 + (b < n % 16)) for b in range(16)})


def _scaled(width: int, params_at_width: Callable[[int], float], limit: float, smallest: int = 8) -> int:
    """The largest width, halving from ``width`` down to ``smallest``, whose parameter count is within ``limit``."""
    while width // 2 >= smallest and params_at_width(width) > limit:
        width //= 2
    return width


def _gpt_params(width: int) -> int:
    return 24 * 12 * width * width + (50257 + 1024) * width


def _builders(limit: int) -> dict[str, Callable[[], tuple[str, nn.Module, object]]]:
    """name -> () -> (display name, model, partition); ``limit`` is the largest parameter count to build."""

    def resnet():
        width = _scaled(64, lambda w: 11_173_962 * (w / 64) ** 2, limit)
        return f"ResNet-18{'' if width == 64 else f' (width {width})'}", resnet18(num_classes=10, width=width), "coarse"

    def wrn():
        widen = _scaled(10, lambda w: 36_479_194 * (w / 10) ** 2, limit, smallest=1)
        return f"WRN-28-{widen}", wrn28_10(num_classes=10, widen_factor=widen), "coarse"

    def vit():
        dim = _scaled(768, lambda d: 86_567_656 * (d / 768) ** 2, limit)
        heads = max(1, dim // 64)
        suffix = "" if dim == 768 else f" shapes (dim {dim})"
        return f"ViT-B/16{suffix}", vit_b16(num_classes=1000, dim=dim, heads=heads), "coarse"

    def gpt():
        width = _scaled(1024, _gpt_params, limit)
        model = gpt2_medium_shapes(width=width)
        return f"GPT-2-medium shapes{'' if width == 1024 else f' (width {width})'}", model, model.partition()

    def small():
        model = many_small_tensors(2048)
        return "2048 small tensors", model, model.partition()

    def equal():
        size = _scaled(4096, lambda s: 2000 * s, limit, smallest=64)
        model = many_equal_tensors(2000, size)
        return f"2000 tensors x {size}", model, model.partition()

    return {
        "resnet18": resnet, "wrn28_10": wrn, "vit_b16": vit, "gpt2_medium": gpt, "small_tensors": small,
        "tensors_4096": equal,
    }  # fmt: skip


SET_KEYS = ["resnet18", "wrn28_10", "vit_b16", "gpt2_medium", "small_tensors"]
#: The whole-step benchmark's sets: the SAM-step sets and 2000 tensors of 4096 elements.
WHOLE_STEP_SET_KEYS = [*SET_KEYS, "tensors_4096"]


def build(key: str, device: str, quick: bool, seed: int = 0) -> ParamSet:
    """The set ``key`` on ``device`` with random gradients; scaled down on CPU and in quick mode."""
    limit = QUICK_MAX_PARAMS if quick else (CPU_MAX_PARAMS if device == "cpu" else float("inf"))
    torch.manual_seed(seed)
    name, model, partition = _builders(limit)[key]()
    model = model.to(device)  # in place: the Parameter objects a partition mapping holds stay the model's
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=generator)
    return ParamSet(name, model, partition)

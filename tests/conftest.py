import copy

import pytest
import torch
import torch.nn.functional as F

from gearsam_fused.models import ResNet

# Relative error allowed between whole parameter vectors, per step.
FP32_STEP_RTOL = 1e-6
FP64_STEP_RTOL = 1e-10


def tiny_resnet(seed: int = 0, dtype: torch.dtype = torch.float32) -> ResNet:
    """Two-stage ResNet with SiLU: smooth, so trajectory comparisons measure the algorithm, not ReLU kinks."""
    torch.manual_seed(seed)
    return ResNet(blocks=(1, 1), width=4, num_classes=3, act="silu").to(dtype)


def batches(n: int, dtype: torch.dtype = torch.float32, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 3, 8, 8, generator=g).to(dtype), torch.randint(0, 3, (batch,), generator=g))
        for _ in range(n)
    ]


def loss_fn(model, xy):
    x, y = xy
    return F.cross_entropy(model(x), y)


def sam_step(opt, model, xy):
    """One two-pass step through first_step/second_step."""
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)
    loss_fn(model, xy).backward()
    opt.second_step(zero_grad=True)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def twin():
    """Two bitwise-identical tiny models."""
    model = tiny_resnet()
    return model, copy.deepcopy(model)

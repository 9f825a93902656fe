"""Cost of the SAM machinery itself: ``first_step`` + ``second_step`` with a base optimizer that does nothing.

Parameters and gradients are those of a CIFAR ResNet-18 (11.2M parameters in 62 tensors), of a ViT-Ti/4 for 32 px
images (5.4M parameters in 152 tensors, many of them small) and of 2048 small tensors (0.8M parameters, 64 to 1024
elements each), float32, on CUDA when there is a GPU and on CPU otherwise. Every implementation runs in the same
process on the same tensors:

* ``per-tensor loop``  pytorch_optimizer.SAM, the widely used per-tensor implementation
* ``reference``        gearsam_fused's per-tensor oracle backend
* ``torch``, ``triton``, ``cpp``  the fused flat-buffer backends (``triton`` only on CUDA; ``cpp`` when the extension
  is built, on CUDA only when it has CUDA kernels)

Memory traffic counted per step (d parameters, 4 bytes each): energy reads g (4d); perturb reads w and g and writes
the backup and w (16d); restore reads the backup and writes w (8d): 28d bytes, the floor for an unfused
energy/perturb/restore step. ``extra_info["GB/s"]`` is that count over the measured time.

    python -m pytest benchmarks/bench_sam_step.py --benchmark-json=benchmarks/results/<name>.json
    python benchmarks/report.py benchmarks/results/<name>.json
"""

import pytest
import torch
from torch import nn

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.backends.cpp_ops import cpp_built_with_cuda, cpp_installed
from gearsam_fused.models import resnet18, vit_b16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLEMENTATIONS = (
    ["per-tensor loop", "reference", "torch"]
    + (["triton"] if DEVICE == "cuda" else [])
    + (["cpp"] if cpp_installed() and (DEVICE == "cpu" or cpp_built_with_cuda()) else [])
)
BYTES_PER_PARAM = 28


class ManySmallTensors(nn.Module):
    """``n`` parameter tensors of 64 to 1024 elements (biases, norms, small heads): where per-tensor loops pay most."""

    def __init__(self, n: int = 2048):
        super().__init__()
        sizes = (64, 128, 256, 512, 1024)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(sizes[i % len(sizes)])) for i in range(n))


MODELS = {
    "ResNet-18": lambda: resnet18(num_classes=10),
    "ViT-Ti/4": lambda: vit_b16(num_classes=10, img_size=32, patch_size=4, dim=192, heads=3),
    "2048 small tensors": ManySmallTensors,
}


class NoStep(torch.optim.Optimizer):
    def __init__(self, params, **kwargs):
        super().__init__(params, kwargs)

    def step(self, closure=None):
        return None


def _synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _setup(model_name: str, implementation: str, rule: str):
    torch.manual_seed(0)
    model = MODELS[model_name]().to(DEVICE)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    if implementation == "per-tensor loop":
        peer = pytest.importorskip("pytorch_optimizer")
        if rule != "sam":
            pytest.skip("the per-tensor peer implements SAM only")
        opt = peer.SAM(model.parameters(), NoStep, rho=0.05)
    else:
        cls = SAM if rule == "sam" else GEARSAM
        opt = cls(model, NoStep, rho=0.05, backend=implementation)
    return model, opt


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("rule", ["sam", "gear"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sam_step(benchmark, implementation, rule, model_name):
    model, opt = _setup(model_name, implementation, rule)

    def step():
        opt.first_step()
        opt.second_step()
        _synchronize()

    for _ in range(3):  # warm-up: kernel compilation, allocator
        step()
    benchmark.group = f"{rule} step, {model_name} parameters, {DEVICE}"
    benchmark.pedantic(step, rounds=20 if DEVICE == "cpu" else 200, iterations=1)
    d = sum(p.numel() for p in model.parameters())
    benchmark.extra_info.update(
        device=DEVICE,
        parameters=d,
        tensors=len(list(model.parameters())),
        bytes_counted=BYTES_PER_PARAM * d,
        **{"GB/s": BYTES_PER_PARAM * d / benchmark.stats.stats.median / 1e9},
    )

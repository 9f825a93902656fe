"""The ``triton`` backend: the fused step as Triton kernels (``gearsam_fused.triton_kernels``) over flat buckets.

Per step: for each bucket two launches for the block energies, one to perturb and one to restore, plus one for the
allocation, whatever the number of parameter tensors. Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set
before triton was imported (Triton's interpreter, for testing).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from ..flat import Bucket
from .fused import FusedBackend


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_usable(devices: set[torch.device]) -> None:
    """Raise ``ValueError`` unless triton is installed and can run on every device in ``devices``."""
    if not triton_installed():
        raise ValueError("backend 'triton' needs the triton package (pip install triton); try backend='torch'")
    off_cuda = sorted(str(d) for d in devices if d.type != "cuda")
    if off_cuda and not interpreter_enabled():
        raise ValueError(
            f"backend 'triton' runs on CUDA tensors, but parameters are on {', '.join(off_cuda)}; use "
            "backend='torch' there (or set TRITON_INTERPRET=1 before importing triton to run the kernels "
            "through Triton's interpreter)"
        )


def _launching_on(device: torch.device):
    """Triton launches on the current CUDA device, which need not be the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class TritonBackend(FusedBackend):
    name = "triton"

    def __init__(self, blocks, device: torch.device):
        check_usable({p.device for block in blocks for p in block.params})
        from .. import triton_kernels  # imports triton: only when this backend is actually used

        self.kernels = triton_kernels
        super().__init__(blocks, device)

    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float) -> torch.Tensor:
        with _launching_on(bucket.device):
            return self.kernels.block_energy(
                bucket.grad, bucket.param, bucket.block_tiles, bucket.partials, tile=bucket.tile, adaptive=adaptive, eta=eta
            )

    def allocate(self, rule, energy, ema, rho, beta, delta):
        with _launching_on(energy.device):
            return self.kernels.allocate(energy, ema, rule=rule, rho=rho, beta=beta, delta=delta)

    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        with _launching_on(bucket.device):
            self.kernels.perturb_(
                bucket.param, bucket.grad, bucket.backup, scale, bucket.tile_block, tile=bucket.tile, adaptive=adaptive, eta=eta
            )

    def _bucket_restore(self, bucket: Bucket) -> None:
        with _launching_on(bucket.device):
            self.kernels.restore_(bucket.param, bucket.backup, tile=bucket.tile)

"""The ``triton`` backend: the fused step as Triton kernels (``gearsam_fused.triton_kernels``) over flat buckets.

Per step: for each bucket two launches for the block energies, one to perturb and one to restore, plus one for the
allocation, whatever the number of parameter tensors. Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set
before triton was imported (Triton's interpreter, for testing).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .flat_buffer import KernelBackend


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class TritonBackend(KernelBackend):
    name = "triton"

    @staticmethod
    def installed() -> bool:
        return triton_installed()

    @staticmethod
    def check_usable(devices: set[torch.device]) -> None:
        if not triton_installed():
            raise ValueError("backend 'triton' needs the triton package (pip install triton); try backend='torch'")
        off_cuda = sorted(str(d) for d in devices if d.type != "cuda")
        if off_cuda and not interpreter_enabled():
            raise ValueError(
                f"backend 'triton' runs on CUDA tensors, but parameters are on {', '.join(off_cuda)}; use "
                "backend='torch' there (or set TRITON_INTERPRET=1 before importing triton to run the kernels "
                "through Triton's interpreter)"
            )

    def __init__(self, blocks, device: torch.device, param_group=None):
        self.check_usable({p.device for block in blocks for p in block.params})
        from .. import triton_kernels  # imports triton: only when this backend is actually used

        super().__init__(blocks, device, triton_kernels, param_group)

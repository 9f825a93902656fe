"""Backend registry and the one dispatch point that turns a backend name into an implementation.

=============  ===============================================================  ==========================
name           what does the tensor work                                        where
=============  ===============================================================  ==========================
``reference``  a per-tensor loop written from the equations (the oracle)        any device
``torch``      vectorised torch ops over flat per-(device, dtype) buffers       any device
``triton``     Triton kernels over the same flat buffers                        CUDA (CPU: interpreter)
=============  ===============================================================  ==========================

``"auto"`` picks ``triton`` when every parameter is on a CUDA device and triton is installed, else ``torch``.
"""

from __future__ import annotations

import torch

from ..partition import Block
from .base import Backend
from .reference import ReferenceBackend
from .torch_ops import TorchBackend
from .triton_ops import TritonBackend, check_usable, triton_installed

#: Backends built into this installation, by name.
BACKENDS: dict[str, type[Backend]] = {"reference": ReferenceBackend, "torch": TorchBackend, "triton": TritonBackend}

#: Names the library knows of but that this version does not provide yet.
PLANNED = ("cpp",)


def available_backends() -> list[str]:
    """Backends this installation can run (``triton`` only when triton is installed)."""
    return [name for name in BACKENDS if name != "triton" or triton_installed()]


def resolve_backend_name(name: str, devices: set[torch.device]) -> str:
    """Turn ``"auto"`` into a concrete backend for parameters on ``devices``; check any other name."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    if name == "auto":
        on_cuda = all(d.type == "cuda" for d in devices)
        return "triton" if on_cuda and triton_installed() else "torch"
    if name == "triton":
        check_usable(devices)
    if name in BACKENDS:
        return name
    if name in PLANNED:
        raise ValueError(
            f"backend {name!r} is not available in this version of gearsam_fused; available: {available_backends()}"
        )
    raise ValueError(f"unknown backend {name!r}; expected 'auto' or one of {available_backends()}")


def make_backend(name: str, blocks: list[Block], device: torch.device) -> Backend:
    """The backend ``name`` (already resolved) over ``blocks``; ``device`` receives energies and radii."""
    return BACKENDS[name](blocks, device)

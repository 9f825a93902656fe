"""Backend registry and the one dispatch point that turns a backend name into an implementation.

=============  ===============================================================  ==========================
name           what does the tensor work                                        where
=============  ===============================================================  ==========================
``reference``  a per-tensor loop written from the equations (the oracle)        any device
``torch``      vectorised torch ops over flat per-(device, dtype) buffers       any device
``triton``     Triton kernels over the same flat buffers                        CUDA (CPU: interpreter)
``cpp``        compiled C++/CUDA kernels (``gearsam_fused._C``) over them       CPU, and CUDA if built so
=============  ===============================================================  ==========================

``"auto"`` picks ``triton`` when every parameter is on a CUDA device and triton is installed; otherwise ``cpp`` when
the extension is built for every device in use; otherwise ``torch``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..partition import Block
from .base import Backend
from .cpp_ops import CppBackend
from .reference import ReferenceBackend
from .torch_ops import TorchBackend
from .triton_ops import TritonBackend

#: Every backend of the library, by name (see :func:`available_backends` for those this installation can run).
BACKENDS: dict[str, type[Backend]] = {
    "reference": ReferenceBackend, "torch": TorchBackend, "triton": TritonBackend, "cpp": CppBackend,
}  # fmt: skip


def available_backends() -> list[str]:
    """Backends this installation can run: ``triton`` needs the triton package, ``cpp`` the compiled extension."""
    return [name for name, cls in BACKENDS.items() if cls.installed()]


def _usable(name: str, devices: set[torch.device]) -> bool:
    try:
        BACKENDS[name].check_usable(devices)
    except ValueError:
        return False
    return True


def resolve_backend_name(name: str, devices: set[torch.device]) -> str:
    """Turn ``"auto"`` into a concrete backend for parameters on ``devices``; check any other name."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    if name == "auto":
        if all(d.type == "cuda" for d in devices) and TritonBackend.installed():
            return "triton"
        return "cpp" if _usable("cpp", devices) else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected 'auto' or one of {list(BACKENDS)}")
    BACKENDS[name].check_usable(devices)
    return name


def make_backend(name: str, blocks: list[Block], device: torch.device,
                 param_group: Mapping[int, int] | None = None) -> Backend:  # fmt: skip
    """The backend ``name`` (already resolved) over ``blocks``; ``device`` receives energies and radii;
    ``param_group`` maps ``id(p)`` to its param group's index (buckets never mix groups)."""
    return BACKENDS[name](blocks, device, param_group)

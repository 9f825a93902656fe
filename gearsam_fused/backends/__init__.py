"""Backend registry and the one dispatch point that turns a backend name into an implementation.

=============  ===============================================================  ==========================
name           what does the tensor work                                        where
=============  ===============================================================  ==========================
``reference``  a per-tensor loop written from the equations (the oracle)        any device
``torch``      vectorised torch ops over flat per-(device, dtype) buffers       any device
``triton``     Triton kernels over the same flat buffers                        CUDA (CPU: interpreter)
``cpp``        compiled C++/CUDA kernels (``gearsam_fused._C``) over them       CPU, and CUDA if built so
``sharded``    torch ops over temporary flat copies, tensors left in place      any device; FSDP2 shards
=============  ===============================================================  ==========================

``"auto"`` picks ``sharded`` for sharded parameters (DTensors, e.g. FSDP2's), whose storage the flat-buffer backends
may not take over; otherwise ``cpp`` when the extension is built for every device in use; otherwise ``triton`` when
every parameter is on a CUDA device and triton is installed; otherwise ``torch``.

``cpp`` before ``triton`` on CUDA rests on steps timed one at a time, each followed by a synchronisation: on an H200
``cpp``'s eager whole step took 0.4x to 0.9x ``triton``'s time up to 86.6M parameters (Triton's launcher and the
Python dispatch of ``torch.library`` operators cost more host time per launch). Queued back to back, as in a loop that
reads nothing back, ``triton`` was 3% to 10% faster at 86.6M (ViT-B/16's size), and at 354.8M it was faster either
way (``benchmarks/results/gpu-h200.md``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..partition import Block
from .base import Backend
from .cpp_backend import CppBackend
from .flat_buffer import FlatBufferBackend
from .reference import ReferenceBackend
from .sharded import ShardedBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

#: Every backend of the library, by name (see :func:`available_backends` for those that can run here).
BACKENDS: dict[str, type[Backend]] = {
    "reference": ReferenceBackend, "torch": TorchBackend, "triton": TritonBackend, "cpp": CppBackend,
    "sharded": ShardedBackend,
}  # fmt: skip
#: The backends that leave every parameter where it is (the FlatBufferBackend ones re-home them into flat buffers).
IN_PLACE_BACKENDS = tuple(name for name, cls in BACKENDS.items() if not issubclass(cls, FlatBufferBackend))


def available_backends() -> list[str]:
    """The backends that can run here, in :data:`BACKENDS`' order: those that ``backend=`` accepts for parameters on
    at least one device of this machine (the CPU, and CUDA where torch sees a CUDA device), as each backend's
    ``check_usable`` decides. ``cpp`` needs the compiled extension; ``triton`` needs the triton package and either a
    CUDA device or, for CPU tensors, ``TRITON_INTERPRET=1`` (Triton's interpreter; read from the environment at each
    call, it takes effect only where it was set before triton was imported). The others run everywhere. A name listed
    may still be refused for parameters on a particular device (``triton`` for CPU parameters without the interpreter,
    ``cpp`` for CUDA parameters where the extension has no CUDA kernels)."""
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    return [name for name in BACKENDS if any(_usable(name, {device}) for device in devices)]


def _usable(name: str, devices: set[torch.device]) -> bool:
    try:
        BACKENDS[name].check_usable(devices)
    except ValueError:
        return False
    return True


def resolve_backend_name(name: str, devices: set[torch.device], sharded: bool = False) -> str:
    """Turn ``"auto"`` into a concrete backend for parameters on ``devices`` (``sharded``: DTensors, such as FSDP2's
    shards); check any other name."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    if sharded and name == "auto":
        return "sharded"
    if sharded and name in BACKENDS and name not in IN_PLACE_BACKENDS:
        raise ValueError(
            f"backend {name!r} re-homes parameters into flat buffers of its own, but these parameters are sharded "
            "DTensors (FSDP2) whose shards FSDP2 keeps in its own buffers and all-gathers from; use backend='auto' "
            f"(or one of {list(IN_PLACE_BACKENDS)})"
        )
    if name == "auto":
        # cpp first on CUDA too: an eager step launches a few kernels per bucket, and torch.library's Python
        # dispatch and Triton's launcher cost more host time per launch than the compiled operators; timed step by
        # step, that outweighs the difference between the kernels up to 86.6M parameters, though queued steps, whose
        # host work overlaps the GPU's, favour triton from about that size (module docstring)
        if _usable("cpp", devices):
            return "cpp"
        if all(d.type == "cuda" for d in devices) and TritonBackend.installed():
            return "triton"
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected 'auto' or one of {list(BACKENDS)}")
    BACKENDS[name].check_usable(devices)
    return name


def make_backend(name: str, blocks: list[Block], device: torch.device,
                 param_group: Mapping[int, int] | None = None) -> Backend:  # fmt: skip
    """The backend ``name`` (already resolved) over ``blocks``; ``device`` receives energies and radii;
    ``param_group`` maps ``id(p)`` to its param group's index (buckets never mix groups)."""
    return BACKENDS[name](blocks, device, param_group)

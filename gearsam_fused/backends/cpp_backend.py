"""The ``cpp`` backend: the compiled kernels of ``gearsam_fused._C`` (sources in ``csrc/``) over flat buckets.

CPU kernels (threaded with ATen's ``parallel_for``, deterministic for any number of threads) are built wherever a C++
compiler is found at install time; CUDA kernels are added when torch is a CUDA build and nvcc is found. Importing the
extension registers the kernels as the operators ``torch.ops.gearsam_fused.*`` (``csrc/library.cpp``; their fakes, for
torch.compile and fake tensors, in :mod:`.cpp_fakes`), which have the same names and arguments as the Triton
launchers, so the step is the same four operations per bucket.
"""

from __future__ import annotations

import functools

import torch

from .flat_buffer import KernelBackend

#: How to get the extension, for error messages.
BUILD_HINT = (
    "build it by reinstalling gearsam_fused from its source tree with a C++ compiler and ninja available: "
    "`pip install ninja && pip install --no-build-isolation -e .` (GEARSAM_BUILD_CPP=1 turns a skipped build into an "
    "error that says why); or use backend='torch'"
)


@functools.cache
def _load() -> tuple[object | None, str]:
    """The kernel module, ``torch.ops.gearsam_fused`` (its operators registered, their fakes too), or None and why
    the extension could not be imported."""
    try:
        from . import cpp_fakes  # noqa: F401  (imports _C, which registers the operators; then their fakes)
    except ImportError as exc:
        return None, str(exc)
    return torch.ops.gearsam_fused, ""


def cpp_installed() -> bool:
    return _load()[0] is not None


def cpp_built_with_cuda() -> bool:
    if _load()[0] is None:
        return False
    from .. import _C

    return _C.built_with_cuda()


def cpp_stream_threshold_bytes() -> int | None:
    """Bytes past which the CPU kernels write the outputs they do not read with non-temporal stores (a core's
    private cache; csrc/cpu/stream.h): -1 where the CPU has no such stores, None where the extension is not built."""
    if _load()[0] is None:
        return None
    from .. import _C

    return _C.cpu_stream_threshold_bytes()


class CppBackend(KernelBackend):
    name = "cpp"

    @staticmethod
    def installed() -> bool:
        return cpp_installed()

    @staticmethod
    def check_usable(devices: set[torch.device]) -> None:
        module, why = _load()
        if module is None:
            raise ValueError(
                f"backend 'cpp' needs the C++ extension gearsam_fused._C, which is not built ({why}); {BUILD_HINT}"
            )
        unsupported = sorted(str(d) for d in devices if d.type not in ("cpu", "cuda"))
        if unsupported:
            raise ValueError(
                f"backend 'cpp' runs on CPU and CUDA tensors, but parameters are on {', '.join(unsupported)}"
            )
        if any(d.type == "cuda" for d in devices) and not cpp_built_with_cuda():
            raise ValueError(
                "backend 'cpp' was built without CUDA kernels, but parameters are on CUDA; reinstall with nvcc on PATH "
                "and a CUDA build of torch (GEARSAM_BUILD_CUDA=1 turns a skipped CUDA build into an error), or use "
                "backend='triton' or 'torch'"
            )

    def __init__(self, blocks, device: torch.device, param_group=None):
        self.check_usable({p.device for block in blocks for p in block.params})
        super().__init__(blocks, device, _load()[0], param_group)

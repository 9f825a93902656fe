"""What the launchers share: their buffer checks (worded once, in :mod:`gearsam_fused.checks`), the compute type, the
host scalars' two arguments, and how they are registered as operators."""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ..checks import (  # noqa: F401  (the launchers' checks, worded once)
    check_block_of_tile,
    check_correction,
    check_device_step,
    check_flat,
    check_friendly,
    check_momentum_energy,
    check_other,
    check_partials,
    check_real,
    check_same,
    check_scales,
)


# ------------------------------------------------------------------------------------------- host scalars
# A Triton scalar argument has one type per compiled signature, so a host scalar that a kernel uses in its compute
# precision goes in twice, as a float32 and a float64 argument, and the kernel picks one at compile time.
@triton.jit
def host_scalar(x32, x64, COMPUTE: tl.constexpr):
    """The host scalar as a COMPUTE value, rounded once: x64 for float64 kernels, x32 otherwise.

    Materialised as a typed value rather than left to implicit promotion, so that arithmetic between two scalars
    (``lerp_weight - 1``) runs in COMPUTE under the interpreter too, where scalar arguments arrive as Python doubles
    whatever their annotation."""
    return tl.full([], x64 if COMPUTE == tl.float64 else x32, COMPUTE)


def in_compute(x: float, dtype: torch.dtype) -> float:
    """x rounded to ``dtype`` (float32 or float64), back as a Python float. Host arithmetic, no tensor: the launcher
    also runs as the op's fake implementation."""
    if dtype == torch.float64:
        return float(x)
    try:
        return struct.unpack("f", struct.pack("f", x))[0]  # the C cast: round to nearest-even
    except OverflowError:  # rounds past float32's largest value
        return math.copysign(math.inf, x)


def pairs(*values: float) -> tuple[float, ...]:
    """Each host scalar twice, as the kernels take it: its float32 and its float64 argument (see host_scalar)."""
    return tuple(v for value in values for v in (value, value))


def compute_type(dtype: torch.dtype):
    """Triton type of the arithmetic for elements of ``dtype``: float64 stays float64, the rest run in float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# ------------------------------------------------------------------------------------------- registration
#: The torch.library namespace of the launchers: ``torch.ops.gearsam_fused_triton.perturb_`` and so on.
NAMESPACE = "gearsam_fused_triton"


def launches(kernel, tensor: torch.Tensor) -> bool:
    """Whether a launcher given ``tensor`` runs ``kernel`` now: not when the tensor is fake and the kernel interpreted.

    A registered launcher is also the op's fake implementation, run on fake tensors by torch.compile and opcheck. On
    the GPU ``wrap_triton`` turns the launch into a traceable call that does nothing on fake tensors; Triton's
    interpreter has no such call (``wrap_triton`` hands an interpreted kernel back as it is), and it would read the
    fake tensors' data."""
    from torch._subclasses.fake_tensor import is_fake
    from triton.runtime.interpreter import InterpretedFunction

    return not (is_fake(tensor) and isinstance(kernel, InterpretedFunction))


def _call_whole(mode, op, types, args, kwargs):
    """The op handed to functionalisation as one operator, as torch.export hands over a ``triton_op``."""
    return mode.__torch_dispatch__(op, types, args, kwargs)


def kept_whole(op):
    """``op`` (a ``triton_op``), functionalised as one operator rather than traced into its kernels.

    Traced into, its kernels would be compiled by Inductor, which takes none of their launch options: FMA contraction
    would be back on (see the package docstring); under the interpreter they would not be traced at all (see
    :func:`launches`). Kept whole, a compiled graph calls the op, which launches its kernels as eager code does."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    op.register_torch_dispatch(FunctionalTensorMode, _call_whole)
    return op

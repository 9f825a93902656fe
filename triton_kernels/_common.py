"""What the launchers share: their buffer checks (worded once, in :mod:`gearsam_fused.checks`), the compute type, and
how they are registered as operators."""

from __future__ import annotations

import torch

from ..checks import (  # noqa: F401  (the launchers' checks, worded once)
    check_block_of_tile,
    check_device_step,
    check_flat,
    check_other,
    check_real,
    check_same,
    check_scales,
)


def compute_type(dtype: torch.dtype):
    """Triton type of the arithmetic for elements of ``dtype``: float64 stays float64, the rest run in float32."""
    import triton.language as tl

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

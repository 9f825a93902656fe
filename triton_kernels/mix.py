"""The SAM family's element-wise work (GSAM, WSAM), in place on a flat bucket's second gradient and kept first one.

    mix_gradient_:        g_i <- fma(c, correction_i, a * g_i),  a = grad_scale[block], c = correction_scale[block]
                          of tile(i); arithmetic in float32 (float64 for float64 buffers), the product rounded on its
                          own, rounded once to the stored dtype
    exchange_sharpness_:  (g_i, correction_i) <- (correction_i, g_i - correction_i), the difference in float32
                          (float64 for float64 buffers), rounded once to the stored dtype

One program per tile; a tile lies inside one block, so the mix loads its block's two coefficients once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._common import (
    NAMESPACE,
    check_block_of_tile,
    check_flat,
    check_same,
    check_scales,
    compute_type,
    kept_whole,
    launches,
)
from .perturb import round_to


@triton.jit
def _mix_kernel(grad_ptr, correction_ptr, grad_scale_ptr, correction_scale_ptr, block_of_tile_ptr, TILE: tl.constexpr,
                COMPUTE: tl.constexpr):  # fmt: skip
    """g <- fma(c, correction, a * g) for the tile's block's (a, c), in COMPUTE precision."""
    tile = tl.program_id(0).to(tl.int64)
    offsets = tile * TILE + tl.arange(0, TILE)
    block = tl.load(block_of_tile_ptr + tile)
    a = tl.load(grad_scale_ptr + block).to(COMPUTE)
    c = tl.load(correction_scale_ptr + block).to(COMPUTE)
    stored = tl.load(grad_ptr + offsets)
    kept = tl.load(correction_ptr + offsets).to(COMPUTE)
    tl.store(grad_ptr + offsets, round_to(tl.fma(c, kept, a * stored.to(COMPUTE)), stored.dtype))


@triton.jit
def _exchange_kernel(grad_ptr, correction_ptr, TILE: tl.constexpr, COMPUTE: tl.constexpr):
    """(g, correction) <- (correction, g - correction), the difference in COMPUTE precision."""
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    g = tl.load(grad_ptr + offsets)
    kept = tl.load(correction_ptr + offsets)
    tl.store(correction_ptr + offsets, round_to(g.to(COMPUTE) - kept.to(COMPUTE), g.dtype))
    tl.store(grad_ptr + offsets, kept)


@kept_whole
@triton_op(f"{NAMESPACE}::mix_gradient_", mutates_args=("grad",))
def mix_gradient_(grad: torch.Tensor, correction: torch.Tensor, grad_scale: torch.Tensor, correction_scale: torch.Tensor,
                  block_of_tile: torch.Tensor, *, tile: int) -> None:  # fmt: skip
    """In place on ``grad``; ``grad_scale`` and ``correction_scale`` are float64 ``[B]``, ``block_of_tile`` int32 per
    tile."""
    check_flat("grad", grad, tile)
    check_same("correction", correction, "grad", grad)
    check_scales(grad_scale, correction_scale, grad)
    check_block_of_tile(block_of_tile, grad, tile)
    n_tiles = block_of_tile.numel()
    if n_tiles and launches(_mix_kernel, grad):
        wrap_triton(_mix_kernel)[(n_tiles,)](
            grad,
            correction,
            grad_scale,
            correction_scale,
            block_of_tile,
            TILE=tile,
            COMPUTE=compute_type(grad.dtype),
            enable_fp_fusion=False,
        )


@kept_whole
@triton_op(f"{NAMESPACE}::exchange_sharpness_", mutates_args=("grad", "correction"))
def exchange_sharpness_(grad: torch.Tensor, correction: torch.Tensor, *, tile: int) -> None:
    """In place on both: ``grad`` takes ``correction``, ``correction`` takes their difference."""
    check_flat("grad", grad, tile)
    check_same("correction", correction, "grad", grad)
    n_tiles = grad.numel() // tile
    if n_tiles and launches(_exchange_kernel, grad):
        wrap_triton(_exchange_kernel)[(n_tiles,)](
            grad, correction, TILE=tile, COMPUTE=compute_type(grad.dtype), enable_fp_fusion=False
        )

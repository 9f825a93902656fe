"""The SAM family's element-wise work (GSAM, WSAM), in place on a flat bucket's second gradient and kept first one.

    mix_gradient_:        g_i <- fma(c, correction_i, a * g_i),  a = grad_scale[block], c = correction_scale[block]
                          of tile(i); arithmetic in float32 (float64 for float64 buffers), the product rounded on its
                          own, rounded once to the stored dtype
    exchange_sharpness_:  (g_i, correction_i) <- (correction_i, g_i - correction_i), the difference in float32
                          (float64 for float64 buffers), rounded once to the stored dtype
    friendly_ascent_:     F-SAM's ascent, (g_i, m_i) <- (fma(-sigma, m_i, g_i), lerp(m_i, g_i, 1 - lmbda)), or
                          m_i <- g_i on the first step; formula and roundings in csrc/cpu/mix.cpp (torch's sub with
                          alpha and lerp on the CPU)

One program per tile; a tile lies inside one block, so the mix loads its block's two coefficients once. The ascent
works on any contiguous range of a bucket (a parameter without a gradient is left out), in masked programs of
:data:`FRIENDLY_BLOCK` elements.
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
    check_friendly,
    check_same,
    check_scales,
    compute_type,
    host_scalar,
    in_compute,
    kept_whole,
    launches,
    pairs,
)
from .perturb import round_to

#: elements per program of the ascent, which has no tiles
FRIENDLY_BLOCK = 1024


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


@triton.jit
def friendly(g, m, s, w, SMALL: tl.constexpr):
    """F-SAM's ascent on values in the compute type: ``(fma(-s, m, g), lerp(m, g, w))``, the lerp anchored by torch's
    rule (SMALL: ``|w| < 0.5``); shared with :func:`~triton_kernels.energy.friendly_energy_`."""
    if SMALL:
        m_new = tl.fma(w, g - m, m)
    else:
        m_new = tl.fma(w - 1.0, g - m, g)
    return tl.fma(-s, m, g), m_new


@triton.jit
def _friendly_kernel(grad_ptr, momentum_ptr, n, sigma32: tl.float32, sigma64: tl.float64, weight32: tl.float32,
                     weight64: tl.float64, FIRST: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr,
                     COMPUTE: tl.constexpr):  # fmt: skip
    """(g, m) <- (fma(-sigma, m, g), lerp(m, g, weight)), or m <- g when FIRST; each host scalar as a pair
    (_common.host_scalar), SMALL is |weight| < 0.5 in COMPUTE (torch's lerp rule)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    stored = tl.load(grad_ptr + offsets, mask=mask)
    if FIRST:
        tl.store(momentum_ptr + offsets, stored, mask=mask)
    else:
        m = tl.load(momentum_ptr + offsets, mask=mask).to(COMPUTE)
        s = host_scalar(sigma32, sigma64, COMPUTE)
        w = host_scalar(weight32, weight64, COMPUTE)
        g_new, m_new = friendly(stored.to(COMPUTE), m, s, w, SMALL)
        tl.store(grad_ptr + offsets, round_to(g_new, stored.dtype), mask=mask)
        tl.store(momentum_ptr + offsets, round_to(m_new, stored.dtype), mask=mask)


def small_weight(lmbda: float, dtype: torch.dtype) -> bool:
    """Whether the lerp weight ``1 - lmbda`` is below 0.5 in size: ATen decides on it rounded to its compute type."""
    return abs(in_compute(1.0 - lmbda, dtype)) < 0.5


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


@kept_whole
@triton_op(f"{NAMESPACE}::friendly_ascent_", mutates_args=("grad", "momentum"))
def friendly_ascent_(grad: torch.Tensor, momentum: torch.Tensor, *, sigma: float, lmbda: float, first: bool) -> None:
    """In place on both: ``grad`` takes F-SAM's ascent direction, ``momentum`` its EMA update (``first``: ``grad``)."""
    check_flat("grad", grad)
    check_friendly(grad, momentum, sigma, lmbda)
    n = grad.numel()
    weight = 1.0 - lmbda
    if n and launches(_friendly_kernel, grad):
        wrap_triton(_friendly_kernel)[(triton.cdiv(n, FRIENDLY_BLOCK),)](
            grad,
            momentum,
            n,
            *pairs(sigma, weight),
            FIRST=first,
            SMALL=small_weight(lmbda, grad.dtype),
            BLOCK=FRIENDLY_BLOCK,
            COMPUTE=compute_type(grad.dtype),
            enable_fp_fusion=False,
        )

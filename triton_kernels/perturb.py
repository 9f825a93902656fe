"""Perturbation to ``w + eps`` and its exact undoing, over a flat bucket.

    perturb_:  backup_i = w_i;   w_i <- w_i + scale[block_of_tile[tile(i)]] * T_i^2 * g_i   (w_i kept where scale is 0)
               T_i = |w_i| + eta (ASAM) or 1; arithmetic in float32 (float64 for float64 buffers), rounded once;
               with kept, kept_i = g_i as well (a copy of the stored bits, in every block)
    restore_:  w_i <- backup_i   (a copy of the stored bits: exact in every dtype)
    restore_discarding_backup_:  the same, as SAM's restore (backup is not read again)

One program per tile; a tile lies inside one block, so it loads its block's scale once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._common import NAMESPACE, check_block_of_tile, check_flat, check_same, compute_type, kept_whole, launches


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x (float32 or float64) rounded to nearest-even in DTYPE (here and in mix.py).

    float32 -> bfloat16 is done with integer arithmetic: Triton's interpreter truncates that cast, and this way CPU test
    runs round exactly like the GPU (and like torch)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _perturb_kernel(param_ptr, grad_ptr, backup_ptr, kept_ptr, scale_ptr, block_of_tile_ptr, eta32: tl.float32,
                    eta64: tl.float64, ADAPTIVE: tl.constexpr, KEEP: tl.constexpr, TILE: tl.constexpr,
                    COMPUTE: tl.constexpr):  # fmt: skip
    """backup = w;  w <- w + scale[block] * T^2 * g with T = |w| + eta if ADAPTIVE else 1, in COMPUTE precision;
    w unchanged when scale[block] is 0. KEEP: kept = g (kept_ptr is backup_ptr otherwise, never written)."""
    tile = tl.program_id(0).to(tl.int64)
    offsets = tile * TILE + tl.arange(0, TILE)
    scale = tl.load(scale_ptr + tl.load(block_of_tile_ptr + tile)).to(COMPUTE)
    stored = tl.load(param_ptr + offsets)
    tl.store(backup_ptr + offsets, stored)
    grad = tl.load(grad_ptr + offsets)
    if KEEP:
        tl.store(kept_ptr + offsets, grad)
    w = stored.to(COMPUTE)
    direction = grad.to(COMPUTE)
    if ADAPTIVE:
        t = tl.abs(w) + (eta64 if COMPUTE == tl.float64 else eta32)
        direction = t * t * direction
    # a block skipped this step (scale 0) keeps its bits, even where its gradient is inf or NaN
    tl.store(param_ptr + offsets, tl.where(scale == 0, stored, round_to(w + direction * scale, stored.dtype)))


@triton.jit
def _restore_kernel(param_ptr, backup_ptr, TILE: tl.constexpr):
    """w = backup, element by element, without arithmetic."""
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    tl.store(param_ptr + offsets, tl.load(backup_ptr + offsets))


@kept_whole
@triton_op(f"{NAMESPACE}::perturb_", mutates_args=("param", "backup", "kept"))
def perturb_(param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor, scale: torch.Tensor,
             block_of_tile: torch.Tensor, kept: torch.Tensor | None = None, *, tile: int, adaptive: bool,
             eta: float) -> None:  # fmt: skip
    """In place on ``param`` (saving it to ``backup``); ``scale`` is float64 ``[B]``, ``block_of_tile`` int32 per
    tile; ``kept``, where given, receives a copy of ``grad`` in the same pass."""
    check_flat("param", param, tile)
    check_same("grad", grad, "param", param)
    check_same("backup", backup, "param", param)
    check_flat("scale", scale, dtype=torch.float64, device=param.device)
    check_block_of_tile(block_of_tile, param, tile)
    if kept is not None:
        check_same("kept", kept, "param", param)
    n_tiles = block_of_tile.numel()
    if n_tiles and launches(_perturb_kernel, param):
        wrap_triton(_perturb_kernel)[(n_tiles,)](
            param,
            grad,
            backup,
            backup if kept is None else kept,
            scale,
            block_of_tile,
            eta,
            eta,
            ADAPTIVE=adaptive,
            KEEP=kept is not None,
            TILE=tile,
            COMPUTE=compute_type(param.dtype),
            enable_fp_fusion=False,
        )


def _launch_restore(param: torch.Tensor, backup: torch.Tensor, tile: int) -> None:
    check_flat("param", param, tile)
    check_same("backup", backup, "param", param)
    n_tiles = param.numel() // tile
    if n_tiles and launches(_restore_kernel, param):
        wrap_triton(_restore_kernel)[(n_tiles,)](param, backup, TILE=tile)


@kept_whole
@triton_op(f"{NAMESPACE}::restore_", mutates_args=("param",))
def restore_(param: torch.Tensor, backup: torch.Tensor, *, tile: int) -> None:
    """``param`` takes back the bits saved in ``backup``."""
    _launch_restore(param, backup, tile)


@kept_whole
@triton_op(f"{NAMESPACE}::restore_discarding_backup_", mutates_args=("param", "backup"))
def restore_discarding_backup_(param: torch.Tensor, backup: torch.Tensor, *, tile: int) -> None:
    """SAM's restore, after which ``backup`` is not read again: :func:`restore_`'s copy here. ``backup`` is declared
    written, as the contract lets an implementation exchange the two buffers' memory instead (the C++ CPU kernels do,
    past the stream threshold)."""
    _launch_restore(param, backup, tile)

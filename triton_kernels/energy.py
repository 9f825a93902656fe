"""Block gradient energy over a flat bucket, deterministic.

    partial_t = sum_{i in tile t} (T_i * g_i)^2          T_i = |w_i| + eta (ASAM) or 1; float32 accumulation
                                                         (float64 for float64 gradients); with other, the
                                                         products g_i * other_i in their place (T = 1)
    e_b       = sum_{t = first_tile_of_block[b]}^{first_tile_of_block[b+1] - 1} partial_t      float64, in tile order

Two launches, no atomics: each tile's sum is one program's fixed tree reduction, and each block's sum is one program
walking its tiles in order, so the same gradients always give bitwise the same energies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._common import NAMESPACE, check_flat, check_other, check_same, compute_type, kept_whole, launches

#: Tiles summed per loop iteration of the per-block reduction.
_BLOCK_CHUNK = 256


@triton.jit
def _tile_energy_kernel(grad_ptr, second_ptr, partial_ptr, eta32: tl.float32, eta64: tl.float64,
                        ADAPTIVE: tl.constexpr, PRODUCT: tl.constexpr, TILE: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """partial[t] = sum over the TILE elements of tile t of (T * g)^2, with T = |w| + eta if ADAPTIVE else 1 (second
    is param); or with PRODUCT of g * other (second is other)."""
    tile = tl.program_id(0).to(tl.int64)  # 64-bit: a bucket may hold more than 2**31 elements
    offsets = tile * TILE + tl.arange(0, TILE)
    g = tl.load(grad_ptr + offsets).to(ACC)
    if PRODUCT:
        terms = g * tl.load(second_ptr + offsets).to(ACC)
    else:
        if ADAPTIVE:
            w = tl.load(second_ptr + offsets).to(ACC)
            g = (tl.abs(w) + (eta64 if ACC == tl.float64 else eta32)) * g
        terms = g * g
    tl.store(partial_ptr + tile, tl.sum(terms, axis=0).to(tl.float64))


@triton.jit
def _block_sum_kernel(partial_ptr, first_tile_of_block_ptr, energy_ptr, CHUNK: tl.constexpr):
    """energy[b] = sum of partial[t] for t in [first_tile_of_block[b], first_tile_of_block[b + 1]), float64, in tile
    order."""
    block = tl.program_id(0)
    first = tl.load(first_tile_of_block_ptr + block)
    last = tl.load(first_tile_of_block_ptr + block + 1)
    acc = tl.zeros([CHUNK], dtype=tl.float64)
    for start in range(first, last, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        acc += tl.load(partial_ptr + offsets, mask=offsets < last, other=0.0)
    tl.store(energy_ptr + block, tl.sum(acc, axis=0))


@kept_whole
@triton_op(f"{NAMESPACE}::block_energy", mutates_args=("partials",))
def block_energy(grad: torch.Tensor, param: torch.Tensor, first_tile_of_block: torch.Tensor, partials: torch.Tensor,
                 other: torch.Tensor | None = None, *, tile: int, adaptive: bool, eta: float) -> torch.Tensor:  # fmt: skip
    """float64 ``[B]``: ``e_b`` of every block of the bucket (``B = len(first_tile_of_block) - 1``); with ``other``
    (``adaptive`` False) the inner product of ``grad`` and ``other`` per block, by the same reduction.

    ``grad`` and ``param`` are the bucket's flat buffers (``param`` is read only when ``adaptive``); ``partials`` is
    float64 scratch with one entry per tile, overwritten.
    """
    check_flat("grad", grad, tile)
    check_same("param", param, "grad", grad)
    check_other(other, grad, adaptive)
    check_flat("first_tile_of_block", first_tile_of_block, dtype=torch.int64, device=grad.device)
    n_tiles = grad.numel() // tile
    check_flat("partials", partials, dtype=torch.float64, device=grad.device)
    if partials.numel() != n_tiles:
        raise ValueError(f"partials has {partials.numel()} entries for {n_tiles} tiles")
    n_blocks = first_tile_of_block.numel() - 1
    energy = torch.empty(n_blocks, dtype=torch.float64, device=grad.device)
    if n_tiles and launches(_tile_energy_kernel, grad):
        wrap_triton(_tile_energy_kernel)[(n_tiles,)](
            grad,
            param if other is None else other,
            partials,
            eta,
            eta,
            ADAPTIVE=adaptive,
            PRODUCT=other is not None,
            TILE=tile,
            ACC=compute_type(grad.dtype),
            enable_fp_fusion=False,
        )
    if n_blocks and launches(_block_sum_kernel, grad):
        wrap_triton(_block_sum_kernel)[(n_blocks,)](partials, first_tile_of_block, energy, CHUNK=_BLOCK_CHUNK)
    return energy

"""Block gradient energy over a flat bucket, deterministic.

    partial_t = sum_{i in tile t} (T_i * g_i)^2          T_i = |w_i| + eta (ASAM) or 1; float32 accumulation
                                                         (float64 for float64 gradients)
    e_b       = sum_{t = first_tile_of_block[b]}^{first_tile_of_block[b+1] - 1} partial_t      float64, in tile order

With other (T = 1), in the same read of each tile, the products g_i * other_i as well, summed the same way into
partial_{n_tiles + t} and per block into a second row of the result.

Two launches, no atomics: each tile's sum is one program's fixed tree reduction, and each block's sum is one program
walking its tiles in order, so the same gradients always give bitwise the same energies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._common import NAMESPACE, check_flat, check_other, check_partials, check_same, compute_type, kept_whole, launches

#: Tiles summed per loop iteration of the per-block reduction.
_BLOCK_CHUNK = 256


@triton.jit
def _tile_energy_kernel(grad_ptr, second_ptr, partial_ptr, n_tiles, eta32: tl.float32, eta64: tl.float64,
                        ADAPTIVE: tl.constexpr, PRODUCT: tl.constexpr, TILE: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """partial[t] = sum over the TILE elements of tile t of (T * g)^2, with T = |w| + eta if ADAPTIVE else 1 (second
    is param); with PRODUCT (T = 1) also partial[n_tiles + t] = the sum of g * other (second is other)."""
    tile = tl.program_id(0).to(tl.int64)  # 64-bit: a bucket may hold more than 2**31 elements
    offsets = tile * TILE + tl.arange(0, TILE)
    g = tl.load(grad_ptr + offsets).to(ACC)
    if PRODUCT:
        products = g * tl.load(second_ptr + offsets).to(ACC)
        tl.store(partial_ptr + n_tiles + tile, tl.sum(products, axis=0).to(tl.float64))
    if ADAPTIVE:
        w = tl.load(second_ptr + offsets).to(ACC)
        g = (tl.abs(w) + (eta64 if ACC == tl.float64 else eta32)) * g
    tl.store(partial_ptr + tile, tl.sum(g * g, axis=0).to(tl.float64))


@triton.jit
def _block_sum_kernel(partial_ptr, first_tile_of_block_ptr, energy_ptr, n_tiles, n_blocks, CHUNK: tl.constexpr):
    """energy[r, b] = sum of partial[r * n_tiles + t] for t in [first_tile_of_block[b], first_tile_of_block[b + 1]),
    float64, in tile order; r is the second program index (one row, or two with other)."""
    block = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    partial_ptr += row * n_tiles
    energy_ptr += row * n_blocks
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
    (``adaptive`` False) ``[2, B]``: the energies, and the inner products of ``grad`` and ``other`` per block by the
    same reduction, in the same read of ``grad``.

    ``grad`` and ``param`` are the bucket's flat buffers (``param`` is read only when ``adaptive``); ``partials`` is
    float64 scratch with one entry per tile (two with ``other``), overwritten.
    """
    check_flat("grad", grad, tile)
    check_same("param", param, "grad", grad)
    check_other(other, grad, adaptive)
    check_flat("first_tile_of_block", first_tile_of_block, dtype=torch.int64, device=grad.device)
    check_flat("partials", partials, dtype=torch.float64, device=grad.device)
    n_tiles, rows = check_partials(partials, grad, tile, other)
    n_blocks = first_tile_of_block.numel() - 1
    energy = torch.empty((rows, n_blocks) if other is not None else (n_blocks,), dtype=torch.float64,
                         device=grad.device)  # fmt: skip
    if n_tiles and launches(_tile_energy_kernel, grad):
        wrap_triton(_tile_energy_kernel)[(n_tiles,)](
            grad,
            param if other is None else other,
            partials,
            n_tiles,
            eta,
            eta,
            ADAPTIVE=adaptive,
            PRODUCT=other is not None,
            TILE=tile,
            ACC=compute_type(grad.dtype),
            enable_fp_fusion=False,
        )
    if n_blocks and launches(_block_sum_kernel, grad):
        wrap_triton(_block_sum_kernel)[(n_blocks, rows)](
            partials, first_tile_of_block, energy, n_tiles, n_blocks, CHUNK=_BLOCK_CHUNK
        )
    return energy

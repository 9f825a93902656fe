"""Block gradient energy over a flat bucket, deterministic.

    partial_t = sum_{i in tile t} (T_i * g_i)^2          T_i = |w_i| + eta (ASAM) or 1; float32 accumulation
                                                         (float64 for float64 gradients)
    e_b       = sum_{t = first_tile_of_block[b]}^{first_tile_of_block[b+1] - 1} partial_t      float64, in tile order

With other (T = 1), in the same read of each tile, the products g_i * other_i as well, summed the same way into
partial_{n_tiles + t} and per block into a second row of the result.

Overflow: a float32 square overflows from about 1.8e19 (the square root of FLT_MAX), and a float32 sum of squares
sooner, while the float64 energy holds up to 1.8e308. Where a tile's float32 sum is not finite, the program sums the
tile again from the values it holds, every term formed in float64 (T with the float64 eta) and summed in float64 by
tl.sum's fixed tree: a finite gradient gives a finite energy, and only an inf or a NaN in it (or a sum past DBL_MAX) a
non-finite one. The common case pays one test per tile; float64 gradients have no wider type to take.

friendly_energy_ takes F-SAM's ascent (triton_kernels.mix) on each tile first and sums the new gradient's squares the
same way: the bits of friendly_ascent_ followed by block_energy, in one read.

Two launches, no atomics: each tile's sum is one program's fixed tree reduction, and each block's sum is one program
walking its tiles in order, so the same gradients always give bitwise the same energies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._common import (
    NAMESPACE,
    check_flat,
    check_friendly,
    check_other,
    check_partials,
    check_same,
    compute_type,
    host_scalar,
    kept_whole,
    launches,
    pairs,
)
from .mix import friendly, small_weight
from .perturb import round_to

#: Tiles summed per loop iteration of the per-block reduction.
_BLOCK_CHUNK = 256


@triton.jit
def _sum_of_products(a, b, ACC: tl.constexpr):
    """The tile's sum of a * b (a and b in ACC) in ACC, as float64; where a float32 sum is not finite, the products
    formed and summed in float64 instead (the module's overflow rule; ``x - x == 0`` fails for inf and NaN alone)."""
    total = tl.sum(a * b, axis=0).to(tl.float64)
    if ACC != tl.float64:
        if not (total - total == 0):
            total = tl.sum(a.to(tl.float64) * b.to(tl.float64), axis=0)
    return total


@triton.jit
def _square_sum(g, second_ptr, offsets, eta32, eta64, ADAPTIVE: tl.constexpr, ACC: tl.constexpr):
    """The tile's sum of (T * g)^2 in ACC, as float64; g in ACC, T = |w| + eta (w from second) if ADAPTIVE else 1.
    Where a float32 sum is not finite, T * g formed (T with eta64) and squared and summed in float64 instead."""
    if ADAPTIVE:
        w = tl.load(second_ptr + offsets).to(ACC)
        t = (tl.abs(w) + (eta64 if ACC == tl.float64 else eta32)) * g
        total = tl.sum(t * t, axis=0).to(tl.float64)
        if ACC != tl.float64:
            if not (total - total == 0):
                wide = (tl.abs(w.to(tl.float64)) + eta64) * g.to(tl.float64)
                total = tl.sum(wide * wide, axis=0)
    else:
        total = _sum_of_products(g, g, ACC)
    return total


@triton.jit
def _tile_energy_kernel(grad_ptr, second_ptr, partial_ptr, n_tiles, eta32: tl.float32, eta64: tl.float64,
                        ADAPTIVE: tl.constexpr, PRODUCT: tl.constexpr, TILE: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """partial[t] = sum over the TILE elements of tile t of (T * g)^2, with T = |w| + eta if ADAPTIVE else 1 (second
    is param); with PRODUCT (T = 1) also partial[n_tiles + t] = the sum of g * other (second is other)."""
    tile = tl.program_id(0).to(tl.int64)  # 64-bit: a bucket may hold more than 2**31 elements
    offsets = tile * TILE + tl.arange(0, TILE)
    g = tl.load(grad_ptr + offsets).to(ACC)
    if PRODUCT:
        other = tl.load(second_ptr + offsets).to(ACC)
        tl.store(partial_ptr + n_tiles + tile, _sum_of_products(g, other, ACC))
    tl.store(partial_ptr + tile, _square_sum(g, second_ptr, offsets, eta32, eta64, ADAPTIVE, ACC))


@triton.jit
def _friendly_energy_kernel(grad_ptr, momentum_ptr, param_ptr, partial_ptr, sigma32: tl.float32, sigma64: tl.float64,
                            weight32: tl.float32, weight64: tl.float64, eta32: tl.float32, eta64: tl.float64,
                            FIRST: tl.constexpr, SMALL: tl.constexpr, ADAPTIVE: tl.constexpr, TILE: tl.constexpr,
                            ACC: tl.constexpr):  # fmt: skip
    """F-SAM's ascent on tile t (mix.friendly; m <- g when FIRST), then partial[t] as _tile_energy_kernel sums the
    new g."""
    tile = tl.program_id(0).to(tl.int64)
    offsets = tile * TILE + tl.arange(0, TILE)
    stored = tl.load(grad_ptr + offsets)
    if FIRST:
        tl.store(momentum_ptr + offsets, stored)
    else:
        m = tl.load(momentum_ptr + offsets).to(ACC)
        s = host_scalar(sigma32, sigma64, ACC)
        w = host_scalar(weight32, weight64, ACC)
        g_new, m_new = friendly(stored.to(ACC), m, s, w, SMALL)
        tl.store(momentum_ptr + offsets, round_to(m_new, stored.dtype))
        stored = round_to(g_new, stored.dtype)
        tl.store(grad_ptr + offsets, stored)
    tl.store(partial_ptr + tile, _square_sum(stored.to(ACC), param_ptr, offsets, eta32, eta64, ADAPTIVE, ACC))


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
    check_other(other, grad, adaptive)
    n_tiles, n_blocks = _check_energy(grad, param, first_tile_of_block, partials, tile, other)
    rows = 1 if other is None else 2
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
    _block_sums(partials, first_tile_of_block, energy, n_tiles, rows)
    return energy


@kept_whole
@triton_op(f"{NAMESPACE}::friendly_energy_", mutates_args=("grad", "momentum", "partials"))
def friendly_energy_(grad: torch.Tensor, momentum: torch.Tensor, param: torch.Tensor, first_tile_of_block: torch.Tensor,
                     partials: torch.Tensor, *, tile: int, adaptive: bool, eta: float, sigma: float, lmbda: float,
                     first: bool) -> torch.Tensor:  # fmt: skip
    """:func:`~triton_kernels.mix.friendly_ascent_` on the whole bucket, then :func:`block_energy` of the new ``grad``
    (``other`` None), in one read: float64 ``[B]``, bit for bit the two launchers one after the other."""
    n_tiles, n_blocks = _check_energy(grad, param, first_tile_of_block, partials, tile)
    check_friendly(grad, momentum, sigma, lmbda)
    energy = torch.empty((n_blocks,), dtype=torch.float64, device=grad.device)
    if n_tiles and launches(_friendly_energy_kernel, grad):
        wrap_triton(_friendly_energy_kernel)[(n_tiles,)](
            grad,
            momentum,
            param,
            partials,
            *pairs(sigma, 1.0 - lmbda, eta),
            FIRST=first,
            SMALL=small_weight(lmbda, grad.dtype),
            ADAPTIVE=adaptive,
            TILE=tile,
            ACC=compute_type(grad.dtype),
            enable_fp_fusion=False,
        )
    _block_sums(partials, first_tile_of_block, energy, n_tiles, 1)
    return energy


def _check_energy(grad, param, first_tile_of_block, partials, tile, other=None) -> tuple[int, int]:
    """The energy launchers' common arguments; ``(n_tiles, n_blocks)``."""
    check_flat("grad", grad, tile)
    check_same("param", param, "grad", grad)
    check_flat("first_tile_of_block", first_tile_of_block, dtype=torch.int64, device=grad.device)
    check_flat("partials", partials, dtype=torch.float64, device=grad.device)
    n_tiles, _ = check_partials(partials, grad, tile, other)
    return n_tiles, first_tile_of_block.numel() - 1


def _block_sums(partials, first_tile_of_block, energy, n_tiles: int, rows: int) -> None:
    """Stage two: each block's tiles of each row of ``partials`` summed into ``energy``."""
    n_blocks = first_tile_of_block.numel() - 1
    if n_blocks and launches(_block_sum_kernel, partials):
        wrap_triton(_block_sum_kernel)[(n_blocks, rows)](
            partials, first_tile_of_block, energy, n_tiles, n_blocks, CHUNK=_BLOCK_CHUNK
        )

"""The ``torch`` backend: the fused step as a handful of vectorised torch operations per flat bucket.

Portable (any device torch runs on) and exact to the same contract as the Triton kernels::

    partial_t = ||T g||_2^2 over tile t                norm in float32 (float64 for float64), squared in float64
    e_b       = sum_{t in block b} partial_t             torch.segment_reduce over the block's tile range
    backup    = w;   w <- w + scale[block(i)] * T_i^2 * g_i   in float32 (float64), one addcmul; w where scale is 0
    w         <- backup

with ``T = |w| + eta`` for ASAM and 1 otherwise. The number of operations does not depend on how many tensors the
model has; every reduction has a fixed order, so results are deterministic. ``addcmul`` may contract the multiply and
add into one FMA, so ``w + eps`` can differ from the reference's separately rounded formula by one unit in the last
place (the Triton backend matches it bit for bit).
"""

from __future__ import annotations

import torch

from ..flat import Bucket
from .base import compute_dtype
from .fused import FusedBackend


class TorchBackend(FusedBackend):
    name = "torch"

    @staticmethod
    def _tiles(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return flat.view(bucket.n_tiles, bucket.tile)

    @torch.no_grad()
    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float) -> torch.Tensor:
        g = self._tiles(bucket.grad, bucket)
        dtype = compute_dtype(g)
        if adaptive:
            g = self._tiles(bucket.param, bucket).abs().to(dtype).add_(eta).mul_(g)
        # Tile norms in the compute dtype, squared in float64: asking vector_norm for float64 directly would first copy
        # the whole buffer to float64.
        norms = torch.linalg.vector_norm(g, dim=1, dtype=None if g.dtype == dtype else dtype)
        bucket.partials.copy_(norms)
        # unsafe: the lengths are ours and valid; checking them would read them back to the host
        return torch.segment_reduce(bucket.partials.square_(), "sum", lengths=bucket.tiles_per_block, unsafe=True)

    @torch.no_grad()
    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        bucket.backup.copy_(bucket.param)
        w = self._tiles(bucket.param, bucket)
        g = self._tiles(bucket.grad, bucket)
        dtype = compute_dtype(w)
        tile_scale = scale[bucket.tile_block].to(dtype).unsqueeze(1)
        skipped = tile_scale == 0  # a block skipped this step stays w, even where its gradient is inf or NaN
        if not adaptive and w.dtype == dtype:
            torch.where(skipped, w, w.addcmul(g, tile_scale), out=w)
            return
        w_compute = w.to(dtype, copy=True)
        direction = g.to(dtype)
        if adaptive:
            direction = w_compute.abs().add_(eta).square_().mul_(direction)
        w.copy_(torch.where(skipped, w_compute, w_compute.addcmul(direction, tile_scale)))

    @torch.no_grad()
    def _bucket_restore(self, bucket: Bucket) -> None:
        bucket.param.copy_(bucket.backup)

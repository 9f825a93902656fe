"""The ``torch`` backend: the fused step as a handful of vectorised torch operations per flat bucket.

Portable (any device torch runs on) and exact to the same contract as the Triton kernels::

    partial_t = ||T g||_2^2 over tile t                norm in float32 (float64 for float64), squared in float64;
                                                        where the float32 sum of squares overflows (|T g| from
                                                        about 1.8e19, or smaller ones summed), in float64 (below)
    e_b       = sum_{t in block b} partial_t             torch.segment_reduce over the block's tile range
    backup    = w;   w <- w + scale[block(i)] * T_i^2 * g_i   in float32 (float64), one addcmul; w where scale is 0
    w         <- backup
    w, state  <- torch's SGD/Adam(W) update of backup over the whole bucket  (torch's own operations, in place)

with ``T = |w| + eta`` for ASAM and 1 otherwise. The number of operations does not depend on how many tensors the
model has; every reduction has a fixed order, so results are deterministic. ``addcmul`` may contract the multiply and
add into one FMA, so ``w + eps`` can differ from the reference's separately rounded formula by one unit in the last
place (the Triton backend matches it bit for bit). The fused base step runs the operations of torch's single-tensor
update (``foreach=False``) on the whole flat buffer: they are element-wise, so it equals torch's optimizer stepping
the pieces bit for bit. They read ``w`` from the backup, so the restore costs no pass of its own, and write their
intermediates into the parameter buffer, so nothing is allocated (a few passes, where the compiled kernels take one).
A step a schedule leaves unperturbed reads ``w`` from the parameters and keeps its intermediates in the backup;
LookSAM's corrected gradient ``g + c_b * g_v`` is one ``addcmul`` (rounded twice, where the kernels take one fma).

The kernels take every tile whose float32 sum overflowed again in float64, so that a finite gradient always has a
finite energy. Torch operations cannot choose which tiles to read without bringing a value to the host, so this
backend takes again the few tiles of each bucket with the largest float32 norms, which are the overflowed ones where
there are any (:func:`~gearsam_fused.backends.flat_buffer.retake_overflowed_tiles`: up to ``RETAKEN_TILES`` per
bucket and call).
"""

from __future__ import annotations

import torch

from ..base_step import BucketUpdate, adam_scalars
from ..flat import Bucket
from .base import compute_dtype
from .flat_buffer import _CHUNK, FlatBufferBackend, retake_overflowed_tiles


class TorchBackend(FlatBufferBackend):
    name = "torch"

    @staticmethod
    def _tiles(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return flat.view(bucket.n_tiles, bucket.tile)

    @torch.no_grad()
    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float, grad: torch.Tensor | None = None):
        g = self._tiles(bucket.grad if grad is None else grad, bucket)
        dtype = compute_dtype(g)
        t = g
        if adaptive:
            t = self._tiles(bucket.param, bucket).abs().to(dtype).add_(eta).mul_(g)
        # Tile norms in the compute dtype, squared in float64: asking vector_norm for float64 directly would first copy
        # the whole buffer to float64.
        norms = torch.linalg.vector_norm(t, dim=1, dtype=None if t.dtype == dtype else dtype)
        partials = bucket.energy_partials
        partials.copy_(norms)
        # float16 squares stay below 4.3e9 (ASAM's, with eta under 1e12, below 4.3e33): a tile's float32 sum is finite
        if dtype != torch.float64 and not (g.dtype == torch.float16 and (not adaptive or abs(eta) < 1e12)):

            def wide(index: torch.Tensor) -> torch.Tensor:  # the tiles' norms, T g formed in float64
                v = g.index_select(0, index)
                if not adaptive:
                    return torch.linalg.vector_norm(v, dim=1, dtype=torch.float64)
                w = self._tiles(bucket.param, bucket).index_select(0, index).double()
                return torch.linalg.vector_norm(w.abs_().add_(eta).mul_(v), dim=1)

            retake_overflowed_tiles(partials, wide)
        # unsafe: the lengths are ours and valid; checking them would read them back to the host
        return torch.segment_reduce(partials.square_(), "sum", lengths=bucket.tile_count_of_block, unsafe=True)

    @torch.no_grad()
    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float,
                        direction: torch.Tensor | None = None) -> None:  # fmt: skip
        bucket.backup.copy_(bucket.param)
        w = self._tiles(bucket.param, bucket)
        g = self._tiles(bucket.grad if direction is None else direction, bucket)
        dtype = compute_dtype(w)
        tile_scale = scale[bucket.block_of_tile].to(dtype).unsqueeze(1)
        skipped = tile_scale == 0  # a block skipped this step stays w, even where its gradient is inf or NaN
        if not adaptive and w.dtype == dtype:
            rows = max(1, _CHUNK // bucket.tile)  # a bounded temporary, still in cache when it is written back
            for start in range(0, bucket.n_tiles, rows):
                part = slice(start, start + rows)
                torch.where(skipped[part], w[part], w[part].addcmul(g[part], tile_scale[part]), out=w[part])
            return
        w_compute = w.to(dtype, copy=True)
        direction = g.to(dtype)
        if adaptive:
            direction = w_compute.abs().add_(eta).square_().mul_(direction)
        w.copy_(torch.where(skipped, w_compute, w_compute.addcmul(direction, tile_scale)))

    @torch.no_grad()
    def _bucket_restore(self, bucket: Bucket) -> None:
        bucket.param.copy_(bucket.backup)

    @torch.no_grad()
    def _bucket_restore_and_update(self, update: BucketUpdate, found_inf: torch.Tensor | None, mix,
                                   momentum_energy: bool = False) -> None:  # fmt: skip
        # w is read from the backup; the parameter buffer holds the intermediates until it receives the new w
        bucket = update.bucket
        self._base_update(update, bucket.backup, bucket.grad, scratch=bucket.param, out=bucket.param)

    @torch.no_grad()
    def _bucket_update(self, update: BucketUpdate, scale, momentum_energy: bool = False) -> None:
        # w is the parameter buffer itself; the backup, unused on such a step, holds the intermediates
        bucket = update.bucket
        g = bucket.grad
        if scale is not None:
            tile_scale = scale[bucket.block_of_tile].to(g.dtype).unsqueeze(1)
            corrected = self._tiles(bucket.backup, bucket)
            kept = self._tiles(self._flat_correction(bucket), bucket)
            torch.addcmul(self._tiles(g, bucket), kept, tile_scale, out=corrected)
            g = bucket.backup
        self._base_update(update, bucket.param, g, scratch=bucket.backup, out=bucket.param)

    def _base_update(self, update: BucketUpdate, w, g, *, scratch: torch.Tensor, out: torch.Tensor) -> None:
        """torch's own single-tensor update, operation for operation, written with out= so that nothing is allocated:
        ``w`` is read (and may be ``out``), ``g`` is read (and may be ``scratch``), the result is written to ``out``."""
        if update.hyper["maximize"]:
            g = torch.neg(g, out=scratch)
        if update.kind == "sgd":
            self._sgd(update, w, g, scratch, out)
        else:
            self._adam(update, w, g, scratch, out)

    @staticmethod
    def _sgd(update: BucketUpdate, w, g, scratch: torch.Tensor, out: torch.Tensor) -> None:
        h, buf = update.hyper, update.state[0]
        if h["weight_decay"] != 0:
            g = torch.add(g, w, alpha=h["weight_decay"], out=scratch)
        if h["momentum"] != 0:
            if update.step == 1:
                buf.copy_(g)
            else:
                buf.mul_(h["momentum"]).add_(g, alpha=1 - h["dampening"])
            g = torch.add(g, buf, alpha=h["momentum"], out=scratch) if h["nesterov"] else buf
        torch.add(w, g, alpha=-h["lr"], out=out)

    @staticmethod
    def _adam(update: BucketUpdate, w, g, scratch: torch.Tensor, out: torch.Tensor) -> None:
        h, (exp_avg, exp_avg_sq, max_exp_avg_sq) = update.hyper, update.state
        beta1, beta2 = h["betas"]
        step_size, bias_correction2_sqrt, decay = adam_scalars(h["lr"], beta1, beta2, h["weight_decay"], update.step)
        if h["weight_decay"] != 0:
            if h["decoupled_weight_decay"]:
                w = w.mul_(decay)  # w is the backup, not needed after this step, or the parameters themselves
            else:
                g = torch.add(g, w, alpha=h["weight_decay"], out=scratch)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        second = exp_avg_sq
        if h["amsgrad"]:
            second = torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = torch.sqrt(second, out=scratch).div_(bias_correction2_sqrt).add_(h["eps"])
        torch.addcdiv(w, exp_avg, denom, value=-step_size, out=out)

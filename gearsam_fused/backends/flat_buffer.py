"""What the flat-buffer backends share: the layout, keeping it in sync, and the step flow over buckets.

A subclass supplies the tensor work for one bucket (:meth:`FlatBufferBackend._bucket_energy`, ``_bucket_perturb``,
``_bucket_restore``, ``_bucket_restore_and_update``); everything here costs a constant number of device operations per bucket, however many
parameter tensors the model has. :class:`KernelBackend` supplies it from a module of kernel launchers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Protocol

import torch

from ..allocation import GEAR_RULE, check_rule
from ..base_step import BucketUpdate
from ..family import Mix
from ..flat import Bucket, FlatLayout
from .base import CORRECTION, DIRECTION, MOMENTUM, Backend, Direction, compute_dtype, friendly_ascent


class FlatBufferBackend(Backend):
    fuses_base_step = True

    def __init__(self, blocks, device: torch.device, param_group=None):
        super().__init__(blocks, device, param_group)
        self.layout = FlatLayout(blocks, param_group=param_group)

    # ------------------------------------------------------------------ per-bucket work, by subclasses
    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float, grad: torch.Tensor | None = None):
        """float64 ``[B]`` on the bucket's device: this bucket's share of every block's energy, of ``grad`` (a flat
        buffer laid out like the bucket's; its gradient when None)."""
        raise NotImplementedError

    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float,
                        kept: torch.Tensor | None = None, direction: torch.Tensor | None = None) -> None:  # fmt: skip
        """The bucket's perturbation along its gradient, or along ``direction`` (a flat buffer laid out like it);
        ``kept`` (only where :attr:`folds_keep`) receives the gradient as well."""
        raise NotImplementedError

    def _bucket_restore(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def _bucket_restore_and_update(self, update: BucketUpdate, found_inf: torch.Tensor | None, mix: Mix | None,
                                   momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """The restore and update of one bucket; with ``mix`` (only where :attr:`folds_mix`), from the gradient
        :meth:`mix_gradient_` would make, in the same pass. With ``momentum_energy``, the bucket's share of the new
        momentum's block energies where the update summed them as it wrote it, else None (then read afterwards)."""
        raise NotImplementedError

    def _bucket_update(self, update: BucketUpdate, scale: torch.Tensor | None,
                       momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """The base update of the bucket's current weights with the gradient ``g + scale[b] * correction`` (``g``
        when ``scale`` is None), ``correction`` the bucket's kept buffer; ``momentum_energy`` as for
        :meth:`_bucket_restore_and_update`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the Backend contract
    def block_energy(self, adaptive: bool, eta: float) -> torch.Tensor:
        self.layout.sync()
        energy = None
        for bucket in self.layout.buckets:  # a fixed order, so the sum is deterministic
            if bucket.n_tiles == 0:
                continue
            part = self._bucket_energy(bucket, adaptive, eta).to(self.device)
            energy = part if energy is None else energy + part
        if energy is None:  # every parameter is empty
            energy = torch.zeros(self.layout.n_blocks, dtype=torch.float64, device=self.device)
        return energy

    def _perturb(self, scale: torch.Tensor, adaptive: bool, eta: float, keep: bool = False) -> None:
        for bucket in self.layout.buckets:
            if bucket.n_tiles:
                kept = {"kept": self._flat_correction(bucket)} if keep else {}
                self._bucket_perturb(bucket, scale.to(bucket.device), adaptive, eta, **kept)

    def _restore(self) -> None:
        for bucket in self.layout.buckets:
            if bucket.n_tiles:
                self._bucket_restore(bucket)

    @torch.no_grad()
    def direction_energy(self, direction: Direction, adaptive: bool, eta: float) -> torch.Tensor:
        return self._per_block(
            self._bucket_energy(bucket, adaptive, eta, self._flat_direction(bucket, direction))
            for bucket in self._direction_buckets(direction)
        )

    def _perturb_along(self, scale: torch.Tensor, direction: Direction, adaptive: bool, eta: float) -> None:
        for bucket in self._direction_buckets(direction):
            flat = self._flat_direction(bucket, direction)
            self._bucket_perturb(bucket, scale.to(bucket.device), adaptive, eta, direction=flat)

    def _direction_buckets(self, direction: Direction) -> list[Bucket]:
        """The buckets to read or move along ``direction``. A flat direction is the fused base step's state, whose
        plan has just synced the layout: a second sync in one compiled step would be handed copies of the gradient
        buffers. A direction given per tensor may come with parameters replaced since the last step: synced first."""
        if direction.flat:
            return [bucket for bucket in self.layout.buckets if bucket.n_tiles]
        return self._live_buckets()

    def _flat_direction(self, bucket: Bucket, direction: Direction) -> torch.Tensor:
        """The bucket's part of ``direction`` as one flat buffer: its own where it has one, else its tensors copied
        into the backend's ``direction`` buffer (zeros for a parameter without one)."""
        flat = direction.flat.get(id(bucket))
        if flat is not None:
            return flat
        flat = self._flat_buffer(DIRECTION, bucket)
        tensors = {id(p): d for block, ds in zip(self.blocks, direction.tensors) for p, d in zip(block.params, ds)}
        for slot in bucket.slots:
            d = tensors.get(id(slot.param))
            view = _slot_view(flat, slot)
            view.zero_() if d is None else view.copy_(d)
        return flat

    def _restore_and_update(self, updates: list[BucketUpdate], found_inf: torch.Tensor | None, mix: Mix | None = None,
                            momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        parts = []
        for update in updates:
            on_device = None if mix is None else mix.to(update.bucket.device)
            parts.append(self._bucket_restore_and_update(update, found_inf, on_device, momentum_energy))
        return self._momentum_energy(updates, parts) if momentum_energy else None

    def _update(self, updates: list[BucketUpdate], correction_scale: torch.Tensor | None,
                momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        parts = []
        for update in updates:
            scale = None if correction_scale is None else correction_scale.to(update.bucket.device)
            parts.append(self._bucket_update(update, scale, momentum_energy))
        return self._momentum_energy(updates, parts) if momentum_energy else None

    def _momentum_energy(self, updates: list[BucketUpdate], parts: list) -> torch.Tensor:
        """The new momentum's block energies, summed over the buckets as :meth:`direction_energy` sums them: each
        bucket's share as its update summed it, or where it did not (None), read from its momentum now."""
        return self._per_block(
            self._bucket_energy(update.bucket, False, 0.0, update.state[0]) if part is None else part
            for update, part in zip(updates, parts)
            if update.bucket.n_tiles
        )

    def zero_grad_(self) -> None:
        self.layout.zero_grads_()

    def memory_overhead(self) -> dict[str, int]:
        return self._with_buffers(self.layout.memory_overhead())

    # ------------------------------------------------------------------ LookSAM's correction, per bucket
    def _flat_buffer(self, name: str, bucket: Bucket) -> torch.Tensor:
        """The bucket's buffer ``name``, laid out like its gradient (zeros when first asked for)."""
        store = self._buffers[name]
        flat = store.get(id(bucket))
        if flat is None:
            flat = store[id(bucket)] = bucket.new_zeros()
        return flat

    def _flat_correction(self, bucket: Bucket) -> torch.Tensor:
        return self._flat_buffer(CORRECTION, bucket)

    def _tiles_of(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return flat.view(bucket.n_tiles, bucket.tile)

    def _live_buckets(self):
        self.layout.sync()
        return [bucket for bucket in self.layout.buckets if bucket.n_tiles]

    def _per_block(self, parts, rows: tuple[int, ...] = ()) -> torch.Tensor:
        """The sum, in bucket order, of per-bucket ``[*rows, B]`` tensors (zeros when there are none)."""
        total = torch.zeros(*rows, self.layout.n_blocks, dtype=torch.float64, device=self.device)
        for part in parts:
            total = total + part.to(self.device)
        return total

    @torch.no_grad()
    def keep_gradient_(self) -> None:
        for bucket in self._live_buckets():
            self._flat_correction(bucket).copy_(bucket.grad)

    @torch.no_grad()
    def block_dot(self) -> torch.Tensor:
        return self._per_block(self._bucket_dot(bucket) for bucket in self._live_buckets())

    def _bucket_dot(self, bucket: Bucket) -> torch.Tensor:
        """Per tile, the products in the compute dtype summed in float64; per block, the tiles' sums in order. A
        bounded number of tiles at a time, so the products never take more than a few MB. A float32 product past
        FLT_MAX is taken again in float64 (:func:`retake_overflowed_tiles`)."""
        a = self._tiles_of(self._flat_correction(bucket), bucket)
        b = self._tiles_of(bucket.grad, bucket)
        dtype = compute_dtype(a)
        rows = max(1, (1 << 20) // bucket.tile)
        sums = bucket.energy_partials
        for start in range(0, bucket.n_tiles, rows):
            products = a[start : start + rows].to(dtype) * b[start : start + rows].to(dtype)
            torch.sum(products, dim=1, dtype=torch.float64, out=sums[start : start + rows])
        if dtype != torch.float64 and a.dtype != torch.float16:  # float16 products stay below 4.3e9

            def wide(index: torch.Tensor) -> torch.Tensor:  # the tiles' products formed and summed in float64
                return torch.linalg.vecdot(a.index_select(0, index).double(), b.index_select(0, index).double())

            retake_overflowed_tiles(sums, wide, signed=True)
        return torch.segment_reduce(sums, "sum", lengths=bucket.tile_count_of_block, unsafe=True)

    @torch.no_grad()
    def orthogonalize_(self, coefficient: torch.Tensor) -> torch.Tensor:
        parts = []
        for bucket in self._live_buckets():
            correction = self._flat_correction(bucket)
            self._gradient_plus_correction(bucket, coefficient, -1, out=correction)
            parts.append(self._bucket_energy(bucket, False, 0.0, correction))
        return self._per_block(parts)

    def _gradient_plus_correction(self, bucket: Bucket, per_block: torch.Tensor, sign: int, out: torch.Tensor):
        """``out <- g + sign * per_block[b] * correction`` over the bucket, in the compute dtype (one ``addcmul``;
        ``out`` may be the gradient or the correction itself)."""
        g = self._tiles_of(bucket.grad, bucket)
        kept = self._tiles_of(self._flat_correction(bucket), bucket)
        dtype = compute_dtype(g)
        scale = per_block.to(bucket.device)[bucket.block_of_tile].to(dtype).unsqueeze(1)
        if g.dtype == dtype:
            torch.addcmul(g, kept, scale, value=sign, out=self._tiles_of(out, bucket))
        else:
            out.copy_(torch.addcmul(g.to(dtype), kept.to(dtype), scale, value=sign).view(-1))

    @torch.no_grad()
    def add_correction_(self, correction_scale: torch.Tensor) -> None:
        for bucket in self._live_buckets():
            self._gradient_plus_correction(bucket, correction_scale, 1, out=bucket.grad)
            self._touched(bucket)

    # ------------------------------------------------------------------ the SAM family's parts, per bucket
    def _per_tile(self, per_block: torch.Tensor, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor:
        """``[n_tiles, 1]``: each tile's entry of the float64 ``[B]`` vector ``per_block``, in ``dtype``."""
        return per_block.to(bucket.device)[bucket.block_of_tile].to(dtype).unsqueeze(1)

    def _touched(self, bucket: Bucket) -> None:
        # the regions of parameters without a gradient may have changed: the next sync must zero them again
        bucket.all_dirty = True

    @torch.no_grad()
    def kept_energy(self) -> torch.Tensor:
        return self._per_block(
            self._bucket_energy(bucket, False, 0.0, self._flat_correction(bucket)) for bucket in self._live_buckets()
        )

    @torch.no_grad()
    def mix_gradient_(self, grad_scale: torch.Tensor, kept_scale: torch.Tensor) -> None:
        for bucket in self._live_buckets():
            g = self._tiles_of(bucket.grad, bucket)
            kept = self._tiles_of(self._flat_correction(bucket), bucket)
            dtype = compute_dtype(g)
            a, c = (self._per_tile(s, bucket, dtype) for s in (grad_scale, kept_scale))
            rows = max(1, _CHUNK // bucket.tile)  # a bounded temporary, still in cache when it is copied back
            for start in range(0, bucket.n_tiles, rows):
                part = slice(start, start + rows)
                if g.dtype == dtype:  # in place: the same two roundings, no temporary
                    g[part].mul_(a[part]).addcmul_(kept[part], c[part])
                else:
                    g[part].copy_(torch.addcmul(g[part].to(dtype) * a[part], kept[part].to(dtype), c[part]))
            self._touched(bucket)

    @torch.no_grad()
    def exchange_sharpness_(self) -> None:
        for bucket in self._live_buckets():
            g, kept = bucket.grad, self._flat_correction(bucket)
            for g_part, kept_part in zip(g.split(_CHUNK), kept.split(_CHUNK)):  # a bounded temporary
                sharpness = g_part - kept_part
                g_part.copy_(kept_part)
                kept_part.copy_(sharpness)
            self._touched(bucket)

    @torch.no_grad()
    def friendly_ascent_(self, sigma: float, lmbda: float, started: Sequence[bool]) -> None:
        started_ids = self._started_ids(started)
        for bucket in self._live_buckets():
            m = self._flat_buffer(MOMENTUM, bucket)
            for start, end, first in _ascent_runs(bucket, started_ids):
                for g_part, m_part in zip(bucket.grad[start:end].split(_CHUNK), m[start:end].split(_CHUNK)):
                    friendly_ascent(g_part, m_part, sigma, lmbda, first)

    def _started_ids(self, started: Sequence[bool]) -> set[int]:
        """``id`` of each parameter whose F-SAM EMA has started (``started``: per parameter, in block order)."""
        params = [p for block in self.blocks for p in block.params]
        return {id(p) for p, was_started in zip(params, started, strict=True) if was_started}

    def buffer_tensors(self, name: str) -> list[torch.Tensor]:
        views = {}
        for bucket in self.layout.buckets:
            flat = self._flat_buffer(name, bucket)
            for slot in bucket.slots:
                views[id(slot.param)] = _slot_view(flat, slot)
        return [views[id(p)] for block in self.blocks for p in block.params]


def _ascent_runs(bucket: Bucket, started_ids: set[int]) -> list[tuple[int, int, bool]]:
    """The element ranges ``[start, end)`` of the bucket's flat buffers that F-SAM's ascent covers, each with whether
    it is the first ascent of its parameters (their EMA not started: ``id`` not in ``started_ids``): runs of
    consecutive parameters that have a gradient and the same such flag, each parameter with the zero padding up to
    the next one or the bucket's end (which the ascent leaves zero), so that a parameter without a gradient keeps its
    EMA and its zero gradient region, as per tensor. The run is the whole bucket when every parameter has a gradient
    and all or none of their EMAs have started. Every range starts and ends on a multiple of ``ALIGN`` (or the
    bucket's end): whole vectors for the kernels."""
    runs: list[tuple[int, int, bool]] = []
    previous = None  # the previous parameter's run key: None without a gradient, else whether its EMA starts now
    slots = bucket.slots  # in the order of their offsets, each on a multiple of ALIGN
    for i, slot in enumerate(slots):
        key = None if slot.param.grad is None else id(slot.param) not in started_ids
        end = slots[i + 1].offset if i + 1 < len(slots) else bucket.grad.numel()  # with the zero padding after it
        if key is not None and key == previous:
            runs[-1] = (runs[-1][0], end, key)
        elif key is not None:
            runs.append((slot.offset, end, key))
        previous = key
    return runs


def _slot_view(flat: torch.Tensor, slot) -> torch.Tensor:
    """The part of a flat buffer laid out like the bucket's parameters that belongs to ``slot``'s parameter, shaped
    like it."""
    v = slot.view
    return torch.as_strided(flat, v.shape, v.stride(), v.storage_offset())


#: Elements per piece of a pass that needs a temporary: the temporary stays a few MB whatever the bucket's size.
_CHUNK = 1 << 20

#: How many tiles of a bucket :func:`retake_overflowed_tiles` can take again per call.
RETAKEN_TILES = 4


def retake_overflowed_tiles(sums: torch.Tensor, wide, signed: bool = False) -> None:
    """The ``torch`` backend's rescue of float32 sums that overflowed: ``sums`` (float64, one per tile, each from
    float32 terms or a float32 sum) keeps every finite entry, and a non-finite one becomes ``wide(index)``, the same
    tiles' sums with every term formed and summed in float64 (``index``: int64 tile indices), finite wherever the
    tiles' values are. A float32 square overflows from about 1.8e19 (the square root of FLT_MAX), the float64 energy
    only past 1.8e308; the kernels (``csrc/README.md``) take every such tile again.

    Torch operations cannot pick the overflowed tiles without reading a value back to the host (a synchronisation on
    a GPU), so the same operations run every call, on the ``RETAKEN_TILES`` tiles of largest ``sums`` (of largest
    ``|sums|`` where ``signed``; NaN ranks first, then inf), which are the non-finite ones where there are any. A
    bucket with more non-finite tiles than that keeps the rest as they are: an energy that overflowed there stays
    infinite, and its block counts as non-finite, as it did before this rescue. The cost, every call: those tiles
    read again and a handful of small operations."""
    k = min(RETAKEN_TILES, sums.numel())
    largest, index = torch.topk(sums.abs() if signed else sums, k, sorted=False)
    current = sums.index_select(0, index) if signed else largest
    sums.index_copy_(0, index, torch.where(largest < math.inf, current, wide(index)))  # false for inf and NaN


def _on_device(**tensors: torch.Tensor | None) -> dict:
    """The kernels' optional device arguments that are given (``scalars``, ``found_inf``): a call without them is
    the call that takes neither."""
    return {name: t for name, t in tensors.items() if t is not None}


def _launching_on(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current CUDA device, not the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class KernelModule(Protocol):
    """What :class:`KernelBackend` needs of a kernel module: eleven launchers over one bucket's flat buffers, with
    these keyword signatures. Both kernel modules are namespaces of registered operators (``torch.library``), so that
    ``torch.compile`` and fake tensors see them: ``torch.ops.gearsam_fused`` (the compiled extension, ``csrc/``) and
    ``gearsam_fused.triton_kernels`` (``torch.ops.gearsam_fused_triton``). What each computes is stated once, in
    ``csrc/README.md``'s table (the formulas are those of :class:`~gearsam_fused.backends.base.Backend`'s methods of
    the same names; the base steps' update in :mod:`gearsam_fused.base_step`), and the schemas in
    ``csrc/library.cpp``."""

    def block_energy(
        self, grad: torch.Tensor, param: torch.Tensor, first_tile_of_block: torch.Tensor, partials: torch.Tensor, *,
        tile: int, adaptive: bool, eta: float, other: torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # fmt: skip

    def allocate(
        self, energy: torch.Tensor, ema: torch.Tensor, *, gear: bool, rho: float, beta: float, delta: float,
        scalars: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def perturb_(
        self, param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor, scale: torch.Tensor,
        block_of_tile: torch.Tensor, *, tile: int, adaptive: bool, eta: float, kept: torch.Tensor | None = None,
    ) -> None: ...  # fmt: skip

    def restore_(self, param: torch.Tensor, backup: torch.Tensor, *, tile: int) -> None: ...

    def restore_discarding_backup_(self, param: torch.Tensor, backup: torch.Tensor, *, tile: int) -> None: ...

    def mix_gradient_(
        self, grad: torch.Tensor, correction: torch.Tensor, grad_scale: torch.Tensor, correction_scale: torch.Tensor,
        block_of_tile: torch.Tensor, *, tile: int,
    ) -> None: ...  # fmt: skip

    def exchange_sharpness_(self, grad: torch.Tensor, correction: torch.Tensor, *, tile: int) -> None: ...

    def friendly_ascent_(
        self, grad: torch.Tensor, momentum: torch.Tensor, *, sigma: float, lmbda: float, first: bool
    ) -> None: ...  # fmt: skip

    def friendly_energy_(
        self, grad: torch.Tensor, momentum: torch.Tensor, param: torch.Tensor, first_tile_of_block: torch.Tensor,
        partials: torch.Tensor, *, tile: int, adaptive: bool, eta: float, sigma: float, lmbda: float, first: bool,
    ) -> torch.Tensor: ...  # fmt: skip

    def sgd_step_(
        self, param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor | None, momentum_buffer: torch.Tensor | None, *,
        tile: int, lr: float, weight_decay: float, momentum: float, dampening: float, nesterov: bool, maximize: bool,
        first: bool, correction: torch.Tensor | None = None, correction_scale: torch.Tensor | None = None,
        block_of_tile: torch.Tensor | None = None, scalars: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None, sharpness: float = 0.0,
        first_tile_of_block: torch.Tensor | None = None, partials: torch.Tensor | None = None,
        momentum_energy: torch.Tensor | None = None,
    ) -> None: ...  # fmt: skip

    def adam_step_(
        self, param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor | None, exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None, *, tile: int, beta1: float, beta2: float,
        eps: float, weight_decay: float, decoupled: bool, amsgrad: bool, maximize: bool, lr: float, step: int,
        correction: torch.Tensor | None = None,
        correction_scale: torch.Tensor | None = None, block_of_tile: torch.Tensor | None = None,
        scalars: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
        grad_scale: torch.Tensor | None = None, sharpness: float = 0.0, first_tile_of_block: torch.Tensor | None = None,
        partials: torch.Tensor | None = None, momentum_energy: torch.Tensor | None = None,
    ) -> None: ...  # fmt: skip


class KernelBackend(FlatBufferBackend):
    """A fused backend whose tensor work is done by a :class:`KernelModule`."""

    capturable = True
    folds_mix = True
    folds_keep = True
    family_operators = frozenset(
        {"keep_gradient_", "block_dot_energy", "kept_energy", "mix_gradient_", "exchange_sharpness_",
         "friendly_ascent_", "friendly_energy_"}
    )  # fmt: skip

    def __init__(self, blocks, device: torch.device, kernels: KernelModule, param_group=None):
        self.kernels = kernels
        super().__init__(blocks, device, param_group)

    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float, grad: torch.Tensor | None = None,
                       other: torch.Tensor | None = None):  # fmt: skip
        """As the base class's; with ``other``, ``[2, B]``: the energies and the inner products of ``grad`` and
        ``other`` per block, in one read."""
        with _launching_on(bucket.device):
            return self.kernels.block_energy(
                bucket.grad if grad is None else grad,
                bucket.param,
                bucket.first_tile_of_block,
                bucket.energy_partials if other is None else bucket.partials,
                tile=bucket.tile,
                adaptive=adaptive,
                eta=eta,
                other=other,
            )

    def keep_gradient_(self) -> None:
        # restore_ is the kernels' copy of stored bits: past the stream threshold its stores bypass the caches, so
        # the kept gradient is written without being read first
        for bucket in self._live_buckets():
            with _launching_on(bucket.device):
                self.kernels.restore_(self._flat_correction(bucket), bucket.grad, tile=bucket.tile)

    def _bucket_dot(self, bucket: Bucket) -> torch.Tensor:
        return self._bucket_dot_energy(bucket)[1]

    def _bucket_dot_energy(self, bucket: Bucket) -> torch.Tensor:
        """``[2, B]``: the gradients' energies and their inner products with the kept gradient, in one read."""
        return self._bucket_energy(bucket, False, 0.0, other=self._flat_correction(bucket))

    @torch.no_grad()
    def block_dot_energy(self) -> tuple[torch.Tensor, torch.Tensor]:
        energy, dot = self._per_block((self._bucket_dot_energy(b) for b in self._live_buckets()), rows=(2,)).unbind(0)
        return dot, energy

    @torch.no_grad()
    def friendly_ascent_(self, sigma: float, lmbda: float, started: Sequence[bool]) -> None:
        started_ids = self._started_ids(started)
        for bucket in self._live_buckets():
            self._bucket_friendly_ascent(bucket, sigma, lmbda, _ascent_runs(bucket, started_ids))

    def _bucket_friendly_ascent(self, bucket: Bucket, sigma: float, lmbda: float,
                                runs: list[tuple[int, int, bool]]) -> None:  # fmt: skip
        m = self._flat_buffer(MOMENTUM, bucket)
        for start, end, first in runs:
            with _launching_on(bucket.device):
                self.kernels.friendly_ascent_(
                    bucket.grad[start:end], m[start:end], sigma=sigma, lmbda=lmbda, first=first
                )

    @torch.no_grad()
    def friendly_energy_(self, sigma: float, lmbda: float, started: Sequence[bool], adaptive: bool,
                         eta: float) -> torch.Tensor:  # fmt: skip
        started_ids = self._started_ids(started)
        return self._per_block(self._bucket_friendly_energy(b, sigma, lmbda, started_ids, adaptive, eta)
                               for b in self._live_buckets())  # fmt: skip

    def _bucket_friendly_energy(self, bucket: Bucket, sigma: float, lmbda: float, started_ids: set[int],
                                adaptive: bool, eta: float) -> torch.Tensor:  # fmt: skip
        """One kernel where the ascent is one run over the whole bucket, else the ascent on each run, then the
        energies."""
        runs = _ascent_runs(bucket, started_ids)
        if len(runs) != 1 or runs[0][:2] != (0, bucket.grad.numel()):
            self._bucket_friendly_ascent(bucket, sigma, lmbda, runs)
            return self._bucket_energy(bucket, adaptive, eta)
        with _launching_on(bucket.device):
            return self.kernels.friendly_energy_(
                bucket.grad, self._flat_buffer(MOMENTUM, bucket), bucket.param, bucket.first_tile_of_block,
                bucket.energy_partials, tile=bucket.tile, adaptive=adaptive, eta=eta, sigma=sigma, lmbda=lmbda,
                first=runs[0][2],
            )  # fmt: skip

    @torch.no_grad()
    def mix_gradient_(self, grad_scale: torch.Tensor, kept_scale: torch.Tensor) -> None:
        for bucket in self._live_buckets():
            with _launching_on(bucket.device):
                self.kernels.mix_gradient_(
                    bucket.grad,
                    self._flat_correction(bucket),
                    grad_scale.to(bucket.device),
                    kept_scale.to(bucket.device),
                    bucket.block_of_tile,
                    tile=bucket.tile,
                )
            self._touched(bucket)

    @torch.no_grad()
    def exchange_sharpness_(self) -> None:
        for bucket in self._live_buckets():
            with _launching_on(bucket.device):
                self.kernels.exchange_sharpness_(bucket.grad, self._flat_correction(bucket), tile=bucket.tile)
            self._touched(bucket)

    def allocate(self, rule, energy, ema, rho, beta, delta, found_inf=None):
        on_device = _on_device(found_inf=found_inf, scalars=rho.reshape(1) if isinstance(rho, torch.Tensor) else None)
        with _launching_on(energy.device):
            gear = check_rule(rule) == GEAR_RULE
            rho = 0.0 if "scalars" in on_device else rho  # read from scalars
            return self.kernels.allocate(energy, ema, gear=gear, rho=rho, beta=beta, delta=delta, **on_device)

    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float,
                        kept: torch.Tensor | None = None, direction: torch.Tensor | None = None) -> None:  # fmt: skip
        with _launching_on(bucket.device):
            self.kernels.perturb_(
                bucket.param,
                bucket.grad if direction is None else direction,
                bucket.backup,
                scale,
                bucket.block_of_tile,
                kept=kept,
                tile=bucket.tile,
                adaptive=adaptive,
                eta=eta,
            )

    def _bucket_restore(self, bucket: Bucket) -> None:
        with _launching_on(bucket.device):
            self.kernels.restore_discarding_backup_(bucket.param, bucket.backup, tile=bucket.tile)

    def _bucket_restore_and_update(self, update: BucketUpdate, found_inf: torch.Tensor | None, mix,
                                   momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        bucket = update.bucket
        corrected = {}
        if mix is not None:
            sharpness = {"sharpness": mix.sharpness} if mix.sharpness != 0.0 else {}  # without it, the GSAM call
            corrected = self._corrected(bucket, mix.kept_scale, grad_scale=mix.grad_scale, **sharpness)
        summed = self._momentum_outputs(bucket) if momentum_energy else {}
        with _launching_on(bucket.device):
            self._launcher(update)(bucket.param, bucket.grad, bucket.backup, *update.state, tile=bucket.tile,
                                   **update.kernel_arguments(), **_on_device(found_inf=found_inf), **corrected,
                                   **summed)  # fmt: skip
        return summed.get("momentum_energy")

    def _bucket_update(self, update: BucketUpdate, scale, momentum_energy: bool = False) -> torch.Tensor | None:
        bucket = update.bucket
        corrected = {} if scale is None else self._corrected(bucket, scale)
        summed = self._momentum_outputs(bucket) if momentum_energy else {}
        with _launching_on(bucket.device):
            # no backup: w is read from the parameters themselves, each element before it is written
            self._launcher(update)(bucket.param, bucket.grad, None, *update.state, tile=bucket.tile,
                                   **update.kernel_arguments(), **corrected, **summed)  # fmt: skip
        return summed.get("momentum_energy")

    @staticmethod
    def _momentum_outputs(bucket: Bucket) -> dict:
        """The base step's arguments that make it sum the new momentum's block energies as it writes it: the
        bucket's tile layout, its partials scratch, and the ``[B]`` output."""
        n_blocks = bucket.first_tile_of_block.numel() - 1
        energy = torch.empty(n_blocks, dtype=torch.float64, device=bucket.device)
        return dict(first_tile_of_block=bucket.first_tile_of_block, partials=bucket.energy_partials,
                    momentum_energy=energy)  # fmt: skip

    def _corrected(self, bucket: Bucket, correction_scale: torch.Tensor, **mix) -> dict:
        """The base step's correction arguments: the kept gradient scaled per block (and the mix's ``grad_scale`` and
        ``sharpness``, given)."""
        return dict(correction=self._flat_correction(bucket), correction_scale=correction_scale,
                    block_of_tile=bucket.block_of_tile, **mix)  # fmt: skip

    def _launcher(self, update: BucketUpdate):
        return self.kernels.sgd_step_ if update.kind == "sgd" else self.kernels.adam_step_

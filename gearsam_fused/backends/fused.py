"""What the flat-buffer backends share: the layout, keeping it in sync, and the step flow over buckets.

A subclass supplies the tensor work for one bucket (:meth:`FusedBackend._bucket_energy`, ``_bucket_perturb``,
``_bucket_restore``, ``_bucket_restore_and_update``); everything here costs a constant number of device operations per bucket, however many
parameter tensors the model has. :class:`KernelBackend` supplies it from a module of kernel launchers.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from ..allocation import GEAR_RULE, check_rule
from ..base_step import BucketUpdate
from ..flat import Bucket, FlatLayout
from .base import Backend


class FusedBackend(Backend):
    fuses_base_step = True

    def __init__(self, blocks, device: torch.device, param_group=None):
        super().__init__(blocks, device, param_group)
        self.layout = FlatLayout(blocks, param_group=param_group)

    # ------------------------------------------------------------------ per-bucket work, by subclasses
    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float) -> torch.Tensor:
        """float64 ``[B]`` on the bucket's device: this bucket's share of every block's energy."""
        raise NotImplementedError

    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        raise NotImplementedError

    def _bucket_restore(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def _bucket_restore_and_update(self, update: BucketUpdate) -> None:
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

    def _perturb(self, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        for bucket in self.layout.buckets:
            if bucket.n_tiles:
                self._bucket_perturb(bucket, scale.to(bucket.device), adaptive, eta)

    def _restore(self) -> None:
        for bucket in self.layout.buckets:
            if bucket.n_tiles:
                self._bucket_restore(bucket)

    def _restore_and_update(self, updates: list[BucketUpdate]) -> None:
        for update in updates:
            self._bucket_restore_and_update(update)

    def zero_grad_(self) -> None:
        self.layout.zero_grads_()

    def memory_overhead(self) -> dict[str, int]:
        return self.layout.memory_overhead()


def _launching_on(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current CUDA device, not the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class KernelModule(Protocol):
    """What :class:`KernelBackend` needs of a kernel module: six launchers over one bucket's flat buffers, with
    these keyword signatures. ``gearsam_fused.triton_kernels`` and the compiled ``gearsam_fused._C`` both provide them.
    The formulas are those of :class:`~gearsam_fused.backends.base.Backend`'s methods of the same names."""

    def block_energy(
        self, grad: torch.Tensor, param: torch.Tensor, block_tiles: torch.Tensor, partials: torch.Tensor, *,
        tile: int, adaptive: bool, eta: float,
    ) -> torch.Tensor: ...  # fmt: skip

    def allocate(
        self, energy: torch.Tensor, ema: torch.Tensor, *, gear: bool, rho: float, beta: float, delta: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def perturb_(
        self, param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor, scale: torch.Tensor,
        tile_block: torch.Tensor, *, tile: int, adaptive: bool, eta: float,
    ) -> None: ...  # fmt: skip

    def restore_(self, param: torch.Tensor, backup: torch.Tensor, *, tile: int) -> None: ...

    # The base optimizer's update folded into the restore (formulas in gearsam_fused.triton_kernels.base_step).
    def sgd_step_(
        self, param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor, momentum_buffer: torch.Tensor | None, *,
        tile: int, lr: float, weight_decay: float, momentum: float, dampening: float, nesterov: bool, maximize: bool,
        first: bool,
    ) -> None: ...  # fmt: skip

    def adam_step_(
        self, param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor, exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None, *, tile: int, beta1: float, beta2: float,
        eps: float, weight_decay: float, decoupled: bool, amsgrad: bool, maximize: bool, step_size: float,
        bias_correction2_sqrt: float, decay: float,
    ) -> None: ...  # fmt: skip


class KernelBackend(FusedBackend):
    """A fused backend whose tensor work is done by a :class:`KernelModule`."""

    def __init__(self, blocks, device: torch.device, kernels: KernelModule, param_group=None):
        self.kernels = kernels
        super().__init__(blocks, device, param_group)

    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float) -> torch.Tensor:
        with _launching_on(bucket.device):
            return self.kernels.block_energy(
                bucket.grad,
                bucket.param,
                bucket.block_tiles,
                bucket.partials,
                tile=bucket.tile,
                adaptive=adaptive,
                eta=eta,
            )

    def allocate(self, rule, energy, ema, rho, beta, delta):
        with _launching_on(energy.device):
            gear = check_rule(rule) == GEAR_RULE
            return self.kernels.allocate(energy, ema, gear=gear, rho=rho, beta=beta, delta=delta)

    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        with _launching_on(bucket.device):
            self.kernels.perturb_(
                bucket.param,
                bucket.grad,
                bucket.backup,
                scale,
                bucket.tile_block,
                tile=bucket.tile,
                adaptive=adaptive,
                eta=eta,
            )

    def _bucket_restore(self, bucket: Bucket) -> None:
        with _launching_on(bucket.device):
            self.kernels.restore_(bucket.param, bucket.backup, tile=bucket.tile)

    def _bucket_restore_and_update(self, update: BucketUpdate) -> None:
        bucket = update.bucket
        launcher = self.kernels.sgd_step_ if update.kind == "sgd" else self.kernels.adam_step_
        with _launching_on(bucket.device):
            launcher(bucket.param, bucket.grad, bucket.backup, *update.state, tile=bucket.tile,
                     **update.kernel_arguments())  # fmt: skip

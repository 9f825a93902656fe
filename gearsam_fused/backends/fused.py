"""What the flat-buffer backends share: the layout, keeping it in sync, and the step flow over buckets.

A subclass supplies the tensor work for one bucket (:meth:`FusedBackend._bucket_energy`, ``_bucket_perturb``,
``_bucket_restore``); everything here costs a constant number of device operations per bucket, however many
parameter tensors the model has.
"""

from __future__ import annotations

import torch

from ..flat import Bucket, FlatLayout
from .base import Backend


class FusedBackend(Backend):
    def __init__(self, blocks, device: torch.device):
        super().__init__(blocks, device)
        self.layout = FlatLayout(blocks)
        self._perturbed = False

    # ------------------------------------------------------------------ per-bucket work, by subclasses
    def _bucket_energy(self, bucket: Bucket, adaptive: bool, eta: float) -> torch.Tensor:
        """float64 ``[B]`` on the bucket's device: this bucket's share of every block's energy."""
        raise NotImplementedError

    def _bucket_perturb(self, bucket: Bucket, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        raise NotImplementedError

    def _bucket_restore(self, bucket: Bucket) -> None:
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

    def perturb_(self, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        if self._perturbed:
            raise RuntimeError("perturb_ called twice without restore_: the parameters already hold w + eps")
        for bucket in self.layout.buckets:
            if bucket.n_tiles:
                self._bucket_perturb(bucket, scale.to(bucket.device), adaptive, eta)
        self._perturbed = True

    def restore_(self) -> None:
        if self._perturbed:
            for bucket in self.layout.buckets:
                if bucket.n_tiles:
                    self._bucket_restore(bucket)
        self._perturbed = False

    def zero_grad_(self) -> None:
        self.layout.zero_grads_()

    def memory_overhead(self) -> dict[str, int]:
        return self.layout.memory_overhead()

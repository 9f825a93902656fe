"""The ``reference`` backend: one plain loop over parameter tensors, written straight from the paper's equations.

It is the oracle every fused backend is tested against, so it favours obviousness over speed: energies are
accumulated in float64 per tensor and per block, the perturbation ``eps = scale_b * T**2 * g`` is formed in the
compute dtype (float32, or float64 for float64 parameters) and rounded once into the parameter (a block with
``scale_b = 0`` is left exactly as it is), and the backup is a clone per tensor.
"""

from __future__ import annotations

import torch

from ..checks import check_dense_grad
from ..sharding import local
from .base import Backend, compute_dtype


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, blocks, device: torch.device, param_group=None):
        super().__init__(blocks, device, param_group)
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _with_grads(self, block):
        # a sharded parameter (DTensor) is worked on through its local shard; the optimizer sums the energies
        for name, p in zip(block.param_names, block.params):
            g = check_dense_grad(p.grad, repr(name))
            if g is not None:
                yield local(p), local(g)

    @torch.no_grad()
    def block_energy(self, adaptive: bool, eta: float) -> torch.Tensor:
        energies = []
        for block in self.blocks:
            energy = torch.zeros((), dtype=torch.float64, device=self.device)
            for p, g in self._with_grads(block):
                v = g.double()
                if adaptive:
                    v = (p.double().abs() + eta) * v
                energy = energy + v.square().sum().to(self.device)
            energies.append(energy)
        return torch.stack(energies)

    @torch.no_grad()
    def _perturb(self, scale: torch.Tensor, adaptive: bool, eta: float) -> None:
        for b, block in enumerate(self.blocks):
            for p, g in self._with_grads(block):
                self._saved.append((p, p.detach().clone()))
                dtype = compute_dtype(p)
                w = p.to(dtype)
                direction = g.to(dtype)
                if adaptive:
                    direction = (w.abs() + eta).square() * direction
                s = scale[b].to(device=p.device, dtype=dtype)
                p.copy_(torch.where(s == 0, w, w + direction * s))  # a skipped block stays w, even where g is inf

    @torch.no_grad()
    def _restore(self) -> None:
        for p, saved in self._saved:
            p.copy_(saved)
        self._saved.clear()

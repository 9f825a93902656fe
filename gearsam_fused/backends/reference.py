"""The ``reference`` backend: one plain loop over parameter tensors, written straight from the paper's equations.

It is the oracle every fused backend is tested against, so it favours obviousness over speed: energies are
accumulated in float64 per tensor and per block, the perturbation ``eps = scale_b * T**2 * g`` is formed in the
compute dtype (float32, or float64 for float64 parameters) and rounded once into the parameter (a block with
``scale_b = 0`` is left exactly as it is), and the backup is a clone per tensor.

It leaves every parameter where it is, but refuses, as the flat-buffer backends do, a parameter whose ``.data`` was
replaced by a tensor of another device, dtype, shape or memory layout after the optimizer was built, naming it: the
base optimizer's state was made for the old tensor, and torch's own step would go on without a word (its SGD steps a
parameter cast from float32 to float64 with the float32 momentum buffer it kept).
"""

from __future__ import annotations

import torch

from ..checks import check_dense_grad
from ..flat import _describe
from ..sharding import local
from .base import Backend, Direction, compute_dtype


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, blocks, device: torch.device, param_group=None):
        super().__init__(blocks, device, param_group)
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: (device, dtype, shape, strides) of each parameter (its local shard) when the optimizer was built.
        self._placed = [[_placement(p) for p in block.params] for block in blocks]

    def _check_placed(self) -> None:
        """Refuse a parameter replaced by a tensor of another device, dtype, shape or memory layout since the
        optimizer was built, naming it (the flat-buffer backends' check, :meth:`gearsam_fused.flat.FlatLayout.sync`)."""
        for block, placed in zip(self.blocks, self._placed):
            for name, p, was in zip(block.param_names, block.params, placed):
                now = _placement(p)
                if now != was:
                    raise RuntimeError(
                        f"parameter {name!r} was replaced by a tensor of another device, dtype, shape or memory layout "
                        f"({_describe(*now)}, was {_describe(*was)}) after the optimizer was built; build the "
                        "optimizer after moving, casting or converting the model"
                    )

    def _with_grads(self, b: int, direction: Direction | None = None):
        """(parameter, its gradient or direction tensor) of block ``b``'s parameters that have one."""
        # a sharded parameter (DTensor) is worked on through its local shard; the optimizer sums the energies
        block = self.blocks[b]
        if direction is not None:
            yield from ((local(p), local(d)) for p, d in zip(block.params, direction.tensors[b]) if d is not None)
            return
        for name, p in zip(block.param_names, block.params):
            g = check_dense_grad(p.grad, repr(name))
            if g is not None:
                yield local(p), local(g)

    def _params_and_grads(self):
        # every per-tensor operation of the base class (LookSAM's, the SAM family's) checks the parameters first, so
        # that one refused leaves the gradients and the buffers as they were
        self._check_placed()
        yield from super()._params_and_grads()

    @torch.no_grad()
    def block_energy(self, adaptive: bool, eta: float, direction: Direction | None = None) -> torch.Tensor:
        self._check_placed()
        energies = []
        for b in range(len(self.blocks)):
            energy = torch.zeros((), dtype=torch.float64, device=self.device)
            for p, g in self._with_grads(b, direction):
                v = g.double()
                if adaptive:
                    v = (p.double().abs() + eta) * v
                energy = energy + v.square().sum().to(self.device)
            energies.append(energy)
        return torch.stack(energies)

    def _forget(self) -> None:
        self._saved.clear()

    @torch.no_grad()
    def _perturb(self, scale: torch.Tensor, adaptive: bool, eta: float, direction: Direction | None = None) -> None:
        self._check_placed()
        for b in range(len(self.blocks)):
            for p, g in self._with_grads(b, direction):
                self._saved.append((p, p.detach().clone()))
                dtype = compute_dtype(p)
                w = p.to(dtype)
                v = g.to(dtype)  # not `direction`: the next block's parameters are read from that
                if adaptive:
                    v = (w.abs() + eta).square() * v
                s = scale[b].to(device=p.device, dtype=dtype)
                p.copy_(torch.where(s == 0, w, w + v * s))  # a skipped block stays w, even where g is inf

    @torch.no_grad()
    def _restore(self) -> None:
        self._check_placed()  # refused before anything is copied: the parameters keep w + eps, and perturbed stays set
        for p, saved in self._saved:
            p.copy_(saved)
        self._saved.clear()


def _placement(p: torch.Tensor) -> tuple:
    """(device, dtype, shape, strides) of ``p``'s local tensor."""
    t = local(p)
    return t.device, t.dtype, tuple(t.shape), t.stride()

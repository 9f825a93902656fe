"""The ``sharded`` backend: the step over parameters whose storage the library must leave where it is.

FSDP2 keeps each rank's shard of a parameter in a padded buffer of its own and all-gathers from that buffer before
every forward, so the flat-buffer backends, which re-home parameters into buffers of their own, cannot take FSDP2's
shards. This backend leaves every tensor in place. Per step and per (device, dtype) it gathers the local shards of
the parameters that have a gradient into temporary flat tensors (one ``torch.cat`` each for ``w`` and ``g``) and
computes on them, element for element, the reference backend's formulas::

    e_b = sum over the tensors of block b of sum((T * g)^2)    in float64 (segment sums per tensor, then per block)
    w  <- where(scale_b == 0, w, w + (T^2 g) * scale_b)        in float32 (float64), rounded once into w

with ``T = |w| + eta`` for ASAM and 1 otherwise, writing the new ``w`` back with one ``torch._foreach_copy_``; the
gathered ``w`` is the backup that restore copies back the same way. The number of torch operations per step does not
depend on how many tensors the model has (``cat`` and ``_foreach_copy_`` batch many tensors per CUDA launch); the
cost is two extra passes over ``w`` and one over ``g`` against the flat-buffer backends. It works on plain tensors
too, and on DTensors it works on their local shards (:func:`gearsam_fused.sharding.local`); the optimizer sums the
energies over the ranks.
"""

from __future__ import annotations

import torch

from ..checks import check_dense_grad
from ..sharding import local
from .base import Backend, Direction, compute_dtype


class _Group:
    """The local tensors of one (device, dtype) that have a gradient this step, in block order, and the block of
    each."""

    def __init__(self):
        self.weights: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.blocks: list[int] = []

    def sizes(self) -> tuple[int, ...]:
        return tuple(w.numel() for w in self.weights)

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def scatter_(self, flat: torch.Tensor) -> None:
        """Write ``flat`` (laid out as :meth:`flat` lays out the weights) into the weights."""
        pieces = flat.split(self.sizes())
        torch._foreach_copy_(self.weights, [piece.view_as(w) for piece, w in zip(pieces, self.weights)])


class ShardedBackend(Backend):
    name = "sharded"

    def __init__(self, blocks, device: torch.device, param_group=None):
        super().__init__(blocks, device, param_group)
        self._saved: list[tuple[_Group, torch.Tensor]] = []
        self._tables: dict[tuple, torch.Tensor] = {}

    def _table(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``values`` as an int64 tensor on ``device``, made once per distinct value: a copy from the host would
        synchronise a CUDA step. The set of parameters with a gradient rarely changes, so the cache stays small."""
        key = (device, values)
        if key not in self._tables:
            self._tables[key] = torch.tensor(values, dtype=torch.int64, device=device)
        return self._tables[key]

    def _groups(self, direction: Direction | None = None) -> list[_Group]:
        """The parameters with a gradient (or, given ``direction``, a direction tensor) by (device, dtype)."""
        groups: dict[tuple[torch.device, torch.dtype], _Group] = {}
        for b, block in enumerate(self.blocks):
            for i, (name, p) in enumerate(zip(block.param_names, block.params)):
                g = check_dense_grad(p.grad, repr(name)) if direction is None else direction.tensors[b][i]
                if g is None:
                    continue
                w = local(p)
                group = groups.setdefault((w.device, w.dtype), _Group())
                group.weights.append(w)
                group.grads.append(local(g))
                group.blocks.append(b)
        return list(groups.values())

    @torch.no_grad()
    def block_energy(self, adaptive: bool, eta: float, direction: Direction | None = None) -> torch.Tensor:
        energy = torch.zeros(len(self.blocks), dtype=torch.float64, device=self.device)
        for group in self._groups(direction):
            v = group.flat(group.grads).double()
            if adaptive:
                v = (group.flat(group.weights).double().abs() + eta) * v
            # segment sums in a fixed order (no atomics): per tensor, then per block (the tensors are in block order);
            # unsafe=True skips checks of the lengths that would read them back to the host
            lengths = self._table(group.sizes(), v.device)
            per_tensor = torch.segment_reduce(v.square(), "sum", lengths=lengths, unsafe=True)
            counts = tuple(group.blocks.count(b) for b in range(len(self.blocks)))
            per_block = torch.segment_reduce(per_tensor, "sum", lengths=self._table(counts, v.device), unsafe=True)
            energy += per_block.to(self.device)
        return energy

    def _forget(self) -> None:
        self._saved.clear()

    @torch.no_grad()
    def _perturb(self, scale: torch.Tensor, adaptive: bool, eta: float, direction: Direction | None = None) -> None:
        for group in self._groups(direction):
            backup = group.flat(group.weights)
            dtype = compute_dtype(backup)
            w = backup.to(dtype)
            v = group.flat(group.grads).to(dtype)
            if adaptive:
                v = (w.abs() + eta).square() * v
            per_tensor = scale.to(w.device)[self._table(tuple(group.blocks), w.device)].to(dtype)
            s = per_tensor.repeat_interleave(self._table(group.sizes(), w.device), output_size=w.numel())
            group.scatter_(torch.where(s == 0, w, w + v * s).to(backup.dtype))
            self._saved.append((group, backup))

    @torch.no_grad()
    def _restore(self) -> None:
        for group, backup in self._saved:
            group.scatter_(backup)
        self._saved.clear()

"""Parameters sharded across ranks: FSDP2 (``torch.distributed.fsdp.fully_shard``) and other DTensor layouts.

A sharded parameter is a ``DTensor``: each rank holds a piece of it (its local shard) and the gradient FSDP2 leaves
after ``backward`` is sharded the same way. SAM's statistics are sums of squares over whole parameters, so a rank's
sum over its local shards is a partial sum: the block energies are summed over the mesh dimensions along which the
parameters are sharded (one all-reduce of a ``[B]`` float64 vector per step, on the device), which gives every rank
the same energies, EMA and radii. Everything element-wise (perturb, restore, the base optimizer's update) works on
the local shards alone. A dimension along which parameters are replicated (HSDP's outer one) holds the same
gradient on every rank and is not summed over.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .compat import DTensor, Shard


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient of which this rank holds a shard)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (an alias of its storage, so writing to it writes the
    shard), ``t`` itself otherwise."""
    return t.to_local() if is_sharded(t) else t


def reduction_groups(named_params: Iterable[tuple[str, torch.Tensor]]) -> list:
    """The process groups over which block energies must be summed: one per mesh dimension along which the
    parameters are sharded (``[]`` when none is a DTensor). Refuses a mix of DTensor and plain parameters, several
    meshes, or parameters sharded along different mesh dimensions: their partial sums could not be combined by one
    reduction."""
    named_params = list(named_params)
    sharded = [(n, p) for n, p in named_params if is_sharded(p)]
    if not sharded:
        return []
    plain = [n for n, p in named_params if not is_sharded(p)]
    if plain:
        raise ValueError(
            f"parameter {plain[0]} is a plain tensor while others are sharded DTensors (e.g. {sharded[0][0]}): "
            "apply fully_shard to the root module as well, so that every parameter is sharded"
        )
    first_name, first = sharded[0]
    mesh = first.device_mesh
    dims = _sharded_dims(first)
    for name, p in sharded[1:]:
        if p.device_mesh != mesh:
            raise ValueError(f"parameters {first_name} and {name} live on different device meshes")
        if _sharded_dims(p) != dims:
            raise ValueError(
                f"parameters {first_name} and {name} are sharded along different mesh dimensions "
                f"({first.placements} and {p.placements})"
            )
    return [mesh.get_group(d) for d in dims]


def _sharded_dims(p) -> tuple[int, ...]:
    return tuple(d for d, placement in enumerate(p.placements) if isinstance(placement, Shard))


def sum_over(groups: list, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed in place over every group of :func:`reduction_groups` (no host synchronisation)."""
    for group in groups:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values

"""Where a sharpness-aware optimizer's parameters go: partitioned into blocks, kept to those it updates, and handed
to the backend that does the step's tensor work (and to the fused base step where the base optimizer allows it)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .allocation import GEAR_RULE
from .backends import make_backend, resolve_backend_name
from .backends.base import Backend
from .base_step import FUSED, PER_TENSOR, FlatBaseStep
from .partition import Block
from .partition import partition as make_partition
from .sharding import is_sharded, reduction_groups


class Placement(NamedTuple):
    """The parameters placed: their blocks, the backend over them and where the per-block statistics live."""

    blocks: list[Block]
    #: (name, parameter) of what the optimizer updates but no block holds (frozen at construction)
    outside_blocks: list[tuple[str, torch.Tensor]]
    #: the process groups that hold shards of a block (FSDP2), whose energies are summed over them
    shard_groups: list
    backend_name: str
    backend: Backend
    device: torch.device  #: the first block's: it receives the energies and radii


def place(param_groups: list[dict], model: nn.Module | None, partition, label, backend: str, rule: str) -> Placement:
    """Partition the parameters of ``param_groups`` into blocks and build the backend over them."""
    optimized = [p for group in param_groups for p in group["params"]]
    blocks = blocks_of(model, partition, optimized, label)
    if rule == GEAR_RULE and len(blocks) == 1 and isinstance(partition, str) and partition != "global":
        warnings.warn(
            f"partition {partition!r} gives a single block ({blocks[0].name!r}), so GEAR-SAM's allocation is "
            "plain SAM's here; pass partition= a finer strategy, a mapping or a callable (`gearsam partition` "
            "shows the blocks)",
            UserWarning,
            stacklevel=4,
        )
    in_blocks = {id(p) for b in blocks for p in b.params}
    # Frozen at construction, so in no block; if one is unfrozen later, the base optimizer would step it while the
    # SAM step ignores it. Checked in first_step (usually an empty list).
    outside_blocks = [(label(p), p) for p in optimized if id(p) not in in_blocks]
    shard_groups = reduction_groups((label(p), p) for p in optimized)
    backend_name = resolve_backend_name(
        backend, {p.device for b in blocks for p in b.params}, sharded=any(map(is_sharded, optimized))
    )
    param_group = {id(p): g for g, group in enumerate(param_groups) for p in group["params"]}
    device = next(p for b in blocks for p in b.params).device
    made = make_backend(backend_name, blocks, device, param_group)
    return Placement(blocks, outside_blocks, shard_groups, backend_name, made, device)


def wrap_base(opt, base_optimizer, base_kwargs: dict, rho: float) -> None:
    """Build ``opt``'s base optimizer over its param groups and share the base's groups, state and defaults."""
    opt.base_optimizer = base_optimizer(opt.param_groups, **base_kwargs)
    opt.param_groups = opt.base_optimizer.param_groups
    if opt.descent is not None:
        opt.descent.check_groups(opt.param_groups, type(opt.base_optimizer).__name__)
    opt.state = opt.base_optimizer.state
    # LR schedulers read defaults (OneCycleLR and CyclicLR look for momentum or betas there): the base's, plus rho
    opt.defaults = {**opt.base_optimizer.defaults, "rho": rho}


def flat_step_for(base_step: str, backend: Backend, backend_name: str, base_optimizer: torch.optim.Optimizer,
                  capturable: bool, key: int) -> tuple[FlatBaseStep | None, str]:  # fmt: skip
    """The fused base step over the backend's buckets, or None and why not (an error if it was asked for); ``key``
    the optimizer's registry key (:class:`~gearsam_fused.base_step.FlatBaseStep`)."""
    if base_step == PER_TENSOR:
        return None, "base_step='per-tensor' was asked for"
    if not backend.fuses_base_step:
        why_not = f"backend {backend_name!r} steps the base optimizer per tensor"
    else:
        why_not = FlatBaseStep.why_not(base_optimizer)
    if why_not and base_step == FUSED:
        raise ValueError(f"base_step='fused' cannot be honoured: {why_not}")
    if why_not:
        return None, why_not
    return FlatBaseStep(base_optimizer, backend.layout, capturable=capturable, key=key), ""


def blocks_of(model: nn.Module | None, strategy, optimized: list[torch.Tensor], label) -> list[Block]:
    """Partition, then keep only what this optimizer updates (a model may have parameters it does not own) and
    drop the blocks left empty. Trainable parameters the model does not hold (a temperature, a loss's weights)
    form a block of their own, ``"other"``, unless the strategy is a mapping, which names every parameter."""
    trainable = [p for p in optimized if p.requires_grad]
    if isinstance(strategy, Mapping) and strategy:
        strategy = _covering(strategy, trainable, label)
    in_model = {id(p) for p in model.parameters()} if model is not None else None
    foreign_to_model = []
    if in_model is not None and not isinstance(strategy, Mapping):
        foreign_to_model = [p for p in trainable if id(p) not in in_model]
        optimized = [p for p in optimized if id(p) in in_model]
    blocks = make_partition(model, strategy, params=optimized) if any(p.requires_grad for p in optimized) else []
    if model is None:  # no module names: a parameter is named by its place in the param groups, as in every message
        for block in blocks:
            block.param_names = [label(p, shape=False) for p in block.params]
            if strategy == "tensor":
                block.name = block.param_names[0]
    owned = {id(p) for p in optimized}
    for block in blocks:
        foreign = [n for n, p in zip(block.param_names, block.params) if id(p) not in owned]
        if foreign and isinstance(strategy, Mapping):
            raise ValueError(
                f"partition block {block.name!r} holds {foreign[0]!r}, which is not in the optimizer's params"
            )
        keep = [(n, p) for n, p in zip(block.param_names, block.params) if id(p) in owned]
        block.param_names = [n for n, _ in keep]
        block.params = [p for _, p in keep]
    blocks = [b for b in blocks if b.params]
    if foreign_to_model:
        name = "other"
        while name in {b.name for b in blocks}:
            name = "_" + name
        blocks.append(Block(name, foreign_to_model, [label(p, shape=False) for p in foreign_to_model]))
    if not blocks:
        raise ValueError("empty partition: none of the optimizer's parameters is trainable")
    return blocks


def _covering(mapping: Mapping, trainable: list[torch.Tensor], label) -> dict:
    """``mapping`` with its parameter lists materialised, after checking that it places every trainable parameter
    (the error names the first one it misses)."""
    mapping = {k: v if isinstance(v, torch.Tensor) else list(v) for k, v in mapping.items()}
    mapped = {id(p) for v in mapping.values() if not isinstance(v, torch.Tensor) for p in v}
    missing = [p for p in trainable if id(p) not in mapped]
    if missing:
        raise ValueError(
            f"parameter {label(missing[0])} is optimized but in no block of the partition mapping; add it to a block, "
            "or leave it out of the optimizer"
        )
    return mapping

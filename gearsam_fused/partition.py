"""Architecture-aware partition of a model's trainable parameters into blocks.

GEAR-SAM splits the SAM radius across blocks; which parameters share a block decides what the allocation can see.
Everything here is pure Python over module structure: no tensor data is read or written.

Strategies
----------
``"coarse"``  architecture-level functional blocks (paper default): the stem, each top-level stage, the head.
``"fine"``    every residual unit / transformer block of a stage on its own; stem and head stay separate.
``"tensor"``  one block per parameter tensor.
``"global"``  one block holding everything (GEAR-SAM then equals SAM).
callable      ``fn(name, param) -> block name``; blocks ordered by first appearance.
mapping       ``{block name: [parameters]}``, taken as given.

How ``"coarse"`` reads a model it has never seen
------------------------------------------------
A module's *height* is 1 when no child of it holds parameters, else 1 + the largest height among its children that
do (a Linear, a norm: 1; a conv+BN pair, a residual unit of plain layers: 2; a stage of such units, a transformer
block: 3; a stack of transformer blocks: 4). At *level* L, a child of height L or more is a *unit*, one of smaller
height a *layer*. Walking the root's children that hold parameters, in registration order:

1. while exactly one unit exists, it holds more than half the parameters and it has a unit child of its own, it is a
   wrapper: replace it by its own children (a ``Wrapper(model=ResNet)``, a ViT's ``blocks`` list, EfficientNet's
   ``features``); a unit with no unit child (a residual unit, a transformer layer at level 3) is never opened;
2. every unit becomes a block, named by its dotted path;
3. maximal runs of consecutive layers merge into one block: the leading run is ``"stem"``, the trailing run
   ``"classifier"``, a run in the middle is named by its members joined with ``"+"``;
4. parameters registered directly on the root or an expanded module (a ViT's ``cls_token``) count as a layer and
   join the run of layers next to them; with none there, they join the unit after them (the last block at the end).

The rule runs at level 3; only where that gives a single block, at level 2, and only where that does too, at level 1.
Level 3 finds the stages of residual and transformer networks; level 2 the stages of a network of plain layers (a
CNN's ``Sequential(conv, act, conv)`` stages, VGG's ``features`` and ``classifier``); level 1, where every layer is a
unit, each layer of an MLP. At level 1 a layer whose parameters are all vectors (a norm, a learned scale) joins the
block of the layer before it, or of the one after it when none precedes it, and that block is named by its members
joined with ``"+"``. A model that no level splits (one Linear, a Linear and its norm) is the single block ``"model"``.

``"fine"`` then splits every coarse block that is a stage into one block per unit of it, named by their paths: a
stage is a module with no parameter of its own and several children holding parameters; at level 3 these must all be
containers (residual units, transformer blocks), so ``layer1`` becomes ``layer1.0, layer1.1`` while a BasicBlock or a
transformer block, which holds layers directly, stays whole; at levels 2 and 1 they are its layers, vector layers
joining the layer before them as in level 1 (``layer1`` of ``Sequential(conv, BN, act, conv)`` becomes
``layer1.0+layer1.1, layer1.3``).

Both read the structure of the full model, every parameter counted whether trainable or not, and only then drop frozen
parameters and the blocks left empty: freezing part of a model never merges or renames the blocks of the rest.

Wrappers that add no structure of their own are looked through, at the root and anywhere inside the model
(:func:`unwrap`): blocks and parameter names are those of the bare model. A parameter reachable under several names
(a tied weight) is named by its first, as ``named_parameters()`` names it, and belongs to the first block reaching it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

STRATEGIES = ("coarse", "fine", "tensor", "global")
_LEVELS = (3, 2, 1)  # the coarse rule's levels, tried in this order


@dataclass
class Block:
    """One allocation unit: a name and the parameters that share one radius."""

    name: str
    params: list[torch.nn.Parameter] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def __repr__(self) -> str:
        return f"Block({self.name!r}, tensors={len(self.params)}, numel={self.numel})"


def _trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Trainable parameters, each once (a tensor listed twice is kept at its first position)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def unwrap(model: nn.Module | None) -> nn.Module | None:
    """The network inside wrappers that add a level to the module tree but no structure of their own:
    ``DistributedDataParallel``, ``DataParallel``, ``torch.compile``'s ``OptimizedModule``, Lightning Fabric's
    module and the activation-checkpointing wrapper. Block and parameter names are the same with or without them, so
    states saved either way load either way. (``fully_shard``, FSDP2, shards in place and needs no unwrapping.)"""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(getattr(model, "_original_module", None), nn.Module) and hasattr(model, "_forward_module"):
            model = model._original_module  # lightning's _FabricModule; its _forward_module may be DDP around it
        elif isinstance(getattr(model, "_checkpoint_wrapped_module", None), nn.Module):
            model = model._checkpoint_wrapped_module  # torch.distributed's checkpoint_wrapper / offload_wrapper
        else:
            return model


# The structural helpers below ignore requires_grad: blocks follow the architecture, not what happens to be frozen.
def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children holding parameters, each seen through its wrappers (a compiled or checkpointed layer)."""
    return [(name, unwrap(child)) for name, child in module.named_children() if _has_params(child)]


def _height(module: nn.Module) -> int:
    return 1 + max((_height(child) for _, child in _children(module)), default=0)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _named_parameters(module: nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``module.named_parameters(prefix)`` with wrappers looked through: each parameter once, under its first name."""
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []

    def walk(m: nn.Module, at: str) -> None:
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((at + name, p))
        for name, child in _children(m):
            walk(child, f"{at}{name}.")

    walk(module, prefix)
    return out


class _Member(NamedTuple):
    """A member of the sequence being segmented: a child holding parameters, or the parameters registered directly on
    a module (``module`` None, ``height`` 0: never a unit)."""

    name: str
    module: nn.Module | None
    height: int
    direct: list[tuple[str, torch.Tensor]]

    def numel(self) -> int:
        return _numel(self.module) if self.module is not None else sum(p.numel() for _, p in self.direct)

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        return self.direct if self.module is None else _named_parameters(self.module, self.name + ".")

    def is_vector_layer(self) -> bool:
        """A layer whose parameters are all vectors (a norm, a learned scale): it belongs with a neighbouring layer."""
        return self.height == 1 and all(p.dim() <= 1 for p in self.module.parameters())


class _Group(NamedTuple):
    """A block before its parameters are gathered: its name and the members it covers."""

    name: str
    members: list[_Member]


def _members(prefix: str, module: nn.Module) -> list[_Member]:
    """Children of ``module`` that hold parameters, direct parameters first."""
    members: list[_Member] = []
    direct = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
    if direct:
        members.append(_Member(prefix, None, 0, direct))
    for name, child in _children(module):
        members.append(_Member(prefix + name, child, _height(child), []))
    return members


def _expand_wrappers(members: list[_Member], level: int) -> list[_Member]:
    """Step 1 of the coarse rule: replace a lone unit that holds most of the parameters by its own members, repeatedly;
    a unit with no unit child stays whole, else a one-layer transformer or a one-unit stage would dissolve into its
    layers."""
    while True:
        units = [i for i, m in enumerate(members) if m.height >= level]
        if len(units) != 1:
            return members
        i = units[0]
        unit = members[i]
        inner = _members(unit.name + ".", unit.module)
        if 2 * unit.numel() <= sum(m.numel() for m in members) or not any(m.height >= level for m in inner):
            return members
        members = members[:i] + inner + members[i + 1 :]


def _runs(members: list[_Member], level: int) -> list[tuple[list[_Member], bool]]:
    """The members cut into (members, is a unit) runs: one per unit, one per maximal run of layers; at level 1 a vector
    layer joins the unit before it, or a unit joins the vector layers before it."""
    runs: list[tuple[list[_Member], bool]] = []
    for m in members:
        unit = m.height >= level
        last = runs[-1] if runs else None
        if unit and level == 1 and last is not None and last[1]:
            if m.is_vector_layer() or all(x.is_vector_layer() for x in last[0]):
                last[0].append(m)
                continue
        if not unit and last is not None and not last[1]:
            last[0].append(m)
        else:
            runs.append(([m], unit))

    # A run made only of direct parameters joins the run after it (the nearest real block), or the last one.
    merged: list[tuple[list[_Member], bool]] = []
    pending: list[_Member] = []
    for run, unit in runs:
        if not unit and all(m.module is None for m in run):
            pending.extend(run)
            continue
        merged.append((pending + run, unit))
        pending = []
    if pending:
        if merged:
            merged[-1][0].extend(pending)
        else:
            merged.append((pending, False))
    return merged


def _joined(members: list[_Member]) -> str:
    return "+".join(m.name for m in members if m.module is not None)


def _segment(members: list[_Member], level: int) -> list[_Group]:
    """Steps 2-4 of the coarse rule over an ordered member list: the named groups."""
    runs = _runs(members, level)
    groups = []
    for k, (run, unit) in enumerate(runs):
        if unit:
            name = _joined(run)
        elif k == 0:
            name = "stem"
        elif k == len(runs) - 1:
            name = "classifier"
        else:
            name = _joined(run)
        groups.append(_Group(name, run))
    return groups


def _coarse_groups(model: nn.Module) -> tuple[int, list[_Group]]:
    """The coarse groups and the level that gave them: the first of ``_LEVELS`` that gives more than one block (a group
    can be left empty by weights tied to an earlier one)."""
    top = _members("", model)
    for level in _LEVELS:
        groups = _segment(_expand_wrappers(top, level), level)
        if len(_blocks(groups)) > 1:
            return level, groups
    return _LEVELS[-1], [_Group("model", top)]


def _blocks(groups: list[_Group]) -> list[Block]:
    """The groups' parameters gathered; a tied weight goes to the first group that reaches it."""
    blocks = []
    seen: set[int] = set()
    for group in groups:
        block = Block(group.name)
        for member in group.members:
            for name, p in member.named_params():
                if id(p) not in seen:
                    seen.add(id(p))
                    block.params.append(p)
                    block.param_names.append(name)
        if block.params:
            blocks.append(block)
    return blocks


def _trainable_part(blocks: list[Block]) -> list[Block]:
    """The blocks cut down to their trainable parameters; a block left empty is dropped, none is merged."""
    out = []
    for b in blocks:
        kept = [(n, p) for n, p in zip(b.param_names, b.params) if p.requires_grad]
        if kept:
            out.append(Block(b.name, [p for _, p in kept], [n for n, _ in kept]))
    return out


def _coarse(model: nn.Module) -> list[Block]:
    return _trainable_part(_blocks(_coarse_groups(model)[1]))


def _stage_units(member: _Member, level: int) -> list[list[_Member]] | None:
    """The units of ``member`` when it is a stage (see the module docstring), else None."""
    if member.module is None or next(member.module.parameters(recurse=False), None) is not None:
        return None
    children = _members(member.name + ".", member.module)
    if len(children) < 2 or any(c.height < level - 1 for c in children):
        return None
    units = [run for run, _ in _runs(children, 1)]  # at level 1 every child is a unit; vector layers join theirs
    return units if len(units) > 1 else None


def _fine(model: nn.Module) -> list[Block]:
    level, coarse = _coarse_groups(model)
    groups: list[_Group] = []
    for group in coarse:
        modules = [i for i, m in enumerate(group.members) if m.module is not None]
        units = _stage_units(group.members[modules[0]], level) if len(modules) == 1 else None
        if units is None:
            groups.append(group)
            continue
        # direct parameters that joined the stage stay next to it: before its first unit, or after its last
        units[0] = group.members[: modules[0]] + units[0]
        units[-1] = units[-1] + group.members[modules[0] + 1 :]
        groups += [_Group(_joined(unit), unit) for unit in units]
    return _trainable_part(_blocks(groups))


def _by_callable(model: nn.Module, fn: Callable[[str, torch.Tensor], str]) -> list[Block]:
    blocks: dict[str, Block] = {}
    for name, p in _named_parameters(model):
        if not p.requires_grad:
            continue
        key = fn(name, p)
        if not isinstance(key, str) or not key:
            raise ValueError(
                f"partition callable returned {key!r} for parameter {name!r}; it must return a non-empty block name"
            )
        block = blocks.setdefault(key, Block(key))
        block.params.append(p)
        block.param_names.append(name)
    return list(blocks.values())


def parameter_names(model: nn.Module | None) -> dict[int, str]:
    """``{id(p): name}`` for every parameter of ``model`` (none without one), wrappers looked through and a tied weight
    under its first name: how the partition, and every message of the optimizers, name a parameter."""
    if model is None:
        return {}
    return {id(p): n for n, p in _named_parameters(unwrap(model))}  # a tied weight under its first name


def _by_mapping(mapping: Mapping[str, Iterable[torch.Tensor]], model: nn.Module | None) -> list[Block]:
    names = parameter_names(model)
    blocks = []
    for key, params in mapping.items():
        if isinstance(params, torch.Tensor):
            raise TypeError(f"partition block {key!r} must map to a list of parameters, not a single tensor")
        block = Block(str(key))
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"partition block {key!r} holds a {type(p).__name__}, expected parameters")
            if p.requires_grad:
                block.params.append(p)
                block.param_names.append(names.get(id(p), f"{block.name}[{len(block.params) - 1}]"))
        blocks.append(block)
    return blocks  # disjointness is checked by _validate, like every other strategy's result


def partition(model: nn.Module | None, strategy="coarse", params: Iterable[torch.Tensor] | None = None) -> list[Block]:
    """Split the trainable parameters of ``model`` (or of ``params``) into ordered, disjoint blocks.

    Args:
        model: the network; needed by ``"coarse"``, ``"fine"`` and callables, which read module and parameter names.
            Wrappers (``DistributedDataParallel``, ``torch.compile``, Lightning Fabric's, ...: :func:`unwrap`) are
            looked through, around the model and inside it.
        strategy: ``"coarse"``, ``"fine"``, ``"tensor"``, ``"global"``, a callable ``(name, param) -> block name``,
            or a mapping ``{block name: [parameters]}``.
        params: the parameters to cover when no model is given (``"tensor"``, ``"global"``); with a model, defaults
            to the model's parameters.

    Returns:
        A list of :class:`Block`. Every trainable parameter is in exactly one block; frozen ones are left out.

    Raises:
        ValueError: unknown strategy, no trainable parameters, a parameter in two blocks, a trainable parameter in
            none, or a strategy that needs a model without one.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"partition() expects an nn.Module as model, got {type(model).__name__}")
    model = unwrap(model)
    _check_strategy(strategy, model)
    if params is None:
        if model is None:
            raise ValueError("partition() needs a model or params")
        params = list(model.parameters())
    else:
        params = list(params)
    names = parameter_names(model)

    if strategy == "coarse":
        blocks = _coarse(model)
    elif strategy == "fine":
        blocks = _fine(model)
    elif strategy in ("tensor", "global"):
        named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(_trainable(params))]
        if strategy == "tensor":
            blocks = [Block(n, [p], [n]) for n, p in named]
        else:
            blocks = [Block("global", [p for _, p in named], [n for n, _ in named])]
    elif isinstance(strategy, Mapping):
        blocks = _by_mapping(strategy, model)
    else:
        blocks = _by_callable(model, strategy)

    _validate(blocks, params, names)
    return blocks


def _check_strategy(strategy, model: nn.Module | None) -> None:
    """Refuse an unknown strategy, or one that reads names without a model, saying what to pass instead."""
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown partition strategy {strategy!r}; expected one of {STRATEGIES}, a callable or a mapping"
            )
        if strategy in ("coarse", "fine") and model is None:
            raise ValueError(
                f"partition strategy {strategy!r} reads module names and needs the model: pass model=... "
                "(or the nn.Module itself as params), or use 'tensor', 'global', a mapping"
            )
    elif not callable(strategy) and not isinstance(strategy, Mapping):
        raise ValueError(
            f"unknown partition strategy of type {type(strategy).__name__}; expected a name, callable or mapping"
        )
    elif callable(strategy) and not isinstance(strategy, Mapping) and model is None:
        raise ValueError("a callable partition strategy receives parameter names and needs the model: pass model=...")


def _validate(blocks: list[Block], params: list[torch.Tensor], names: dict[int, str]) -> None:
    if not blocks or not any(b.params for b in blocks):
        raise ValueError("empty partition: no block holds a trainable parameter")
    seen_names: set[str] = set()
    owner: dict[int, str] = {}
    for b in blocks:
        if b.name in seen_names:
            raise ValueError(f"two partition blocks are named {b.name!r}; block names must be unique")
        seen_names.add(b.name)
        for p in b.params:
            if id(p) in owner:
                label = names.get(id(p), f"of shape {tuple(p.shape)}")
                if owner[id(p)] == b.name:
                    raise ValueError(f"parameter {label} appears twice in partition block {b.name!r}")
                raise ValueError(f"parameter {label} is in two partition blocks: {owner[id(p)]!r} and {b.name!r}")
            owner[id(p)] = b.name
    for i, p in enumerate(params):
        if p.requires_grad and id(p) not in owner:
            raise ValueError(
                f"trainable parameter {names.get(id(p), f'#{i} of shape {tuple(p.shape)}')} is in no partition block"
            )


def format_partition(blocks: list[Block]) -> str:
    """A plain-text table of blocks: name, tensor count, parameter count, share of parameters."""
    total = sum(b.numel for b in blocks) or 1
    width = max([len("block")] + [len(b.name) for b in blocks])
    lines = [f"{'block':<{width}}  {'tensors':>7}  {'params':>12}  {'%':>6}"]
    for b in blocks:
        lines.append(f"{b.name:<{width}}  {len(b.params):>7}  {b.numel:>12,}  {100.0 * b.numel / total:>6.2f}")
    lines.append(f"{'total':<{width}}  {sum(len(b.params) for b in blocks):>7}  {total:>12,}  {100.0:>6.2f}")
    return "\n".join(lines)

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
A child module is *shallow* when all its parameters sit on it or on its direct children (a Linear, a
conv+BN pair, a PatchEmbed); otherwise it is *deep* (a residual stage, a transformer block). Walking the root's
children in registration order:

1. while exactly one deep child exists, it holds more than half the parameters and it has a deep child of its own,
   it is a wrapper: replace it by its own children (a ``Wrapper(model=ResNet)``, a ViT's ``blocks`` list,
   EfficientNet's ``features``); a unit (a residual unit, a transformer layer) is never opened, even when alone;
2. every deep child becomes a block, named by its dotted path;
3. maximal runs of consecutive shallow children merge into one block: the leading run is ``"stem"``, the trailing
   run ``"classifier"``, a run in the middle is named by its members joined with ``"+"``, and a model with no deep
   child at all is the single block ``"model"``;
4. parameters registered directly on an expanded module (a ViT's ``cls_token``) join the run in front of them, or
   the first block when nothing shallow precedes it.

``"fine"`` then splits every coarse block that is a stage (a container whose parametered children are all
containers: residual units, transformer blocks) into one block per unit, so ``layer1`` becomes
``layer1.0, layer1.1`` while a BasicBlock or a transformer block, which holds layers directly, stays whole.

Both read the structure of the full model, every parameter counted whether trainable or not, and only then drop frozen
parameters and the blocks left empty: freezing part of a model never merges or renames the blocks of the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

STRATEGIES = ("coarse", "fine", "tensor", "global")


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


# The structural helpers below ignore requires_grad: blocks follow the architecture, not what happens to be frozen.
def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_deep(module: nn.Module) -> bool:
    """True when some parameter lies two or more module levels below ``module``."""
    return any(any(_has_params(grandchild) for grandchild in child.children()) for child in module.children())


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# A member of the sequence being segmented: (dotted name, module or None, deep?, [(name, param)] when the member
# stands for parameters registered directly on a module)
_Member = tuple[str, "nn.Module | None", bool, list]


def _members(prefix: str, module: nn.Module) -> list[_Member]:
    """Children of ``module`` that hold parameters, direct parameters first."""
    members: list[_Member] = []
    direct = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
    if direct:
        members.append((prefix, None, False, direct))
    for name, child in module.named_children():
        if _has_params(child):
            members.append((prefix + name, child, _is_deep(child), []))
    return members


def _expand_wrappers(members: list[_Member]) -> list[_Member]:
    """Replace a lone deep member that holds most of the parameters by its own members, repeatedly; a unit (no deep
    child) stays whole, else a one-layer transformer or a one-unit stage would dissolve into its layers."""
    while True:
        deep = [i for i, m in enumerate(members) if m[2]]
        if len(deep) != 1:
            return members
        i = deep[0]
        name, module, _, _ = members[i]
        total = sum(_numel(m[1]) if m[1] is not None else sum(p.numel() for _, p in m[3]) for m in members)
        inner = _members(name + ".", module)
        if 2 * _numel(module) <= total or not any(m[2] for m in inner):
            return members
        members = members[:i] + inner + members[i + 1 :]


def _named_params(member: _Member) -> list[tuple[str, torch.Tensor]]:
    name, module, _, direct = member
    if module is None:
        return direct
    return [(f"{name}.{n}", p) for n, p in module.named_parameters()]


def _segment(members: list[_Member]) -> list[Block]:
    """Steps 2-4 of the coarse rule over an ordered member list."""
    groups: list[tuple[list[_Member], bool]] = []  # (members, is_deep)
    for m in members:
        if m[2]:
            groups.append(([m], True))
        elif groups and not groups[-1][1]:
            groups[-1][0].append(m)
        else:
            groups.append(([m], False))

    # A run made only of direct parameters joins the block after it (the nearest real block).
    merged: list[tuple[list[_Member], bool]] = []
    pending: list[_Member] = []
    for group, deep in groups:
        if not deep and all(m[1] is None for m in group):
            pending.extend(group)
            continue
        merged.append((pending + group, deep))
        pending = []
    if pending:
        if merged:
            merged[-1][0].extend(pending)
        else:
            merged.append((pending, False))

    has_deep = any(deep for _, deep in merged)
    blocks = []
    seen: set[int] = set()  # a tied weight goes to the first block that reaches it
    for k, (group, deep) in enumerate(merged):
        if not has_deep:
            name = "model"
        elif deep:
            name = next(m[0] for m in group if m[1] is not None)
        elif k == 0:
            name = "stem"
        elif k == len(merged) - 1:
            name = "classifier"
        else:
            name = "+".join(m[0] for m in group if m[1] is not None)
        block = Block(name)
        for m in group:
            for pname, p in _named_params(m):
                if id(p) not in seen:
                    seen.add(id(p))
                    block.params.append(p)
                    block.param_names.append(pname)
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


def _coarse_all(model: nn.Module) -> list[Block]:
    return _segment(_expand_wrappers(_members("", model)))


def _coarse(model: nn.Module) -> list[Block]:
    return _trainable_part(_coarse_all(model))


def _is_unit_sequence(module: nn.Module) -> bool:
    """True for a stage: no parameter of its own, and every child holding parameters is itself a container
    (a residual unit, a transformer block) rather than a layer such as a Linear or a norm."""
    children = [c for c in module.children() if _has_params(c)]
    return (
        len(children) > 1
        and next(module.parameters(recurse=False), None) is None
        and all(any(_has_params(g) for g in c.children()) for c in children)
    )


def _fine(model: nn.Module) -> list[Block]:
    modules = dict(model.named_modules())
    blocks: list[Block] = []
    for block in _coarse_all(model):
        module = modules.get(block.name)
        if module is None or not _is_unit_sequence(module):
            blocks.append(block)
            continue
        owned = {id(p) for p in block.params}
        for child_name, child in module.named_children():
            unit = Block(f"{block.name}.{child_name}")
            for n, p in child.named_parameters():
                if id(p) in owned:
                    owned.discard(id(p))
                    unit.params.append(p)
                    unit.param_names.append(f"{unit.name}.{n}")
            if unit.params:
                blocks.append(unit)
    return _trainable_part(blocks)


def _by_callable(model: nn.Module, fn: Callable[[str, torch.Tensor], str]) -> list[Block]:
    blocks: dict[str, Block] = {}
    for name, p in model.named_parameters():
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


def _param_names(model: nn.Module | None) -> dict[int, str]:
    if model is None:
        return {}
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def _by_mapping(mapping: Mapping[str, Iterable[torch.Tensor]], model: nn.Module | None) -> list[Block]:
    names = _param_names(model)
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


def unwrap(model: nn.Module | None) -> nn.Module | None:
    """The network inside ``torch.compile``, ``DistributedDataParallel`` and ``DataParallel`` wrappers: block and
    parameter names are the same with or without them, so states saved either way load either way."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def partition(model: nn.Module | None, strategy="coarse", params: Iterable[torch.Tensor] | None = None) -> list[Block]:
    """Split the trainable parameters of ``model`` (or of ``params``) into ordered, disjoint blocks.

    Args:
        model: the network; needed by ``"coarse"``, ``"fine"`` and callables, which read module and parameter names.
            Wrappers (``torch.compile``, ``DistributedDataParallel``, ``DataParallel``) are looked through.
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

    if params is None:
        if model is None:
            raise ValueError("partition() needs a model or params")
        params = list(model.parameters())
    else:
        params = list(params)
    names = _param_names(model)

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

"""State dicts of the sharpness-aware optimizers: the base optimizer's own (torch's per-parameter format), with the
optimizer's state (rule, blocks, GEAR-SAM's EMA, the last energies and radii, the schedule's and the SAM family's
state) under ``"gearsam"`` in the first param group; loading checks that the dict was saved by the same kind of
optimizer over the same blocks, and takes over a plain torch optimizer's state dict."""

from __future__ import annotations

import warnings

import torch

from .allocation import GEAR_RULE
from .backends.base import CORRECTION, MOMENTUM

#: The key of the optimizer's own entry in the first param group.
STATE_KEY = "gearsam"
#: Param-group keys a plain state dict may lack: ours, and flags torch's optimizers default when loading older states.
OPTIONAL_GROUP_KEYS = {"rho", "foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


def save(opt) -> dict:
    """The base optimizer's state dict (torch's per-parameter format), with this optimizer's own state (the rule,
    blocks, GEAR EMA, last energies and radii) under ``"gearsam"`` in the first param group: tools that keep only
    ``"state"`` and ``"param_groups"`` (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``)
    keep it too, and a plain torch optimizer that loads the dict ignores it."""
    opt._refuse_mid_step("state_dict()")
    if opt._flat_step is not None:
        opt._flat_step.check_state()
    state = opt.base_optimizer.state_dict()
    state["param_groups"][0][STATE_KEY] = {
        "rule": opt.rule,
        "block_names": opt.block_names,
        "ema": opt._run.ema.detach().cpu().clone(),
        "energy": opt._run.energy.detach().cpu().clone(),
        "radius": opt._run.radius.detach().cpu().clone(),
        "last_rho": float(opt._run.last_rho),
        "shapes": [[tuple(p.shape) for p in b.params] for b in opt.blocks],
    }
    if opt.schedule is not None:
        state["param_groups"][0][STATE_KEY]["schedule"] = _schedule_entry(opt)
    state["param_groups"][0][STATE_KEY].update(_family_entry(opt))
    if opt.one_pass:
        state["param_groups"][0][STATE_KEY]["one_pass"] = True
    return state


def _family_entry(opt) -> dict:
    """The SAM family's parts in a state dict: their reprs, and F-SAM's EMA once it holds a gradient."""
    entry = {"ascent": repr(opt.ascent), "descent": repr(opt.descent)}
    if opt.ascent is not None and any(opt._run.ascent_started):
        entry["momentum"] = [t.detach().cpu().clone() for t in opt._backend.buffer_tensors(MOMENTUM)]
        entry["ascent_started"] = list(opt._run.ascent_started)
    return entry


def _check_parts(opt, ours: dict) -> None:
    """Refuse a state saved with other parts of the SAM family, or with a schedule this optimizer does not have: a
    saved schedule's state (its statistics, LookSAM's correction) is never dropped. A state saved without a schedule
    loads into one with a schedule, which starts afresh (a run switching to a schedule)."""
    for part in ("ascent", "descent"):
        saved, mine = ours.get(part, "None"), repr(getattr(opt, part))
        if saved != mine:
            raise ValueError(f"state dict was saved with {part}={saved}, this optimizer has {part}={mine}")
    entry = ours.get("schedule")
    if entry is not None and entry["schedule"] != repr(opt.schedule):
        mine = "none" if opt.schedule is None else repr(opt.schedule)
        raise ValueError(
            f"state dict was saved with schedule {entry['schedule']}, this optimizer has {mine}; build it with "
            f"schedule={entry['schedule']} to resume (a saved schedule's state is not dropped)"
        )


def _load_family(opt, ours: dict) -> None:
    """Resume the SAM family's parts (:func:`_check_parts` has compared them)."""
    n_params = sum(len(block.params) for block in opt.blocks)
    # a state saved before the EMA started per parameter: every EMA had started together
    started = ours.get("ascent_started", [True] * n_params if "momentum" in ours else [])
    opt._run.ascent_started = tuple(bool(s) for s in started)
    if started:
        for t, saved in zip(opt._backend.buffer_tensors(MOMENTUM), ours["momentum"], strict=True):
            t.copy_(saved)


def _schedule_entry(opt) -> dict:
    entry = {
        "schedule": repr(opt.schedule),
        "steps_done": opt._run.steps_done,
        "next_sam": opt.sam_step,
        "state": opt.schedule.state_dict(opt._run.schedule_state),
    }
    if opt.schedule.corrects:
        entry["orthogonal_energy"] = opt._run.orthogonal_energy.detach().cpu().clone()
        entry["correction"] = [t.detach().cpu().clone() for t in opt._backend.buffer_tensors(CORRECTION)]
    return entry


def _load_schedule(opt, entry: dict | None) -> None:
    """Resume the schedule from a state-dict entry (:func:`_check_parts` has compared it with this optimizer's), or
    start it afresh when the state was saved without one (a run that switches to a schedule)."""
    if opt.schedule is None:
        return
    if entry is None:
        opt._run.steps_done, opt._run.next_sam = 0, True
        opt._run.schedule_state = opt.schedule.initial_state(opt._run.ema.device)
        if opt.schedule.corrects:
            opt._run.orthogonal_energy.zero_()
            for t in opt._backend.buffer_tensors(CORRECTION):
                t.zero_()
        return
    opt._run.steps_done, opt._run.next_sam = int(entry["steps_done"]), bool(entry["next_sam"])
    opt._run.schedule_state = opt.schedule.initial_state(opt._run.ema.device)
    opt.schedule.load_state_dict(opt._run.schedule_state, entry["state"], opt._run.ema.device)
    if opt.schedule.corrects:
        opt._run.orthogonal_energy.copy_(entry["orthogonal_energy"])
        for t, saved in zip(opt._backend.buffer_tensors(CORRECTION), entry["correction"], strict=True):
            t.copy_(saved)


def load(opt, state_dict: dict, optimizers: dict) -> None:
    opt._refuse_mid_step("load_state_dict()")
    state_dict, ours = split_state(state_dict)
    if ours is None:
        _load_plain(opt, state_dict)
        return
    rule = ours["rule"]
    if bool(ours.get("one_pass", False)) != opt.one_pass:
        saver = (
            "a one-pass MomentumSAM" if ours.get("one_pass") else "a two-pass optimizer (SAM's first_step/second_step)"
        )
        raise ValueError(f"state dict was saved by {saver}, cannot load it into {type(opt).__name__}")
    if rule != opt.rule:
        saver = optimizers[rule].__name__ if rule in optimizers else repr(rule)
        raise ValueError(f"state dict was saved by {saver}, cannot load it into {type(opt).__name__}")
    if list(ours["block_names"]) != opt.block_names:
        raise ValueError(
            f"state dict blocks {list(ours['block_names'])} differ from this optimizer's blocks {opt.block_names}"
        )
    for block, shapes in zip(opt.blocks, ours["shapes"]):
        if len(shapes) != len(block.params):
            raise ValueError(
                f"block {block.name!r} has {len(block.params)} parameters; the state was saved for {len(shapes)}"
            )
        for i, (name, p, shape) in enumerate(zip(block.param_names, block.params, shapes)):
            if tuple(p.shape) != tuple(shape):
                raise ValueError(
                    f"block {block.name!r} parameter {i} ({name!r}) has shape {tuple(p.shape)}; the state was "
                    f"saved for {tuple(shape)}"
                )
    _check_parts(opt, ours)
    _load_base(opt, state_dict)
    for name in ("ema", "energy", "radius"):
        getattr(opt._run, name).copy_(ours[name])
    _set_last_rho(opt, float(ours["last_rho"]))
    _load_schedule(opt, ours.get("schedule"))
    _load_family(opt, ours)
    opt._run.undo = None


def _load_base(opt, state_dict: dict, rhos: list | None = None) -> None:
    """Load the base optimizer's part; groups the dict gives no rho keep ``rhos``. Capturable, the loaded rho and
    lrs are copied into the device tensors a captured graph reads."""
    opt.base_optimizer.load_state_dict(state_dict)
    opt.param_groups = opt.base_optimizer.param_groups
    opt.state = opt.base_optimizer.state
    for group, rho in zip(opt.param_groups, rhos or ()):
        group.setdefault("rho", rho)
    if opt._device is not None:
        opt._device.place(opt.param_groups)
    if opt._flat_step is not None:
        opt._flat_step.adopt()


def _set_last_rho(opt, rho: float) -> None:
    if isinstance(opt._run.last_rho, torch.Tensor):
        opt._run.last_rho.fill_(rho)
    else:
        opt._run.last_rho = rho


def _load_plain(opt, state_dict: dict) -> None:
    """Take over the state of a plain torch optimizer (a run switched to SAM from its checkpoint): the base
    optimizer's state and hyperparameters load as into the base optimizer itself; every group keeps its current
    ``rho``, and the allocation state (GEAR-SAM's EMA, the last energies and radii) starts at zero, as at
    construction."""
    expected = opt.base_optimizer.defaults.keys() - OPTIONAL_GROUP_KEYS
    for g, group in enumerate(state_dict.get("param_groups", [])):
        missing = sorted(expected - group.keys())
        if missing:
            raise ValueError(
                f"state dict param group {g} lacks {missing}: it was not saved by "
                f"{type(opt.base_optimizer).__name__}, the base optimizer of this {type(opt).__name__}"
            )
    rhos = [group["rho"] for group in opt.param_groups]
    _load_base(opt, state_dict, rhos)
    for tensor in (opt._run.ema, opt._run.energy, opt._run.radius):
        tensor.zero_()
    _set_last_rho(opt, float(rhos[0]))
    _load_schedule(opt, None)
    opt._run.undo = None
    if opt.rule == GEAR_RULE:
        warnings.warn(
            f"loaded a state dict without a {STATE_KEY!r} entry (saved by a plain "
            f"{type(opt.base_optimizer).__name__}?): the base optimizer's state is taken over, and GEAR-SAM's EMA "
            "of block energies starts at zero, as in a new optimizer",
            UserWarning,
            stacklevel=4,
        )


def init_state(opt) -> None:
    """The state of ``opt``'s base optimizer, created as its first step would (see ``SharpnessAware.init_state``)."""
    if opt.state:
        return
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    if opt.perturbed or any(p.grad is not None for p in params):
        raise RuntimeError("init_state() belongs to a fresh optimizer, before any backward pass")
    lrs = [group["lr"] for group in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in opt.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        opt.base_optimizer.step()
    finally:
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)


def split_state(state_dict: dict) -> tuple[dict, dict | None]:
    """(the base optimizer's part of ``state_dict``, this library's entry or None), without changing the caller's
    dict; the entry is in the first param group."""
    state_dict = dict(state_dict)
    groups = [dict(group) for group in state_dict.get("param_groups", [])]
    ours = groups[0].pop(STATE_KEY) if groups and STATE_KEY in groups[0] else None
    state_dict["param_groups"] = groups
    return state_dict, ours

"""The constructor's arguments of the sharpness-aware optimizers, checked by name before anything is built: the base
optimizer, the parameters and their groups (and how every message names a parameter), and the step's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .base_step import BASE_STEPS, PER_TENSOR, FlatBaseStep
from .checks import PARAM_DTYPES, check_param_dtype, check_real
from .family import Descent, FriendlyAscent, check_ascent, check_descent
from .partition import parameter_names
from .schedules import Schedule, check_schedule


def check_base_optimizer(base_optimizer) -> None:
    """Refuse what cannot be a base optimizer: an instance rather than a class or factory, and ZeRO."""
    if isinstance(base_optimizer, torch.optim.Optimizer) or not callable(base_optimizer):
        got = (
            f"an instance of {type(base_optimizer).__name__}"
            if isinstance(base_optimizer, torch.optim.Optimizer)
            else repr(base_optimizer)
        )
        raise TypeError(
            "base_optimizer must be an optimizer class (or factory) such as torch.optim.SGD, called as "
            f"base_optimizer(param_groups, **kwargs); got {got}"
        )
    if _is_zero(base_optimizer):
        raise ValueError(
            "ZeroRedundancyOptimizer as base optimizer is not supported: it keeps its own param groups and "
            "state (its state_dict() needs consolidate_state_dict() on every rank first) and may re-home the "
            "parameters into buckets of its own, as the flat-buffer backends do. To shard optimizer state, "
            "shard the model with fully_shard (FSDP2), which SAM and GEAR-SAM support"
        )


def params_and_model(params, model: nn.Module | None) -> tuple:
    """``(params, model)`` with an ``nn.Module`` passed as ``params`` taken as the model too."""
    if isinstance(params, nn.Module):
        if model is not None and model is not params:
            raise ValueError("params is an nn.Module and model is a different module; pass only one of them")
        return list(params.parameters()), params
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return params, model


def _is_zero(factory) -> bool:
    """Whether ``factory`` builds a ``ZeroRedundancyOptimizer`` (the class, a subclass, or a partial of either)."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch built without distributed support
        return False
    factory = getattr(factory, "func", factory)  # functools.partial
    return isinstance(factory, type) and issubclass(factory, ZeroRedundancyOptimizer)


def param_group_list(params) -> list[dict]:
    """``params`` as ``torch.optim.Optimizer`` reads it (tensors, ``(name, tensor)`` pairs or group dicts), as a list
    of group dicts with their ``"params"`` in lists: read once, so that a generator can be checked before torch reads
    it."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or param-group dicts, got a single tensor")
    params = list(params)
    if not params:
        return params  # torch's own error says so
    if not isinstance(params[0], dict):
        return [{"params": params}]
    for group in params:  # in the caller's dicts, as torch.optim does: a group may be passed again
        members = group.get("params", [])
        group["params"] = [members] if isinstance(members, torch.Tensor) else list(members)
    return params


def _group_tensors(group: dict) -> list[torch.Tensor]:
    return [p[1] if isinstance(p, tuple) else p for p in group["params"]]


def check_parameters(param_groups: list[dict], label) -> None:
    """Every parameter listed once, in one group, and of a dtype the step updates exactly; errors name it."""
    seen: set[int] = set()
    for group in param_groups:
        for p in _group_tensors(group):
            if not isinstance(p, torch.Tensor):
                continue  # torch's own check names what it got
            if id(p) in seen:
                raise ValueError(f"parameter {label(p)} is passed twice (in one param group or in two)")
            seen.add(id(p))
            if p.requires_grad and p.dtype not in PARAM_DTYPES:  # labelled only then: a label costs a string
                check_param_dtype(p, label(p))


def labeller(param_groups: list[dict], model: nn.Module | None) -> Callable[..., str]:
    """``label(p)``: how every message names an optimized parameter: its name in ``model``, else its place in the
    param groups (with a hint to pass ``model=``); with its shape unless ``shape=False``. A parameter listed twice is
    named by its first place."""
    names = parameter_names(model)
    places = {}
    for g, group in enumerate(param_groups):
        for i, p in enumerate(_group_tensors(group)):
            places.setdefault(id(p), f"param_groups[{g}]['params'][{i}]")

    def label(p: torch.Tensor, shape: bool = True) -> str:
        name = names.get(id(p))
        if not shape:
            return name or places[id(p)]
        if name is not None:
            return f"{name!r} (shape {tuple(p.shape)})"
        hint = "" if model is not None else "; pass model= to name it"
        return f"{places[id(p)]} (shape {tuple(p.shape)}{hint})"

    return label


@dataclass(frozen=True)
class Options:
    """The step's options, checked (:func:`check_options`)."""

    adaptive: bool
    eta: float
    delta: float
    base_step: str
    schedule: Schedule | None
    capturable: bool
    ascent: FriendlyAscent | None
    descent: Descent | None


def check_options(rho, adaptive, eta, delta, base_step, schedule, capturable, ascent, descent) -> Options:
    """Check the step's options, each by name."""
    check_real("rho", rho, low=0.0)
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {capturable!r}")
    schedule = check_schedule(schedule)
    if schedule is not None and schedule.corrects and adaptive:
        raise ValueError(
            f"schedule {schedule!r} is LookSAM, whose direction is defined for plain gradients; it is not "
            "defined for ASAM (adaptive=True)"
        )
    ascent, descent = check_ascent(ascent), check_descent(descent)
    _check_family(ascent, descent, schedule, capturable)
    if base_step not in BASE_STEPS:
        raise ValueError(f"base_step must be one of {BASE_STEPS}, got {base_step!r}")
    eta = check_real("eta", eta, low=0.0)
    delta = check_real("delta", delta, low=0.0, low_inclusive=False)
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive must be a bool, got {adaptive!r}")
    return Options(adaptive, eta, delta, base_step, schedule, capturable, ascent, descent)


def check_capturable(opt) -> None:
    """Refuse ``capturable=True`` where ``opt`` would read a value on the host or step per tensor."""
    why = _capturable_refusal(opt)
    if why:
        raise ValueError(f"capturable=True cannot be honoured: {why}")


def _capturable_refusal(opt) -> str:
    """Why ``opt`` cannot make a step that reads no value on the host and never steps per tensor ("" when it can)."""
    if not opt.backend.capturable:
        return f"backend {opt.backend_name!r} has no capturable kernels; use backend='cpp' or 'triton'"
    if opt.schedule is not None:
        return f"schedule {opt.schedule!r} decides on the host which steps take the second pass"
    if opt.base_step == PER_TENSOR or FlatBaseStep.why_not(opt.base_optimizer):
        return "the base step must be fused (torch's SGD, Adam or AdamW, base_step 'auto' or 'fused'): " + (
            FlatBaseStep.why_not(opt.base_optimizer) or "base_step='per-tensor' was asked for"
        )
    if opt._shard_groups:
        return "sharded parameters (FSDP2) sum their energies over ranks, which is not captured"
    buckets = opt.backend.layout.buckets
    dtypes = {b.dtype for b in buckets} - {torch.float32, torch.float64}
    if dtypes:
        return f"the fused base step takes float32 and float64 parameters, not {sorted(map(str, dtypes))}"
    if len({b.device for b in buckets}) > 1:
        return f"the parameters are on several devices ({sorted(str(b.device) for b in buckets)})"
    return ""


def _check_family(ascent, descent, schedule, capturable: bool) -> None:
    """Refuse the SAM family's parts where a step could not honour them. A schedule's skipped step has no
    perturbation, so ``h = g`` and every descent is ``g`` (the base step with it) and no ascent is taken; but LookSAM's
    correction keeps its ``g`` where a descent keeps its own, after an ascent replaced it, and a schedule that reads
    the first gradient's energy would read the ascent direction's on the SAM steps."""
    parts = [repr(part) for part in (ascent, descent) if part is not None]
    if not parts:
        return
    if schedule is not None and schedule.corrects:
        raise ValueError(
            f"schedule {schedule!r} with {' and '.join(parts)}: LookSAM's correction keeps the first gradient in the "
            "buffer the descent keeps it in (and an ascent replaces it before the perturbation reads it); use Every, "
            "Random or Adaptive"
        )
    if schedule is not None and schedule.reads_energy and ascent is not None:
        raise ValueError(
            f"schedule {schedule!r} with {ascent!r}: the schedule decides from the first gradient's energy, and on a "
            "SAM step the ascent replaces the gradient before its energy is taken; use Every or Random"
        )
    if capturable:
        raise ValueError(
            f"capturable=True with {' and '.join(parts)}: their steps read the learning rate and the first step's "
            "flag on the host; use capturable=False"
        )


#: The options :class:`SAM` and :class:`GEARSAM` take and hand to :class:`SharpnessAware` as they are (their
#: signatures differ in order and defaults only).
FORWARDED = (
    "rho", "adaptive", "eta", "delta", "backend", "model", "partition", "base_step", "schedule", "capturable", "ascent",
    "descent",
)  # fmt: skip


def forwarded(arguments: dict) -> dict:
    """The :data:`FORWARDED` options out of a constructor's ``locals()``."""
    return {name: arguments[name] for name in FORWARDED}

"""What a step does under a schedule (:mod:`gearsam_fused.schedules`): let it decide whether the next step takes the
second pass, and make a step it skips (the base optimizer's update with the first gradient). And LookSAM's two
formulas (Liu et al., CVPR 2022): on a SAM step, the part of the SAM gradient orthogonal to the first gradient (kept
by the backend, which holds it as ``g_v``); on a skipped step, the scale of its correction ``g + scale * g_v``. Over
all blocks for SAM's allocation, per block for GEAR-SAM's."""

from __future__ import annotations

import torch

from .allocation import GEAR_RULE
from .backends.base import Backend
from .base_step import FUSED, PER_TENSOR
from .compiled import mark_stepped_now, step_per_tensor
from .sharding import sum_over
from .step_state import DeviceDecision


def decide_next(opt, energy: torch.Tensor) -> None:
    """Let ``opt``'s schedule decide the next step from this one's energies; a device decision is copied to the host
    without waiting (read when ``opt.sam_step`` is next asked)."""
    decision = opt.schedule.decide_next(opt._run.steps_done, energy.sum(), opt._run.schedule_state)
    opt._run.next_sam = DeviceDecision(decision) if isinstance(decision, torch.Tensor) else bool(decision)


def skipped_step(opt, energy: torch.Tensor, rho: float) -> None:
    """A step of ``opt`` without the second pass: GEAR-SAM's EMA still takes the energies, then the base optimizer
    steps with the first gradient (plus LookSAM's correction) over the flat buffers or by its own ``step()``."""
    run, backend = opt._run, opt.backend
    if opt.rule == GEAR_RULE:
        backend.allocate(opt.rule, energy, run.ema, rho, opt.beta, opt.delta)
    correction = None
    if opt.schedule.corrects:
        correction = correction_scale(energy, run.orthogonal_energy, opt.rule, opt.schedule.alpha)
    updates = opt._plan()
    if updates is None and opt.base_step == FUSED:
        raise RuntimeError(f"base_step='fused' cannot be honoured this step: {opt._flat_step.reason}")
    if updates is None:
        if correction is not None:
            backend.add_correction_(correction)
        step_per_tensor(opt)
    else:
        opt._flat_step.run(updates, backend, perturbed=False, correction=correction)
    run.last_base_step = PER_TENSOR if updates is None else FUSED
    run.record(energy, torch.zeros_like(energy), rho, sam=False)
    run.undo = None
    run.steps_done += 1
    mark_stepped_now(opt)  # tells torch LR schedulers that an optimizer step happened


def orthogonalize(backend: Backend, energy: torch.Tensor, rule: str, shard_groups) -> torch.Tensor:
    """``g_v = g_s - (<g, g_s> / ||g||^2) g`` in the backend's buffer, with ``g`` the first gradient it kept and
    ``g_s`` the current one, ``energy`` the blocks' ``||g||^2``; returns ``||g_v||^2`` per block, summed over the
    ranks that hold shards of a block."""
    dot = sum_over(shard_groups, backend.block_dot())
    if rule != GEAR_RULE:
        dot, energy = dot.sum().expand_as(dot), energy.sum().expand_as(energy)
    positive = energy > 0
    coefficient = torch.where(positive, dot / torch.where(positive, energy, 1.0), 0.0)
    return sum_over(shard_groups, backend.orthogonalize_(coefficient))


def correction_scale(energy: torch.Tensor, orthogonal_energy: torch.Tensor, rule: str, alpha: float) -> torch.Tensor:
    """``alpha * ||g|| / ||g_v||`` per block (0 where ``g_v = 0``), from the blocks' ``||g||^2`` and ``||g_v||^2``."""
    if rule != GEAR_RULE:
        energy, orthogonal_energy = energy.sum().expand_as(energy), orthogonal_energy.sum().expand_as(energy)
    positive = orthogonal_energy > 0
    ratio = energy.sqrt() / torch.where(positive, orthogonal_energy, 1.0).sqrt()
    return torch.where(positive, alpha * ratio, 0.0)

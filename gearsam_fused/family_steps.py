"""What a sharpness-aware step does with the SAM family's parts (:mod:`gearsam_fused.family`): keep the first
gradient for the descent and take the ascent direction on a first step, keep and restore F-SAM's EMA around a
cancellable step, and refuse, inside ``torch.compile``, a part the backend runs as torch operations on its flat
buffers."""

from __future__ import annotations

import torch

from .backends.base import MOMENTUM
from .backends.flat_buffer import KernelBackend
from .base_step import PER_TENSOR
from .compat import raise_refusal


def first_step_parts(opt) -> tuple[bool, torch.Tensor | None]:
    """The SAM family's parts of a first step of the sharpness-aware optimizer ``opt``: keep ``g`` for the descent,
    and replace the gradients by the ascent direction. Whether ``g`` is still to be kept (without an ascent, the
    perturbation keeps it as it reads it: one pass fewer where the backend folds the copy into it), and the ascent
    direction's energies (this rank's), None without an ascent."""
    keep = opt.descent is not None
    if keep and opt.ascent is not None:
        opt.backend.keep_gradient_()  # before the ascent replaces g
        keep = False
    if opt.ascent is None:
        return keep, None
    params = [p for block in opt.blocks for p in block.params]
    started = opt._run.ascent_started or (False,) * len(params)
    energy = opt.ascent.apply_(opt.backend, started, opt.adaptive, opt.eta)
    opt._run.ascent_started = tuple(s or p.grad is not None for s, p in zip(started, params, strict=True))
    return keep, energy


def refuse_compiled(opt, folds: bool = True) -> None:
    """Under torch.compile, refuse a part of ``opt`` that writes the flat buffers with torch operations: the compiled
    step would write copies of them (only registered operators are called on the buffers themselves). ``folds``
    (second_step): whether the fused base step takes the descent's mix; where it does not, the descent's
    :attr:`~gearsam_fused.family.Descent.unfolded_operations` run as well."""
    for part in (opt.ascent, opt.descent):
        if part is None:
            continue
        unfolded = () if folds or part is opt.ascent else part.unfolded_operations
        operations = part.operations + unfolded
        unregistered = [op for op in operations if op not in opt.backend.family_operators]
        if unregistered:
            kernels = set(operations) <= KernelBackend.family_operators
            where = (f" (the base step does not take the descent this step: {_not_folded_reason(opt)})"
                     if set(unregistered) & set(unfolded) else "")  # fmt: skip
            raise_refusal(
                f"the SAM family's part {part!r} runs {', '.join(unregistered)} on backend {opt.backend_name!r}"
                f"{where} as torch operations, which torch.compile would apply to copies of the flat buffers; "
                + ("use backend='cpp' or 'triton', where it is registered operators, or " if kernels else "")
                + "run the step eagerly"
            )


def _not_folded_reason(opt) -> str:
    """Why the base update does not take the descent's mix in its own pass."""
    if not opt.backend.folds_mix:
        return f"backend {opt.backend_name!r} does not fold it into its kernels"
    if opt._flat_step is None or opt.base_step == PER_TENSOR:
        return f"base_step={opt.base_step!r}"
    return opt._flat_step.reason


def ascent_copy(opt) -> list[torch.Tensor] | None:
    """A copy of F-SAM's EMA, which a cancellable step keeps until it completes (one parameter-sized buffer); None
    without an ascent."""
    if opt.ascent is None:
        return None
    return [t.clone() for t in opt.backend.buffer_tensors(MOMENTUM)]


def restore_ascent(opt, saved: list[torch.Tensor] | None) -> None:
    """Put F-SAM's EMA back to ``saved`` (:func:`ascent_copy`'s), when a step is cancelled; nothing for None."""
    if saved is not None:
        for t, value in zip(opt.backend.buffer_tensors(MOMENTUM), saved, strict=True):
            t.copy_(value)

"""A step's checks of the gradients: that the first gradient exists, and on no parameter frozen when the optimizer
was built (:func:`check_first`); and that a gradient was computed at ``w + eps`` before ``second_step`` (without it,
the base optimizer would step with the first gradient, or with none): the gradients ``zero_grad`` leaves after
``first_step`` are marked (:func:`marks`), and ``second_step`` refuses to step where none is new (:func:`check`),
putting ``w`` back first."""

from __future__ import annotations

import torch

from .allocation import GEAR_RULE
from .compat import raise_refusal


def check_first(opt, caller: str) -> None:
    """Refuse a step without gradients, or with a gradient on a parameter frozen when the optimizer was built."""
    # any() stops at the first gradient it finds, so a normal step pays O(1) here.
    if not any(p.grad is not None for block in opt.blocks for p in block.params):
        raise RuntimeError(_no_gradients(opt, caller))
    for name, p in opt._outside_blocks:
        if p.grad is not None:
            raise RuntimeError(
                f"parameter {name} has a gradient but was frozen when the optimizer was built, so it is in no "
                "block and would not be perturbed; build the optimizer after changing requires_grad"
            )


def _no_gradients(opt, caller: str) -> str:
    """Why ``opt`` found no gradient: no backward ran, or the model's parameters were replaced after the optimizer was
    built, so the backward gave its gradients to tensors the optimizer does not hold."""
    model = None if opt._model is None else opt._model()
    if model is not None:
        now = set(map(id, model.parameters()))
        replaced = [
            name
            for block in opt.blocks
            for name, p in zip(block.param_names, block.params)
            if id(p) in opt._model_param_ids and id(p) not in now
        ]
        if replaced:
            return (
                f"{caller} found no gradients on its parameters because the model's parameters are no longer the "
                f"ones it was built with: {len(replaced)} of them were replaced (first {replaced[0]!r}), e.g. by "
                "model.load_state_dict(..., assign=True), model.to('meta') or to_empty(). Build the optimizer after "
                "replacing them, or load weights with assign=False, which copies them into the parameters it holds"
            )
    return f"{caller} found no gradients: call loss.backward() before {caller}"


def marks(opt) -> list[tuple[torch.Tensor, int]]:
    """(gradient, version) of every gradient that exists: ``backward`` makes a new tensor where there was none and
    bumps the version of one it accumulates into (a flat buffer's views share one counter)."""
    return [(p.grad, p.grad._version) for block in opt.blocks for p in block.params if p.grad is not None]


def check(opt) -> None:
    """Refuse a second_step with no gradient computed at ``w + eps`` (after putting ``w`` back). Under
    ``torch.compile``, gradients cleared in place are compared when the compiled code runs
    (:func:`~gearsam_fused.compiled.check_second_gradient_`): their version counters are not traceable."""
    if opt._run.cleared and torch.compiler.is_compiling():
        if not opt.backend.fuses_base_step:
            raise_refusal(
                f"backend {opt.backend_name!r} keeps no flat gradient buffers: after zero_grad(set_to_none=False) "
                "its compiled second_step cannot tell whether a backward ran; use zero_grad() (set_to_none=True)"
            )
        grads = [bucket.grad for bucket in opt.backend.layout.buckets]
        torch.ops.gearsam_fused.check_second_gradient_(grads, opt._key)
    elif missing(opt):
        refuse(opt)


def missing(opt) -> bool:
    """Whether no gradient exists, or none changed since ``zero_grad`` cleared them after ``first_step``. O(1) after
    ``zero_grad(set_to_none=True)``, the usual case: the first gradient found ends the search."""
    if not opt._run.cleared:
        return all(p.grad is None for block in opt.blocks for p in block.params)
    current = marks(opt)
    return len(current) == len(opt._run.cleared) and all(
        g is h and v == w for (g, v), (h, w) in zip(current, opt._run.cleared)
    )


def refuse(opt) -> None:
    """Abandon the step (:func:`abandon`) and say why."""
    kept = abandon(opt)
    raise RuntimeError(
        "second_step() found no gradient computed at w + eps: after first_step(), run the second forward and "
        f"backward before second_step(); the weights were restored to w and no step was taken{kept}"
    )


def abandon(opt) -> str:
    """Put ``w`` back, and the allocation state too where the step kept it; says what was not undone."""
    opt._run.cleared = None
    if opt._run.undo is not None:
        opt.cancel_step()
        return ""
    opt.backend.restore_()
    if opt.rule != GEAR_RULE:
        return ""
    return " (GEAR-SAM's EMA keeps this step's energies: first_step(cancellable=True) would undo them too)"

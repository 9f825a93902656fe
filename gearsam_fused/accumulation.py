"""Gradient accumulation for SAM and GEAR-SAM.

A SAM step with a batch split into ``k`` micro-batches equals the large-batch step when both passes accumulate over
the same micro-batches and the optimizer steps only after all ``k`` backward passes of each::

    for mb in micro_batches:                          # first pass, at w
        (loss_fn(mb) / k).backward()
    optimizer.first_step(zero_grad=True)              # eps from the whole batch's gradient
    for mb in micro_batches:                          # second pass, at w + eps, same micro-batches
        (loss_fn(mb) / k).backward()
    optimizer.second_step(zero_grad=True)

(Perturbing per micro-batch instead would be "m-sharpness", a different algorithm.) :func:`accumulated_step` runs
exactly this, optionally with float16 loss scaling and with BatchNorm statistics frozen in the second pass. On a step
the optimizer's ``schedule`` skips (``first_step`` returns False, having made the base update with the accumulated
first gradient) it runs the first pass only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .amp import SAMScaler
from .bn import frozen_bn_stats
from .optim import SharpnessAware, check_sharpness_aware


def accumulated_step(
    optimizer: SharpnessAware,
    loss_fn: Callable[[object], torch.Tensor],
    micro_batches: Iterable,
    *,
    amp: SAMScaler | None = None,
    model: nn.Module | None = None,
    set_to_none: bool = True,
) -> torch.Tensor:
    """One SAM / GEAR-SAM step whose gradient, in each pass, is the mean of the micro-batches' gradients.

    ``loss_fn(mb)`` returns the scalar mean loss of micro-batch ``mb``; each is divided by ``k = len(micro_batches)``
    before ``backward``, so with equally sized micro-batches the step equals the step on their concatenation (without
    BatchNorm in train mode: it normalises each micro-batch by its own statistics). In order: zero the gradients
    (``optimizer.zero_grad(set_to_none)``), first pass over all micro-batches, ``first_step``, zero, second pass over
    the same micro-batches, ``second_step``. The second pass's gradients are left in place. On a step the optimizer's
    ``schedule`` skips, one pass over the micro-batches, then ``first_step``, which makes the update with their
    accumulated gradient (left in place without ``amp``).

    Args:
        amp: a :class:`~gearsam_fused.amp.SAMScaler` wrapping ``optimizer``: every micro-batch loss is scaled by its
            GradScaler and each pass unscaled once. When the first pass overflows the second is not run; ``amp.last``
            says whether the step was skipped. Call ``amp.scaler.update()`` after this function.
        model: freeze the BatchNorm running statistics of this module during the second pass
            (:func:`~gearsam_fused.bn.frozen_bn_stats`).
        set_to_none: how the gradients are zeroed (False keeps a fused backend's gradients as flat-buffer views).

    Returns the first-pass loss (the loss at ``w``) averaged over the micro-batches, detached, without synchronising.
    """
    micro_batches = _checked(optimizer, loss_fn, micro_batches, amp, model)
    optimizer.zero_grad(set_to_none=set_to_none)
    loss = _backward_pass(loss_fn, micro_batches, amp)
    if amp is not None:
        run_second = amp.first_step(set_to_none=set_to_none)
    else:
        run_second = optimizer.first_step()  # False on a step the schedule skips: the update is made
        if run_second:
            optimizer.zero_grad(set_to_none=set_to_none)
    if run_second:
        with frozen_bn_stats(model) if model is not None else contextlib.nullcontext():
            _backward_pass(loss_fn, micro_batches, amp)
    if amp is not None:
        amp.second_step()
    elif run_second:
        optimizer.second_step()
    return loss


def _checked(optimizer, loss_fn, micro_batches, amp, model) -> list:
    """Refuse bad arguments of :func:`accumulated_step`, each by name; returns the micro-batches as a list (both
    passes iterate over them)."""
    check_sharpness_aware(optimizer)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(micro_batch) -> loss, got {type(loss_fn).__name__}")
    if isinstance(micro_batches, torch.Tensor) or not isinstance(micro_batches, Iterable):
        raise TypeError(
            f"micro_batches must be a list of micro-batches (e.g. zip(x.chunk(k), y.chunk(k))), got "
            f"{type(micro_batches).__name__}"
        )
    micro_batches = list(micro_batches)  # both passes iterate over them
    if not micro_batches:
        raise ValueError("micro_batches is empty: a step needs at least one micro-batch")
    if amp is not None:
        if not isinstance(amp, SAMScaler):
            raise TypeError(f"amp must be a SAMScaler, got {type(amp).__name__}")
        if amp.optimizer is not optimizer:
            raise ValueError("amp wraps a different optimizer than the one passed to accumulated_step")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module (whose BatchNorm statistics to freeze), got {type(model).__name__}"
        )
    return micro_batches


def _backward_pass(loss_fn, micro_batches: list, amp: SAMScaler | None) -> torch.Tensor:
    """``backward`` of every micro-batch's loss over ``k``, scaled by ``amp``'s GradScaler if given; returns their
    detached sum, the pass's mean loss."""
    k, total = len(micro_batches), None
    for i, mb in enumerate(micro_batches):
        loss = loss_fn(mb)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor (the micro-batch's mean loss); for micro-batch {i} it "
                f"returned {type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        loss = loss / k
        (amp.scaler.scale(loss) if amp is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total

"""Mixed precision for :class:`~gearsam_fused.SAM` and :class:`~gearsam_fused.GEARSAM`.

bfloat16 autocast needs nothing: run both forward passes under ``torch.autocast(device, dtype=torch.bfloat16)``.

float16 autocast needs loss scaling, and ``torch.amp.GradScaler``'s own recipe (``scaler.step(optimizer)``) does not
fit a two-pass optimizer: the step has two gradients, each of which must be unscaled exactly once and checked for
overflow, and an overflow in either pass must cancel the whole step. :class:`SAMScaler` drives the two passes
through an existing ``GradScaler``::

    scaler = torch.amp.GradScaler("cuda")
    amp = SAMScaler(optimizer, scaler)
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if amp.first_step():                        # unscale, check, perturb (or not), zero the gradients
            with torch.autocast("cuda", dtype=torch.float16), frozen_bn_stats(model):
                scaler.scale(loss_fn(model(x), y)).backward()
        report = amp.second_step(zero_grad=True)    # unscale, check, restore w, base step (or undo the step)
        scaler.update()                             # lowers the scale after a skipped step, as usual

``first_step`` returns False when the second pass is not to run: after an overflow in the first pass, and on a step
the optimizer's ``schedule`` skips (:mod:`gearsam_fused.schedules`), whose update ``first_step`` has then made with
the unscaled first gradient. ``second_step`` is called on every step: it finishes the scaler's bookkeeping.

With an optimizer built with ``capturable=True`` nothing is read on the host: the overflow flags go to the optimizer
(``first_step(found_inf=...)``, ``second_step(found_inf=...)``), whose kernels skip an overflowing step on the device,
so the step can be captured in a CUDA graph. ``first_step`` then always returns True (the host does not know), and the
report's fields are read from the device when they are asked for (:class:`DeviceStepReport`). Weights, optimizer
state, step counts, GEAR EMA and loss scale come out bit for bit as on the host path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .compat import OptState, drop_optimizer_record, optimizer_record, scaler_records, unscale_
from .optim import SharpnessAware, check_sharpness_aware


@functools.cache
def _can_unscale(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether GradScaler's unscale kernel exists for gradients of ``dtype`` on ``device`` (torch 2.11 has none for
    bfloat16 on CUDA, though it has one on CPU): tried once on a one-element gradient."""
    grad = torch.zeros(1, dtype=dtype, device=device)
    found_inf, inv_scale = torch.zeros(1, device=device), torch.ones(1, device=device)
    try:
        unscale_([grad], found_inf, inv_scale)
    except NotImplementedError:
        return False
    return True


@dataclass(frozen=True)
class ScaledStepReport:
    """What :meth:`SAMScaler.second_step` did.

    ``skipped``: the perturbation (if any) was undone and the base optimizer did not step; the weights, the base
    optimizer's state and the GEAR EMA are as before the step. ``reason``: why, or None. ``first_pass_finite`` /
    ``second_pass_finite``: whether each pass's unscaled gradients were all finite (a pass that did not run counts as
    finite). ``scale``: the loss scale both passes used. ``sam_step``: whether the step was a SAM step (its
    ``first_step`` perturbs, or would have had the first pass been finite); False on a step the optimizer's schedule
    skipped, which runs the first pass only and, unless that overflowed, makes the base update with its gradient.
    """

    skipped: bool
    reason: str | None
    first_pass_finite: bool
    second_pass_finite: bool
    scale: float
    sam_step: bool = True


def _reason(first_finite: bool, second_finite: bool) -> str | None:
    failed = [name for name, ok in (("first", first_finite), ("second", second_finite)) if not ok]
    if not failed:
        return None
    return f"non-finite gradient in the {' and '.join(failed)} pass{'es' if len(failed) > 1 else ''}"


class DeviceStepReport:
    """:class:`ScaledStepReport`'s fields for a step whose overflow was handled on the device (``capturable=True``):
    each is read from the device when asked for, which synchronises; the step itself never waits."""

    sam_step = True

    def __init__(self, first_found: torch.Tensor, second_found: torch.Tensor, scale: torch.Tensor):
        self._found = first_found, second_found
        self._scale = scale

    @property
    def first_pass_finite(self) -> bool:
        return not bool(self._found[0].item())

    @property
    def second_pass_finite(self) -> bool:
        return not bool(self._found[1].item())

    @property
    def skipped(self) -> bool:
        return not (self.first_pass_finite and self.second_pass_finite)

    @property
    def reason(self) -> str | None:
        return _reason(self.first_pass_finite, self.second_pass_finite)

    @property
    def scale(self) -> float:
        return float(self._scale.item())

    def __repr__(self) -> str:
        return f"DeviceStepReport(first_found={self._found[0]!r}, second_found={self._found[1]!r})"


class SAMScaler:
    """Runs a SAM / GEAR-SAM step with float16 loss scaling by ``scaler`` (a ``torch.amp.GradScaler``).

    Per step, after ``scaler.scale(loss).backward()`` of each pass:

    * :meth:`first_step` unscales the first gradients (unless the caller already did, with ``scaler.unscale_``, to
      clip them) and checks them for inf/NaN, as ``GradScaler.step`` does. If they are finite the optimizer perturbs
      the weights with the unscaled gradients (energies and radii never see the scale); otherwise nothing moves. The
      gradients are then zeroed for the second pass.
    * :meth:`second_step` unscales and checks the second gradients the same way. If both passes were finite it
      restores ``w`` and steps the base optimizer; otherwise it restores ``w``, rolls back the GEAR EMA and skips the
      base step. On a step the optimizer's schedule skips, :meth:`first_step` has already made the update (when the
      first pass was finite) and :meth:`second_step` unscales nothing more. Either way it records the overflow in ``scaler`` so that ``scaler.update()`` lowers the scale exactly
      as after a step ``GradScaler.step`` skipped, and returns (and keeps in :attr:`last`) a :class:`ScaledStepReport`.

    Reading an overflow flag synchronises with the device once per pass, as ``GradScaler.step`` does once per step.
    When the first pass overflows, :meth:`first_step` returns False; the second forward/backward may then be left out
    (``second_step`` still has to be called). With a disabled scaler both methods are the optimizer's own steps. With
    a ``capturable`` optimizer the flags stay on the device (see the module docstring).
    """

    def __init__(self, optimizer: SharpnessAware, scaler: torch.amp.GradScaler):
        check_sharpness_aware(optimizer)
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if scaler.is_enabled():
            if scaler_records(scaler) is None:
                raise RuntimeError(
                    "this torch's GradScaler does not keep per-optimizer overflow records in _per_optimizer_states, "
                    "which SAMScaler needs to unscale two passes"
                )
            for block in optimizer.blocks:
                for name, p in zip(block.param_names, block.params):
                    if p.dtype == torch.float16:
                        raise ValueError(
                            f"parameter {name!r} is float16, and GradScaler cannot unscale float16 gradients; keep the "
                            "parameters in float32 and run the forward passes under torch.autocast(dtype=torch.float16)"
                        )
                    if not _can_unscale(p.dtype, p.device):
                        raise ValueError(
                            f"parameter {name!r} is {p.dtype} on {p.device}, and this torch's GradScaler cannot unscale "
                            f"{p.dtype} gradients there; bfloat16 has float32's exponent range and needs no loss "
                            "scaling: step the optimizer itself, or keep the parameters in float32"
                        )
        self.optimizer = optimizer
        self.scaler = scaler
        #: Whether the overflow flags go to the optimizer's kernels instead of being read on the host.
        self.on_device = optimizer.capturable and scaler.is_enabled()
        #: Report of the last completed step (None before the first).
        self.last: ScaledStepReport | DeviceStepReport | None = None
        # the first pass's overflow records, whether it was finite, and whether the step is a SAM step
        self._first: tuple[dict, bool, bool] | None = None

    # ------------------------------------------------------------------ GradScaler bookkeeping
    def _state(self) -> dict:
        state = optimizer_record(self.scaler, self.optimizer)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "the GradScaler already stepped this optimizer since its last update(): call scaler.update() once at "
                "the end of every step, and do not call scaler.step() on a SAM optimizer"
            )
        return state

    def _unscaled_records(self) -> dict:
        """Unscale the current gradients unless the caller already did; the pass's overflow records per device."""
        state = self._state()
        if state["stage"] is OptState.READY and self._has_grads():
            self.scaler.unscale_(self.optimizer)
        return dict(state["found_inf_per_device"])

    def _has_grads(self) -> bool:
        return any(p.grad is not None for group in self.optimizer.param_groups for p in group["params"])

    @staticmethod
    def _found(records: dict) -> torch.Tensor:
        """The pass's overflow flag: a capturable optimizer's parameters are on one device, so there is one."""
        (found,) = records.values()
        return found

    @staticmethod
    def _finite(records: dict) -> bool:
        return not any(bool(found.item()) for found in records.values())

    # ------------------------------------------------------------------ the two steps
    def first_step(self, *, set_to_none: bool = True) -> bool:
        """Unscale and check the first pass's gradients; if they are finite, perturb the weights, or on a step the
        optimizer's schedule skips, make the base optimizer's update with them. Then zero the gradients
        (``optimizer.zero_grad(set_to_none)``), which the second pass needs. Returns whether to run the second pass:
        whether the weights were perturbed, i.e. False when this step will be skipped (an overflow) and on a step
        the schedule skips. Call :meth:`second_step` either way."""
        if self._first is not None:
            raise RuntimeError("SAMScaler.first_step() called twice: call second_step() to finish the step first")
        opt = self.optimizer
        sam = opt.sam_step  # before anything moves: an overflow leaves the schedule where it is
        if not self.scaler.is_enabled():
            perturbed = opt.first_step()
            opt.zero_grad(set_to_none=set_to_none)
            self._first = ({}, True, sam)
            return perturbed
        if not self._has_grads():
            raise RuntimeError("SAMScaler.first_step() found no gradients: call scaler.scale(loss).backward() first")
        records = self._unscaled_records()
        if self.on_device:
            opt.first_step(found_inf=self._found(records))
            finite = True  # as far as the host knows: the device skips the step
        else:
            finite = self._finite(records)
        if finite and not self.on_device:
            opt.first_step(cancellable=True)  # on a skipped step: the update, with the unscaled first gradient
        # The second pass must be unscaled by itself: hold this pass's records here and give the scaler a fresh slate.
        drop_optimizer_record(self.scaler, opt)
        self._first = (records, finite, sam)
        opt.zero_grad(set_to_none=set_to_none)
        return finite and sam

    def second_step(self, *, zero_grad: bool = False, set_to_none: bool = True) -> ScaledStepReport:
        """Unscale and check the second pass's gradients; finish the step if both passes were finite, else undo it
        (see the class docstring). Records the overflow for ``scaler.update()``; with ``zero_grad`` zeroes the
        gradients afterwards. Returns the step's :class:`ScaledStepReport`, also kept in :attr:`last`. On a step the
        schedule skips (no second pass; its first may have overflowed) nothing more is unscaled: only the
        first pass's overflow records reach ``scaler.update()``. (After an overflow in the first pass of a SAM step,
        gradients a second pass made anyway are unscaled, checked and reported all the same.)"""
        if self._first is None:
            raise RuntimeError("SAMScaler.second_step() called without a preceding first_step()")
        opt = self.optimizer
        first_records, first_finite, sam = self._first
        second_ran = first_finite and sam
        if not self.scaler.is_enabled():
            if second_ran:
                opt.second_step()
            second_finite = True
            scale = 1.0
        else:
            if second_ran and not self._has_grads():
                raise RuntimeError(
                    "SAMScaler.second_step() found no gradients: call scaler.scale(loss).backward() at the perturbed "
                    "weights first"
                )
            if sam:
                records = self._unscaled_records()
            else:  # a step the schedule skips has no second pass: nothing to unscale, only the first pass's records
                self._state()
                records = {}
            if self.on_device:
                second_found = self._found(records)
                # the scale both passes used (update() changes the tensor in place); reading it would synchronise
                report = DeviceStepReport(self._found(first_records), second_found, self.scaler._scale.clone())
                opt.second_step(found_inf=second_found)
            else:
                second_finite = self._finite(records)
                if second_ran and second_finite:
                    opt.second_step()
                elif second_ran:
                    opt.cancel_step()
            # scaler.update() reads these: an overflow in either pass lowers the scale, as after a skipped step.
            for device, found in first_records.items():
                records[device] = records[device] + found if device in records else found
            state = optimizer_record(self.scaler, opt)
            state["found_inf_per_device"] = records
            state["stage"] = OptState.STEPPED
            scale = None if self.on_device else self.scaler.get_scale()
        self._first = None
        if self.on_device:
            self.last = report
        else:
            reason = _reason(first_finite, second_finite)
            self.last = ScaledStepReport(reason is not None, reason, first_finite, second_finite, scale, sam)
        if zero_grad:
            opt.zero_grad(set_to_none=set_to_none)
        return self.last

"""SAM, ASAM and GEAR-SAM in a Lightning ``LightningModule`` with automatic optimization: :class:`SharpnessAwareMixin`.

Lightning runs ``training_step`` and ``backward`` once per micro-batch, and on the last micro-batch of an accumulation
window calls ``optimizer_step`` with a closure for that micro-batch. The mixin keeps that loop and adds SAM's second
pass::

    every micro-batch m_i of the window is remembered (on_train_batch_start)
    optimizer_step:  the closure: first pass of the last micro-batch (g(w) now accumulated over the window)
                     optimizer.step(second pass):  first_step()          w -> w + eps
                                                   training_step + backward over m_1..m_k at w + eps (logging off,
                                                   BatchNorm statistics frozen), the loss divided as Lightning does
                                                   Lightning's clipping (gradient_clip_val): the second gradient only
                                                   second_step()         restore w, base step

On a step the optimizer's ``schedule`` skips (:mod:`gearsam_fused.schedules`) nothing is added: Lightning's
``optimizer.step(closure)`` runs the closure (the first pass), its hooks and clipping, then ``first_step()``, which
makes the base update with the (clipped) first gradient, as a plain optimizer's step would.

``configure_optimizers`` returns a :class:`~gearsam_fused.SAM` or :class:`~gearsam_fused.GEARSAM` (with LR schedulers
if wanted); checkpoints hold its state dict, so ``ckpt_path=`` resumes the GEAR EMA too.
"""

from __future__ import annotations

import contextlib

import torch

from ..bn import frozen_bn_stats
from ..optim import SharpnessAware


class SharpnessAwareMixin:
    """Put before ``LightningModule`` in the bases: ``class Net(SharpnessAwareMixin, L.LightningModule)``.

    A module that overrides ``on_train_batch_start`` or ``optimizer_step`` itself must call ``super()`` there.
    ``training_step`` runs twice per micro-batch; what it logs is the first pass's (the loss at ``w``).
    ``precision="16-mixed"`` is refused: Lightning's loss scaler calls the optimizer's ``step()`` without a closure.
    Under a ``schedule``, ``training_step`` runs once per micro-batch on the steps the schedule skips.
    """

    def on_train_batch_start(self, batch, batch_idx: int):
        self.__dict__.setdefault("_sam_window", []).append((batch, batch_idx))
        return super().on_train_batch_start(batch, batch_idx)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        sam = getattr(optimizer, "optimizer", optimizer)  # Lightning wraps it in a LightningOptimizer
        if not isinstance(sam, SharpnessAware):
            raise TypeError(
                f"SharpnessAwareMixin needs configure_optimizers to return a SAM or GEARSAM optimizer, got "
                f"{type(sam).__name__}"
            )
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "SharpnessAwareMixin does not support precision='16-mixed': Lightning's loss scaler calls the "
                "optimizer's step() without a closure, so SAM's second pass could not run; use 'bf16-mixed'"
            )
        if optimizer_closure is None:
            raise ValueError("optimizer_step needs Lightning's closure (automatic optimization)")
        window, self._sam_window = self.__dict__.get("_sam_window", []), []
        if not sam.sam_step:  # the schedule skips this step's second pass: a plain step, whose update first_step makes
            with _closure_then_first_step(sam):
                optimizer.step(closure=optimizer_closure)
            return
        optimizer_closure()  # the first pass of the window's last micro-batch
        optimizer.step(closure=lambda: self._second_pass(window))

    def _second_pass(self, window: list) -> None:
        strategy, divide = self.trainer.strategy, self.trainer.accumulate_grad_batches
        with _logging_off(self), frozen_bn_stats(self):
            for batch, batch_idx in window:
                output = strategy.training_step(batch, batch_idx)
                loss = output if isinstance(output, torch.Tensor) else output["loss"]
                strategy.backward(loss / divide, None)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Logs ``sam/rho`` and each block's share of the radius (``sam/share/<block>``), from device tensors, and
        ``sam/sam_fraction``, the fraction of the epoch's steps that were SAM steps (1 without a schedule)."""
        sam = getattr(optimizer, "optimizer", optimizer)
        if isinstance(sam, SharpnessAware):
            # the epoch's mean of 1 (a SAM step: perturbed by now) and 0 (a step the schedule skips)
            self.log("sam/sam_fraction", float(sam.perturbed), on_step=False, on_epoch=True, batch_size=1)
        if isinstance(sam, SharpnessAware) and sam.perturbed:
            stats = sam.step_statistics
            if stats.rho > 0:
                shares = sam.describe_blocks(stats.energy, stats.ema, stats.radius, stats.rho)["share"]
                self.log("sam/rho", float(stats.rho))
                for name, share in zip(sam.block_names, shares.unbind()):
                    self.log(f"sam/share/{name}", share)
        return super().on_before_optimizer_step(optimizer)


@contextlib.contextmanager
def _closure_then_first_step(sam: SharpnessAware):
    """Within the block, ``sam.step(closure)`` is a plain optimizer's step: run the closure (with the precision plugin's
    hooks and clipping around it), then ``sam.first_step()``, which on a step the schedule skips makes the update.
    An LR scheduler's own wrapper of ``step`` (an instance attribute) is put back on exit."""
    saved = sam.__dict__.get("step")

    def step(closure=None):
        with torch.enable_grad():
            loss = closure()
        sam.first_step()  # the update: the decision, read before the closure, is still "skip"
        return loss

    sam.step = step
    try:
        yield
    finally:
        if saved is None:
            del sam.step
        else:
            sam.step = saved


@contextlib.contextmanager
def _logging_off(module):
    """``module.log`` and ``log_dict`` do nothing inside: the second pass must not overwrite the first pass's logs."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict

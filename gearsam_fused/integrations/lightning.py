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

One-pass momentum SAM (:class:`~gearsam_fused.MomentumSAM`) needs no mixin: its ``step(closure)`` runs Lightning's
closure (the one forward and backward, at the look-ahead point ``w~``) and then steps, as any torch optimizer's does.
:class:`MomentumSAMCallback` makes validation, checkpoints and the module after ``fit`` see the weights ``w``.
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch import Callback

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
        if sam.one_pass:
            raise TypeError(
                f"SharpnessAwareMixin adds SAM's second pass, which {type(sam).__name__} does not take: leave the mixin "
                "out (Lightning's own optimizer_step steps it with its closure) and add MomentumSAMCallback() to the "
                "Trainer's callbacks"
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


class MomentumSAMCallback(Callback):
    """Validation, checkpoints and the module after ``fit`` see the weights ``w`` of a
    :class:`~gearsam_fused.MomentumSAM` (or of another optimizer with its ``eval()``/``train()`` protocol) that
    ``configure_optimizers`` returns; training runs at the look-ahead point::

        trainer = L.Trainer(max_epochs=10, callbacks=[MomentumSAMCallback()])

    - ``on_validation_start`` (the sanity check's too): ``optimizer.eval()``, so validation runs at ``w``;
    - reading the module's state dict during ``fit`` calls ``optimizer.eval()`` first. Lightning's checkpoint
      (``trainer.save_checkpoint``, whichever ``ModelCheckpoint`` hook saves it) collects the module's state dict
      before anything else, ahead of every ``on_save_checkpoint`` hook, so that hook would come too late; this way the
      checkpoint holds ``w`` and the optimizer's state in eval mode, and ``ckpt_path=`` resumes exactly;
    - ``on_train_batch_start``: ``optimizer.train()``, back to the look-ahead point (bit for bit the one left);
    - ``on_train_end``: ``optimizer.eval()``: after ``fit`` the module holds ``w`` for ``test``, ``predict``, saving
      or use; another ``fit`` moves back to the look-ahead point.

    BatchNorm running statistics are gathered at the look-ahead point; :func:`gearsam_fused.recompute_bn_stats` gathers
    them at ``w`` (e.g. in the module's ``on_validation_start``, which runs after this callback's).
    """

    def __init__(self):
        self._optimizers: list = []
        self._hook = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._optimizers = [opt for opt in trainer.optimizers if callable(getattr(opt, "eval", None))
                            and callable(getattr(opt, "train", None))]  # fmt: skip
        if not self._optimizers:
            names = ", ".join(type(opt).__name__ for opt in trainer.optimizers) or "none"
            raise TypeError(
                f"MomentumSAMCallback needs configure_optimizers to return an optimizer with eval() and train(), such "
                f"as MomentumSAM; got {names}"
            )
        if self._hook is None:
            self._hook = pl_module.register_state_dict_pre_hook(self._weights_read)

    def _weights_read(self, module, prefix, keep_vars) -> None:
        self._eval()

    def _eval(self) -> None:
        for opt in self._optimizers:
            opt.eval()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._eval()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for opt in self._optimizers:
            opt.train()

    def on_train_end(self, trainer, pl_module) -> None:
        self._eval()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


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

"""SAM, ASAM and GEAR-SAM in Hugging Face ``transformers.Trainer``: :class:`SAMTrainer`.

The Trainer runs forward and backward once per micro-batch (``training_step``), then, once per accumulation window,
clips the gradient and calls ``optimizer.step()``. :class:`SAMTrainer` keeps that loop and adds SAM's second pass::

    window of micro-batches m_1..m_k (the Trainer's first pass accumulates g(w) over them)
    last micro-batch: first_step()                 w -> w + eps, from the accumulated first gradient
                      forward + backward m_1..m_k  at w + eps, the same micro-batches, the same loss scaling
    the Trainer:      clip (the second gradient only), optimizer.step() = second_step(): restore w, base step,
                      LR scheduler step, zero_grad

Under a ``schedule`` (:mod:`gearsam_fused.schedules`), a window whose step the schedule skips has no second pass:
the Trainer clips the first gradient and its ``optimizer.step()`` is ``first_step()``, which makes the base update
with it, exactly as a plain Trainer's step.

The optimizer is built from ``TrainingArguments`` as the Trainer builds its own (``optim``, learning rate, weight
decay on the Trainer's decay parameters only) and wrapped in SAM or GEAR-SAM; the Trainer steps it through
:class:`SecondStep`, whose state dict is the SAM optimizer's, so checkpoints and ``resume_from_checkpoint`` carry the
GEAR EMA (and the schedule's position). ``rho``, each block's share of the radius, the share of the step time SAM's
own work took and the fraction of the steps since the last log that were SAM steps go into the Trainer's logs
(``sam/rho``, ``sam/share/<block>``, ``sam/overhead``, ``sam/sam_fraction``), and so into its reporting integrations.

One-pass momentum SAM (:class:`~gearsam_fused.MomentumSAM`, ``sam="momentum-sam"`` or ``"momentum-gear-sam"``) takes
one gradient per step with the optimizer's own ``step()``, so the Trainer's loop is left as it is; between steps the
parameters hold the look-ahead point ``w~`` and ``optimizer.eval()`` puts the weights ``w`` in them. The Trainer
itself calls ``optimizer.eval()`` at the start of every evaluation and ``optimizer.train()`` in every training step
(its support for schedule-free optimizers), but nothing before it saves the model: :class:`MomentumSAMCallback` adds
that, so that checkpoints, ``save_model()`` and the model after ``train()`` hold ``w``. It works in any Trainer given
the optimizer as ``optimizers=(opt, None)``; :class:`SAMTrainer` adds it itself for the momentum flavours.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from .. import timing
from ..bn import frozen_bn_stats
from ..momentum import MomentumSAM
from ..optim import GEARSAM, GSAM, SAM, WSAM, FriendlySAM, SharpnessAware

#: The flavours :class:`SAMTrainer` accepts: optimizer class and whether it is adaptive (ASAM). The SAM family's
#: classes take their papers' default parts (GSAM alpha 0.4, WSAM gamma 0.9 decoupled, F-SAM sigma 1.0 lmbda 0.9);
#: for others, pass the optimizer built by hand (``optimizers=(opt, None)``).
FLAVOURS = {
    "sam": (SAM, False), "asam": (SAM, True), "gear-sam": (GEARSAM, False), "gsam": (GSAM, False),
    "wsam": (WSAM, False), "friendly-sam": (FriendlySAM, False),
    "momentum-sam": (MomentumSAM, False), "momentum-gear-sam": (MomentumSAM, False),
}  # fmt: skip
#: The one-pass flavours and MomentumSAM's ``allocation``: SAM's global radius or GEAR-SAM's per-block radii.
ONE_PASS = {"momentum-sam": "sam", "momentum-gear-sam": "gear"}
#: ``rho`` where none is given: SAM's radius, or the look-ahead radius of the momentum flavours (the ``gearsam``
#: command's ``--momentum-rho``), whose scale is not SAM's.
DEFAULT_RHO = {"two-pass": 0.05, "one-pass": 1.0}


class SecondStep(torch.optim.Optimizer):
    """The optimizer the Trainer steps: ``step()`` is ``sam.second_step()`` (restore ``w``, then the base optimizer's
    step with the gradient taken at ``w + eps``), or on a step ``sam``'s schedule skips, ``sam.first_step()`` (the
    base optimizer's step with the first gradient). Its ``param_groups``, ``state`` and state dict are ``sam``'s, so the
    Trainer's LR scheduler and checkpoints work on it as on any optimizer."""

    def __init__(self, sam: SharpnessAware):
        self.sam = sam
        super().__init__(sam.param_groups, sam.defaults)  # the same group dicts: a scheduler's lr reaches sam
        self.state = sam.state

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("SecondStep.step() takes no closure: SAMTrainer runs the second pass itself")
        if self.sam.perturbed:
            self.sam.second_step()
        elif not self.sam.sam_step:
            self.sam.first_step()  # a step the schedule skips: the base update with the (clipped) first gradient
        else:
            raise RuntimeError(
                "SecondStep.step() on a SAM step whose weights are not perturbed: SAMTrainer.training_step runs "
                "first_step() and the second pass on the last micro-batch of each accumulation window"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sam.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.sam.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.sam.load_state_dict(state_dict)
        self.param_groups, self.state = self.sam.param_groups, self.sam.state


class SAMTrainer(Trainer):
    """``transformers.Trainer`` training with SAM, ASAM or GEAR-SAM around the optimizer ``TrainingArguments`` select.

    Besides the Trainer's own arguments:

    Args:
        sam: one of :data:`FLAVOURS`: ``"sam"``, ``"asam"``, ``"gear-sam"``, ``"gsam"``, ``"wsam"``,
            ``"friendly-sam"``, or one-pass momentum SAM, ``"momentum-sam"`` or ``"momentum-gear-sam"``
            (:class:`~gearsam_fused.MomentumSAM` with SAM's or GEAR-SAM's allocation; the base optimizer must keep a
            momentum: ``optim="adamw_torch"``, or ``optim="sgd"`` with ``optim_args="momentum=0.9"``).
        rho: the radius (default 0.05; for the momentum flavours the look-ahead radius, default 1.0); ``beta``:
            GEAR-SAM's EMA factor; ``eta``: ASAM's ``T = |w| + eta``.
        partition: the blocks (:func:`gearsam_fused.partition`; GEAR-SAM allocates over them, SAM reports them).
        backend: as :class:`gearsam_fused.SAM`'s.
        schedule: which steps take the second pass (:mod:`gearsam_fused.schedules`; None: every step). A step the
            schedule skips runs the first pass only (over the whole window), and the Trainer's ``optimizer.step()``
            makes the base update with the clipped first gradient. Not with the momentum flavours.

    With a momentum flavour (or a :class:`~gearsam_fused.MomentumSAM` given as ``optimizers=(opt, None)``) each step is
    the Trainer's own, with the one gradient taken at the look-ahead point, and :class:`MomentumSAMCallback` keeps
    evaluation, checkpoints and the model after training at ``w``; ``sam/rho`` and ``sam/share/<block>`` are logged.

    Gradient accumulation, ``max_grad_norm`` (applied to the second gradient), bf16, fp16 with the Trainer's loss
    scaler, LR schedulers and checkpoints work as in the Trainer. BatchNorm running statistics see the first pass
    only. With a loss scaler, an overflow in either pass skips the whole step, as the scaler skips a plain step: an
    overflow in the first pass leaves the weights unperturbed and the second pass out; one in the second pass makes
    the scaler skip ``optimizer.step()``, and the perturbation is undone (weights, GEAR EMA) right after.
    """

    def __init__(self, *args, sam: str = "gear-sam", rho: float | None = None, beta: float = 0.9, eta: float = 0.01,
                 partition="coarse", backend: str = "auto", schedule=None, **kwargs):  # fmt: skip
        if sam not in FLAVOURS:
            raise ValueError(f"sam must be one of {list(FLAVOURS)}, got {sam!r}")
        if sam in ONE_PASS and schedule is not None:
            raise ValueError(f"sam={sam!r} takes one gradient every step: a schedule of second passes does not apply")
        if rho is None:
            rho = DEFAULT_RHO["one-pass" if sam in ONE_PASS else "two-pass"]
        self.sam_settings = dict(sam=sam, rho=rho, beta=beta, eta=eta, partition=partition, backend=backend,
                                 schedule=schedule)  # fmt: skip
        self._sam_steps = [0, 0]  # SAM steps and steps since the last training log
        self._window: list[tuple[dict, object]] = []  # the micro-batches of the current accumulation window
        self._second_step: SecondStep | None = None  # what the Trainer steps (it may wrap it: accelerate does)
        self._one_pass: MomentumSAM | None = None  # or this, stepped by the Trainer as it is
        self._clock = _StepClock()
        super().__init__(*args, **kwargs)
        self.add_callback(_UndoSkippedStep(self))
        if isinstance(self.optimizer, MomentumSAM) or (self.optimizer is None and sam in ONE_PASS):
            self.add_callback(MomentumSAMCallback())
        if isinstance(self.optimizer, MomentumSAM):
            self._one_pass = self.optimizer
        elif isinstance(self.optimizer, SharpnessAware):
            self.optimizer = self._second_step = SecondStep(self.optimizer)
        elif isinstance(self.optimizer, SecondStep):
            self._second_step = self.optimizer
        elif self.optimizer is not None:
            raise TypeError(
                f"SAMTrainer needs a SAM or GEARSAM optimizer, or none (it builds one from TrainingArguments); got "
                f"{type(self.optimizer).__name__}"
            )

    @property
    def sam(self) -> SharpnessAware:
        """The SAM / GEAR-SAM / MomentumSAM optimizer (after ``create_optimizer``)."""
        if self._one_pass is not None:
            return self._one_pass
        if self._second_step is None:
            raise RuntimeError("the optimizer is built when training starts (or by create_optimizer())")
        return self._second_step.sam

    def create_optimizer(self, model: nn.Module | None = None):
        if self.optimizer is None:
            model = self.model if model is None else model
            sam = self._build_sam(model)
            if isinstance(sam, MomentumSAM):
                self.optimizer = self._one_pass = sam
            else:
                self.optimizer = self._second_step = SecondStep(sam)
        return self.optimizer

    def _build_sam(self, model: nn.Module) -> SharpnessAware:
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if self.optimizer_cls_and_kwargs is not None:
            base, kwargs = self.optimizer_cls_and_kwargs
        else:
            base, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        for key in ("params", "model", "optimizer_dict"):
            if key in kwargs:
                raise ValueError(
                    f"optim={self.args.optim!r} lays out its own parameters ({key!r}); SAMTrainer wraps optimizers "
                    "built from param groups (adamw_torch, sgd, adafactor, ...)"
                )
        s = self.sam_settings
        cls, adaptive = FLAVOURS[s["sam"]]
        if cls is MomentumSAM:
            return MomentumSAM(groups, base, model=model, rho=s["rho"], allocation=ONE_PASS[s["sam"]], beta=s["beta"],
                               partition=s["partition"], backend=s["backend"], **kwargs)  # fmt: skip
        extra = {"beta": s["beta"]} if cls is GEARSAM else {}
        return cls(groups, base, model=model, rho=s["rho"], adaptive=adaptive, eta=s["eta"] if adaptive else 0.0,
                   partition=s["partition"], backend=s["backend"], schedule=s["schedule"], **extra,
                   **kwargs)  # fmt: skip

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        if self._one_pass is not None:  # the Trainer's own step: the one gradient, then optimizer.step()
            return super().training_step(model, inputs, num_items_in_batch)
        if not self._window:
            self._clock.mark("start", self.args.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._window.append((inputs, num_items_in_batch))
        if self.accelerator.sync_gradients:  # the window's last micro-batch: the Trainer clips and steps next
            window, self._window = self._window, []
            perturbs = self.sam.sam_step  # known before the window began: the schedule's decision for this step
            self._sam_steps[0] += perturbs
            self._sam_steps[1] += 1
            self._clock.mark("sam", self.args.device)
            if perturbs:  # else the Trainer's optimizer.step() makes the update with the first gradient
                self._second_pass(model, window)
            self._clock.mark("sam_end", self.args.device)
        return loss  # the first pass's, as the Trainer logs it

    def _second_pass(self, model: nn.Module, window: list[tuple[dict, object]]) -> None:
        sam, scaler = self.sam, self.accelerator.scaler
        if scaler is not None:
            scaler.unscale_(sam)  # the first pass's gradients, unscaled once (recorded for the scaler's update)
        sam.first_step(cancellable=True)
        if scaler is not None and not bool(sam.step_statistics.energy.isfinite().all()):  # one synchronisation
            # the first pass overflowed: no perturbation, no second pass; the gradients stay non-finite, so the
            # Trainer's scaler skips this step and lowers the scale, as for any overflow
            sam.cancel_step()
            return
        sam.zero_grad()
        with sam.cancel_on_error(), frozen_bn_stats(model):
            for i, (inputs, num_items_in_batch) in enumerate(window):
                # under DDP only the last backward of the window all-reduces, as in the first pass
                last = i == len(window) - 1
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and (self._second_step is not None or self._one_pass is not None):  # a training log
            stats = self.sam.block_stats()  # one synchronisation, at logging time only
            logs["sam/rho"] = self.sam.step_statistics.rho
            for name, share in zip(self.sam.block_names, stats["share"].tolist()):
                logs[f"sam/share/{name}"] = share
            overhead = self._clock.share("sam", "sam_end")
            if overhead is not None:
                logs["sam/overhead"] = overhead
            sam_steps, steps = self._sam_steps
            if steps:
                logs["sam/sam_fraction"] = sam_steps / steps
                self._sam_steps = [0, 0]
        super().log(logs, *args, **kwargs)


class MomentumSAMCallback(TrainerCallback):
    """Evaluation, checkpoints and the model after training see the weights ``w`` of a
    :class:`~gearsam_fused.MomentumSAM` (or of another optimizer with its ``eval()``/``train()`` protocol) that the
    Trainer steps; training runs at the look-ahead point. For any ``transformers.Trainer`` (or subclass) given the
    optimizer as ``optimizers=(opt, None)``::

        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                          callbacks=[MomentumSAMCallback()])

    The Trainer already calls ``optimizer.eval()`` at the start of each evaluation (``evaluation_loop``) and
    ``optimizer.train()`` in each ``training_step``. This callback adds:

    - while training, reading the model's state dict (each checkpoint's ``save_model``, a ``save_pretrained``) calls
      ``optimizer.eval()`` first, so the saved weights are ``w`` and the optimizer's checkpoint is saved in eval mode
      (``resume_from_checkpoint`` continues exactly); the next training step moves back to the look-ahead point;
    - at the end of training, ``optimizer.eval()``: the model then holds ``w`` for ``save_model()``, ``evaluate()``,
      ``push_to_hub()`` or use; a later ``train()`` call moves back to the look-ahead point.

    ``load_best_model_at_end`` loads into ``w``: it needs an evaluation strategy, and the Trainer evaluates on the last
    step (or at the end of the last epoch) before it loads the best checkpoint.

    BatchNorm running statistics are gathered at the look-ahead point; :func:`gearsam_fused.recompute_bn_stats` gathers
    them at ``w``.
    """

    def __init__(self):
        self._optimizer = None
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
        if not (callable(getattr(inner, "eval", None)) and callable(getattr(inner, "train", None))):
            raise TypeError(
                f"MomentumSAMCallback needs an optimizer with eval() and train(), such as MomentumSAM, given to the "
                f"Trainer as optimizers=(opt, None); got {type(inner).__name__}"
            )
        self._optimizer = inner
        if self._hook is None:
            self._hook = model.register_state_dict_pre_hook(self._weights_read)

    def _weights_read(self, module, prefix, keep_vars) -> None:
        self._optimizer.eval()

    def on_train_end(self, args, state, control, **kwargs):
        if self._optimizer is not None:
            self._optimizer.eval()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class _UndoSkippedStep(TrainerCallback):
    """After ``optimizer.step()``: a loss scaler that found the second gradient non-finite skipped it, so the weights
    still hold ``w + eps``; undo the perturbation (weights and GEAR EMA), as a skipped step leaves everything as it
    was."""

    def __init__(self, trainer: SAMTrainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        second_step = self.trainer._second_step
        if second_step is not None and second_step.sam.perturbed:
            second_step.sam.cancel_step()
        self.trainer._clock.mark("end", args.device)


class _StepClock:
    """Marks in each optimizer step ("start", "sam", "sam_end", "end") on the clock of the device doing the work
    (:mod:`gearsam_fused.timing`: on a GPU recorded without waiting for it, read at logging time)."""

    def __init__(self):
        self.steps: list[dict] = []

    def mark(self, name: str, device: torch.device) -> None:
        if name == "start":
            self.steps.append({})
        if not self.steps:
            return
        self.steps[-1][name] = timing.mark(device)

    def share(self, begin: str, end: str) -> float | None:
        """Of the time of the steps marked since the last call, the share spent between ``begin`` and ``end`` (None
        when no step was complete); forgets them."""
        done = [m for m in self.steps if {"start", begin, end, "end"} <= m.keys()]
        self.steps = [m for m in self.steps if "end" not in m]
        total = sum(timing.seconds(m["start"], m["end"]) for m in done)
        return sum(timing.seconds(m[begin], m[end]) for m in done) / total if total > 0 else None

"""torch.optim-style frontends: :class:`SAM` (and ASAM) and :class:`GEARSAM`, and the SAM family's :class:`GSAM`,
:class:`WSAM` and :class:`FriendlySAM`, SAM with one part of the step chosen (:mod:`gearsam_fused.family`).

Both wrap a base optimizer exactly like the widely used ``SAM(params, base_optimizer, rho, adaptive, **kw)`` class:
the caller computes the first gradient, ``first_step`` moves the weights to ``w + eps``, the caller computes the
gradient there, and ``second_step`` restores ``w`` and lets the base optimizer step with that gradient.

Per step, for the blocks ``b`` of the partition: the block energies ``e_b`` (:meth:`Backend.block_energy
<gearsam_fused.backends.base.Backend.block_energy>`), each block's radius and scale by the class's rule
(:func:`~gearsam_fused.allocation.sam_allocate`, :func:`~gearsam_fused.allocation.gear_allocate`: the formulas are
stated there, once), then ``eps_p = scale_b * T_p**2 * g_p`` (:meth:`Backend.perturb_
<gearsam_fused.backends.base.Backend.perturb_>`). The documentation's Algorithm page derives them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import fields

import torch
from torch import nn

from . import family_steps, gradients, schedule_steps, state_dicts
from .allocation import GEAR_RULE, SAM_RULE
from .arguments import (
    check_base_optimizer,
    check_capturable,
    check_options,
    check_parameters,
    forwarded,
    labeller,
    param_group_list,
    params_and_model,
)
from .backends.base import Backend
from .base_step import FUSED, PER_TENSOR
from .capturable import DeviceScalars, check_found_inf_given
from .checks import check_real
from .compat import raise_refusal
from .compiled import mark_stepped_now, own_graph, register, step_per_tensor
from .family import Descent, FriendlyAscent, SurrogateGap, WeightedSharpness
from .placement import flat_step_for, place, wrap_base
from .schedules import Schedule
from .sharding import sum_over
from .step_state import DeviceDecision, StepState, StepStatistics, describe


class SharpnessAware(torch.optim.Optimizer):
    """What :class:`SAM` and :class:`GEARSAM` share: the two-step protocol, the state, and the telemetry views.
    ``isinstance(opt, SharpnessAware)`` is how the library's helpers recognise them (see
    :func:`check_sharpness_aware`). A subclass chooses its allocation ``rule``."""

    #: The allocation rule (one of :data:`gearsam_fused.allocation.RULES`), also the method's name in state dicts
    #: and on the command line.
    rule = ""
    beta = 0.0  # EMA factor; only GEAR-SAM's rule reads it
    #: Whether one gradient makes a step (:class:`~gearsam_fused.MomentumSAM`), which state dicts record.
    one_pass = False

    def __init__(
        self,
        params,
        base_optimizer: Callable[..., torch.optim.Optimizer],
        *,
        rho: float,
        adaptive: bool,
        eta: float,
        delta: float,
        backend: str,
        model: nn.Module | None,
        partition,
        base_step: str,
        base_kwargs: dict,
        schedule: Schedule | None = None,
        capturable: bool = False,
        ascent: FriendlyAscent | None = None,
        descent: Descent | None = None,
    ):
        options = check_options(rho, adaptive, eta, delta, base_step, schedule, capturable, ascent, descent)
        for field in fields(options):  # capturable, schedule, ascent, descent, base_step, eta, delta, adaptive
            setattr(self, field.name, getattr(options, field.name))
        check_base_optimizer(base_optimizer)
        params, model = params_and_model(params, model)
        # to say so when the model's parameters are replaced after construction (gradients.check_first)
        self._model = None if model is None else weakref.ref(model)
        self._model_param_ids = frozenset(map(id, model.parameters())) if model is not None else frozenset()
        # Checked before torch reads the groups: it only warns of a parameter listed twice in one group (two flat slots
        # for one tensor would corrupt both) and names none listed in two groups.
        params = param_group_list(params)
        label = labeller(params, model)
        check_parameters(params, label)
        super().__init__(params, dict(rho=rho, **base_kwargs))
        wrap_base(self, base_optimizer, base_kwargs, rho)
        placed = place(self.param_groups, model, partition, label, backend, self.rule)
        self.blocks, self._outside_blocks, self._shard_groups = (
            placed.blocks,
            placed.outside_blocks,
            placed.shard_groups,
        )
        self.backend_name, self._backend, device = placed.backend_name, placed.backend, placed.device
        if capturable:
            check_capturable(self)
            self.base_step = FUSED  # a step that cannot be fused is an error, never a per-tensor step reading the host
        # how compiled code finds this optimizer again when it runs (check_second_gradient_, check_ready_)
        self._key = register(self)
        self._flat_step, self._flat_step_why_not = flat_step_for(
            self.base_step, self._backend, self.backend_name, self.base_optimizer, capturable, self._key
        )
        #: capturable=True: rho, the lrs and what a skipped step restores, on the device (None otherwise)
        self._device = DeviceScalars(self.param_groups, device, len(self.blocks)) if capturable else None
        rho = self._device.last_rho if capturable else float(rho)
        self._run = StepState.fresh(len(self.blocks), device, rho, self._flat_step is not None, self.schedule)

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "base_optimizer"):
            raise NotImplementedError(
                f"{type(self).__name__} fixes its blocks at construction; pass every parameter group to the constructor"
            )
        super().add_param_group(param_group)

    # ---------------------------------------------------------------- public API
    @property
    def block_names(self) -> list[str]:
        return [b.name for b in self.blocks]

    @property
    def backend(self) -> Backend:
        """The backend doing this optimizer's tensor work (:attr:`backend_name` names it), for inspection: e.g. the
        flat buffers of the flat-buffer backends, ``opt.backend.layout.buckets``. Read-only."""
        return self._backend

    @property
    def perturbed(self) -> bool:
        """Whether the parameters hold ``w + eps`` (between ``first_step`` and ``second_step``/``cancel_step``)."""
        return self._backend.perturbed

    @property
    def base_step_mode(self) -> str:
        """How the last :meth:`second_step` ran the base optimizer (before the first, how it will if it can):
        ``"fused"``, restored and updated over the flat buffers in one pass per bucket (torch's SGD, Adam and AdamW on
        a flat-buffer backend), or ``"per-tensor"``, restored and then stepped by the base optimizer itself.
        :attr:`base_step_reason` says why a step was not fused."""
        return self._run.last_base_step

    @property
    def base_step_reason(self) -> str:
        """Why the last :meth:`second_step` stepped the base optimizer per tensor ("" when it was fused)."""
        if self._run.last_base_step == FUSED:
            return ""
        return self._flat_step_why_not or self._flat_step.reason

    @property
    def sam_step(self) -> bool:
        """Whether the next step to begin is a SAM step: its :meth:`first_step` perturbs and the second forward and
        backward are needed (always True without a ``schedule``). Known before that step's first forward; between
        ``first_step`` and ``second_step`` it already speaks of the step after. Reading it may wait for the device to
        finish the step before (:class:`~gearsam_fused.schedules.Adaptive` on CUDA), never for later work."""
        if isinstance(self._run.next_sam, DeviceDecision):
            self._run.next_sam = self._run.next_sam.value()
        return self._run.next_sam

    @property
    def step_statistics(self) -> StepStatistics:
        """The last ``first_step``'s raw statistics on the device, without a copy (see :class:`StepStatistics`);
        :meth:`block_stats` is the same on the host, copied and described."""
        return StepStatistics(self._run.energy, self._run.ema, self._run.radius, self._run.last_rho, self._run.last_sam)

    def _rho(self) -> float | torch.Tensor:
        if self._device is not None:
            return self._device.current_rho(self.param_groups)
        values = {group["rho"] for group in self.param_groups}
        if len(values) != 1:
            raise ValueError(
                f"all param_groups must share one rho (the global radius that is split across blocks); got {sorted(values)}"
            )
        return check_real("rho", values.pop(), low=0.0)

    @torch.no_grad()
    def first_step(
        self, zero_grad: bool = False, *, cancellable: bool = False, found_inf: torch.Tensor | None = None
    ) -> bool:
        """Move every parameter with a gradient to ``w + eps`` (saving ``w``) and return True: the caller runs the
        second forward and backward, then :meth:`second_step`. On a step its ``schedule`` skips (:attr:`sam_step` was
        False), make the base optimizer's update with this gradient instead (LookSAM: corrected) and return False:
        the step is complete. With ``cancellable=True`` a perturbing step also keeps the allocation and schedule state
        of before it (``O(blocks)`` numbers), so that :meth:`cancel_step` can undo the whole step.

        ``found_inf`` (``capturable=True`` only): GradScaler's overflow flag of this pass's unscaled gradients, a float32
        one-element tensor on the device. Where it is set the step is skipped on the device, with no synchronisation:
        nothing is perturbed and the GEAR EMA keeps its value (this step's energies and zero radii are recorded), and
        :meth:`second_step` restores ``w`` without an update (see :class:`~gearsam_fused.amp.SAMScaler`)."""
        own_graph()
        sam = self._first_step(zero_grad, cancellable, found_inf)
        own_graph()
        return sam

    def _first_step(self, zero_grad: bool, cancellable: bool, found_inf: torch.Tensor | None = None) -> bool:
        if self.perturbed:
            raise RuntimeError("first_step() called twice: call second_step() to restore the weights first")
        if self.schedule is not None and torch.compiler.is_compiling():
            raise_refusal(
                "a schedule decides on the host which steps take the second pass, which a step compiled with "
                "torch.compile cannot do; compile the step without a schedule, or run it eagerly"
            )
        if torch.compiler.is_compiling():
            family_steps.refuse_compiled(self)
        rho = self._rho()
        gradients.check_first(self, "first_step()")
        check_found_inf_given(self._device, found_inf)
        sam = self.sam_step
        # The EMA is updated in place by allocate, so undoing needs a copy; only cancellable steps pay for it.
        undo = None
        if cancellable and sam:
            undo = self._run.checkpoint(family_steps.ascent_copy(self))
        # a skipped step has no perturbation: h = g, every descent is g, no ascent direction is taken
        keep, energy = family_steps.first_step_parts(self) if sam else (False, None)
        if energy is None:
            energy = self._backend.block_energy(self.adaptive, self.eta)
        energy = sum_over(self._shard_groups, energy)
        if self.schedule is not None:
            schedule_steps.decide_next(self, energy)
        if not sam:
            schedule_steps.skipped_step(self, energy, rho)
        else:
            allocation = {}
            if self._device is not None:  # what a skipped step puts back, and the rho of this step, on the device
                self._device.ema_before.copy_(self._run.ema)
                self._device.last_rho.copy_(rho)
                rho, allocation = self._device.last_rho, {"found_inf": found_inf}
                self._run.found_inf = found_inf
            scale, radius = self._backend.allocate(
                self.rule, energy, self._run.ema, rho, self.beta, self.delta, **allocation
            )
            # g, for the descent or for second_step's decomposition of the SAM gradient (LookSAM)
            keep = keep or (self.schedule is not None and self.schedule.corrects)
            self._backend.perturb_(scale, self.adaptive, self.eta, keep=keep)
            self._run.record(energy, radius, rho, sam=True)
            self._run.undo = undo
        self._run.cleared = None
        if zero_grad:
            self.zero_grad()
        return sam

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False, *, found_inf: torch.Tensor | None = None) -> None:
        """Restore ``w`` exactly and step the base optimizer with the gradient taken at ``w + eps``: in one pass over
        the flat buffers where the base step is fused (see :attr:`base_step_mode`), else by its own ``step()``.

        ``found_inf`` (``capturable=True`` only), as for :meth:`first_step`, of the second pass: where it or the first
        pass's is set, the kernels restore ``w`` and leave the base optimizer's state, its step counts and the GEAR
        EMA as they were before the step, with no synchronisation."""
        own_graph()
        self._second_step(zero_grad, found_inf)
        own_graph()

    def _second_step(self, zero_grad: bool, found_inf: torch.Tensor | None = None) -> None:
        if not self.perturbed:
            if self._run.last_sam is False and self._run.cleared is None:
                raise RuntimeError(
                    f"second_step() after a step the schedule {self.schedule!r} skipped: first_step() returned False "
                    "and already made the base optimizer's update; run the second pass and second_step() only when "
                    "first_step() returns True"
                )
            raise RuntimeError("second_step() called without a preceding first_step()")
        skip = None
        check_found_inf_given(self._device, found_inf)
        if self._device is not None:
            skip = self._device.skip_flag(self._run.found_inf, found_inf)
            self._run.found_inf = None
        gradients.check(self)
        self._run.cleared = None
        updates = self._plan()
        if updates is None and self.base_step == FUSED:
            self._backend.restore_()  # w, not w + eps, stays in the model
            raise RuntimeError(f"base_step='fused' cannot be honoured this step: {self._flat_step.reason}")
        folds = updates is not None and self._backend.folds_mix  # the fused step takes the descent's mix itself
        if torch.compiler.is_compiling():
            family_steps.refuse_compiled(self, folds)
        if self.schedule is not None and self.schedule.corrects:
            self._run.orthogonal_energy = schedule_steps.orthogonalize(
                self._backend, self._run.energy, self.rule, self._shard_groups
            )
        mix = None
        if self.descent is not None:
            # the first step's energies are g's own where neither an ascent nor ASAM's scaling came between
            first_energy = self._run.energy if self.ascent is None and not self.adaptive else None
            mix = self.descent.before_update(
                self._backend, self._reduce, per_block=self.rule == GEAR_RULE, first_energy=first_energy, folds=folds
            )
        if updates is None:
            if mix is not None:
                self._backend.mix_gradient_(mix.grad_scale, mix.kept_scale)  # the base optimizer's step reads them
            self._backend.restore_()
            step_per_tensor(self)
        else:
            self._flat_step.run(updates, self._backend, found_inf=skip, mix=mix)
        if self.descent is not None:
            self.descent.after_update(self._backend, self.param_groups, folds=folds)
        if skip is not None:
            self._device.keep_ema(self._run.ema, skip)
        self._run.last_base_step = PER_TENSOR if updates is None else FUSED
        self._run.undo = None
        self._run.steps_done += 1
        mark_stepped_now(self)  # tells torch LR schedulers that an optimizer step happened
        if zero_grad:
            self.zero_grad()

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        """A ``[B]`` vector summed over the ranks that hold shards of a block (itself without sharding)."""
        return sum_over(self._shard_groups, values)

    def _plan(self) -> list | None:
        """The fused base step's plan of this step (None: the base optimizer's own step)."""
        return None if self._flat_step is None else self._flat_step.plan()

    @torch.no_grad()
    def cancel_step(self) -> None:
        """Undo a ``first_step(cancellable=True)`` instead of completing it: restore ``w`` exactly, put the GEAR EMA
        and :meth:`block_stats` back to their values before it, and leave the base optimizer untouched. For a step
        whose second gradient cannot be used, e.g. a non-finite one under loss scaling (see
        :class:`gearsam_fused.amp.SAMScaler`)."""
        if not self.perturbed:
            raise RuntimeError("cancel_step() called without a preceding first_step()")
        if self._run.undo is None:
            raise RuntimeError(
                "cancel_step() needs first_step(cancellable=True), which keeps the state to roll back; the weights "
                "still hold w + eps, so call second_step() to finish this step"
            )
        self._backend.restore_()
        family_steps.restore_ascent(self, self._run.roll_back())

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """One full step. The caller has already run the first backward; ``closure`` must zero nothing itself,
        recompute the loss at the perturbed point and call ``backward()``. Returns the closure's loss, or None on a
        step the ``schedule`` skips (the closure is not called: the base optimizer steps with the first gradient). If
        the closure raises, the step is cancelled (weights, allocation and schedule state as before it) and the
        exception propagates."""
        if closure is None:
            raise RuntimeError(
                f"{type(self).__name__}.step() needs a closure that recomputes the loss and its gradients "
                "(or call first_step() and second_step() yourself); to create the optimizer state before loading a "
                "checkpoint with torch.distributed.checkpoint, call init_state() first"
            )
        if not self.first_step(zero_grad=True, cancellable=True):
            return None
        with self.cancel_on_error(), torch.enable_grad():
            loss = closure()
        self.second_step()
        return loss

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the base optimizer's state as its first step would, without moving any parameter, so that a
        checkpoint can be loaded into a fresh optimizer in place: ``torch.distributed.checkpoint`` loads only into
        state that exists (``get_optimizer_state_dict``/``set_optimizer_state_dict`` would otherwise call ``step()``
        without a closure to create it). Runs the base optimizer's ``step()`` once on zero gradients with every
        learning rate at 0, as torch's checkpoint code does for plain optimizers (so until the checkpoint overwrites
        it, Adam's step count reads 1), then clears the gradients. Does nothing when the state exists."""
        state_dicts.init_state(self)

    @contextlib.contextmanager
    def cancel_on_error(self):
        """Context manager for the second pass after ``first_step(cancellable=True)``: if the pass raises (out of
        memory, an interrupt), the step is cancelled with :meth:`cancel_step` before the exception propagates, so
        ``w + eps`` is never left in the model where a later step or a checkpoint would take it for ``w``::

            opt.first_step(zero_grad=True, cancellable=True)
            with opt.cancel_on_error():
                loss_fn(model(x), y).backward()
            opt.second_step()
        """
        if not self.perturbed or self._run.undo is None:
            raise RuntimeError("cancel_on_error() belongs after first_step(cancellable=True), before second_step()")
        try:
            yield
        except BaseException:
            self.cancel_step()
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. With a fused backend, ``set_to_none=False`` zeroes each flat
        gradient buffer in one operation and keeps the gradients as its views, so the next ``backward`` accumulates
        straight into the buffer; ``set_to_none=True`` frees them, and the next ``first_step`` copies the fresh
        gradients in (one extra pass over the gradients)."""
        if set_to_none and torch.compiler.is_compiling():
            for p in (p for group in self.param_groups for p in group["params"]):
                p.grad = None  # torch's zero_grad does just this, but is not traceable
        elif set_to_none:
            super().zero_grad(set_to_none=True)
        else:
            self._backend.zero_grad_()
        if self.perturbed:  # second_step checks that a backward came after this
            self._run.cleared = gradients.marks(self)

    def memory_overhead(self) -> dict[str, int]:
        """Bytes the backend holds beyond the parameters and their gradients: ``backup`` (the saved weights),
        ``padding`` (alignment in the flat buffers), ``tables`` (O(blocks + tiles) indices and partial sums) and
        ``total``. ``grad_buffer`` is the fused backends' flat gradient buffer: the gradients' own memory while they
        are its views (``zero_grad(set_to_none=False)``), held in addition to them after ``zero_grad()`` with
        ``set_to_none=True`` frees the views, since the next ``backward`` allocates fresh gradients; it is not in
        ``total``."""
        return self._backend.memory_overhead()

    def state_dict(self) -> dict:
        """The base optimizer's state dict (torch's per-parameter format), with this optimizer's own state (the rule,
        blocks, GEAR EMA, last energies and radii, the schedule's and the SAM family's) under ``"gearsam"`` in the
        first param group: tools that keep only ``"state"`` and ``"param_groups"``
        (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``) keep it too, and a plain torch
        optimizer that loads the dict ignores it (:mod:`gearsam_fused.state_dicts`)."""
        return state_dicts.save(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved by the same kind of optimizer over the same blocks, or a plain torch optimizer's
        (its state taken over, the allocation state started afresh); anything else is refused with what differs."""
        state_dicts.load(self, state_dict, OPTIMIZERS)

    def _refuse_mid_step(self, caller: str) -> None:
        if self.perturbed:
            raise RuntimeError(f"{caller} between first_step() and second_step(): the weights hold w + eps")

    def __getstate__(self):
        # The parameters are views of flat buffers this optimizer owns; a copy would hold buffers that no parameter
        # uses, and step a model it does not know.
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied: it owns the memory of the model's parameters. Save "
            f"opt.state_dict() (and the model's) and load it into a new {type(self).__name__} built on the new model"
        )

    def block_stats(self) -> dict[str, torch.Tensor]:
        """Telemetry of the last ``first_step`` as CPU float64 tensors of shape ``[B]`` (this call synchronises):
        ``energy`` e_b, ``score`` the allocation score s_b (GEAR-SAM's EMA, SAM's ``sqrt(e_b)``), ``radius`` rho_b,
        ``share`` rho_b**2 / rho**2; and ``non_finite``, how many blocks had a non-finite energy (a 0-d tensor;
        GEAR-SAM did not perturb those blocks, SAM perturbed nothing)."""
        # copies, also on CPU: the EMA is live optimizer state and must not change under the caller (or by them)
        stats = self.step_statistics
        host = [t.to("cpu", copy=True) for t in (stats.energy, stats.ema, stats.radius)]
        return self.describe_blocks(*host, stats.rho)

    def describe_blocks(self, energy: torch.Tensor, ema: torch.Tensor, radius: torch.Tensor, rho: float) -> dict:
        """The :meth:`block_stats` dict from a step's raw energies, EMA state and radii (recorded elsewhere, e.g. by
        :class:`~gearsam_fused.telemetry.BlockTelemetry`) and its ``rho``."""
        # the allocation's score: GEAR-SAM's EMA; SAM's implicit one is the block's instantaneous gradient norm
        # (paper Eq. sam_block_radius)
        score = ema if self.rule == GEAR_RULE else energy.sqrt()
        return describe(energy, score, radius, rho)


class SAM(SharpnessAware):
    """Sharpness-aware minimisation (Foret et al.) and, with ``adaptive=True``, ASAM (Kwon et al.).

    ``eps = rho * T**2 * g / (||T * g|| + delta)`` with ``T = |w| + eta`` for ASAM and ``T = 1`` otherwise.

    Args:
        params: parameters, param-group dicts, or an ``nn.Module``.
        base_optimizer: optimizer class, called as ``base_optimizer(param_groups, **base_kwargs)``.
        rho: neighbourhood radius (kept in ``param_groups`` so it can be scheduled; all groups share it).
        adaptive: ASAM's element-wise scaling by ``|w| + eta``.
        eta: ASAM offset; 0 matches the common SAM implementation, the ASAM paper uses 0.01.
        backend: ``"auto"`` or a name from :func:`gearsam_fused.available_backends`.
        model, partition: only used to report SAM's implicit per-block radii in :meth:`block_stats`
            (default: ``"coarse"`` when a model is known, else ``"global"``). The step does not depend on them.
        delta: added to the gradient norm before dividing.
        base_step: ``"auto"`` runs torch's SGD, Adam and AdamW fused with the restore over the flat buffers where it
            can and per tensor elsewhere (:attr:`base_step_mode` says which ran, :attr:`base_step_reason` why);
            ``"fused"`` makes a step that cannot be fused an error; ``"per-tensor"`` always calls the base optimizer's
            own ``step()``.
        schedule: which steps take the second pass: None (every step), or one of
            :class:`~gearsam_fused.schedules.Every`, :class:`~gearsam_fused.schedules.LookSAM`,
            :class:`~gearsam_fused.schedules.Random`, :class:`~gearsam_fused.schedules.Adaptive`; see
            :attr:`sam_step` and :meth:`first_step`.
        capturable: keep ``rho``, every group's ``lr`` and the step counts on the device (as float64 tensors in
            ``param_groups``, which LR schedulers write in place) so that no step reads a value on the host and the
            whole step can be captured in a CUDA graph; an overflowing step under loss scaling is then skipped on the
            device (``found_inf``). Needs the ``cpp`` or ``triton`` backend, the fused base step and no schedule
            (:mod:`gearsam_fused.capturable`).
        ascent, descent: the SAM family's parts (:mod:`gearsam_fused.family`): F-SAM's ascent direction
            (:class:`~gearsam_fused.family.FriendlyAscent`), GSAM's or WSAM's descent gradient
            (:class:`~gearsam_fused.family.SurrogateGap`, :class:`~gearsam_fused.family.WeightedSharpness`); None for
            SAM's own. Not with a schedule or ``capturable=True``.
    """

    rule = SAM_RULE

    def __init__(
        self,
        params,
        base_optimizer,
        rho: float = 0.05,
        adaptive: bool = False,
        eta: float = 0.0,
        backend: str = "auto",
        *,
        model: nn.Module | None = None,
        partition=None,
        delta: float = 1e-12,
        base_step: str = "auto",
        schedule: Schedule | None = None,
        capturable: bool = False,
        ascent: FriendlyAscent | None = None,
        descent: Descent | None = None,
        **base_kwargs,
    ):
        if partition is None:
            partition = "coarse" if isinstance(params, nn.Module) or model is not None else "global"
        super().__init__(params, base_optimizer, base_kwargs=base_kwargs, **forwarded(locals()))


class GEARSAM(SharpnessAware):
    """GEAR-SAM: SAM whose radius is split across architecture blocks by an EMA of block gradient energy.

    See the module docstring for the formulas. Arguments as :class:`SAM`'s, plus those below.

    Args:
        model: the network, needed (unless ``params`` is the module) by ``"coarse"``, ``"fine"`` and callables.
        partition: a strategy accepted by :func:`gearsam_fused.partition`.
        beta: EMA factor in [0, 1).
        delta: stabiliser of the block direction ``g_b / (||g_b|| + delta)``; must be > 0.
        base_step, schedule, capturable: as :class:`SAM`'s. Under a schedule the EMA takes every step's energies.
        ascent, descent: as :class:`SAM`'s: GEAR-SAM's allocation with F-SAM's ascent direction or GSAM's or WSAM's
            descent gradient, whose inner products and norms are then taken per block.
    """

    rule = GEAR_RULE

    def __init__(
        self,
        params,
        base_optimizer,
        *,
        model: nn.Module | None = None,
        partition="coarse",
        rho: float = 0.05,
        beta: float = 0.9,
        delta: float = 1e-12,
        adaptive: bool = False,
        eta: float = 0.0,
        backend: str = "auto",
        base_step: str = "auto",
        schedule: Schedule | None = None,
        capturable: bool = False,
        ascent: FriendlyAscent | None = None,
        descent: Descent | None = None,
        **base_kwargs,
    ):
        self.beta = check_real("beta", beta, low=0.0, high=1.0)
        super().__init__(params, base_optimizer, base_kwargs=base_kwargs, **forwarded(locals()))


class GSAM(SAM):
    """GSAM (Zhuang et al., ICLR 2022): :class:`SAM` whose descent gradient is
    :class:`~gearsam_fused.family.SurrogateGap` (``alpha``, ``eps``). Other arguments as :class:`SAM`'s."""

    def __init__(self, params, base_optimizer, rho: float = 0.05, *, alpha: float = 0.4, eps: float = 1e-12, **kwargs):
        super().__init__(params, base_optimizer, rho, descent=SurrogateGap(alpha, eps), **kwargs)


class WSAM(SAM):
    """WSAM (Yue et al., KDD 2023): :class:`SAM` whose descent gradient is
    :class:`~gearsam_fused.family.WeightedSharpness` (``gamma``, ``decouple``). Other arguments as :class:`SAM`'s."""

    def __init__(self, params, base_optimizer, rho: float = 0.05, *, gamma: float = 0.9, decouple: bool = True,
                 **kwargs):  # fmt: skip
        super().__init__(params, base_optimizer, rho, descent=WeightedSharpness(gamma, decouple), **kwargs)


class FriendlySAM(SAM):
    """F-SAM (Li et al., CVPR 2024): :class:`SAM` whose ascent direction is
    :class:`~gearsam_fused.family.FriendlyAscent` (``sigma``, ``lmbda``). Other arguments as :class:`SAM`'s."""

    def __init__(self, params, base_optimizer, rho: float = 0.05, *, sigma: float = 1.0, lmbda: float = 0.9,
                 **kwargs):  # fmt: skip
        super().__init__(params, base_optimizer, rho, ascent=FriendlyAscent(sigma, lmbda), **kwargs)


#: The sharpness-aware optimizers by rule: the names the ``gearsam`` command and state dicts use.
OPTIMIZERS: dict[str, type[SharpnessAware]] = {SAM.rule: SAM, GEARSAM.rule: GEARSAM}


def check_sharpness_aware(optimizer, name: str = "optimizer") -> SharpnessAware:
    """``optimizer`` if it is a :class:`SAM` or :class:`GEARSAM`, else a TypeError naming what it is; ``name`` says
    what the caller calls it."""
    if not isinstance(optimizer, SharpnessAware):
        raise TypeError(f"{name} must be a gearsam_fused SAM or GEARSAM, got {type(optimizer).__name__}")
    return optimizer

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
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .allocation import GEAR_RULE, SAM_RULE
from .backends import make_backend, resolve_backend_name
from .backends.base import CORRECTION, MOMENTUM, Backend
from .backends.flat_buffer import KernelBackend
from .base_step import BASE_STEPS, FUSED, PER_TENSOR, FlatBaseStep, run_post_hooks, run_pre_hooks, step_closure
from .capturable import DeviceScalars
from .checks import PARAM_DTYPES, check_found_inf, check_param_dtype, check_real
from .compat import graph_break, graph_may_break, mark_stepped
from .family import Descent, FriendlyAscent, Mix, SurrogateGap, WeightedSharpness, check_ascent, check_descent
from .host_ops import host_op
from .partition import Block, parameter_names
from .partition import partition as make_partition
from .schedules import Schedule, check_schedule
from .sharding import is_sharded, reduction_groups, sum_over

_STATE_KEY = "gearsam"
# Param-group keys a plain state dict may lack: ours, and flags torch's optimizers default when loading older states.
_OPTIONAL_GROUP_KEYS = {"rho", "foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


class StepStatistics(NamedTuple):
    """The raw statistics of the last ``first_step``: float64 ``[B]`` tensors on the optimizer's device, and rho.

    They are the optimizer's own tensors, handed out without a copy or a synchronisation so that a step can be
    recorded for free (:class:`~gearsam_fused.telemetry.BlockTelemetry`): read them, never write them, and copy what
    you keep, since the next ``first_step`` updates ``ema`` in place.
    """

    energy: torch.Tensor  #: e_b
    ema: torch.Tensor  #: GEAR-SAM's s_b (SAM keeps it at 0)
    radius: torch.Tensor  #: rho_b
    rho: float | torch.Tensor  #: the global radius of that step (capturable=True: a float64 [1] tensor on the device)
    sam_step: bool = True  #: whether that step perturbed (False: its schedule skipped the second pass; radius is 0)


@dataclass
class _Run:
    """What an optimizer carries from one call to the next besides the base optimizer's state. A plain object rather
    than attributes of the optimizer: inside a function compiled with ``torch.compile``, assignments to attributes of
    a ``torch.optim.Optimizer`` are dropped without a word (torch 2.13), and ``first_step``/``second_step`` compile."""

    ema: torch.Tensor  #: GEAR-SAM's s_b (SAM keeps it at 0)
    energy: torch.Tensor  #: the last first_step's e_b
    radius: torch.Tensor  #: the last first_step's rho_b
    orthogonal_energy: torch.Tensor  #: LookSAM's block energies of g_v (the buffer itself is the backend's)
    last_rho: float
    last_base_step: str
    schedule_state: dict
    last_sam: bool = True
    undo: tuple | None = None  #: allocation and schedule state of before a cancellable first_step
    steps_done: int = 0  #: steps completed, for the schedule
    next_sam: bool | _Pending = True  #: the schedule's decision for the next step (maybe still on the device)
    cleared: list | None = None  #: the gradients as zero_grad() left them after first_step (see _grad_marks)
    found_inf: torch.Tensor | None = None  #: the first pass's overflow flag, where first_step was given one
    #: per parameter (block order), whether F-SAM's EMA holds a gradient (the backend's momentum buffer); () for none
    ascent_started: tuple[bool, ...] = ()

    def record(self, energy: torch.Tensor, radius: torch.Tensor, rho: float, sam: bool) -> None:
        """Keep a first_step's statistics (see :class:`StepStatistics`)."""
        self.energy, self.radius, self.last_rho, self.last_sam = energy, radius, rho, sam

    def checkpoint(self, ascent=None) -> tuple:
        """What :meth:`roll_back` needs to undo the step about to begin (the EMA is copied: allocate updates it in
        place); ``ascent`` is what the ascent direction needs to be undone, returned by :meth:`roll_back`."""
        # a capturable step's rho is the device's tensor, which the step writes in place: its value is kept
        last_rho = self.last_rho.clone() if isinstance(self.last_rho, torch.Tensor) else self.last_rho
        return (self.ema.clone(), self.energy, self.radius, last_rho, self.last_sam,
                _snapshot(self.schedule_state), self.next_sam, self.ascent_started, ascent)  # fmt: skip

    def roll_back(self):
        """Back to :attr:`undo`, the checkpoint of the cancelled step; returns its ``ascent``."""
        (ema, self.energy, self.radius, last_rho, self.last_sam, self.schedule_state, self.next_sam,
         self.ascent_started, ascent) = self.undo  # fmt: skip
        if isinstance(self.last_rho, torch.Tensor):  # the device's tensor stays the one a captured step reads
            self.last_rho.copy_(last_rho)
        else:
            self.last_rho = last_rho
        self.ema.copy_(ema)
        self.undo = None
        return ascent


def _check_base_optimizer(base_optimizer) -> None:
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


def _params_and_model(params, model: nn.Module | None) -> tuple:
    """``(params, model)`` with an ``nn.Module`` passed as ``params`` taken as the model too."""
    if isinstance(params, nn.Module):
        if model is not None and model is not params:
            raise ValueError("params is an nn.Module and model is a different module; pass only one of them")
        return list(params.parameters()), params
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return params, model


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
        self._check_options(rho, adaptive, eta, delta, base_step, schedule, capturable, ascent, descent)
        _check_base_optimizer(base_optimizer)
        params, model = _params_and_model(params, model)
        # Checked before torch reads the groups: it only warns of a parameter listed twice in one group (two flat slots
        # for one tensor would corrupt both) and names none listed in two groups.
        params = _param_group_list(params)
        label = _labeller(params, model)
        _check_parameters(params, label)
        super().__init__(params, dict(rho=rho, **base_kwargs))
        self._wrap_base(base_optimizer, base_kwargs, rho)
        device = self._place(model, partition, label, backend)
        if capturable:
            self._check_capturable()
        self._flat_step, self._flat_step_why_not = self._make_flat_step()
        # how compiled code finds this optimizer again when it runs (check_second_gradient_, check_settled_)
        self._key = _register(self)
        #: capturable=True: rho, the lrs and what a skipped step restores, on the device (None otherwise)
        self._device = DeviceScalars(self.param_groups, device, len(self.blocks)) if capturable else None
        zeros = torch.zeros(len(self.blocks), dtype=torch.float64, device=device)
        self._run = _Run(
            ema=zeros.clone(), energy=zeros.clone(), radius=zeros.clone(), orthogonal_energy=zeros.clone(),
            last_rho=self._device.last_rho if capturable else float(rho),
            last_base_step=FUSED if self._flat_step is not None else PER_TENSOR,
            schedule_state=self.schedule.initial_state(device) if self.schedule is not None else {},
        )  # fmt: skip

    def _check_options(self, rho, adaptive, eta, delta, base_step, schedule, capturable, ascent, descent) -> None:
        """Check the step's options, each by name, and keep them."""
        check_real("rho", rho, low=0.0)
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {capturable!r}")
        self.capturable = capturable
        self.schedule = check_schedule(schedule)
        if self.schedule is not None and self.schedule.corrects and adaptive:
            raise ValueError(
                f"schedule {self.schedule!r} is LookSAM, whose direction is defined for plain gradients; it is not "
                "defined for ASAM (adaptive=True)"
            )
        self.ascent, self.descent = check_ascent(ascent), check_descent(descent)
        _check_family(self.ascent, self.descent, self.schedule, capturable)
        if base_step not in BASE_STEPS:
            raise ValueError(f"base_step must be one of {BASE_STEPS}, got {base_step!r}")
        self.base_step = base_step
        self.eta = check_real("eta", eta, low=0.0)
        self.delta = check_real("delta", delta, low=0.0, low_inclusive=False)
        if not isinstance(adaptive, bool):
            raise TypeError(f"adaptive must be a bool, got {adaptive!r}")
        self.adaptive = adaptive

    def _wrap_base(self, base_optimizer, base_kwargs: dict, rho: float) -> None:
        """Build the base optimizer over this optimizer's param groups and share its groups, state and defaults."""
        self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        self.param_groups = self.base_optimizer.param_groups
        if self.descent is not None:
            self.descent.check_groups(self.param_groups, type(self.base_optimizer).__name__)
        self.state = self.base_optimizer.state
        # LR schedulers read defaults (OneCycleLR and CyclicLR look for momentum or betas there): the base's, plus rho
        self.defaults = {**self.base_optimizer.defaults, "rho": rho}

    def _place(self, model: nn.Module | None, partition, label, backend: str) -> torch.device:
        """Partition the parameters into blocks and build the backend over them; returns the device that receives the
        energies and radii (the first block's)."""
        optimized = [p for group in self.param_groups for p in group["params"]]
        self.blocks: list[Block] = self._blocks(model, partition, optimized, label)
        if self.rule == GEAR_RULE and len(self.blocks) == 1 and isinstance(partition, str) and partition != "global":
            warnings.warn(
                f"partition {partition!r} gives a single block ({self.blocks[0].name!r}), so GEAR-SAM's allocation is "
                "plain SAM's here; pass partition= a finer strategy, a mapping or a callable (`gearsam partition` "
                "shows the blocks)",
                UserWarning,
                stacklevel=4,
            )
        in_blocks = {id(p) for b in self.blocks for p in b.params}
        # Frozen at construction, so in no block; if one is unfrozen later, the base optimizer would step it while the
        # SAM step ignores it. Checked in first_step (usually an empty list).
        self._outside_blocks = [(label(p), p) for p in optimized if id(p) not in in_blocks]
        # sharded parameters (FSDP2): energies are summed over the ranks that hold the shards
        self._shard_groups = reduction_groups((label(p), p) for p in optimized)
        self.backend_name = resolve_backend_name(
            backend, {p.device for b in self.blocks for p in b.params}, sharded=any(map(is_sharded, optimized))
        )
        param_group = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        device = next(p for b in self.blocks for p in b.params).device
        self._backend = make_backend(self.backend_name, self.blocks, device, param_group)
        return device

    def _check_capturable(self) -> None:
        """Refuse ``capturable=True`` where a step would read a value on the host or step per tensor."""
        why = ""
        if not self._backend.capturable:
            why = f"backend {self.backend_name!r} has no capturable kernels; use backend='cpp' or 'triton'"
        elif self.schedule is not None:
            why = f"schedule {self.schedule!r} decides on the host which steps take the second pass"
        elif self.base_step == PER_TENSOR or FlatBaseStep.why_not(self.base_optimizer):
            why = "the base step must be fused (torch's SGD, Adam or AdamW, base_step 'auto' or 'fused'): " + (
                FlatBaseStep.why_not(self.base_optimizer) or "base_step='per-tensor' was asked for"
            )
        elif self._shard_groups:
            why = "sharded parameters (FSDP2) sum their energies over ranks, which is not captured"
        else:
            buckets = self._backend.layout.buckets
            dtypes = {b.dtype for b in buckets} - {torch.float32, torch.float64}
            if dtypes:
                why = f"the fused base step takes float32 and float64 parameters, not {sorted(map(str, dtypes))}"
            elif len({b.device for b in buckets}) > 1:
                why = f"the parameters are on several devices ({sorted(str(b.device) for b in buckets)})"
        if why:
            raise ValueError(f"capturable=True cannot be honoured: {why}")
        self.base_step = FUSED  # a step that cannot be fused is an error, never a per-tensor step that reads the host

    def _make_flat_step(self) -> tuple[FlatBaseStep | None, str]:
        """The fused base step over the backend's buckets, or None and why not (an error if it was asked for)."""
        if self.base_step == PER_TENSOR:
            return None, "base_step='per-tensor' was asked for"
        if not self._backend.fuses_base_step:
            why_not = f"backend {self.backend_name!r} steps the base optimizer per tensor"
        else:
            why_not = FlatBaseStep.why_not(self.base_optimizer)
        if why_not and self.base_step == FUSED:
            raise ValueError(f"base_step='fused' cannot be honoured: {why_not}")
        if why_not:
            return None, why_not
        return FlatBaseStep(self.base_optimizer, self._backend.layout, capturable=self.capturable), ""

    @staticmethod
    def _blocks(model: nn.Module | None, strategy, optimized: list[torch.Tensor], label) -> list[Block]:
        """Partition, then keep only what this optimizer updates (a model may have parameters it does not own) and
        drop the blocks left empty. Trainable parameters the model does not hold (a temperature, a loss's weights)
        form a block of their own, ``"other"``, unless the strategy is a mapping, which names every parameter."""
        trainable = [p for p in optimized if p.requires_grad]
        if isinstance(strategy, Mapping) and strategy:
            strategy = _covering(strategy, trainable, label)
        in_model = {id(p) for p in model.parameters()} if model is not None else None
        foreign_to_model = []
        if in_model is not None and not isinstance(strategy, Mapping):
            foreign_to_model = [p for p in trainable if id(p) not in in_model]
            optimized = [p for p in optimized if id(p) in in_model]
        blocks = make_partition(model, strategy, params=optimized) if any(p.requires_grad for p in optimized) else []
        if model is None:  # no module names: a parameter is named by its place in the param groups, as in every message
            for block in blocks:
                block.param_names = [label(p, shape=False) for p in block.params]
                if strategy == "tensor":
                    block.name = block.param_names[0]
        owned = {id(p) for p in optimized}
        for block in blocks:
            foreign = [n for n, p in zip(block.param_names, block.params) if id(p) not in owned]
            if foreign and isinstance(strategy, Mapping):
                raise ValueError(
                    f"partition block {block.name!r} holds {foreign[0]!r}, which is not in the optimizer's params"
                )
            keep = [(n, p) for n, p in zip(block.param_names, block.params) if id(p) in owned]
            block.param_names = [n for n, _ in keep]
            block.params = [p for _, p in keep]
        blocks = [b for b in blocks if b.params]
        if foreign_to_model:
            name = "other"
            while name in {b.name for b in blocks}:
                name = "_" + name
            blocks.append(Block(name, foreign_to_model, [label(p, shape=False) for p in foreign_to_model]))
        if not blocks:
            raise ValueError("empty partition: none of the optimizer's parameters is trainable")
        return blocks

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
        if isinstance(self._run.next_sam, _Pending):
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
        _own_graph()
        sam = self._first_step(zero_grad, cancellable, found_inf)
        _own_graph()
        return sam

    def _first_step(self, zero_grad: bool, cancellable: bool, found_inf: torch.Tensor | None = None) -> bool:
        if self.perturbed:
            raise RuntimeError("first_step() called twice: call second_step() to restore the weights first")
        if self.schedule is not None and torch.compiler.is_compiling():
            raise RuntimeError(
                "a schedule decides on the host which steps take the second pass, which a step compiled with "
                "torch.compile cannot do; compile the step without a schedule, or run it eagerly"
            )
        self._refuse_family_compiled()
        rho = self._rho()
        self._check_gradients("first_step()")
        if found_inf is not None:
            if self._device is None:
                raise ValueError(
                    "found_inf skips an overflowing step on the device, which needs capturable=True (the step counts "
                    "live on the device); without it, SAMScaler reads the overflow on the host"
                )
            check_found_inf(found_inf, self._device.device)
        sam = self.sam_step
        # The EMA is updated in place by allocate, so undoing needs a copy; only cancellable steps pay for it.
        undo = None
        if cancellable and sam:
            undo = self._run.checkpoint(self._momentum_copy() if self.ascent is not None else None)
        # a skipped step has no perturbation: h = g, every descent is g, no ascent direction is taken
        keep, energy = self._family_first_step() if sam else (False, None)
        if energy is None:
            energy = self._backend.block_energy(self.adaptive, self.eta)
        energy = sum_over(self._shard_groups, energy)
        if self.schedule is not None:
            self._decide_next(energy)
        if not sam:
            self._skipped_step(energy, rho)
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

    def _check_gradients(self, caller: str) -> None:
        """Refuse a step without gradients, or with a gradient on a parameter frozen when the optimizer was built."""
        # any() stops at the first gradient it finds, so a normal step pays O(1) here.
        if not any(p.grad is not None for block in self.blocks for p in block.params):
            raise RuntimeError(f"{caller} found no gradients: call loss.backward() before {caller}")
        for name, p in self._outside_blocks:
            if p.grad is not None:
                raise RuntimeError(
                    f"parameter {name} has a gradient but was frozen when the optimizer was built, so it is in no "
                    "block and would not be perturbed; build the optimizer after changing requires_grad"
                )

    def _refuse_family_compiled(self, folds: bool = True) -> None:
        """Under torch.compile, refuse a SAM family part that writes the flat buffers with torch operations: the
        compiled step would write copies of them (only registered operators are called on the buffers themselves).
        ``folds`` (second_step): whether the fused base step takes the descent's mix; where it does not, the
        descent's :attr:`~gearsam_fused.family.Descent.unfolded_operations` run as well."""
        if not torch.compiler.is_compiling():
            return
        for part in (self.ascent, self.descent):
            if part is None:
                continue
            unfolded = () if folds or part is self.ascent else part.unfolded_operations
            operations = part.operations + unfolded
            unregistered = [op for op in operations if op not in self._backend.family_operators]
            if unregistered:
                kernels = set(operations) <= KernelBackend.family_operators
                where = (f" (the base step does not take the descent this step: {self._not_folded_reason()})"
                         if set(unregistered) & set(unfolded) else "")  # fmt: skip
                raise RuntimeError(
                    f"the SAM family's part {part!r} runs {', '.join(unregistered)} on backend {self.backend_name!r}"
                    f"{where} as torch operations, which torch.compile would apply to copies of the flat buffers; "
                    + ("use backend='cpp' or 'triton', where it is registered operators, or " if kernels else "")
                    + "run the step eagerly"
                )

    def _not_folded_reason(self) -> str:
        """Why the base update does not take the descent's mix in its own pass."""
        if not self._backend.folds_mix:
            return f"backend {self.backend_name!r} does not fold it into its kernels"
        if self._flat_step is None or self.base_step == PER_TENSOR:
            return f"base_step={self.base_step!r}"
        return self._flat_step.reason

    def _family_first_step(self) -> tuple[bool, torch.Tensor | None]:
        """The SAM family's parts of a first step (:mod:`gearsam_fused.family`): keep ``g`` for the descent, and
        replace the gradients by the ascent direction. Whether ``g`` is still to be kept (without an ascent, the
        perturbation keeps it as it reads it: one pass fewer where the backend folds the copy into it), and the
        ascent direction's energies (this rank's), None without an ascent."""
        keep = self.descent is not None
        if keep and self.ascent is not None:
            self._backend.keep_gradient_()  # before the ascent replaces g
            keep = False
        if self.ascent is None:
            return keep, None
        params = [p for block in self.blocks for p in block.params]
        started = self._run.ascent_started or (False,) * len(params)
        energy = self.ascent.apply_(self._backend, started, self.adaptive, self.eta)
        self._run.ascent_started = tuple(s or p.grad is not None for s, p in zip(started, params, strict=True))
        return keep, energy

    def _decide_next(self, energy: torch.Tensor) -> None:
        """Let the schedule decide the next step from this one's energies; a device decision is copied to the host
        without waiting (read when :attr:`sam_step` is next asked)."""
        decision = self.schedule.decide_next(self._run.steps_done, energy.sum(), self._run.schedule_state)
        self._run.next_sam = _Pending(decision) if isinstance(decision, torch.Tensor) else bool(decision)

    def _skipped_step(self, energy: torch.Tensor, rho: float) -> None:
        """A step without the second pass: GEAR-SAM's EMA still takes the energies, then the base optimizer steps
        with the first gradient (plus LookSAM's correction) over the flat buffers or by its own ``step()``."""
        if self.rule == GEAR_RULE:
            self._backend.allocate(self.rule, energy, self._run.ema, rho, self.beta, self.delta)
        correction = self._correction_scale(energy) if self.schedule.corrects else None
        updates = self._plan()
        if updates is None and self.base_step == FUSED:
            raise RuntimeError(f"base_step='fused' cannot be honoured this step: {self._flat_step.reason}")
        if updates is None:
            if correction is not None:
                self._backend.add_correction_(correction)
            self._per_tensor_base_step()
        else:
            self._fused_base_step(updates, correction, perturbed=False)
        self._run.last_base_step = PER_TENSOR if updates is None else FUSED
        self._run.record(energy, torch.zeros_like(energy), rho, sam=False)
        self._run.undo = None
        self._run.steps_done += 1
        self._mark_stepped(base=False)  # tells torch LR schedulers that an optimizer step happened

    def _correction_scale(self, energy: torch.Tensor) -> torch.Tensor:
        """LookSAM's ``alpha * ||g|| / ||g_v||`` per block: over all blocks for SAM, per block for GEAR-SAM (0 where
        ``g_v = 0``)."""
        orthogonal = self._run.orthogonal_energy
        if self.rule != GEAR_RULE:
            energy, orthogonal = energy.sum().expand_as(energy), orthogonal.sum().expand_as(orthogonal)
        positive = orthogonal > 0
        ratio = energy.sqrt() / torch.where(positive, orthogonal, 1.0).sqrt()
        return torch.where(positive, self.schedule.alpha * ratio, 0.0)

    def _orthogonalize(self) -> None:
        """LookSAM on a SAM step: ``g_v = g_s - (<g, g_s> / ||g||^2) g`` over all blocks (SAM) or per block (GEAR-SAM),
        with g the first gradient the backend kept and g_s the current one."""
        dot = sum_over(self._shard_groups, self._backend.block_dot())
        energy = self._run.energy
        if self.rule != GEAR_RULE:
            dot, energy = dot.sum().expand_as(dot), energy.sum().expand_as(energy)
        positive = energy > 0
        coefficient = torch.where(positive, dot / torch.where(positive, energy, 1.0), 0.0)
        self._run.orthogonal_energy = sum_over(self._shard_groups, self._backend.orthogonalize_(coefficient))

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False, *, found_inf: torch.Tensor | None = None) -> None:
        """Restore ``w`` exactly and step the base optimizer with the gradient taken at ``w + eps``: in one pass over
        the flat buffers where the base step is fused (see :attr:`base_step_mode`), else by its own ``step()``.

        ``found_inf`` (``capturable=True`` only), as for :meth:`first_step`, of the second pass: where it or the first
        pass's is set, the kernels restore ``w`` and leave the base optimizer's state, its step counts and the GEAR
        EMA as they were before the step, with no synchronisation."""
        _own_graph()
        self._second_step(zero_grad, found_inf)
        _own_graph()

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
        if found_inf is not None and self._device is None:
            raise ValueError("found_inf skips an overflowing step on the device, which needs capturable=True")
        if self._device is not None:
            if found_inf is not None:
                check_found_inf(found_inf, self._device.device)
            skip = self._device.skip_flag(self._run.found_inf, found_inf)
            self._run.found_inf = None
        self._check_second_gradient()
        self._run.cleared = None
        updates = self._plan()
        if updates is None and self.base_step == FUSED:
            self._backend.restore_()  # w, not w + eps, stays in the model
            raise RuntimeError(f"base_step='fused' cannot be honoured this step: {self._flat_step.reason}")
        folds = updates is not None and self._backend.folds_mix  # the fused step takes the descent's mix itself
        self._refuse_family_compiled(folds)
        if self.schedule is not None and self.schedule.corrects:
            self._orthogonalize()
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
            self._per_tensor_base_step()
        else:
            self._fused_base_step(updates, found_inf=skip, mix=mix)
        if self.descent is not None:
            self.descent.after_update(self._backend, self.param_groups, folds=folds)
        if skip is not None:
            self._device.keep_ema(self._run.ema, skip)
        self._run.last_base_step = PER_TENSOR if updates is None else FUSED
        self._run.undo = None
        self._run.steps_done += 1
        self._mark_stepped(base=False)  # tells torch LR schedulers that an optimizer step happened
        if zero_grad:
            self.zero_grad()

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        """A ``[B]`` vector summed over the ranks that hold shards of a block (itself without sharding)."""
        return sum_over(self._shard_groups, values)

    def _per_tensor_base_step(self) -> None:
        """The base optimizer's own ``step()``. Inside a compiled step over re-homed parameters it runs eagerly (a
        graph break, like those torch's ``step()`` makes around itself): the compiler refuses a step that writes
        parameters sharing one buffer ("non-differentiable view input mutations")."""
        if self._backend.fuses_base_step and torch.compiler.is_compiling():
            _eager_step(self.base_optimizer)
        else:
            self.base_optimizer.step()

    def _fused_base_step(self, updates: list, correction: torch.Tensor | None = None, perturbed: bool = True,
                         found_inf: torch.Tensor | None = None, mix: Mix | None = None,
                         momentum_energy: bool = False) -> torch.Tensor | None:  # fmt: skip
        """Restore and update (``perturbed``), or update the current weights, over the flat buffers, between the base
        optimizer's step hooks as its ``step()`` would run them (a pre-hook may hand the step a closure, which runs
        first, as in torch's step). Where ``found_inf`` is set, the update restores ``w`` and nothing else; ``mix``:
        the SAM family's descent gradient; ``momentum_energy``: returns the new momentum's block energies
        (:meth:`~gearsam_fused.backends.base.Backend.restore_and_update_`)."""
        try:
            args, kwargs = run_pre_hooks(self.base_optimizer)
            closure = step_closure(self.base_optimizer, args, kwargs)
            if closure is not None:
                with torch.enable_grad():
                    closure()
                updates = self._plan()  # the closure may have changed the gradients
                if updates is None:
                    raise RuntimeError(
                        f"the base step cannot run after a step pre-hook's closure: {self._flat_step.reason}"
                    )
        except BaseException:
            self._backend.restore_()  # w, not w + eps, stays in the model, as when torch's own step() fails
            raise
        self._flat_step.stage(updates)
        if perturbed:
            energy = self._backend.restore_and_update_(updates, found_inf, mix, momentum_energy)
        else:
            energy = self._backend.update_(updates, correction, momentum_energy)
        self._flat_step.finish(updates, found_inf)
        self._mark_stepped(base=True)  # as the base optimizer's step() would have: a scheduler may be attached to it
        run_post_hooks(self.base_optimizer, args, kwargs)
        return energy

    def _plan(self) -> list | None:
        """The fused base step's plan of this step (None: the base optimizer's own step). The buckets that a step
        compiled whole planned from themselves alone (settled) are checked each time the compiled code runs
        (:func:`check_settled_`)."""
        if self._flat_step is None:
            return None
        updates = self._flat_step.plan()
        settled = [update.bucket.grad for update in updates or () if update.settled]
        if settled:
            torch.ops.gearsam_fused.check_settled_(settled, self._key)
        return updates

    def _grad_marks(self) -> list[tuple[torch.Tensor, int]]:
        """(gradient, version) of every gradient that exists: ``backward`` makes a new tensor where there was none and
        bumps the version of one it accumulates into (a flat buffer's views share one counter)."""
        return [(p.grad, p.grad._version) for block in self.blocks for p in block.params if p.grad is not None]

    def _check_second_gradient(self) -> None:
        """Refuse a second_step with no gradient computed at ``w + eps`` (after putting ``w`` back). Under
        ``torch.compile``, gradients cleared in place are compared when the compiled code runs
        (:func:`check_second_gradient_`): their version counters are not traceable."""
        if self._run.cleared and torch.compiler.is_compiling():
            if not self._backend.fuses_base_step:
                raise RuntimeError(
                    f"backend {self.backend_name!r} keeps no flat gradient buffers: after zero_grad(set_to_none=False) "
                    "its compiled second_step cannot tell whether a backward ran; use zero_grad() (set_to_none=True)"
                )
            grads = [bucket.grad for bucket in self._backend.layout.buckets]
            torch.ops.gearsam_fused.check_second_gradient_(grads, self._key)
        elif self._no_second_gradient():
            self._refuse_without_second_gradient()

    def _mark_stepped(self, base: bool) -> None:
        """Tell torch's LR schedulers that this optimizer (``base``: its base optimizer) stepped. Compiled code marks
        it when it is traced, at its first call (:func:`_mark_stepped_when_traced`): the mark is never cleared, so
        once is all it takes, and a compiled setattr on an optimizer is what dynamo could not trace in torch 2.11
        ("Attempted setattr on a user-defined object that does not have an AttributeMutation mutation_type")."""
        if torch.compiler.is_compiling():
            _mark_stepped_when_traced(self, base)
        else:
            mark_stepped(self.base_optimizer if base else self)

    def _refuse_without_second_gradient(self):
        kept = self._abandon_step()
        raise RuntimeError(
            "second_step() found no gradient computed at w + eps: after first_step(), run the second forward and "
            f"backward before second_step(); the weights were restored to w and no step was taken{kept}"
        )

    def _no_second_gradient(self) -> bool:
        """Whether no gradient exists, or none changed since :meth:`zero_grad` cleared them after ``first_step``. O(1)
        after ``zero_grad(set_to_none=True)``, the usual case: the first gradient found ends the search."""
        params = (p for block in self.blocks for p in block.params)
        if not self._run.cleared:
            return all(p.grad is None for p in params)
        current = self._grad_marks()
        return len(current) == len(self._run.cleared) and all(
            g is h and v == w for (g, v), (h, w) in zip(current, self._run.cleared)
        )

    def _abandon_step(self) -> str:
        """Put ``w`` back, and the allocation state too where the step kept it; says what was not undone."""
        self._run.cleared = None
        if self._run.undo is not None:
            self.cancel_step()
            return ""
        self._backend.restore_()
        if self.rule != GEAR_RULE:
            return ""
        return " (GEAR-SAM's EMA keeps this step's energies: first_step(cancellable=True) would undo them too)"

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
        momentum = self._run.roll_back()
        if momentum is not None:  # F-SAM's EMA as it was before the step
            for t, saved in zip(self._backend.buffer_tensors(MOMENTUM), momentum, strict=True):
                t.copy_(saved)

    def _momentum_copy(self) -> list[torch.Tensor]:
        """A copy of F-SAM's EMA, which a cancellable step keeps until it completes (one parameter-sized buffer)."""
        return [t.clone() for t in self._backend.buffer_tensors(MOMENTUM)]

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
        if self.state:
            return
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self.perturbed or any(p.grad is not None for p in params):
            raise RuntimeError("init_state() belongs to a fresh optimizer, before any backward pass")
        lrs = [group["lr"] for group in self.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for group in self.param_groups:
                group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            self.base_optimizer.step()
        finally:
            for group, lr in zip(self.param_groups, lrs):
                group["lr"] = lr
            self.zero_grad(set_to_none=True)

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
            self._run.cleared = self._grad_marks()

    def memory_overhead(self) -> dict[str, int]:
        """Bytes the backend holds beyond the parameters and their gradients: ``backup`` (the saved weights),
        ``padding`` (alignment in the flat buffers), ``tables`` (O(blocks + tiles) indices and partial sums) and
        ``total``. ``grad_buffer`` is the fused backends' flat gradient buffer: the gradients' own memory while they
        are its views (``zero_grad(set_to_none=False)``), held in addition to them after ``zero_grad()`` with
        ``set_to_none=True`` frees the views, since the next ``backward`` allocates fresh gradients; it is not in
        ``total``."""
        return self._backend.memory_overhead()

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
        rho = float(rho)
        share = radius.square() / rho**2 if rho > 0 else torch.zeros_like(radius)
        non_finite = energy.isfinite().logical_not().sum()
        return {
            "energy": energy,
            "score": self._score(energy, ema),
            "radius": radius,
            "share": share,
            "non_finite": non_finite,
        }

    @staticmethod
    def _score(energy: torch.Tensor, ema: torch.Tensor) -> torch.Tensor:
        return ema

    def state_dict(self) -> dict:
        """The base optimizer's state dict (torch's per-parameter format), with this optimizer's own state (the rule,
        blocks, GEAR EMA, last energies and radii) under ``"gearsam"`` in the first param group: tools that keep only
        ``"state"`` and ``"param_groups"`` (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``)
        keep it too, and a plain torch optimizer that loads the dict ignores it."""
        self._refuse_mid_step("state_dict()")
        state = self.base_optimizer.state_dict()
        state["param_groups"][0][_STATE_KEY] = {
            "rule": self.rule,
            "block_names": self.block_names,
            "ema": self._run.ema.detach().cpu().clone(),
            "energy": self._run.energy.detach().cpu().clone(),
            "radius": self._run.radius.detach().cpu().clone(),
            "last_rho": float(self._run.last_rho),
            "shapes": [[tuple(p.shape) for p in b.params] for b in self.blocks],
        }
        if self.schedule is not None:
            state["param_groups"][0][_STATE_KEY]["schedule"] = self._schedule_entry()
        state["param_groups"][0][_STATE_KEY].update(self._family_entry())
        if self.one_pass:
            state["param_groups"][0][_STATE_KEY]["one_pass"] = True
        return state

    def _refuse_mid_step(self, caller: str) -> None:
        if self.perturbed:
            raise RuntimeError(f"{caller} between first_step() and second_step(): the weights hold w + eps")

    def _family_entry(self) -> dict:
        """The SAM family's parts in a state dict: their reprs, and F-SAM's EMA once it holds a gradient."""
        entry = {"ascent": repr(self.ascent), "descent": repr(self.descent)}
        if self.ascent is not None and any(self._run.ascent_started):
            entry["momentum"] = [t.detach().cpu().clone() for t in self._backend.buffer_tensors(MOMENTUM)]
            entry["ascent_started"] = list(self._run.ascent_started)
        return entry

    def _load_family(self, ours: dict) -> None:
        """Resume the SAM family's parts; a state saved with other parts is refused."""
        for part in ("ascent", "descent"):
            saved, mine = ours.get(part, "None"), repr(getattr(self, part))
            if saved != mine:
                raise ValueError(f"state dict was saved with {part}={saved}, this optimizer has {part}={mine}")
        n_params = sum(len(block.params) for block in self.blocks)
        # a state saved before the EMA started per parameter: every EMA had started together
        started = ours.get("ascent_started", [True] * n_params if "momentum" in ours else [])
        self._run.ascent_started = tuple(bool(s) for s in started)
        if started:
            for t, saved in zip(self._backend.buffer_tensors(MOMENTUM), ours["momentum"], strict=True):
                t.copy_(saved)

    def _schedule_entry(self) -> dict:
        entry = {
            "schedule": repr(self.schedule),
            "steps_done": self._run.steps_done,
            "next_sam": self.sam_step,
            "state": self.schedule.state_dict(self._run.schedule_state),
        }
        if self.schedule.corrects:
            entry["orthogonal_energy"] = self._run.orthogonal_energy.detach().cpu().clone()
            entry["correction"] = [t.detach().cpu().clone() for t in self._backend.buffer_tensors(CORRECTION)]
        return entry

    def _load_schedule(self, entry: dict | None) -> None:
        """Resume the schedule from a state-dict entry, or start it afresh when the state was saved without one (a
        run that switches to a schedule); a different schedule than the one saved is refused."""
        if self.schedule is None:
            return
        if entry is None:
            self._run.steps_done, self._run.next_sam = 0, True
            self._run.schedule_state = self.schedule.initial_state(self._run.ema.device)
            if self.schedule.corrects:
                self._run.orthogonal_energy.zero_()
                for t in self._backend.buffer_tensors(CORRECTION):
                    t.zero_()
            return
        if entry["schedule"] != repr(self.schedule):
            raise ValueError(
                f"state dict was saved with schedule {entry['schedule']}, this optimizer has {self.schedule!r}; build "
                "it with the same schedule to resume"
            )
        self._run.steps_done, self._run.next_sam = int(entry["steps_done"]), bool(entry["next_sam"])
        self._run.schedule_state = self.schedule.initial_state(self._run.ema.device)
        self.schedule.load_state_dict(self._run.schedule_state, entry["state"], self._run.ema.device)
        if self.schedule.corrects:
            self._run.orthogonal_energy.copy_(entry["orthogonal_energy"])
            for t, saved in zip(self._backend.buffer_tensors(CORRECTION), entry["correction"], strict=True):
                t.copy_(saved)

    def load_state_dict(self, state_dict: dict) -> None:
        self._refuse_mid_step("load_state_dict()")
        state_dict, ours = _split_state(state_dict)
        if ours is None:
            self._load_plain_state_dict(state_dict)
            return
        rule = ours["rule"]
        if bool(ours.get("one_pass", False)) != self.one_pass:
            saver = (
                "a one-pass MomentumSAM"
                if ours.get("one_pass")
                else "a two-pass optimizer (SAM's first_step/second_step)"
            )
            raise ValueError(f"state dict was saved by {saver}, cannot load it into {type(self).__name__}")
        if rule != self.rule:
            saver = {r: cls.__name__ for r, cls in OPTIMIZERS.items()}.get(rule, repr(rule))
            raise ValueError(f"state dict was saved by {saver}, cannot load it into {type(self).__name__}")
        if list(ours["block_names"]) != self.block_names:
            raise ValueError(
                f"state dict blocks {list(ours['block_names'])} differ from this optimizer's blocks {self.block_names}"
            )
        for block, shapes in zip(self.blocks, ours["shapes"]):
            if len(shapes) != len(block.params):
                raise ValueError(
                    f"block {block.name!r} has {len(block.params)} parameters; the state was saved for {len(shapes)}"
                )
            for i, (name, p, shape) in enumerate(zip(block.param_names, block.params, shapes)):
                if tuple(p.shape) != tuple(shape):
                    raise ValueError(
                        f"block {block.name!r} parameter {i} ({name!r}) has shape {tuple(p.shape)}; the state was "
                        f"saved for {tuple(shape)}"
                    )
        self._load_base(state_dict)
        for name in ("ema", "energy", "radius"):
            getattr(self._run, name).copy_(ours[name])
        self._set_last_rho(float(ours["last_rho"]))
        self._load_schedule(ours.get("schedule"))
        self._load_family(ours)
        self._run.undo = None

    def _load_base(self, state_dict: dict, rhos: list | None = None) -> None:
        """Load the base optimizer's part; groups the dict gives no rho keep ``rhos``. Capturable, the loaded rho and
        lrs are copied into the device tensors a captured graph reads."""
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        for group, rho in zip(self.param_groups, rhos or ()):
            group.setdefault("rho", rho)
        if self._device is not None:
            self._device.place(self.param_groups)
        if self._flat_step is not None:
            self._flat_step.adopt()

    def _set_last_rho(self, rho: float) -> None:
        if isinstance(self._run.last_rho, torch.Tensor):
            self._run.last_rho.fill_(rho)
        else:
            self._run.last_rho = rho

    def _load_plain_state_dict(self, state_dict: dict) -> None:
        """Take over the state of a plain torch optimizer (a run switched to SAM from its checkpoint): the base
        optimizer's state and hyperparameters load as into the base optimizer itself; every group keeps its current
        ``rho``, and the allocation state (GEAR-SAM's EMA, the last energies and radii) starts at zero, as at
        construction."""
        expected = self.base_optimizer.defaults.keys() - _OPTIONAL_GROUP_KEYS
        for g, group in enumerate(state_dict.get("param_groups", [])):
            missing = sorted(expected - group.keys())
            if missing:
                raise ValueError(
                    f"state dict param group {g} lacks {missing}: it was not saved by "
                    f"{type(self.base_optimizer).__name__}, the base optimizer of this {type(self).__name__}"
                )
        rhos = [group["rho"] for group in self.param_groups]
        self._load_base(state_dict, rhos)
        for tensor in (self._run.ema, self._run.energy, self._run.radius):
            tensor.zero_()
        self._set_last_rho(float(rhos[0]))
        self._load_schedule(None)
        self._run.undo = None
        if self.rule == GEAR_RULE:
            warnings.warn(
                f"loaded a state dict without a {_STATE_KEY!r} entry (saved by a plain "
                f"{type(self.base_optimizer).__name__}?): the base optimizer's state is taken over, and GEAR-SAM's EMA "
                "of block energies starts at zero, as in a new optimizer",
                UserWarning,
                stacklevel=3,
            )


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


@torch.compiler.disable
def _eager_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _own_graph() -> None:
    """Inside a larger compiled function (a whole training step), end the graph here, so that the step's writes to
    the flat buffers and the model's reads of the parameters, views of them, are never in one graph: AOT autograd
    refuses graphs that write an input sharing memory with other inputs. A no-op in eager code and under
    ``fullgraph=True``, where the step is all there is to compile."""
    if torch.compiler.is_compiling() and graph_may_break():
        graph_break()


_OPTIMIZERS: weakref.WeakValueDictionary[int, SharpnessAware] = weakref.WeakValueDictionary()


def _register(optimizer: SharpnessAware) -> int:
    """A key under which compiled code finds ``optimizer`` when it runs (its id, held weakly)."""
    _OPTIMIZERS[id(optimizer)] = optimizer
    return id(optimizer)


@torch.compiler.assume_constant_result
def _mark_stepped_when_traced(optimizer: SharpnessAware, base: bool) -> bool:
    """:meth:`SharpnessAware._mark_stepped` for compiled code: run for real while dynamo traces the step, not by the
    compiled code, which so never sets an attribute of an optimizer (``base``: the base optimizer of ``optimizer``).
    It takes the optimizer, not its key: dynamo makes an integer dynamic once it has compiled the same code for two
    values of it (two optimizers' keys), and a dynamic integer is no constant to run this with."""
    mark_stepped(optimizer.base_optimizer if base else optimizer)
    return True


# Declared as writing the gradient buffers, though it only reads them: so that it stays in the graph, before the
# sync that copies new gradients in.
@host_op("check_second_gradient_", "int optimizer")
def check_second_gradient_(grads: list[torch.Tensor], optimizer: int) -> None:
    """:meth:`SharpnessAware.second_step`'s check that a backward ran after ``first_step`` and an in-place
    ``zero_grad``, made when compiled code runs; ``grads`` are the optimizer's flat gradient buffers."""
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError("the optimizer this compiled step belongs to no longer exists")
    if opt._no_second_gradient():
        opt._refuse_without_second_gradient()


# Declared as writing the gradient buffers, though it only reads them, for the same reason: before the update.
@host_op("check_settled_", "int optimizer")
def check_settled_(grads: list[torch.Tensor], optimizer: int) -> None:
    """The checks that a step compiled whole left out of its plan of the buckets whose flat gradient buffers are
    ``grads`` (:meth:`~gearsam_fused.base_step.FlatBaseStep.unsettled`), made when the compiled code runs. Where one
    fails, the step is abandoned with an error and the next call compiles the step again."""
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError("the optimizer this compiled step belongs to no longer exists")
    addresses = {g.data_ptr() for g in grads}
    for bucket in opt._flat_step.layout.buckets:
        reason = opt._flat_step.unsettled(bucket, synced=True) if bucket.grad.data_ptr() in addresses else ""
        if reason:
            opt._flat_step.invalidate()
            kept = opt._abandon_step()
            raise RuntimeError(
                f"second_step, compiled with fullgraph=True when every parameter had a gradient and the optimizer "
                f"state the last step left, found that {reason}: the weights were restored to w and no step was "
                f"taken{kept}. Its next call compiles it again for what it finds; a parameter without a gradient "
                "then needs the base optimizer's own step, which fullgraph=True refuses"
            )


class _Pending:
    """A schedule's decision still on the device: copied to pinned host memory without waiting, read on demand."""

    def __init__(self, decision: torch.Tensor):
        if decision.device.type == "cuda":
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(decision, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = decision, None

    def value(self) -> bool:
        if self._ready is not None:
            self._ready.synchronize()  # waits for the step that decided, not for any later work
        return bool(self._host)


def _snapshot(state: dict) -> dict:
    """A copy of a schedule's state that later steps cannot change."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _split_state(state_dict: dict) -> tuple[dict, dict | None]:
    """(the base optimizer's part of ``state_dict``, this library's entry or None), without changing the caller's
    dict; the entry is in the first param group."""
    state_dict = dict(state_dict)
    groups = [dict(group) for group in state_dict.get("param_groups", [])]
    ours = groups[0].pop(_STATE_KEY) if groups and _STATE_KEY in groups[0] else None
    state_dict["param_groups"] = groups
    return state_dict, ours


def _covering(mapping: Mapping, trainable: list[torch.Tensor], label) -> dict:
    """``mapping`` with its parameter lists materialised, after checking that it places every trainable parameter
    (the error names the first one it misses)."""
    mapping = {k: v if isinstance(v, torch.Tensor) else list(v) for k, v in mapping.items()}
    mapped = {id(p) for v in mapping.values() if not isinstance(v, torch.Tensor) for p in v}
    missing = [p for p in trainable if id(p) not in mapped]
    if missing:
        raise ValueError(
            f"parameter {label(missing[0])} is optimized but in no block of the partition mapping; add it to a block, "
            "or leave it out of the optimizer"
        )
    return mapping


def _is_zero(factory) -> bool:
    """Whether ``factory`` builds a ``ZeroRedundancyOptimizer`` (the class, a subclass, or a partial of either)."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch built without distributed support
        return False
    factory = getattr(factory, "func", factory)  # functools.partial
    return isinstance(factory, type) and issubclass(factory, ZeroRedundancyOptimizer)


def _param_group_list(params) -> list[dict]:
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


def _check_parameters(param_groups: list[dict], label) -> None:
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


def _labeller(param_groups: list[dict], model: nn.Module | None) -> Callable[..., str]:
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


#: The options :class:`SAM` and :class:`GEARSAM` take and hand to :class:`SharpnessAware` as they are (their
#: signatures differ in order and defaults only).
_FORWARDED = (
    "rho", "adaptive", "eta", "delta", "backend", "model", "partition", "base_step", "schedule", "capturable", "ascent",
    "descent",
)  # fmt: skip


def _forwarded(arguments: dict) -> dict:
    """The :data:`_FORWARDED` options out of a constructor's ``locals()``."""
    return {name: arguments[name] for name in _FORWARDED}


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
        super().__init__(params, base_optimizer, base_kwargs=base_kwargs, **_forwarded(locals()))

    @staticmethod
    def _score(energy: torch.Tensor, ema: torch.Tensor) -> torch.Tensor:
        # SAM's implicit allocation score is the instantaneous block gradient norm (paper Eq. sam_block_radius).
        return energy.sqrt()


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
        super().__init__(params, base_optimizer, base_kwargs=base_kwargs, **_forwarded(locals()))


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

"""One-pass momentum SAM: the SAM step taken with one gradient, at a look-ahead point along the base optimizer's
momentum (Becker, Altrock and Ecker, "Momentum-SAM: Sharpness Aware Minimization without Computational Overhead").

Between steps the parameters hold the look-ahead point ``w~ = w - r * v / ||v||`` and the backend's saved copy holds
``w``; ``v`` is SGD's momentum buffer or Adam's first moment, the direction in which the base optimizer moves ``w``.
The caller takes the one gradient of the step there, ``g = grad L(w~)``, and :meth:`MomentumSAM.step`:

1. puts ``w`` back from the saved copy (bit for bit: never ``w~`` plus a recomputed perturbation) and makes the base
   optimizer's update with ``g``, in one pass where the base step is fused (``restore_and_update_``);
2. takes the block energies of the new momentum, ``e_b = sum_{p in b} ||v_p||^2`` (ASAM's ``||T_p v_p||^2`` with
   ``adaptive``), and allocates the radius by the optimizer's rule: SAM's global ``rho`` or GEAR-SAM's per-block
   radii from the EMA of these energies (:mod:`gearsam_fused.allocation`). The kernel backends sum the plain energies
   tile by tile in the update's pass, as it writes the momentum; ASAM's, which read the new ``w``, take a pass of
   their own;
3. moves to the new look-ahead point, ``p <- w - scale_b * T_p**2 * v_p`` (``perturb_along_`` with the negated scale).

In the design's terms the ascent direction is ``-v``, the allocation is SAM's or GEAR-SAM's, and the descent gradient is
the one gradient ``g``. Choices, and why:

- GEAR-SAM's EMA takes the energies of the momentum, not of the gradient: the momentum is the direction the radius is
  spent along, so its energies give ``||eps_b|| = r_b`` as in the two-pass step; it is itself an average of the
  gradients, which the EMA would otherwise smooth a second time; and it costs no read of the gradients beyond the
  base update's.
- Weight decay is taken at ``w``, as the base optimizer takes it and as :class:`~gearsam_fused.SAM` does: the update
  reads ``w`` from the saved copy, so decay (SGD's and Adam's ``weight_decay * w``, AdamW's ``w * (1 - lr * wd)``) never
  sees the look-ahead offset, and ``rho`` changes nothing but the point the gradient is taken at.
- The first step has no momentum yet, so its gradient is taken at ``w``; a block whose momentum is zero stays at ``w``.
- A radius changed between steps (a scheduler on ``rho``) leaves nothing behind: the restore puts back the saved ``w``,
  whatever radius the look-ahead used.

:meth:`MomentumSAM.eval` puts ``w`` in the parameters and :meth:`MomentumSAM.train` the look-ahead back, as
schedule-free optimizers do: evaluate and save the model in eval mode.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import gradients
from .allocation import GEAR_RULE, RULES, SAM_RULE, check_rule
from .arguments import check_base_optimizer
from .backends.base import Direction
from .base_step import FUSED, PER_TENSOR
from .checks import check_real
from .compiled import mark_stepped_now, own_graph, step_per_tensor
from .optim import SharpnessAware
from .sharding import sum_over
from .state_dicts import STATE_KEY, split_state

#: The base optimizers MomentumSAM perturbs along, and the state that holds their momentum.
MOMENTUM_STATE: dict[type, str] = {torch.optim.SGD: "momentum_buffer", torch.optim.Adam: "exp_avg",
                                   torch.optim.AdamW: "exp_avg"}  # fmt: skip
#: ``allocation=`` names: SAM's global radius, GEAR-SAM's per-block radii (the rules' own names are taken too).
_NAMES = {"sam": SAM_RULE, "gear": GEAR_RULE}
ALLOCATIONS = {**_NAMES, **{rule: rule for rule in RULES}}


class MomentumSAM(SharpnessAware):
    """One-pass momentum SAM over torch's SGD (``momentum > 0``), Adam or AdamW, with torch's one-call protocol::

        opt = MomentumSAM(model, torch.optim.SGD, rho=1.0, lr=0.05, momentum=0.9)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    See the module's documentation for the step. ``opt.eval()`` before evaluating or saving the model, ``opt.train()``
    before training again.

    Args:
        params: parameters, param-group dicts, or an ``nn.Module``.
        base_optimizer: ``torch.optim.SGD``, ``torch.optim.Adam`` or ``torch.optim.AdamW`` (or a subclass).
        rho: the look-ahead radius (in ``param_groups``, so it can be scheduled; all groups share it). Its scale is not
            SAM's: the look-ahead moves along the momentum, not the gradient (the efficiency study compares values).
        allocation: ``"sam"`` (one global radius) or ``"gear"`` (GEAR-SAM's per-block radii, EMA factor ``beta``).
        adaptive, eta: ASAM's element-wise scaling ``T = |w| + eta`` of the direction, at ``w``.
        model, partition, delta, backend, base_step, capturable: as :class:`~gearsam_fused.GEARSAM`'s (``partition``
            defaults to ``"coarse"`` where a model is known, else ``"global"``).
        **base_kwargs: the base optimizer's arguments (``lr``, ``momentum``, ``betas``, ``weight_decay``, ...).
    """

    one_pass = True

    def __init__(
        self,
        params,
        base_optimizer,
        *,
        rho: float,
        allocation: str = "sam",
        beta: float = 0.9,
        model: nn.Module | None = None,
        partition=None,
        delta: float = 1e-12,
        adaptive: bool = False,
        eta: float = 0.0,
        backend: str = "auto",
        base_step: str = "auto",
        capturable: bool = False,
        **base_kwargs,
    ):
        given = sorted(_TWO_PASS_OPTIONS & base_kwargs.keys())
        if given:  # else the base optimizer would refuse them as keywords of its own
            raise TypeError(
                f"MomentumSAM takes no {', '.join(given)}: a step schedule skips second passes and the SAM family's "
                "parts choose the second pass's ascent and descent, while MomentumSAM takes one pass, along the momentum"
            )
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {sorted(ALLOCATIONS)}, got {allocation!r}")
        self.rule = check_rule(ALLOCATIONS[allocation])
        self.beta = check_real("beta", beta, low=0.0, high=1.0) if self.rule == GEAR_RULE else 0.0
        check_base_optimizer(base_optimizer)  # an instance, ZeRO: SAM's own errors, before the momentum's
        self.momentum_key = _momentum_key(base_optimizer)
        if partition is None:
            partition = "coarse" if isinstance(params, nn.Module) or model is not None else "global"
        super().__init__(
            params, base_optimizer, rho=rho, adaptive=adaptive, eta=eta, delta=delta, backend=backend, model=model,
            partition=partition, base_step=base_step, base_kwargs=base_kwargs, capturable=capturable,
        )  # fmt: skip
        self._check_momentum()
        #: the negated scale of the look-ahead in place (float64 [B]), which train() moves to again
        self._run.lookahead = torch.zeros_like(self._run.ema)
        self._run.looking_ahead = False  # whether a look-ahead exists (after a step, not before the first)
        self._run.training = True

    def _check_momentum(self) -> None:
        """Refuse a param group whose base optimizer keeps no momentum to look ahead along."""
        for i, group in enumerate(self.param_groups):
            coefficient = group["momentum"] if self.momentum_key == "momentum_buffer" else group["betas"][0]
            if not coefficient > 0:
                name = "momentum" if self.momentum_key == "momentum_buffer" else "betas[0]"
                raise ValueError(
                    f"param group {i} has {name}={coefficient!r}: MomentumSAM looks ahead along the base optimizer's "
                    f"momentum, which needs {name} > 0"
                )

    # ------------------------------------------------------------------ the one-call step
    @torch.no_grad()
    def step(self, closure=None):
        """One step with the gradient the caller computed at the parameters (the look-ahead point): the base
        optimizer's update of ``w``, then the new look-ahead point. ``closure``, as for torch's optimizers, recomputes
        the loss and its gradients first; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        own_graph()
        self._one_pass_step()
        own_graph()
        return loss

    def _one_pass_step(self) -> None:
        if not self._run.training:
            raise RuntimeError(
                "step() in eval mode: the parameters hold w, not the look-ahead point the step expects its gradient "
                "at; call opt.train() before training (and opt.eval() before evaluating or saving)"
            )
        rho = self._rho()
        gradients.check_first(self, "step()")
        self._check_momentum()
        updates = self._plan()
        if updates is None:
            self._backend.restore_()  # the base optimizer's own step updates w (and a refusal leaves w, not w~)
            if self.base_step == FUSED:
                self._run.looking_ahead = False
                raise RuntimeError(f"base_step='fused' cannot be honoured this step: {self._flat_step.reason}")
            step_per_tensor(self)
            energy = None
        else:
            energy = self._base_update(updates)
        self._run.last_base_step = FUSED if updates is not None else PER_TENSOR
        self._look_ahead(rho, self._direction(updates), energy)
        self._run.steps_done += 1
        mark_stepped_now(self)

    def _base_update(self, updates: list) -> torch.Tensor | None:
        """The fused base update; returns the new momentum's block energies where it sums them as it writes the
        momentum (the plain energies; ASAM's read the new ``w``, and take a pass of their own)."""
        return self._flat_step.run(updates, self._backend, perturbed=self.perturbed, momentum_energy=not self.adaptive)

    def _look_ahead(self, rho, direction: Direction, energy: torch.Tensor | None) -> None:
        """Allocate by the direction's energies (``energy``, where the update summed them) and move the parameters to
        ``w - scale * T**2 * v``."""
        if energy is None:
            energy = self._backend.direction_energy(direction, self.adaptive, self.eta)
        energy = sum_over(self._shard_groups, energy)
        if self._device is not None:
            self._device.last_rho.copy_(rho)
            rho = self._device.last_rho
        scale, radius = self._backend.allocate(self.rule, energy, self._run.ema, rho, self.beta, self.delta)
        torch.neg(scale, out=self._run.lookahead)
        self._backend.perturb_along_(self._run.lookahead, direction, self.adaptive, self.eta)
        self._run.record(energy, radius, rho, sam=True)
        self._run.looking_ahead = True

    def _direction(self, updates: list | None) -> Direction:
        """The momentum: the fused step's flat state buffers where it ran, else each parameter's state tensor."""
        if updates is not None:
            return Direction([], {id(u.bucket): u.state[0] for u in updates})
        state = self.state
        return Direction([[state[p].get(self.momentum_key) if p in state else None for p in block.params]
                          for block in self.blocks])  # fmt: skip

    def first_step(self, *args, **kwargs):
        raise RuntimeError(_ONE_CALL)

    def second_step(self, *args, **kwargs):
        raise RuntimeError(_ONE_CALL)

    # ------------------------------------------------------------------ the weights a user sees
    @property
    def training(self) -> bool:
        """Whether the parameters hold the look-ahead point (train mode) rather than ``w`` (eval mode)."""
        return self._run.training

    @torch.no_grad()
    def eval(self) -> MomentumSAM:
        """Put ``w`` in the parameters (bit for bit what the last update wrote), for evaluation and checkpoints.
        Idempotent."""
        if self._run.training:
            self._backend.restore_()
            self._run.training = False
        return self

    @torch.no_grad()
    def train(self, mode: bool = True) -> MomentumSAM:
        """Put the look-ahead point back in the parameters (the bits it held before :meth:`eval`: the same
        perturbation of the same ``w``); ``train(False)`` is :meth:`eval`. Idempotent."""
        if not mode:
            return self.eval()
        if not self._run.training:
            if self._run.looking_ahead:
                direction = self._direction(None)
                self._backend.perturb_along_(self._run.lookahead, direction, self.adaptive, self.eta)
            self._run.training = True
        return self

    # ------------------------------------------------------------------ state dicts
    def _refuse_mid_step(self, caller: str) -> None:
        """Nothing: between two steps the state is whole, in either mode."""

    def state_dict(self) -> dict:
        """As :meth:`SharpnessAware.state_dict`, with the mode and the look-ahead's scale; in train mode also ``w``
        (one copy of the parameters: the model's own state dict then holds the look-ahead point), so that a resume
        in either mode is exact. Saving in eval mode keeps the checkpoint to the model's ``w`` and the state."""
        state = super().state_dict()
        entry = state["param_groups"][0][STATE_KEY]
        entry.update(training=self._run.training, looking_ahead=self._run.looking_ahead,
                     lookahead=self._run.lookahead.detach().cpu().clone())  # fmt: skip
        if self._run.training and self._run.looking_ahead:
            self.eval()
            entry["weights"] = [p.detach().clone() for block in self.blocks for p in block.params]
            self.train()
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """As :meth:`SharpnessAware.load_state_dict`, and the mode saved: in train mode the parameters are set to the
        saved look-ahead point at once (from the saved ``w``); in eval mode they are left to the model's state dict
        (``w``) and :meth:`train` moves to the look-ahead point. A plain optimizer's state dict starts without a
        look-ahead, in the current mode."""
        saved = split_state(state_dict)[1]
        if saved is not None and saved.get("one_pass") and saved["rule"] != self.rule:
            names = {rule: name for name, rule in _NAMES.items()}
            raise ValueError(
                f"state dict was saved by MomentumSAM with allocation={names.get(saved['rule'], saved['rule'])!r}, "
                f"this optimizer has allocation={names[self.rule]!r}"
            )
        if saved is not None and saved.get("training") and saved.get("looking_ahead") and "weights" not in saved:
            raise ValueError(
                "state dict was saved in train mode but holds no copy of w (torch.distributed.checkpoint loads only "
                "the entries a fresh optimizer's state dict has): save it in eval mode, after opt.eval(), to resume "
                "from the model's own weights"
            )
        super().load_state_dict(state_dict)  # first: a refused state dict leaves w and the look-ahead as they were
        self._backend.forget_()  # the loaded state replaces the weights the saved copy belongs to
        self._run.looking_ahead = False
        self._run.lookahead.zero_()
        entry = state_dict.get("param_groups", [{}])[0].get(STATE_KEY)
        if entry is None:
            return
        self._run.lookahead.copy_(entry["lookahead"])
        self._run.looking_ahead = bool(entry["looking_ahead"])
        self._run.training = bool(entry["training"])
        if self._run.training and self._run.looking_ahead:
            params = [p for block in self.blocks for p in block.params]
            for p, w in zip(params, entry["weights"], strict=True):
                p.copy_(w)
            self._backend.perturb_along_(self._run.lookahead, self._direction(None), self.adaptive, self.eta)


#: The two-pass optimizers' options that a one-pass step has no use for.
_TWO_PASS_OPTIONS = frozenset({"schedule", "ascent", "descent"})

_ONE_CALL = (
    "MomentumSAM takes one gradient per step: call loss.backward() and then step() (first_step() and second_step() "
    "belong to the two-pass optimizers, SAM and GEARSAM)"
)


def _momentum_key(base_optimizer) -> str:
    """The state name of the base optimizer's momentum, or an error naming what is supported. A
    ``functools.partial`` of a class is that class."""
    cls = base_optimizer.func if isinstance(base_optimizer, functools.partial) else base_optimizer
    if isinstance(cls, type):
        for base, key in MOMENTUM_STATE.items():
            if issubclass(cls, base):
                return key
    name = getattr(base_optimizer, "__name__", repr(base_optimizer))
    raise ValueError(
        f"MomentumSAM looks ahead along the momentum of torch.optim.SGD (momentum > 0), Adam or AdamW; got {name}"
    )

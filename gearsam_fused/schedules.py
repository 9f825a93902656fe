"""Step schedules: which steps of a :class:`~gearsam_fused.SAM` or :class:`~gearsam_fused.GEARSAM` take the second
pass.

SAM's cost is its second forward and backward. A schedule lets most steps skip it: on a *SAM step* the optimizer
perturbs and the caller runs the second pass as always; on a *skipped step* ``first_step`` makes the base
optimizer's update itself, with the first gradient ``g`` (:class:`Every`, :class:`Random`, :class:`Adaptive`) or, for
:class:`LookSAM`, with ``g`` plus the part of the last SAM gradient orthogonal to it (formulas in :class:`LookSAM`).
The first gradient is computed on every step, so its block energies are too: GEAR-SAM's EMA is updated on every step,
as under full GEAR-SAM.

The decision for a step is known before its first forward (``opt.sam_step``): :class:`Every`, :class:`LookSAM` and
:class:`Random` decide from the step count alone, :class:`Adaptive` from the statistics of the step before, so that on
CUDA deciding never waits for the step's own gradient.

A schedule object holds only its settings; the optimizer keeps the state (counts, statistics, a generator), saves it
in its state dict and resumes from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .checks import check_real

__all__ = ["Schedule", "Every", "LookSAM", "Random", "Adaptive", "check_schedule"]


class Schedule:
    """Base class of the schedules. A subclass decides per step with :meth:`decide_next`."""

    #: Whether skipped steps add the stored orthogonal part of the last SAM gradient (LookSAM).
    corrects = False
    #: Whether :meth:`decide_next` reads its ``statistic``, the first gradient's energy (Adaptive).
    reads_energy = False

    def initial_state(self, device: torch.device) -> dict:
        """The state a new optimizer starts from (saved and loaded with the optimizer's state dict)."""
        return {}

    def decide_next(self, step: int, statistic: torch.Tensor, state: dict) -> bool | torch.Tensor:
        """Whether step ``step + 1`` is a SAM step, given step ``step``'s first-gradient energy ``statistic`` (a 0-d
        float64 tensor on the optimizer's device, summed over blocks). Step 0 is always a SAM step. A 0-d bool tensor
        on the device may be returned where deciding needs a device value: the optimizer copies it to the host
        without waiting and reads it when the next step begins."""
        raise NotImplementedError

    def state_dict(self, state: dict) -> dict:
        return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def load_state_dict(self, state: dict, saved: dict, device: torch.device) -> None:
        for key, value in saved.items():
            state[key] = value.to(device) if isinstance(value, torch.Tensor) else value


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1 (a SAM step every k steps), got {k!r}")
    return k


@dataclass(frozen=True)
class Every(Schedule):
    """A SAM step on steps 0, k, 2k, ...; the base optimizer alone, with the first gradient, on the others (MosaicML
    composer's ``interval``). ``Every(1)`` is full SAM, bit for bit."""

    k: int = 2

    def __post_init__(self):
        _check_k(self.k)

    def decide_next(self, step: int, statistic: torch.Tensor, state: dict) -> bool:
        return (step + 1) % self.k == 0


@dataclass(frozen=True)
class LookSAM(Every):
    """LookSAM (Liu et al., CVPR 2022): SAM steps as in :class:`Every`; between them the SAM gradient is estimated.

    On a SAM step, with ``g`` the first gradient and ``g_s`` the gradient at ``w + eps``, the part of ``g_s``
    orthogonal to ``g`` is kept (one buffer the size of the parameters)::

        g_v = g_s - (<g, g_s> / ||g||^2) * g

    and on the skipped steps the base optimizer steps with ``g + alpha * (||g|| / ||g_v||) * g_v`` (``g`` alone when
    ``g_v = 0``). SAM takes the dot product and norms over all parameters; GEAR-SAM per block, so each block keeps
    its own direction. ``LookSAM(1, alpha)`` is full SAM, bit for bit. Not defined for ASAM (``adaptive=True``)."""

    alpha: float = 0.7
    corrects = True

    def __post_init__(self):
        super().__post_init__()
        check_real("alpha", self.alpha, low=0.0)


@dataclass(frozen=True)
class Random(Schedule):
    """A SAM step with probability ``p`` per step (step 0 always), drawn from a generator seeded with ``seed``: the
    same seed gives every rank the same steps."""

    p: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if check_real("p", self.p, low=0.0) > 1.0:
            raise ValueError(f"p must lie in [0, 1], got {self.p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")

    def initial_state(self, device):
        generator = torch.Generator().manual_seed(self.seed)
        return {"generator": generator.get_state()}

    def load_state_dict(self, state, saved, device):
        state["generator"] = saved["generator"].cpu().clone()  # a CPU generator's state, wherever the optimizer is

    def decide_next(self, step, statistic, state):
        generator = torch.Generator()
        generator.set_state(state["generator"])
        draw = torch.rand((), generator=generator, dtype=torch.float64).item()
        state["generator"] = generator.get_state()
        return draw < self.p


@dataclass(frozen=True)
class Adaptive(Schedule):
    """AE-SAM (Jiang et al., ICLR 2023): a SAM step when the squared gradient norm is high against its recent history.

    With ``z_t`` step t's total first-gradient energy (``||g||^2``; with ASAM, ``||T g||^2``) and its EMA mean and
    variance (``beta``; initialised by the first step's value)::

        step t + 1 is a SAM step  iff  z_t >= mu_{t-1} + c * sigma_{t-1}
        mu_t = beta * mu_{t-1} + (1 - beta) * z_t;  sigma_t^2 = beta * sigma_{t-1}^2 + (1 - beta) * (z_t - mu_t)^2

    Deciding step t + 1 from step t's gradient (AE-SAM decides step t from its own) is what lets CUDA decide without
    waiting for the device; step 0 and step 1 are SAM steps. A larger ``c`` means fewer SAM steps (about half at
    ``c = 0`` for a steady gradient norm). A non-finite ``z_t`` leaves the statistics as they were and skips step
    t + 1's second pass. Under ``torch.distributed`` the statistic is averaged over ``group`` (the default group when
    None) before deciding, so every rank takes the same decision even when first gradients differ (m-sharpness)."""

    c: float = 0.0
    beta: float = 0.9
    group: object = field(default=None, compare=False, repr=False)
    reads_energy = True

    def __post_init__(self):
        check_real("c", self.c, low=-math.inf)
        check_real("beta", self.beta, low=0.0, high=1.0)

    def initial_state(self, device):
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return {"mean": zero.clone(), "var": zero.clone(), "count": 0}

    def decide_next(self, step, statistic, state):
        z = self._reduced(statistic.double())
        finite = z.isfinite()
        mean, var = state["mean"], state["var"]
        if state["count"] == 0:  # the first value starts the statistics
            mean.copy_(torch.where(finite, z, mean))
            state["count"] = 1
            return torch.ones((), dtype=torch.bool, device=z.device)
        sam = finite & (z >= mean + self.c * var.sqrt())
        new_mean = mean * self.beta + (1.0 - self.beta) * z
        new_var = var * self.beta + (1.0 - self.beta) * (z - new_mean).square()
        mean.copy_(torch.where(finite, new_mean, mean))
        var.copy_(torch.where(finite, new_var, var))
        state["count"] += 1
        return sam

    def _reduced(self, z: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return z
        size = dist.get_world_size(self.group)
        if size == 1:
            return z
        z = z.clone()
        dist.all_reduce(z, group=self.group)
        return z / size


def check_schedule(schedule) -> Schedule | None:
    """``schedule`` if it is None or a :class:`Schedule`, else a TypeError naming the schedules."""
    if schedule is None or isinstance(schedule, Schedule):
        return schedule
    raise TypeError(
        "schedule must be None (a SAM step every step) or one of gearsam_fused.Every(k), LookSAM(k, alpha), "
        f"Random(p), Adaptive(c); got {schedule!r}"
    )

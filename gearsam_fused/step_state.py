"""What a sharpness-aware optimizer carries from one call to the next besides the base optimizer's state: the
statistics of its last step (:class:`StepStatistics`, public), the rest of its step state (:class:`StepState`), and a
schedule's decision still on the device (:class:`DeviceDecision`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .base_step import FUSED, PER_TENSOR


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


def describe(energy: torch.Tensor, score: torch.Tensor, radius: torch.Tensor, rho) -> dict[str, torch.Tensor]:
    """A step's statistics as ``block_stats()`` describes them: ``energy`` e_b, ``score`` the allocation's s_b,
    ``radius`` rho_b, ``share`` rho_b**2 / rho**2 (0 where rho is 0) and ``non_finite``, how many blocks had a
    non-finite energy (a 0-d tensor)."""
    rho = float(rho)
    share = radius.square() / rho**2 if rho > 0 else torch.zeros_like(radius)
    non_finite = energy.isfinite().logical_not().sum()
    return {"energy": energy, "score": score, "radius": radius, "share": share, "non_finite": non_finite}


@dataclass
class StepState:
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
    next_sam: bool | DeviceDecision = True  #: the schedule's decision for the next step (maybe still on the device)
    cleared: list | None = (
        None  #: the gradients as zero_grad() left them after first_step (see gearsam_fused.gradients.marks)
    )
    found_inf: torch.Tensor | None = None  #: the first pass's overflow flag, where first_step was given one
    #: per parameter (block order), whether F-SAM's EMA holds a gradient (the backend's momentum buffer); () for none
    ascent_started: tuple[bool, ...] = ()

    @classmethod
    def fresh(cls, n_blocks: int, device: torch.device, rho, fused: bool, schedule) -> StepState:
        """The state of an optimizer before its first step: zeros for its ``n_blocks`` blocks, ``rho`` as the last
        radius, and ``schedule``'s initial state (None: no schedule)."""
        zeros = torch.zeros(n_blocks, dtype=torch.float64, device=device)
        return cls(
            ema=zeros.clone(), energy=zeros.clone(), radius=zeros.clone(), orthogonal_energy=zeros.clone(),
            last_rho=rho, last_base_step=FUSED if fused else PER_TENSOR,
            schedule_state=schedule.initial_state(device) if schedule is not None else {},
        )  # fmt: skip

    def record(self, energy: torch.Tensor, radius: torch.Tensor, rho: float, sam: bool) -> None:
        """Keep a first_step's statistics (see :class:`StepStatistics`)."""
        self.energy, self.radius, self.last_rho, self.last_sam = energy, radius, rho, sam

    def checkpoint(self, ascent=None) -> tuple:
        """What :meth:`roll_back` needs to undo the step about to begin (the EMA is copied: allocate updates it in
        place); ``ascent`` is what the ascent direction needs to be undone, returned by :meth:`roll_back`."""
        # a capturable step's rho is the device's tensor, which the step writes in place: its value is kept
        last_rho = self.last_rho.clone() if isinstance(self.last_rho, torch.Tensor) else self.last_rho
        return (self.ema.clone(), self.energy, self.radius, last_rho, self.last_sam,
                snapshot(self.schedule_state), self.next_sam, self.ascent_started, ascent)  # fmt: skip

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


class DeviceDecision:
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


def snapshot(state: dict) -> dict:
    """A copy of a schedule's state that later steps cannot change."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

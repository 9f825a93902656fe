"""``capturable=True``: what a SAM step keeps on the device so that a CUDA graph can capture it once and replay it.

A graph replays its kernels with the arguments they had when it was captured, so everything that changes from one
step to the next is read by the kernels from device memory instead of being passed from the host:

* ``rho``: one float64 tensor of one element, shared by every param group (``group["rho"]``);
* ``lr``: one such tensor per param group (``group["lr"]``); torch's LR schedulers write a tensor lr in place
  (``fill_``), so they keep working, and so does writing ``group["rho"].fill_(value)``. Assigning a float to either
  replaces the tensor the graph reads, and the next step refuses it rather than ignoring it;
* the step counts (Adam's ``state["step"]``, and for SGD the count that says which step starts the momentum buffer):
  on the device, advanced there (:class:`~gearsam_fused.base_step.FlatBaseStep` with ``capturable``);
* a step whose gradients overflowed (``found_inf``, from ``torch.amp.GradScaler``): skipped by the kernels on the
  device, the way torch's fused optimizers skip it, with no synchronisation (:meth:`DeviceScalars.skip_flag`,
  :meth:`DeviceScalars.keep_ema`).

Every buffer the step keeps is made here or at construction; a step creates only temporaries, which a captured graph
takes from its own memory pool. The tensors have shape ``(1,)``, not ``()``: Inductor (torch 2.13, CPU) compiles a
copy of a 0-d float64 input into a zero, which a step compiled with ``torch.compile`` would otherwise take for rho.
"""

from __future__ import annotations

import torch

from .checks import check_found_inf, check_real


def _describe(t: torch.Tensor) -> str:
    return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)} on {t.device}"


class DeviceScalars:
    """The device copies of ``rho`` and every group's ``lr``, the EMA of before the step, and the last step's rho."""

    def __init__(self, param_groups: list[dict], device: torch.device, n_blocks: int):
        self.device = device
        self.rho = torch.zeros(1, dtype=torch.float64, device=device)
        self.lrs = [torch.zeros(1, dtype=torch.float64, device=device) for _ in param_groups]
        #: the GEAR EMA as the current step found it, to put back when the step is skipped
        self.ema_before = torch.zeros(n_blocks, dtype=torch.float64, device=device)
        #: the rho of the last first_step
        self.last_rho = torch.zeros(1, dtype=torch.float64, device=device)
        self.place(param_groups)

    def place(self, param_groups: list[dict]) -> None:
        """Copy each group's ``rho`` and ``lr`` (floats, or one-element tensors on the device) into the device tensors
        and put those in the groups: at construction, and after ``load_state_dict`` brought values of its own (a graph
        captured before keeps reading the same tensors)."""
        rhos = {float(group["rho"]) for group in param_groups}
        if len(rhos) != 1:
            raise ValueError(f"all param_groups must share one rho; got {sorted(rhos)}")
        self.rho.fill_(check_real("rho", rhos.pop(), low=0.0))
        for g, (group, lr) in enumerate(zip(param_groups, self.lrs, strict=True)):
            value = group["lr"]
            if isinstance(value, torch.Tensor) and (value.numel() != 1 or value.requires_grad):
                needs = " that requires grad" if value.requires_grad else ""
                raise ValueError(
                    f"param group {g}: lr is {_describe(value)}{needs}; capturable=True takes a float or a "
                    "one-element tensor that needs no gradient"
                )
            lr.copy_(value.detach().reshape(1) if isinstance(value, torch.Tensor) else float(value))
            group["lr"] = lr
            group["rho"] = self.rho

    def current_rho(self, param_groups: list[dict]) -> torch.Tensor:
        """The rho tensor, after checking that no group's ``rho`` or ``lr`` was replaced (identity tests only: no
        value is read)."""
        for g, (group, lr) in enumerate(zip(param_groups, self.lrs, strict=True)):
            for key, ours in (("rho", self.rho), ("lr", lr)):
                if group[key] is not ours:
                    raise ValueError(
                        f"param group {g}'s {key} was replaced (by {group[key]!r}); with capturable=True the step reads "
                        f"it from the device tensor it was given: write it with group[{key!r}].fill_(value)"
                    )
        return self.rho

    @staticmethod
    def skip_flag(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
        """1.0 where either pass overflowed, else 0.0 (float32, 0-d, on the device); None when neither was checked."""
        flags = [f.reshape(()) != 0 for f in (first, second) if f is not None]
        if not flags:
            return None
        return (flags[0] | flags[1] if len(flags) == 2 else flags[0]).float()

    def keep_ema(self, ema: torch.Tensor, skip: torch.Tensor) -> None:
        """Put back the EMA of before the step where ``skip`` is set (a device select, no read)."""
        ema.copy_(torch.where(skip.bool(), self.ema_before, ema))


def check_found_inf_given(device: DeviceScalars | None, found_inf: torch.Tensor | None) -> None:
    """Refuse ``found_inf`` where the optimizer keeps no device scalars (``device`` None: not ``capturable``), or
    where it is not GradScaler's flag on their device."""
    if found_inf is None:
        return
    if device is None:
        raise ValueError(
            "found_inf skips an overflowing step on the device, which needs capturable=True (the step counts live on "
            "the device); without it, SAMScaler reads the overflow on the host"
        )
    check_found_inf(found_inf, device.device)

"""Fake implementations of the operators ``torch.ops.gearsam_fused.*`` that ``gearsam_fused._C`` defines
(``csrc/library.cpp``): what torch.compile, fake tensors and the meta device run in place of the kernels.

Each one applies the argument checks of ``csrc/ops.cpp`` that need no data, in the same order and with the same
messages, then gives outputs of the right shape, dtype and device without computing anything: the energy
(``block_energy``, ``friendly_energy_``) is float64 ``[first_tile_of_block.numel() - 1]`` on ``grad``'s device,
``allocate``'s scale and radius are shaped like the energy, the other eight operators return nothing.
``register_fake`` also makes them the operators' Meta kernels.

``_C`` names this module as where its fakes live (``m.set_python_module``), so torch checks that they are registered
from here; ``cpp`` imports it with the extension.
"""

from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (defines the operators this module extends)
from ..checks import (
    check_block_of_tile,
    check_correction,
    check_device_step,
    check_flat,
    check_friendly,
    check_momentum_energy,
    check_other,
    check_partials,
    check_same,
    check_scales,
)

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------- ops.cpp's checks
def _check_flat(name: str, t: torch.Tensor, tile: int = 0, dtype: torch.dtype | None = None,
                on_device_of: torch.Tensor | None = None) -> None:  # fmt: skip
    check_flat(name, t, tile or None, dtype, None if on_device_of is None else on_device_of.device)


def _check_tile(tile: int) -> None:
    if tile <= 0:
        raise ValueError(f"tile must be positive, got {tile}")


def _check_floating(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOATING:
        raise ValueError(f"{name} must be float32, float64, float16 or bfloat16, got {t.dtype}")


def _check_base_step(param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor | None, tile: int) -> None:
    """The base steps' checks up to their state: tile, param (float32 or float64 only), grad, and backup unless it is
    None (w read from param)."""
    _check_tile(tile)
    _check_flat("param", param, tile)
    if param.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"fused base step supports float32 and float64 buffers, got {param.dtype} for param")
    check_same("grad", grad, "param", param)
    if backup is not None:
        check_same("backup", backup, "param", param)


def _check_optional_state(name: str, t: torch.Tensor | None, needed: bool, why: str, param: torch.Tensor) -> None:
    """A state buffer the optimizer keeps exactly when ``needed``."""
    if needed and t is None:
        raise ValueError(f"{name} is required when {why}, got None")
    if not needed and t is not None:
        raise ValueError(f"{name} must be None unless {why}")
    if t is not None:
        check_same(name, t, "param", param)


def _check_energy(grad, param, first_tile_of_block, partials, tile, other=None) -> int:
    """The energy kernels' common arguments; returns the number of blocks."""
    _check_tile(tile)
    _check_flat("grad", grad, tile)
    _check_floating("grad", grad)
    check_same("param", param, "grad", grad)
    _check_flat("first_tile_of_block", first_tile_of_block, 0, torch.int64, grad)
    _check_flat("partials", partials, 0, torch.float64, grad)
    check_partials(partials, grad, tile, other)
    if first_tile_of_block.numel() < 1:
        raise ValueError("first_tile_of_block needs at least one entry (B + 1 for B blocks)")
    return first_tile_of_block.numel() - 1


# ------------------------------------------------------------------------------------------- the fakes
@torch.library.register_fake("gearsam_fused::block_energy")
def _block_energy(grad, param, first_tile_of_block, partials, *, tile, adaptive, eta, other=None):
    check_other(other, grad, adaptive)
    n_blocks = _check_energy(grad, param, first_tile_of_block, partials, tile, other)
    return grad.new_empty((2, n_blocks) if other is not None else (n_blocks,), dtype=torch.float64)


@torch.library.register_fake("gearsam_fused::allocate")
def _allocate(energy, ema, *, gear, rho, beta, delta, scalars=None, found_inf=None):
    _check_flat("energy", energy, 0, torch.float64)
    check_same("ema", ema, "energy", energy)
    check_device_step("allocate", energy, scalars, found_inf, rho=rho)
    return torch.empty_like(energy), torch.empty_like(energy)


@torch.library.register_fake("gearsam_fused::perturb_")
def _perturb(param, grad, backup, scale, block_of_tile, *, tile, adaptive, eta, kept=None):
    _check_tile(tile)
    _check_flat("param", param, tile)
    _check_floating("param", param)
    check_same("grad", grad, "param", param)
    check_same("backup", backup, "param", param)
    _check_flat("scale", scale, 0, torch.float64, param)
    check_block_of_tile(block_of_tile, param, tile)
    if kept is not None:
        check_same("kept", kept, "param", param)


@torch.library.register_fake("gearsam_fused::restore_")
def _restore(param, backup, *, tile):
    _check_tile(tile)
    _check_flat("param", param, tile)
    check_same("backup", backup, "param", param)


torch.library.register_fake("gearsam_fused::restore_consuming_")(_restore)


@torch.library.register_fake("gearsam_fused::mix_gradient_")
def _mix_gradient(grad, correction, grad_scale, correction_scale, block_of_tile, *, tile):
    _check_tile(tile)
    _check_flat("grad", grad, tile)
    _check_floating("grad", grad)
    check_same("correction", correction, "grad", grad)
    check_scales(grad_scale, correction_scale, grad)
    check_block_of_tile(block_of_tile, grad, tile)


@torch.library.register_fake("gearsam_fused::exchange_sharpness_")
def _exchange_sharpness(grad, correction, *, tile):
    _check_tile(tile)
    _check_flat("grad", grad, tile)
    _check_floating("grad", grad)
    check_same("correction", correction, "grad", grad)


@torch.library.register_fake("gearsam_fused::friendly_ascent_")
def _friendly_ascent(grad, momentum, *, sigma, lmbda, first):
    _check_flat("grad", grad)
    _check_floating("grad", grad)
    check_friendly(grad, momentum, sigma, lmbda)


@torch.library.register_fake("gearsam_fused::friendly_energy_")
def _friendly_energy(grad, momentum, param, first_tile_of_block, partials, *, tile, adaptive, eta, sigma, lmbda, first):
    n_blocks = _check_energy(grad, param, first_tile_of_block, partials, tile)
    check_friendly(grad, momentum, sigma, lmbda)
    return grad.new_empty((n_blocks,), dtype=torch.float64)


@torch.library.register_fake("gearsam_fused::sgd_step_")
def _sgd_step(param, grad, backup, momentum_buffer, *, tile, lr, weight_decay, momentum, dampening, nesterov, maximize,
              first, correction=None, correction_scale=None, block_of_tile=None, scalars=None, found_inf=None,
              grad_scale=None, sharpness=0.0, first_tile_of_block=None, partials=None, momentum_energy=None):  # fmt: skip
    _check_base_step(param, grad, backup, tile)
    _check_optional_state("momentum_buffer", momentum_buffer, momentum != 0, "momentum != 0", param)
    check_correction(param, tile, correction, correction_scale, block_of_tile, grad_scale, sharpness)
    check_device_step("sgd_step_", param, scalars, found_inf, lr=lr, first=first)
    check_momentum_energy(param, tile, momentum_buffer is not None, found_inf, first_tile_of_block, partials,
                          momentum_energy)  # fmt: skip


@torch.library.register_fake("gearsam_fused::adam_step_")
def _adam_step(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, *, tile, beta1, beta2, eps, weight_decay,
               decoupled, amsgrad, maximize, lr, step, correction=None,
               correction_scale=None, block_of_tile=None, scalars=None, found_inf=None, grad_scale=None,
               sharpness=0.0, first_tile_of_block=None, partials=None, momentum_energy=None):  # fmt: skip
    _check_base_step(param, grad, backup, tile)
    check_same("exp_avg", exp_avg, "param", param)
    check_same("exp_avg_sq", exp_avg_sq, "param", param)
    _check_optional_state("max_exp_avg_sq", max_exp_avg_sq, amsgrad, "amsgrad=True", param)
    check_correction(param, tile, correction, correction_scale, block_of_tile, grad_scale, sharpness)
    check_device_step("adam_step_", param, scalars, found_inf, lr=lr, step=step)
    check_momentum_energy(param, tile, True, found_inf, first_tile_of_block, partials, momentum_energy)

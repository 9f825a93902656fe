"""Fake implementations of the operators ``torch.ops.gearsam_fused.*`` that ``gearsam_fused._C`` defines
(``csrc/library.cpp``): what torch.compile, fake tensors and the meta device run in place of the kernels.

A fake sees no data. It checks what a trace needs to be right: each tensor's layout (contiguous 1-D), dtype, device
and size against the others, which optional tensors are given together, and the state buffers the options call for
(``momentum_buffer`` with ``momentum != 0``, ``max_exp_avg_sq`` with ``amsgrad``). It uses ``torch._check``, so a
wrong call fails with a RuntimeError naming the argument, and under dynamic shapes a size check becomes a guard
rather than a branch. The values of the other scalar arguments (a finite ``sigma``, host values left at 0 beside
``scalars``, ...) are left to the kernels, whose checks in ``csrc/ops.cpp`` refuse every wrong call with a ValueError.

The outputs have the right shape, dtype and device, with nothing computed: the energy (``block_energy``,
``friendly_energy_``) is float64 ``[B]``, ``B = first_tile_of_block.numel() - 1``, on ``grad``'s device (``[2, B]``
for ``block_energy`` with ``other``); ``allocate``'s scale and radius are like the energy; the other eight operators
return nothing. ``register_fake`` also makes them the operators' Meta kernels.

``_C`` names this module as where its fakes live (``m.set_python_module``), so torch checks that they are registered
from here; ``cpp`` imports it with the extension.
"""

from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (defines the operators this module extends)

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_BASE_STEP = (torch.float32, torch.float64)  # the base steps compute in the buffers' own type


# ------------------------------------------------------------------------------------------- checks
def _flat(name: str, t: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
    """A buffer the kernels walk as one array: contiguous 1-D, of ``dtype`` on ``device`` where given."""
    torch._check(
        t.dim() == 1 and t.is_contiguous(),
        lambda: f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}, strides {t.stride()}",
    )
    torch._check(dtype is None or t.dtype == dtype, lambda: f"{name} must be {dtype}, got {t.dtype}")
    torch._check(device is None or t.device == device, lambda: f"{name} is on {t.device}, the buffers on {device}")


def _like(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """A buffer read or written beside ``like``: flat, with its length, dtype and device."""
    _flat(name, t)
    torch._check(
        t.dtype == like.dtype and t.device == like.device and t.numel() == like.numel(),
        lambda: (
            f"{name} ({t.dtype} {tuple(t.shape)} on {t.device}) must match {like_name} "
            f"({like.dtype} {tuple(like.shape)} on {like.device})"
        ),
    )


def _dtype_in(name: str, t: torch.Tensor, dtypes: tuple) -> None:
    torch._check(t.dtype in dtypes, lambda: f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")


def _tiled(name: str, t: torch.Tensor, tile: int, dtypes: tuple | None = _FLOATING) -> None:
    """The buffer whose tiles an operator walks: flat, whole tiles, one of ``dtypes`` (any where None)."""
    torch._check(tile > 0, lambda: f"tile must be positive, got {tile}")
    _flat(name, t)
    torch._check(t.numel() % tile == 0, lambda: f"{name} has {t.numel()} elements, not a multiple of the tile ({tile})")
    if dtypes is not None:
        _dtype_in(name, t, dtypes)


def _per_tile(name: str, t: torch.Tensor, like: torch.Tensor, tile: int, dtype: torch.dtype, rows: int = 1) -> None:
    """``rows`` entries per tile of ``like``, of ``dtype`` on its device."""
    _flat(name, t, dtype, like.device)
    n_tiles = like.numel() // tile
    per_tile = f" ({rows} per tile)" if rows > 1 else ""
    torch._check(t.numel() == rows * n_tiles, lambda: f"{name} has {t.numel()} entries for {n_tiles} tiles{per_tile}")


def _blocks(first_tile_of_block: torch.Tensor, like: torch.Tensor) -> int:
    """The number of blocks B of the table ``first_tile_of_block`` (int64 ``[B + 1]``)."""
    _flat("first_tile_of_block", first_tile_of_block, torch.int64, like.device)
    torch._check(
        first_tile_of_block.numel() >= 1, lambda: "first_tile_of_block needs at least one entry (B + 1 for B blocks)"
    )
    return first_tile_of_block.numel() - 1


def _energy(grad, param, first_tile_of_block, partials, tile: int, rows: int = 1) -> int:
    """The energy kernels' common arguments (``rows`` partials per tile); the number of blocks."""
    _tiled("grad", grad, tile)
    _like("param", param, "grad", grad)
    _per_tile("partials", partials, grad, tile, torch.float64, rows)
    return _blocks(first_tile_of_block, grad)


def _scales(grad_scale: torch.Tensor, correction_scale: torch.Tensor, like: torch.Tensor) -> None:
    """Per-block coefficients: float64 on ``like``'s device, as many of each."""
    _flat("grad_scale", grad_scale, torch.float64, like.device)
    _flat("correction_scale", correction_scale, torch.float64, like.device)
    torch._check(
        grad_scale.numel() == correction_scale.numel(),
        lambda: f"grad_scale has {grad_scale.numel()} entries, correction_scale {correction_scale.numel()}",
    )


def _base_step(param, grad, backup, tile: int) -> None:
    _tiled("param", param, tile, _BASE_STEP)
    _like("grad", grad, "param", param)
    if backup is not None:  # None: the step reads the weights from param
        _like("backup", backup, "param", param)


def _state(name: str, t: torch.Tensor | None, needed: bool, why: str, param: torch.Tensor) -> None:
    """A state buffer given exactly when ``needed`` (``why`` says when)."""
    torch._check(
        (t is not None) == needed,
        lambda: f"{name} is required when {why}" if needed else f"{name} must be None unless {why}",
    )
    if t is not None:
        _like(name, t, "param", param)


def _correction(param, tile: int, correction, correction_scale, block_of_tile, grad_scale) -> None:
    """A base step's correction: the three tensors all or none, ``grad_scale`` only beside them."""
    given = {"correction": correction, "correction_scale": correction_scale, "block_of_tile": block_of_tile}
    missing = [name for name, t in given.items() if t is None]
    torch._check(
        len(missing) in (0, len(given)),
        lambda: f"correction, correction_scale and block_of_tile go together, missing {', '.join(missing)}",
    )
    torch._check(
        grad_scale is None or not missing,
        lambda: "grad_scale is given only beside correction, correction_scale and block_of_tile",
    )
    if missing:
        return
    _like("correction", correction, "param", param)
    _flat("correction_scale", correction_scale, torch.float64, param.device)
    if grad_scale is not None:
        _scales(grad_scale, correction_scale, param)
    _per_tile("block_of_tile", block_of_tile, param, tile, torch.int32)


def _device_values(like, scalars, found_inf, count: int) -> None:
    """A capturable step's ``scalars`` (float64, ``count`` of them) and ``found_inf`` (float32, one element of any
    shape, as GradScaler keeps it), on ``like``'s device."""
    if scalars is not None:
        _flat("scalars", scalars, torch.float64, like.device)
        torch._check(scalars.numel() == count, lambda: f"scalars has {scalars.numel()} elements, expected {count}")
    if found_inf is not None:
        torch._check(
            found_inf.dtype == torch.float32 and found_inf.device == like.device and found_inf.numel() == 1,
            lambda: (
                f"found_inf must be one torch.float32 element on {like.device}, got {found_inf.dtype} "
                f"{tuple(found_inf.shape)} on {found_inf.device}"
            ),
        )


def _momentum_energy(
    param, tile: int, has_momentum: bool, found_inf, first_tile_of_block, partials, momentum_energy
) -> None:
    """A base step's momentum energy outputs: all three or none, beside a momentum, never with ``found_inf``."""
    outputs = (first_tile_of_block, partials, momentum_energy)
    if all(t is None for t in outputs):
        return
    torch._check(
        all(t is not None for t in outputs),
        lambda: "first_tile_of_block, partials and momentum_energy are given together or not at all",
    )
    torch._check(has_momentum, lambda: "momentum_energy sums the momentum the step writes: this step keeps none")
    torch._check(found_inf is None, lambda: "momentum_energy is not taken with found_inf")
    _per_tile("partials", partials, param, tile, torch.float64)
    n_blocks = _blocks(first_tile_of_block, param)
    _flat("momentum_energy", momentum_energy, torch.float64, param.device)
    torch._check(
        momentum_energy.numel() == n_blocks,
        lambda: f"momentum_energy has {momentum_energy.numel()} entries for {n_blocks} blocks",
    )


# ------------------------------------------------------------------------------------------- the fakes
@torch.library.register_fake("gearsam_fused::block_energy")
def _block_energy(grad, param, first_tile_of_block, partials, *, tile, adaptive, eta, other=None):
    if other is not None:
        _like("other", other, "grad", grad)
    n_blocks = _energy(grad, param, first_tile_of_block, partials, tile, rows=1 if other is None else 2)
    return grad.new_empty((n_blocks,) if other is None else (2, n_blocks), dtype=torch.float64)


@torch.library.register_fake("gearsam_fused::allocate")
def _allocate(energy, ema, *, gear, rho, beta, delta, scalars=None, found_inf=None):
    _flat("energy", energy, torch.float64)
    _like("ema", ema, "energy", energy)
    _device_values(energy, scalars, found_inf, 1)
    return torch.empty_like(energy), torch.empty_like(energy)


@torch.library.register_fake("gearsam_fused::perturb_")
def _perturb(param, grad, backup, scale, block_of_tile, *, tile, adaptive, eta, kept=None):
    _tiled("param", param, tile)
    _like("grad", grad, "param", param)
    _like("backup", backup, "param", param)
    if kept is not None:
        _like("kept", kept, "param", param)
    _flat("scale", scale, torch.float64, param.device)
    _per_tile("block_of_tile", block_of_tile, param, tile, torch.int32)


@torch.library.register_fake("gearsam_fused::restore_")
def _restore(param, backup, *, tile):
    _tiled("param", param, tile, dtypes=None)
    _like("backup", backup, "param", param)


torch.library.register_fake("gearsam_fused::restore_discarding_backup_")(_restore)


@torch.library.register_fake("gearsam_fused::mix_gradient_")
def _mix_gradient(grad, correction, grad_scale, correction_scale, block_of_tile, *, tile):
    _tiled("grad", grad, tile)
    _like("correction", correction, "grad", grad)
    _scales(grad_scale, correction_scale, grad)
    _per_tile("block_of_tile", block_of_tile, grad, tile, torch.int32)


@torch.library.register_fake("gearsam_fused::exchange_sharpness_")
def _exchange_sharpness(grad, correction, *, tile):
    _tiled("grad", grad, tile)
    _like("correction", correction, "grad", grad)


@torch.library.register_fake("gearsam_fused::friendly_ascent_")
def _friendly_ascent(grad, momentum, *, sigma, lmbda, first):
    _flat("grad", grad)
    _dtype_in("grad", grad, _FLOATING)
    _like("momentum", momentum, "grad", grad)


@torch.library.register_fake("gearsam_fused::friendly_energy_")
def _friendly_energy(grad, momentum, param, first_tile_of_block, partials, *, tile, adaptive, eta, sigma, lmbda, first):
    n_blocks = _energy(grad, param, first_tile_of_block, partials, tile)
    _like("momentum", momentum, "grad", grad)
    return grad.new_empty((n_blocks,), dtype=torch.float64)


@torch.library.register_fake("gearsam_fused::sgd_step_")
def _sgd_step(param, grad, backup, momentum_buffer, *, tile, lr, weight_decay, momentum, dampening, nesterov, maximize,
              first, correction=None, correction_scale=None, block_of_tile=None, scalars=None, found_inf=None,
              grad_scale=None, sharpness=0.0, first_tile_of_block=None, partials=None, momentum_energy=None):  # fmt: skip
    _base_step(param, grad, backup, tile)
    _state("momentum_buffer", momentum_buffer, momentum != 0, "momentum != 0", param)
    _correction(param, tile, correction, correction_scale, block_of_tile, grad_scale)
    _device_values(param, scalars, found_inf, 2)
    _momentum_energy(
        param, tile, momentum_buffer is not None, found_inf, first_tile_of_block, partials, momentum_energy
    )


@torch.library.register_fake("gearsam_fused::adam_step_")
def _adam_step(param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, *, tile, beta1, beta2, eps, weight_decay,
               decoupled, amsgrad, maximize, lr, step, correction=None,
               correction_scale=None, block_of_tile=None, scalars=None, found_inf=None, grad_scale=None,
               sharpness=0.0, first_tile_of_block=None, partials=None, momentum_energy=None):  # fmt: skip
    _base_step(param, grad, backup, tile)
    _like("exp_avg", exp_avg, "param", param)
    _like("exp_avg_sq", exp_avg_sq, "param", param)
    _state("max_exp_avg_sq", max_exp_avg_sq, amsgrad, "amsgrad=True", param)
    _correction(param, tile, correction, correction_scale, block_of_tile, grad_scale)
    _device_values(param, scalars, found_inf, 2)
    _momentum_energy(param, tile, True, found_inf, first_tile_of_block, partials, momentum_energy)

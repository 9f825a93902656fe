"""Argument and tensor checks shared by the frontend, the backends and the application, so each error is worded once."""

from __future__ import annotations

import math
import re
from numbers import Real

import torch


def check_torch_version(minimum: str, found: str | None = None) -> None:
    """ImportError unless torch (``found``, default the imported one) is release ``minimum`` or later."""
    found = torch.__version__ if found is None else found

    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))

    if release(found) < release(minimum):
        raise ImportError(f"gearsam_fused needs torch >= {minimum}, but torch {found} is installed; upgrade torch")


def check_real(
    name: str, value, *, low: float, low_inclusive: bool = True, high: float | None = None, high_inclusive: bool = False
) -> float:
    """``float(value)`` if it is a finite real in ``[low, high)`` (``(`` when not ``low_inclusive``, ``]`` when
    ``high_inclusive``)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    value = float(value)
    too_low = value < low if low_inclusive else value <= low
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        bounds = ("[" if low_inclusive else "(") + f"{low}, " + (f"{high}" if high is not None else "inf")
        bounds += "]" if high is not None and high_inclusive else ")"
        raise ValueError(f"{name} must lie in {bounds}, got {value!r}")
    return value


def check_dense_grad(grad: torch.Tensor | None, what: str) -> torch.Tensor | None:
    """``grad`` unchanged, refusing layouts the SAM step cannot handle; ``what`` names the parameter."""
    if grad is not None and grad.layout != torch.strided:
        raise TypeError(
            f"SAM does not support sparse gradients ({what} has a {grad.layout} grad); use a dense embedding "
            "(sparse=False)"
        )
    return grad


#: The dtypes a trainable parameter may have: the step computes in float32 (float64 for float64) and stores back.
PARAM_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_param_dtype(p: torch.Tensor, what: str) -> None:
    """Refuse a trainable parameter whose dtype the SAM step cannot update exactly; ``what`` names it. Complex
    parameters would need norms of ``|g|`` and ASAM's ``|w|`` taken on the complex values, and float8 ones a scaling
    recipe of their own; frozen parameters of any dtype are left alone, as torch's optimizers leave them."""
    if not p.requires_grad or p.dtype in PARAM_DTYPES:
        return
    dtype = str(p.dtype).removeprefix("torch.")
    hint = " (keep it as a real tensor of twice the size, e.g. torch.view_as_real)" if p.is_complex() else ""
    supported = ", ".join(str(d).removeprefix("torch.") for d in PARAM_DTYPES)
    raise TypeError(f"parameter {what} is {dtype}: SAM and GEAR-SAM update {supported} parameters{hint}")


# The checks of a kernel's flat buffers: a kernel given the wrong buffer fails with a message, not with garbage. The
# Triton launchers run them; csrc/ops.cpp words them alike, so both backends refuse a wrong call in the same words.
def check_flat(name: str, t: torch.Tensor, tile: int | None = None, dtype: torch.dtype | None = None,
               device: torch.device | None = None) -> None:  # fmt: skip
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the buffers on {device}")
    if not t.is_contiguous() or t.dim() != 1:
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}, strides {t.stride()}")
    if tile is not None and t.numel() % tile:
        raise ValueError(f"{name} has {t.numel()} elements, not a multiple of the tile ({tile})")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def check_same(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """A buffer read or written beside ``like``: flat itself (a strided view of the right length would be read as if
    it were contiguous), then of ``like``'s shape, dtype and device."""
    check_flat(name, t)
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name} ({t.dtype} {tuple(t.shape)} on {t.device}) must match {like_name} "
            f"({like.dtype} {tuple(like.shape)} on {like.device})"
        )


def check_other(other: torch.Tensor | None, grad: torch.Tensor, adaptive: bool) -> None:
    """``block_energy``'s second buffer, whose inner product with ``grad`` it takes beside the energies: like
    ``grad``, and without ASAM's scaling, which that product does not have."""
    if other is None:
        return
    check_same("other", other, "grad", grad)
    if adaptive:
        raise ValueError(
            "block_energy with other takes the inner product of the two beside the plain energies, which has no "
            "adaptive form; pass adaptive=False"
        )


def check_friendly(grad: torch.Tensor, momentum: torch.Tensor, sigma: float, lmbda: float) -> None:
    """F-SAM's arguments beside ``grad``: the EMA buffer like it, finite ``sigma`` and ``lmbda``."""
    check_same("momentum", momentum, "grad", grad)
    check_real("sigma", sigma, low=-math.inf)
    check_real("lmbda", lmbda, low=-math.inf)


def check_partials(partials: torch.Tensor, grad: torch.Tensor, tile: int, other: torch.Tensor | None) -> tuple:
    """``block_energy``'s scratch: one entry per tile of ``grad``, two with ``other``. ``(n_tiles, rows)``; the
    dtype and device are checked beside the other flat buffers."""
    n_tiles, rows = grad.numel() // tile, 1 if other is None else 2
    if partials.numel() != rows * n_tiles:
        per_tile = " (two per tile with other)" if rows == 2 else ""
        raise ValueError(f"partials has {partials.numel()} entries for {n_tiles} tiles{per_tile}")
    return n_tiles, rows


def check_block_of_tile(block_of_tile: torch.Tensor, like: torch.Tensor, tile: int) -> None:
    """The block of each of ``like``'s tiles: int32, flat, on ``like``'s device, one entry per tile."""
    check_flat("block_of_tile", block_of_tile, dtype=torch.int32, device=like.device)
    n_tiles = like.numel() // tile
    if block_of_tile.numel() != n_tiles:
        raise ValueError(f"block_of_tile has {block_of_tile.numel()} entries for {n_tiles} tiles")


def check_scales(grad_scale: torch.Tensor, correction_scale: torch.Tensor, grad: torch.Tensor) -> None:
    """``mix_gradient_``'s per-block coefficients: float64, flat, on ``grad``'s device, one per block each."""
    check_flat("grad_scale", grad_scale, dtype=torch.float64, device=grad.device)
    check_flat("correction_scale", correction_scale, dtype=torch.float64, device=grad.device)
    if correction_scale.numel() != grad_scale.numel():
        raise ValueError(
            f"correction_scale has {correction_scale.numel()} entries, grad_scale {grad_scale.numel()}: one per block "
            "each"
        )


def check_correction(param: torch.Tensor, tile: int, correction: torch.Tensor | None,
                     correction_scale: torch.Tensor | None, block_of_tile: torch.Tensor | None,
                     grad_scale: torch.Tensor | None, sharpness: float = 0.0) -> int:  # fmt: skip
    """A base step's corrected gradient: ``correction``, ``correction_scale`` and ``block_of_tile`` all or none
    (given in part, the caller's state is broken), checked as ``perturb_`` checks its scale and block_of_tile,
    ``grad_scale`` only beside them, checked as ``mix_gradient_`` checks its scales, and a nonzero ``sharpness``
    (finite) only beside ``grad_scale``. The kernels' level: 0 without a correction, 1 with one (LookSAM's
    ``fma(c, correction, g)``), 2 with ``grad_scale`` too (``mix_gradient_``'s), 3 with ``sharpness`` as well (WSAM's
    decoupled sharpness step after the update). Same words as csrc/ops.cpp."""
    if not math.isfinite(sharpness):
        raise ValueError(f"sharpness must be a finite real number, got {sharpness!r}")
    if sharpness != 0.0 and grad_scale is None:
        raise ValueError(
            "sharpness steps along grad - correction after the update from a mixed gradient: give grad_scale, "
            "correction, correction_scale and block_of_tile with it"
        )
    given = {"correction": correction, "correction_scale": correction_scale, "block_of_tile": block_of_tile}
    missing = [name for name, t in given.items() if t is None]
    if len(missing) == len(given):
        if grad_scale is not None:
            raise ValueError(
                "grad_scale scales the gradient beside a correction: give correction, correction_scale and "
                "block_of_tile with it"
            )
        return 0
    if missing:
        raise ValueError(
            f"correction, correction_scale and block_of_tile must be given together, missing {', '.join(missing)}"
        )
    check_same("correction", correction, "param", param)
    check_flat("correction_scale", correction_scale, dtype=torch.float64, device=param.device)
    if grad_scale is not None:
        check_scales(grad_scale, correction_scale, param)
    check_block_of_tile(block_of_tile, param, tile)
    return 1 if grad_scale is None else 2 if sharpness == 0.0 else 3


def check_momentum_energy(param: torch.Tensor, tile: int, has_momentum: bool, found_inf: torch.Tensor | None,
                          first_tile_of_block: torch.Tensor | None, partials: torch.Tensor | None,
                          momentum_energy: torch.Tensor | None) -> bool:  # fmt: skip
    """A base step's momentum energy outputs: ``first_tile_of_block``, ``partials`` and ``momentum_energy`` all or
    none, beside a momentum the step writes and without ``found_inf`` (a skipped step writes none), checked as
    ``block_energy`` checks its own. Whether they are given. Same words as csrc/ops.cpp; reads no data."""
    given = [t is not None for t in (first_tile_of_block, partials, momentum_energy)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("first_tile_of_block, partials and momentum_energy are given together or not at all")
    if not has_momentum:
        raise ValueError("momentum_energy sums the momentum the step writes: this step keeps none")
    if found_inf is not None:
        raise ValueError("momentum_energy is not taken with found_inf: a skipped step writes no momentum")
    check_flat("first_tile_of_block", first_tile_of_block, dtype=torch.int64, device=param.device)
    check_flat("partials", partials, dtype=torch.float64, device=param.device)
    check_flat("momentum_energy", momentum_energy, dtype=torch.float64, device=param.device)
    n_tiles = param.numel() // tile
    if partials.numel() != n_tiles:
        raise ValueError(f"partials has {partials.numel()} entries for {n_tiles} tiles")
    if first_tile_of_block.numel() < 1:
        raise ValueError("first_tile_of_block needs at least one entry (B + 1 for B blocks)")
    n_blocks = first_tile_of_block.numel() - 1
    if momentum_energy.numel() != n_blocks:
        raise ValueError(f"momentum_energy has {momentum_energy.numel()} entries for {n_blocks} blocks")
    return True


#: What each kernel operator of a capturable step reads from its ``scalars``, in order (gearsam_fused.capturable).
DEVICE_SCALARS = {"allocate": ("rho",), "sgd_step_": ("lr", "step"), "adam_step_": ("lr", "step")}


def check_found_inf(found_inf, device: torch.device) -> None:
    """A loss-scaling overflow flag as GradScaler keeps it: a float32 tensor of one element (0-d or not) on
    ``device``. Reads no data."""
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a tensor, got {type(found_inf).__name__}")
    if found_inf.device != device:
        raise ValueError(f"found_inf is on {found_inf.device}, the buffers on {device}")
    if found_inf.dtype != torch.float32:
        raise ValueError(f"found_inf must be torch.float32, got {found_inf.dtype}")
    if found_inf.numel() != 1:
        raise ValueError(f"found_inf has {found_inf.numel()} elements, expected 1")


def check_device_step(op: str, like: torch.Tensor, scalars: torch.Tensor | None, found_inf: torch.Tensor | None,
                      **host) -> None:  # fmt: skip
    """A capturable step's arguments to kernel operator ``op``: ``scalars`` (float64, contiguous 1-D, one entry per
    :data:`DEVICE_SCALARS` name) and ``found_inf`` (:func:`check_found_inf`) on ``like``'s device; None passes. With
    ``scalars``, the host values it replaces (``host``: rho; lr and first; lr and step) must be 0 / False, since a
    nonzero one would be ignored. Same words as csrc/ops.cpp; reads no data."""
    if scalars is not None:
        check_flat("scalars", scalars, None, torch.float64, like.device)
        names = DEVICE_SCALARS[op]
        if scalars.numel() != len(names):
            raise ValueError(f"scalars has {scalars.numel()} elements; {op} takes {len(names)} ({', '.join(names)})")
    if found_inf is not None:
        check_found_inf(found_inf, like.device)
    if scalars is None or not any(host.values()):
        return
    if op == "allocate":
        raise ValueError(f"rho is read from scalars when it is given; pass rho=0.0, got {float(host['rho'])}")
    flag, neutral = ("first", "first=False") if op == "sgd_step_" else ("step", "step=0")
    raise ValueError(f"lr and {flag} are read from scalars when it is given; pass lr=0.0 and {neutral}")

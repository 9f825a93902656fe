"""Radius allocation on the device: one program, float64, no host synchronisation.

The GEAR rule (``GEAR=True``) and the SAM rule (``GEAR=False``) are stated once, in
:func:`gearsam_fused.allocation.gear_allocate` and :func:`~gearsam_fused.allocation.sam_allocate`. Here, as there,
``||s||_2`` is taken through ``t_b = s_b / max_j s_j``, so that squaring neither underflows nor overflows.

``x - x == 0`` is the finiteness test: it fails for inf (inf - inf is NaN) and NaN alone.

Device arguments (optional; a call without them launches ``_allocate_kernel``, which takes none)::

    scalars    float64 [1] = (rho,)     rho read from it on the device (the host ``rho`` must then be 0.0)
    found_inf  float32, one element     nonzero: scale_b = r_b = 0 for every b and ``ema`` is not written
                                        (both rules); zero: the formulas above

so that a CUDA graph replays the allocation with the current rho and skips it after a loss-scaling overflow. A call
with either runs ``_allocate_device_kernel``, which shares the body.

The program walks the blocks in chunks: for GEAR once for ``max s``, then once for ``||t||`` (for SAM once for
``sum e``), and last to write ``s``, ``r`` and ``scale``. The EMA is recomputed in every walk rather than re-read, so
no thread reads what another has just written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._common import NAMESPACE, check_device_step, check_flat, check_same, kept_whole, launches

#: Blocks handled per loop iteration.
_CHUNK = 1024


@triton.jit
def _load_smoothed(energy_ptr, ema_ptr, offsets, mask, beta):
    """``(e, s)`` at ``offsets``: the energies and the EMA's next value (its current one where e is not finite)."""
    e = tl.load(energy_ptr + offsets, mask=mask, other=0.0)
    s = tl.load(ema_ptr + offsets, mask=mask, other=0.0)
    return e, tl.where(e - e == 0, beta * s + (1.0 - beta) * e, s)


@triton.jit
def _allocate(energy_ptr, ema_ptr, scale_ptr, radius_ptr, n_blocks, rho, beta, delta, GEAR: tl.constexpr,
              CHUNK: tl.constexpr):  # fmt: skip
    """See the module docstring for the formulas of both rules."""
    peak = 0.0
    if GEAR:
        largest = tl.zeros([CHUNK], dtype=tl.float64)
        for start in range(0, n_blocks, CHUNK):
            offsets = start + tl.arange(0, CHUNK)
            mask = offsets < n_blocks
            _, s = _load_smoothed(energy_ptr, ema_ptr, offsets, mask, beta)
            largest = tl.maximum(largest, s)
        peak = tl.max(largest, axis=0)
    safe_peak = tl.where(peak > 0, peak, 1.0)
    acc = tl.zeros([CHUNK], dtype=tl.float64)
    for start in range(0, n_blocks, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        mask = offsets < n_blocks
        if GEAR:
            _, s = _load_smoothed(energy_ptr, ema_ptr, offsets, mask, beta)
            t = s / safe_peak
            acc += t * t
        else:
            acc += tl.load(energy_ptr + offsets, mask=mask, other=0.0)
    norm = tl.sqrt(tl.sum(acc, axis=0))
    safe_norm = tl.where(norm > 0, norm, 1.0)
    for start in range(0, n_blocks, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        mask = offsets < n_blocks
        if GEAR:
            e, s = _load_smoothed(energy_ptr, ema_ptr, offsets, mask, beta)
            tl.store(ema_ptr + offsets, s, mask=mask)
            finite = e - e == 0
            radius = tl.where(finite, tl.where(norm > 0, rho * ((s / safe_peak) / safe_norm), 0.0), 0.0)
            scale = tl.where(finite, radius / (tl.sqrt(e) + delta), 0.0)
        else:
            root = tl.sqrt(tl.load(energy_ptr + offsets, mask=mask, other=0.0))
            finite = norm - norm == 0
            radius = tl.where(finite, tl.where(norm > 0, rho * (root / safe_norm), 0.0), 0.0)
            scale = tl.zeros([CHUNK], dtype=tl.float64) + tl.where(finite, rho / (norm + delta), 0.0)
        tl.store(radius_ptr + offsets, radius, mask=mask)
        tl.store(scale_ptr + offsets, scale, mask=mask)


@triton.jit
def _allocate_kernel(energy_ptr, ema_ptr, scale_ptr, radius_ptr, n_blocks, rho: tl.float64, beta: tl.float64,
                     delta: tl.float64, GEAR: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """_allocate with the host's rho, nothing skipped."""
    _allocate(energy_ptr, ema_ptr, scale_ptr, radius_ptr, n_blocks, rho, beta, delta, GEAR, CHUNK)


@triton.jit
def _allocate_device_kernel(energy_ptr, ema_ptr, scale_ptr, radius_ptr, scalars_ptr, found_inf_ptr, n_blocks,
                            rho: tl.float64, beta: tl.float64, delta: tl.float64, GEAR: tl.constexpr,
                            HAS_SCALARS: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                            CHUNK: tl.constexpr):  # fmt: skip
    """_allocate with rho = scalars[0] if HAS_SCALARS, and, if HAS_FOUND_INF, zero scales and radii and ``ema`` not
    written when found_inf is nonzero (absent pointers stand in as energy_ptr, never dereferenced).

    The skip is a branch on the loaded flag rather than masked stores: one program, so no divergence, and a skipped
    allocation neither reads the energies nor computes what it would throw away."""
    if HAS_SCALARS:
        rho = tl.load(scalars_ptr)  # float64, as the host's rho
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:
            zeros = tl.zeros([CHUNK], dtype=tl.float64)
            for start in range(0, n_blocks, CHUNK):
                offsets = start + tl.arange(0, CHUNK)
                mask = offsets < n_blocks
                tl.store(radius_ptr + offsets, zeros, mask=mask)
                tl.store(scale_ptr + offsets, zeros, mask=mask)
        else:
            _allocate(energy_ptr, ema_ptr, scale_ptr, radius_ptr, n_blocks, rho, beta, delta, GEAR, CHUNK)
    else:
        _allocate(energy_ptr, ema_ptr, scale_ptr, radius_ptr, n_blocks, rho, beta, delta, GEAR, CHUNK)


@kept_whole
@triton_op(f"{NAMESPACE}::allocate", mutates_args=("ema",))
def allocate(energy: torch.Tensor, ema: torch.Tensor, scalars: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None, *, gear: bool, rho: float, beta: float,
             delta: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(scale, radius)``, float64 ``[B]``, by the GEAR rule (``gear``, updates ``ema`` in place) or the SAM rule.
    ``gear`` is a bool by the op's schema: the dispatcher refuses anything else before this runs. ``scalars``
    (float64 ``[1]``: rho, read on the device; then ``rho`` must be 0.0) and ``found_inf`` (float32, one element:
    nonzero gives zero scales and radii and leaves ``ema`` unwritten) as the module docstring says; tensors are
    positional-or-keyword, as a registered op takes no keyword-only tensor."""
    check_flat("energy", energy, dtype=torch.float64)
    check_same("ema", ema, "energy", energy)
    check_device_step("allocate", energy, scalars, found_inf, rho=rho)
    scale = torch.empty_like(energy)
    radius = torch.empty_like(energy)
    n_blocks = energy.numel()
    if scalars is None and found_inf is None:
        if n_blocks and launches(_allocate_kernel, energy):
            wrap_triton(_allocate_kernel)[(1,)](
                energy,
                ema,
                scale,
                radius,
                n_blocks,
                rho,
                beta,
                delta,
                GEAR=gear,
                CHUNK=_CHUNK,
                enable_fp_fusion=False,
            )
    elif n_blocks and launches(_allocate_device_kernel, energy):
        wrap_triton(_allocate_device_kernel)[(1,)](
            energy,
            ema,
            scale,
            radius,
            energy if scalars is None else scalars,  # placeholders, never dereferenced
            energy if found_inf is None else found_inf,
            n_blocks,
            rho,
            beta,
            delta,
            GEAR=gear,
            HAS_SCALARS=scalars is not None,
            HAS_FOUND_INF=found_inf is not None,
            CHUNK=_CHUNK,
            enable_fp_fusion=False,
        )
    return scale, radius

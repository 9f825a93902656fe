"""SAM's restore folded into the base optimizer's update: one pass over a flat bucket after the second backward.

``param`` holds ``w + eps`` and ``backup`` holds ``w``; each kernel reads ``backup`` (never ``param``), applies torch's
update to it and writes ``param`` and the optimizer state. ``backup=None`` is a step from the current weights, with no
perturbation to undo: ``w`` is read from ``param`` itself, each element before it is written (a registered op may not
take one tensor twice when it writes it). The update and its roundings are stated once, in
:mod:`gearsam_fused.base_step`; here every operation is written out as one Triton operation (``tl.fma`` for an fma,
``enable_fp_fusion=False`` so that nothing else fuses), and the square root is the correctly rounded one.

Device arguments (optional tensors, after the correction's; a call without them runs the kernels that take none)::

    scalars    float64 [2] = (lr, k), k the step count (1 for the first), read in the kernel instead of the host's
               lr and step (Adam) or first (SGD), which must then be lr=0.0 and step=0 / first=False:
               sgd_step_:   C(-lr);  first step := (k == 1), decided at run time (the buffer then not read)
               adam_step_:  step_size = lr / (1 - beta1**k),  bias_correction2_sqrt = (1 - beta2**k) ** 0.5,
                            decay = 1 - lr * weight_decay, in float64 with C's pow (adam_scalars' operations), each
                            rounded once to C as the host's values are: the same bits as the host call
    found_inf  float32, one element (GradScaler's, 0-d):  nonzero:  param <- backup (param untouched without backup)
               and nothing else is read or written (the state keeps its bits, grad may hold inf/NaN);
               zero:  the step above

so that a CUDA graph replays the step with the current lr and step count and skips it after a loss-scaling overflow.
Under Triton's interpreter (no libdevice) the kernels' float64 pow is Python's ``**``, which is C's pow; on a GPU it
is libdevice's.

One program per tile; the state tensors a configuration does not use are never loaded or stored. A step without a
correction runs kernels that have no correction arguments at all; one with it (with or without ``grad_scale``: the
CORRECTED level, see ``_step_grad``) runs the ``_corrected`` twins; one with either device argument runs the
``_device`` kernel (correction or not); all share the same body. Asked for the new momentum's block energies
(MomentumSAM), each program also stores its tile's sum of the momentum's squares as it writes it (``ENERGY``), and the
launcher sums them per block with the energy's second stage (:mod:`triton_kernels.energy`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.language.extra import libdevice

from ..base_step import adam_scalars
from ._common import (
    NAMESPACE,
    check_correction,
    check_device_step,
    check_flat,
    check_momentum_energy,
    check_same,
    compute_type,
    host_scalar,
    in_compute,
    kept_whole,
    launches,
    pairs,
)
from .energy import _block_sums, _sum_of_products


@triton.jit
def _rounded(x, COMPUTE: tl.constexpr):
    """A float64 value loaded or derived on the device, rounded once to COMPUTE: host_scalar's twin for the scalars a
    kernel reads from memory (the float32 cast of a double rounds to nearest-even, as the host's does)."""
    return x.to(COMPUTE)


@triton.jit
def _host_or_device(x32, x64, on_device, HAS_SCALARS: tl.constexpr, COMPUTE: tl.constexpr):
    """``on_device`` (a COMPUTE value derived from scalars) if HAS_SCALARS, else the host's pair as host_scalar gives it:
    without scalars, a kernel compiles to the very instructions of one that calls host_scalar itself."""
    if HAS_SCALARS:
        value = on_device
    else:
        value = host_scalar(x32, x64, COMPUTE)
    return value


@triton.jit
def _libdevice_pow(x, y):
    """C's pow(x, y) of two float64 values: libdevice's on the GPU."""
    return libdevice.pow(x, y)


def _interpreted_pow(x, y):
    """C's pow(x, y) of two float64 values under Triton's interpreter, which has no libdevice: Python's float ``**``,
    which is C's pow, element by element (numpy's power may take a vectorised path of its own). Where ``**`` raises
    (0 to a negative power, a negative base to a fractional one, an overflow), pow's IEEE result instead."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    def pow_(a: float, b: float) -> float:
        try:
            result = a**b
        except (ZeroDivisionError, OverflowError):
            with np.errstate(all="ignore"):
                return float(np.power(np.float64(a), np.float64(b)))
        return math.nan if isinstance(result, complex) else result  # a negative base to a fractional power

    a, b = np.broadcast_arrays(np.asarray(x.handle.data, np.float64), np.asarray(y.handle.data, np.float64))
    data = np.array([pow_(float(u), float(v)) for u, v in zip(a.ravel(), b.ravel())], np.float64).reshape(a.shape)
    return tl.tensor(TensorHandle(data, tl.float64), x.type if x.handle.data.shape == a.shape else y.type)


@triton.jit
def _div(x, y, COMPUTE: tl.constexpr):
    """x / y correctly rounded: a float32 ``/`` compiles to an approximate division on NVIDIA GPUs."""
    if COMPUTE == tl.float64:
        return x / y
    else:
        return tl.div_rn(x, y)


@triton.jit
def _sqrt(x, COMPUTE: tl.constexpr):
    """sqrt(x) correctly rounded: a float32 ``tl.sqrt`` compiles to an approximate root on NVIDIA GPUs."""
    if COMPUTE == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


#: pow for the kernels' float64 scalars: a jit function calls a plain Python function only when interpreted.
_pow64 = _libdevice_pow if isinstance(_rounded, triton.runtime.JITFunction) else _interpreted_pow


@triton.jit
def _step_grad(grad_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr, offsets, CORRECTED: tl.constexpr,
               COMPUTE: tl.constexpr):  # fmt: skip
    """The tile's gradient before maximize's sign: grad (CORRECTED 0); fma(C(cscale[block]), correction, grad)
    (CORRECTED 1, LookSAM); fma(C(cscale[block]), correction, C(gscale[block]) * grad) (CORRECTED 2, the SAM family's
    mix; and 3, the mix followed by the sharpness step, see _sharpened), the block's float64 scales rounded once to
    COMPUTE."""
    g = tl.load(grad_ptr + offsets)
    if CORRECTED:
        block = tl.load(block_of_tile_ptr + tl.program_id(0))
        if CORRECTED >= 2:
            g = tl.load(gscale_ptr + block).to(COMPUTE) * g  # rounded on its own: no fp fusion in these kernels
        g = tl.fma(tl.load(cscale_ptr + block).to(COMPUTE), tl.load(corr_ptr + offsets), g)
    return g


@triton.jit
def _sharpened(w_new, grad_ptr, corr_ptr, scalars_ptr, offsets, sharpness_step32, sharpness_step64, sharpness64,
               CORRECTED: tl.constexpr, HAS_SCALARS: tl.constexpr, COMPUTE: tl.constexpr):  # fmt: skip
    """The updated parameter w_new, followed by WSAM's decoupled sharpness step where CORRECTED is 3:
    fma(C(-lr * sharpness), grad - correction, w_new), the difference rounded on its own. -lr * sharpness is the
    host's pair, or with HAS_SCALARS, scalars' -lr times sharpness64 in float64, rounded once to COMPUTE."""
    if CORRECTED == 3:
        on_device = 0.0  # derived from scalars if HAS_SCALARS
        if HAS_SCALARS:
            on_device = _rounded(-tl.load(scalars_ptr) * sharpness64, COMPUTE)
        factor = _host_or_device(sharpness_step32, sharpness_step64, on_device, HAS_SCALARS, COMPUTE)
        w_new = tl.fma(factor, tl.load(grad_ptr + offsets) - tl.load(corr_ptr + offsets), w_new)
    return w_new


@triton.jit
def _momentum_partial(m, partial_ptr, COMPUTE: tl.constexpr):
    """partial[tile] = the tile's sum of m**2 (m as stored: the base steps compute in their buffers' type), the partial
    block_energy's first stage takes of the stored momentum: _square_sum's operations on the same values (its
    float64 sum where a float32 one overflows included)."""
    tl.store(partial_ptr + tl.program_id(0), _sum_of_products(m, m, COMPUTE))


@triton.jit
def _sgd_update(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
                scalars_ptr, offsets, neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32, momentum64,
                one_minus_dampening32, one_minus_dampening64, sharpness_step32, sharpness_step64, sharpness64,
                HAS_WEIGHT_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, CORRECTED: tl.constexpr, HAS_SCALARS: tl.constexpr,
                COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """The tile's SGD update (see _sgd_tile); with HAS_SCALARS, lr and k are read from scalars_ptr: neg_lr is
    C(-lr) and the first step is k == 1, decided at run time (FIRST is then False)."""
    w = tl.load(backup_ptr + offsets)  # loaded before param is stored: backup_ptr is param_ptr for backup=None
    g = _step_grad(grad_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr, offsets, CORRECTED, COMPUTE)
    if MAXIMIZE:
        g = -g  # a sign flip, as torch's neg: +0 becomes -0
    if HAS_WEIGHT_DECAY:
        g = tl.fma(host_scalar(weight_decay32, weight_decay64, COMPUTE), w, g)
    if HAS_MOMENTUM:
        momentum = host_scalar(momentum32, momentum64, COMPUTE)
        if FIRST:
            buf = g  # torch's first step clones the gradient: no dampening
        elif HAS_SCALARS:
            # a branch on the step count, the same for every program: the first step never reads the buffer
            if tl.load(scalars_ptr + 1) == 1.0:
                buf = g
            else:
                buf = tl.fma(
                    host_scalar(one_minus_dampening32, one_minus_dampening64, COMPUTE),
                    g,
                    tl.load(buf_ptr + offsets) * momentum,
                )
        else:
            buf = tl.fma(
                host_scalar(one_minus_dampening32, one_minus_dampening64, COMPUTE),
                g,
                tl.load(buf_ptr + offsets) * momentum,
            )
        tl.store(buf_ptr + offsets, buf)
        if ENERGY:
            _momentum_partial(buf, partial_ptr, COMPUTE)
        if NESTEROV:
            g = tl.fma(momentum, buf, g)
        else:
            g = buf
    neg_lr = 0.0  # read from scalars if HAS_SCALARS
    if HAS_SCALARS:
        neg_lr = _rounded(-tl.load(scalars_ptr), COMPUTE)
    w = tl.fma(_host_or_device(neg_lr32, neg_lr64, neg_lr, HAS_SCALARS, COMPUTE), g, w)
    w = _sharpened(w, grad_ptr, corr_ptr, scalars_ptr, offsets, sharpness_step32, sharpness_step64, sharpness64,
                   CORRECTED, HAS_SCALARS, COMPUTE)  # fmt: skip
    tl.store(param_ptr + offsets, w)


@triton.jit
def _sgd_tile(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
              scalars_ptr, found_inf_ptr, neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32, momentum64,
              one_minus_dampening32, one_minus_dampening64, sharpness_step32, sharpness_step64, sharpness64,
              HAS_WEIGHT_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
              MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, CORRECTED: tl.constexpr, HAS_SCALARS: tl.constexpr,
              HAS_FOUND_INF: tl.constexpr, HAS_BACKUP: tl.constexpr, TILE: tl.constexpr,
              COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """w = backup;  g = grad, corrected if CORRECTED (see _step_grad);  g = -g if MAXIMIZE;
    g = fma(weight_decay, w, g) if HAS_WEIGHT_DECAY; with HAS_MOMENTUM: buf = g if FIRST else
    fma(one_minus_dampening, g, buf * momentum), d = fma(momentum, buf, g) if NESTEROV else buf;  without: d = g.
    param = fma(neg_lr, d, w), then the sharpness step if CORRECTED is 3 (see _sharpened).  one_minus_dampening is
    1 - dampening, neg_lr is -lr.
    HAS_SCALARS: lr and k from scalars_ptr (see _sgd_update). HAS_FOUND_INF: where found_inf is nonzero, param =
    backup (if HAS_BACKUP; param untouched otherwise) and nothing else is read or written."""
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    if HAS_FOUND_INF:
        # A branch, not masked stores: the flag is the same for every program (no divergence), and a skipped step
        # reads neither grad (which may hold inf/NaN) nor the state, and computes nothing it would throw away.
        if tl.load(found_inf_ptr) != 0.0:
            if HAS_BACKUP:
                tl.store(param_ptr + offsets, tl.load(backup_ptr + offsets))
        else:
            _sgd_update(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
                        scalars_ptr, offsets, neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32,
                        momentum64, one_minus_dampening32, one_minus_dampening64, sharpness_step32, sharpness_step64,
                        sharpness64, HAS_WEIGHT_DECAY, HAS_MOMENTUM, NESTEROV, MAXIMIZE, FIRST, CORRECTED, HAS_SCALARS,
                        COMPUTE, partial_ptr, ENERGY)  # fmt: skip
    else:
        _sgd_update(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
                    scalars_ptr, offsets, neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32, momentum64,
                    one_minus_dampening32, one_minus_dampening64, sharpness_step32, sharpness_step64, sharpness64,
                    HAS_WEIGHT_DECAY, HAS_MOMENTUM, NESTEROV, MAXIMIZE, FIRST, CORRECTED, HAS_SCALARS,
                    COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _sgd_kernel(param_ptr, grad_ptr, backup_ptr, buf_ptr, neg_lr32: tl.float32, neg_lr64: tl.float64,
                weight_decay32: tl.float32, weight_decay64: tl.float64, momentum32: tl.float32, momentum64: tl.float64,
                one_minus_dampening32: tl.float32, one_minus_dampening64: tl.float64, HAS_WEIGHT_DECAY: tl.constexpr,
                HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, FIRST: tl.constexpr,
                TILE: tl.constexpr, COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """_sgd_tile without a correction or device arguments (grad_ptr stands in for their pointers, never
    dereferenced)."""
    _sgd_tile(param_ptr, grad_ptr, backup_ptr, buf_ptr, grad_ptr, grad_ptr, grad_ptr, grad_ptr, grad_ptr, grad_ptr,
              neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32, momentum64, one_minus_dampening32,
              one_minus_dampening64, neg_lr32, neg_lr64, neg_lr64, HAS_WEIGHT_DECAY, HAS_MOMENTUM, NESTEROV, MAXIMIZE,
              FIRST, False, False, False, False, TILE, COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _sgd_corrected_kernel(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
                          neg_lr32: tl.float32, neg_lr64: tl.float64, weight_decay32: tl.float32,
                          weight_decay64: tl.float64, momentum32: tl.float32, momentum64: tl.float64,
                          one_minus_dampening32: tl.float32, one_minus_dampening64: tl.float64,
                          sharpness_step32: tl.float32, sharpness_step64: tl.float64, sharpness64: tl.float64,
                          HAS_WEIGHT_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                          MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, CORRECTED: tl.constexpr, TILE: tl.constexpr,
                          COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """_sgd_tile with a correction (CORRECTED 1 to 3, see _step_grad), without device arguments."""
    _sgd_tile(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr, grad_ptr,
              grad_ptr, neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32, momentum64,
              one_minus_dampening32, one_minus_dampening64, sharpness_step32, sharpness_step64, sharpness64,
              HAS_WEIGHT_DECAY, HAS_MOMENTUM, NESTEROV, MAXIMIZE, FIRST, CORRECTED, False, False, False, TILE,
              COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _sgd_device_kernel(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
                       scalars_ptr, found_inf_ptr, neg_lr32: tl.float32, neg_lr64: tl.float64,
                       weight_decay32: tl.float32, weight_decay64: tl.float64, momentum32: tl.float32,
                       momentum64: tl.float64, one_minus_dampening32: tl.float32, one_minus_dampening64: tl.float64,
                       sharpness_step32: tl.float32, sharpness_step64: tl.float64, sharpness64: tl.float64,
                       HAS_WEIGHT_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                       MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, CORRECTED: tl.constexpr, HAS_SCALARS: tl.constexpr,
                       HAS_FOUND_INF: tl.constexpr, HAS_BACKUP: tl.constexpr, TILE: tl.constexpr,
                       COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """_sgd_tile with scalars and/or found_inf, with or without a correction (absent pointers stand in as other
    buffers, never dereferenced)."""
    _sgd_tile(param_ptr, grad_ptr, backup_ptr, buf_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr,
              scalars_ptr, found_inf_ptr, neg_lr32, neg_lr64, weight_decay32, weight_decay64, momentum32, momentum64,
              one_minus_dampening32, one_minus_dampening64, sharpness_step32, sharpness_step64, sharpness64,
              HAS_WEIGHT_DECAY, HAS_MOMENTUM, NESTEROV, MAXIMIZE, FIRST, CORRECTED, HAS_SCALARS, HAS_FOUND_INF,
              HAS_BACKUP, TILE, COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _adam_device_scalars(scalars_ptr, beta1_64, beta2_64, weight_decay64, COMPUTE: tl.constexpr):
    """``(C(-step_size), C(bias_correction2_sqrt), C(decay))`` from lr = scalars[0] and k = scalars[1], derived in
    float64 by the operations of gearsam_fused.base_step.adam_scalars (``**`` is C's pow) and rounded once to C."""
    lr = tl.load(scalars_ptr)
    k = tl.load(scalars_ptr + 1)
    one = tl.full([], 1.0, tl.float64)
    step_size = lr / (one - _pow64(tl.full([], beta1_64, tl.float64), k))
    bias_correction2_sqrt = _pow64(one - _pow64(tl.full([], beta2_64, tl.float64), k), tl.full([], 0.5, tl.float64))
    decay = one - lr * tl.full([], weight_decay64, tl.float64)
    return _rounded(-step_size, COMPUTE), _rounded(bias_correction2_sqrt, COMPUTE), _rounded(decay, COMPUTE)


@triton.jit
def _adam_update(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr, cscale_ptr,
                 gscale_ptr, block_of_tile_ptr, scalars_ptr, offsets, beta1_64, lerp_weight32, lerp_weight64, beta2_32,
                 beta2_64, one_minus_beta2_32, one_minus_beta2_64, eps32, eps64, weight_decay32, weight_decay64,
                 decay32, decay64, neg_step_size32, neg_step_size64, bias_correction2_sqrt32, bias_correction2_sqrt64,
                 sharpness_step32, sharpness_step64, sharpness64, HAS_WEIGHT_DECAY: tl.constexpr,
                 DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, LERP_SMALL: tl.constexpr,
                 CORRECTED: tl.constexpr, HAS_SCALARS: tl.constexpr, COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """The tile's Adam update (see _adam_tile); with HAS_SCALARS, neg_step_size, bias_correction2_sqrt and decay come
    from _adam_device_scalars instead of the host's pairs."""
    neg_step_size, bias_correction2_sqrt, decay = 0.0, 0.0, 0.0  # derived from scalars if HAS_SCALARS
    if HAS_SCALARS:
        neg_step_size, bias_correction2_sqrt, decay = _adam_device_scalars(
            scalars_ptr, beta1_64, beta2_64, weight_decay64, COMPUTE
        )
    w = tl.load(backup_ptr + offsets)  # loaded before param is stored: backup_ptr is param_ptr for backup=None
    g = _step_grad(grad_ptr, corr_ptr, cscale_ptr, gscale_ptr, block_of_tile_ptr, offsets, CORRECTED, COMPUTE)
    if MAXIMIZE:
        g = -g
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            w = w * _host_or_device(decay32, decay64, decay, HAS_SCALARS, COMPUTE)
        else:
            g = tl.fma(host_scalar(weight_decay32, weight_decay64, COMPUTE), w, g)
    # ATen's lerp: anchored at m for a small weight, at g for a large one (the weight rounded to C decides)
    m = tl.load(exp_avg_ptr + offsets)
    lerp_weight = host_scalar(lerp_weight32, lerp_weight64, COMPUTE)
    diff = g - m
    if LERP_SMALL:
        m = tl.fma(lerp_weight, diff, m)
    else:
        m = tl.fma(lerp_weight - 1.0, diff, g)
    v = tl.load(exp_avg_sq_ptr + offsets) * host_scalar(beta2_32, beta2_64, COMPUTE)
    v = tl.fma(host_scalar(one_minus_beta2_32, one_minus_beta2_64, COMPUTE) * g, g, v)
    tl.store(exp_avg_ptr + offsets, m)
    if ENERGY:
        _momentum_partial(m, partial_ptr, COMPUTE)
    tl.store(exp_avg_sq_ptr + offsets, v)
    second = v
    if AMSGRAD:
        # torch.maximum propagates NaN; Triton's default maximum would drop it
        second = tl.maximum(tl.load(max_exp_avg_sq_ptr + offsets), v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(max_exp_avg_sq_ptr + offsets, second)
    denom = _div(
        _sqrt(second, COMPUTE),
        _host_or_device(bias_correction2_sqrt32, bias_correction2_sqrt64, bias_correction2_sqrt, HAS_SCALARS, COMPUTE),
        COMPUTE,
    )
    denom = denom + host_scalar(eps32, eps64, COMPUTE)
    update = _div(
        _host_or_device(neg_step_size32, neg_step_size64, neg_step_size, HAS_SCALARS, COMPUTE) * m, denom, COMPUTE
    )
    w = _sharpened(w + update, grad_ptr, corr_ptr, scalars_ptr, offsets, sharpness_step32, sharpness_step64,
                   sharpness64, CORRECTED, HAS_SCALARS, COMPUTE)  # fmt: skip
    tl.store(param_ptr + offsets, w)


@triton.jit
def _adam_tile(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr, cscale_ptr,
               gscale_ptr, block_of_tile_ptr, scalars_ptr, found_inf_ptr, beta1_64, lerp_weight32, lerp_weight64,
               beta2_32, beta2_64, one_minus_beta2_32, one_minus_beta2_64, eps32, eps64, weight_decay32, weight_decay64,
               decay32, decay64, neg_step_size32, neg_step_size64, bias_correction2_sqrt32, bias_correction2_sqrt64,
               sharpness_step32, sharpness_step64, sharpness64, HAS_WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr,
               AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, LERP_SMALL: tl.constexpr, CORRECTED: tl.constexpr,
               HAS_SCALARS: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_BACKUP: tl.constexpr, TILE: tl.constexpr,
               COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """w = backup;  g = grad, corrected if CORRECTED (see _step_grad);  g = -g if MAXIMIZE;  with HAS_WEIGHT_DECAY:
    w = w * decay if DECOUPLED else g = fma(weight_decay, w, g);
    m = fma(lerp_weight, g - m, m) if LERP_SMALL else fma(lerp_weight - 1, g - m, g);
    v = fma(one_minus_beta2 * g, g, v * beta2);  vmax = max(vmax, v) if AMSGRAD;
    param = w + (neg_step_size * m) / (sqrt(vmax if AMSGRAD else v) / bias_correction2_sqrt + eps), then the sharpness
    step if CORRECTED is 3 (see _sharpened).
    lerp_weight is 1 - beta1, one_minus_beta2 is 1 - beta2.  HAS_SCALARS: neg_step_size, bias_correction2_sqrt and
    decay derived on the device from scalars (lr, k) and beta1_64, beta2_64, weight_decay64.
    HAS_FOUND_INF: where found_inf is nonzero, param = backup (if HAS_BACKUP; param untouched otherwise) and nothing
    else is read or written (see _sgd_tile)."""
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    if HAS_FOUND_INF:
        # a branch, not masked stores: see _sgd_tile
        if tl.load(found_inf_ptr) != 0.0:
            if HAS_BACKUP:
                tl.store(param_ptr + offsets, tl.load(backup_ptr + offsets))
        else:
            _adam_update(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr,
                         cscale_ptr, gscale_ptr, block_of_tile_ptr, scalars_ptr, offsets, beta1_64, lerp_weight32,
                         lerp_weight64, beta2_32, beta2_64, one_minus_beta2_32, one_minus_beta2_64, eps32, eps64,
                         weight_decay32, weight_decay64, decay32, decay64, neg_step_size32, neg_step_size64,
                         bias_correction2_sqrt32, bias_correction2_sqrt64, sharpness_step32, sharpness_step64,
                         sharpness64, HAS_WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE, LERP_SMALL, CORRECTED,
                         HAS_SCALARS, COMPUTE, partial_ptr, ENERGY)  # fmt: skip
    else:
        _adam_update(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr,
                     cscale_ptr, gscale_ptr, block_of_tile_ptr, scalars_ptr, offsets, beta1_64, lerp_weight32,
                     lerp_weight64, beta2_32, beta2_64, one_minus_beta2_32, one_minus_beta2_64, eps32, eps64,
                     weight_decay32, weight_decay64, decay32, decay64, neg_step_size32, neg_step_size64,
                     bias_correction2_sqrt32, bias_correction2_sqrt64, sharpness_step32, sharpness_step64, sharpness64,
                     HAS_WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE, LERP_SMALL, CORRECTED, HAS_SCALARS,
                     COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _adam_kernel(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr,
                 lerp_weight32: tl.float32, lerp_weight64: tl.float64, beta2_32: tl.float32, beta2_64: tl.float64,
                 one_minus_beta2_32: tl.float32, one_minus_beta2_64: tl.float64, eps32: tl.float32, eps64: tl.float64,
                 weight_decay32: tl.float32, weight_decay64: tl.float64, decay32: tl.float32, decay64: tl.float64,
                 neg_step_size32: tl.float32, neg_step_size64: tl.float64, bias_correction2_sqrt32: tl.float32,
                 bias_correction2_sqrt64: tl.float64, HAS_WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr,
                 AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, LERP_SMALL: tl.constexpr, TILE: tl.constexpr,
                 COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """_adam_tile without a correction or device arguments (grad_ptr stands in for their pointers, never
    dereferenced; beta1_64 is only read with scalars)."""
    _adam_tile(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, grad_ptr, grad_ptr,
               grad_ptr, grad_ptr, grad_ptr, grad_ptr, lerp_weight64, lerp_weight32, lerp_weight64, beta2_32, beta2_64,
               one_minus_beta2_32, one_minus_beta2_64, eps32, eps64, weight_decay32, weight_decay64, decay32, decay64,
               neg_step_size32, neg_step_size64, bias_correction2_sqrt32, bias_correction2_sqrt64, neg_step_size32,
               neg_step_size64, neg_step_size64, HAS_WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE, LERP_SMALL, False,
               False, False, False, TILE, COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _adam_corrected_kernel(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr,
                           cscale_ptr, gscale_ptr, block_of_tile_ptr, lerp_weight32: tl.float32,
                           lerp_weight64: tl.float64, beta2_32: tl.float32, beta2_64: tl.float64,
                           one_minus_beta2_32: tl.float32, one_minus_beta2_64: tl.float64, eps32: tl.float32,
                           eps64: tl.float64, weight_decay32: tl.float32, weight_decay64: tl.float64,
                           decay32: tl.float32, decay64: tl.float64, neg_step_size32: tl.float32,
                           neg_step_size64: tl.float64, bias_correction2_sqrt32: tl.float32,
                           bias_correction2_sqrt64: tl.float64, sharpness_step32: tl.float32,
                           sharpness_step64: tl.float64, sharpness64: tl.float64, HAS_WEIGHT_DECAY: tl.constexpr,
                           DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                           LERP_SMALL: tl.constexpr, CORRECTED: tl.constexpr, TILE: tl.constexpr,
                           COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """_adam_tile with a correction (CORRECTED 1 to 3, see _step_grad), without device arguments."""
    _adam_tile(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr, cscale_ptr,
               gscale_ptr, block_of_tile_ptr, grad_ptr, grad_ptr, lerp_weight64, lerp_weight32, lerp_weight64, beta2_32,
               beta2_64, one_minus_beta2_32, one_minus_beta2_64, eps32, eps64, weight_decay32, weight_decay64, decay32,
               decay64, neg_step_size32, neg_step_size64, bias_correction2_sqrt32, bias_correction2_sqrt64,
               sharpness_step32, sharpness_step64, sharpness64, HAS_WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE,
               LERP_SMALL, CORRECTED, False, False, False, TILE, COMPUTE, partial_ptr, ENERGY)  # fmt: skip


@triton.jit
def _adam_device_kernel(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr,
                        cscale_ptr, gscale_ptr, block_of_tile_ptr, scalars_ptr, found_inf_ptr, beta1_64: tl.float64,
                        lerp_weight32: tl.float32, lerp_weight64: tl.float64, beta2_32: tl.float32,
                        beta2_64: tl.float64, one_minus_beta2_32: tl.float32, one_minus_beta2_64: tl.float64,
                        eps32: tl.float32, eps64: tl.float64, weight_decay32: tl.float32, weight_decay64: tl.float64,
                        decay32: tl.float32, decay64: tl.float64, neg_step_size32: tl.float32,
                        neg_step_size64: tl.float64, bias_correction2_sqrt32: tl.float32,
                        bias_correction2_sqrt64: tl.float64, sharpness_step32: tl.float32, sharpness_step64: tl.float64,
                        sharpness64: tl.float64, HAS_WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr,
                        AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, LERP_SMALL: tl.constexpr,
                        CORRECTED: tl.constexpr, HAS_SCALARS: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                        HAS_BACKUP: tl.constexpr, TILE: tl.constexpr, COMPUTE: tl.constexpr, partial_ptr, ENERGY: tl.constexpr):  # fmt: skip
    """_adam_tile with scalars and/or found_inf, with or without a correction (absent pointers stand in as other
    buffers, never dereferenced)."""
    _adam_tile(param_ptr, grad_ptr, backup_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, corr_ptr, cscale_ptr,
               gscale_ptr, block_of_tile_ptr, scalars_ptr, found_inf_ptr, beta1_64, lerp_weight32, lerp_weight64,
               beta2_32, beta2_64, one_minus_beta2_32, one_minus_beta2_64, eps32, eps64, weight_decay32, weight_decay64,
               decay32, decay64, neg_step_size32, neg_step_size64, bias_correction2_sqrt32, bias_correction2_sqrt64,
               sharpness_step32, sharpness_step64, sharpness64, HAS_WEIGHT_DECAY, DECOUPLED, AMSGRAD, MAXIMIZE,
               LERP_SMALL, CORRECTED, HAS_SCALARS, HAS_FOUND_INF, HAS_BACKUP, TILE, COMPUTE, partial_ptr, ENERGY)  # fmt: skip


def _check_base_buffers(param: torch.Tensor, tile: int, **buffers: torch.Tensor | None) -> None:
    """param flat in a whole number of tiles and float32 / float64; every given buffer like it."""
    check_flat("param", param, tile)
    if param.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"fused base step supports float32 and float64 buffers, got {param.dtype}")
    for name, t in buffers.items():
        if t is not None:
            # same shape alone would let a strided view through
            check_flat(name, t)
            check_same(name, t, "param", param)


def _sharpness_arguments(corrected: tuple, device_args: bool, lr: float, sharpness: float) -> tuple:
    """What the ``_corrected`` twins and the ``_device`` kernel take after the update's scalars: the host pair of
    ``-lr * sharpness`` (0 without scalars' lr) and the weight ``sharpness`` (for scalars' lr), or () for the plain
    kernel."""
    if not (corrected or device_args):
        return ()
    return (*pairs(-lr * sharpness), sharpness)


def _correction_pointers(correction: torch.Tensor | None, correction_scale: torch.Tensor | None,
                         block_of_tile: torch.Tensor | None, grad_scale: torch.Tensor | None) -> tuple:  # fmt: skip
    """The kernels' four correction pointers (correction_scale standing in for an absent grad_scale, never
    dereferenced), or () without a correction."""
    if correction is None:
        return ()
    return correction, correction_scale, correction_scale if grad_scale is None else grad_scale, block_of_tile


def _pick(plain, with_correction, with_device_args, corrected: tuple, scalars, found_inf) -> tuple:
    """``(kernel, whether it takes device arguments)``: the ``_device`` kernel where ``scalars`` or ``found_inf`` is
    given, else the ``_corrected`` twin where a correction is, else the plain kernel."""
    device_args = scalars is not None or found_inf is not None
    return (with_device_args if device_args else with_correction if corrected else plain), device_args


def _flags(level: int, device_args: bool, scalars: torch.Tensor | None, found_inf: torch.Tensor | None,
           backup: torch.Tensor | None) -> dict:  # fmt: skip
    """The constexpr flags the picked kernel takes beyond the plain kernel's: CORRECTED (the ``_corrected`` twins and
    the ``_device`` kernel), and the ``_device`` kernel's own."""
    if not device_args:
        return dict(CORRECTED=level) if level else {}
    return dict(CORRECTED=level, HAS_SCALARS=scalars is not None, HAS_FOUND_INF=found_inf is not None,
                HAS_BACKUP=backup is not None)  # fmt: skip


def _device_pointers(param: torch.Tensor, corrected: tuple, scalars: torch.Tensor | None,
                     found_inf: torch.Tensor | None) -> tuple:  # fmt: skip
    """The pointers a ``_device`` kernel takes after the state: the correction's four and scalars and found_inf,
    param standing in for the absent ones (never dereferenced)."""
    return (
        *(corrected or (param, param, param, param)),
        param if scalars is None else scalars,
        param if found_inf is None else found_inf,
    )


@kept_whole
@triton_op(
    f"{NAMESPACE}::sgd_step_", mutates_args=("param", "backup", "momentum_buffer", "partials", "momentum_energy")
)
def sgd_step_(param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor | None,
              momentum_buffer: torch.Tensor | None, correction: torch.Tensor | None = None,
              correction_scale: torch.Tensor | None = None, block_of_tile: torch.Tensor | None = None,
              scalars: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
              grad_scale: torch.Tensor | None = None, first_tile_of_block: torch.Tensor | None = None,
              partials: torch.Tensor | None = None, momentum_energy: torch.Tensor | None = None, *, tile: int, lr: float,
              weight_decay: float, momentum: float, dampening: float, nesterov: bool, maximize: bool,
              first: bool, sharpness: float = 0.0) -> None:  # fmt: skip
    """``param`` <- torch's SGD step taken from ``backup`` (from ``param`` itself if ``backup`` is None);
    ``momentum_buffer`` (given iff ``momentum != 0``) updated in place, and only written, not read, on the ``first``
    step. ``grad`` and ``backup`` are only read. With ``correction``, ``correction_scale`` (float64 ``[B]``) and
    ``block_of_tile`` (int32 per tile), all or none, the step's gradient is ``fma(C(correction_scale[block]),
    correction, grad)`` (LookSAM); with ``grad_scale`` (float64 ``[B]``, only beside them) it is
    ``fma(C(correction_scale[block]), correction, C(grad_scale[block]) * grad)``, ``mix_gradient_``'s (the SAM
    family's descent gradient); with a nonzero ``sharpness`` (only beside ``grad_scale``) ``param`` then takes WSAM's
    decoupled sharpness step, ``fma(C(-lr * sharpness), grad - correction, param)``. With ``scalars`` (float64 ``[2]``: lr and the step count k, read on the device; then
    ``lr=0.0`` and ``first=False``) the step is lr's and the first is k == 1. With ``found_inf`` (float32, one
    element) nonzero, ``param`` <- ``backup`` (untouched without backup) and nothing else is written or ``grad``
    read. With ``first_tile_of_block``, ``partials`` and ``momentum_energy`` (all or none; not with ``found_inf``),
    ``momentum_energy`` (float64 ``[B]``) receives the block energies of the new momentum buffer, each tile's partial
    summed by the program that writes it: :func:`~triton_kernels.energy.block_energy` of the buffer, bit for bit.
    Tensors are positional-or-keyword: a registered op takes no keyword-only tensor."""
    _check_base_buffers(param, tile, grad=grad, backup=backup, momentum_buffer=momentum_buffer)
    if (momentum_buffer is None) != (momentum == 0):
        raise ValueError(
            f"momentum_buffer must be given exactly when momentum != 0 (momentum={momentum}, "
            f"momentum_buffer {'missing' if momentum_buffer is None else 'given'})"
        )
    level = check_correction(param, tile, correction, correction_scale, block_of_tile, grad_scale, sharpness)
    corrected = _correction_pointers(correction, correction_scale, block_of_tile, grad_scale)
    check_device_step("sgd_step_", param, scalars, found_inf, lr=lr, first=first)
    energy = check_momentum_energy(param, tile, momentum_buffer is not None, found_inf, first_tile_of_block, partials,
                                   momentum_energy)  # fmt: skip
    kernel, device_args = _pick(_sgd_kernel, _sgd_corrected_kernel, _sgd_device_kernel, corrected, scalars, found_inf)
    n_tiles = param.numel() // tile
    if n_tiles and launches(kernel, param):
        _launch_sgd(kernel, param, grad, backup, momentum_buffer, corrected, level, device_args, scalars, found_inf,
                    partials if energy else None, tile=tile, lr=lr, weight_decay=weight_decay, momentum=momentum,
                    dampening=dampening, nesterov=nesterov, maximize=maximize, first=first, sharpness=sharpness)  # fmt: skip
    if energy:
        _block_sums(partials, first_tile_of_block, momentum_energy, n_tiles, 1)


def _launch_sgd(kernel, param, grad, backup, momentum_buffer, corrected, level, device_args, scalars, found_inf,
                partials, *, tile, lr, weight_decay, momentum, dampening, nesterov, maximize, first, sharpness):  # fmt: skip
    """sgd_step_'s launch of the picked kernel over every tile (partials: where each tile's momentum energy goes, or
    None)."""
    n_tiles = param.numel() // tile
    # the differences are taken in double, as torch takes them, and rounded to C in the kernel
    neg_lr, one_minus_dampening = -lr, 1.0 - dampening
    pointers = (
        param,
        grad,
        param if backup is None else backup,
        param if momentum_buffer is None else momentum_buffer,  # a placeholder pointer, never dereferenced
        *(_device_pointers(param, corrected, scalars, found_inf) if device_args else corrected),
    )
    device_flags = _flags(level, device_args, scalars, found_inf, backup)
    wrap_triton(kernel)[(n_tiles,)](
        *pointers,
        *pairs(neg_lr, weight_decay, momentum, one_minus_dampening),
        *_sharpness_arguments(corrected, device_args, lr, sharpness),
        HAS_WEIGHT_DECAY=weight_decay != 0,
        HAS_MOMENTUM=momentum != 0,
        NESTEROV=bool(nesterov),
        MAXIMIZE=bool(maximize),
        FIRST=bool(first),
        **device_flags,
        TILE=tile,
        COMPUTE=compute_type(param.dtype),
        partial_ptr=param if partials is None else partials,  # a placeholder pointer without, never dereferenced
        ENERGY=partials is not None,
        enable_fp_fusion=False,
    )


@kept_whole
@triton_op(
    f"{NAMESPACE}::adam_step_",
    mutates_args=("param", "backup", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "partials", "momentum_energy"),
)
def adam_step_(param: torch.Tensor, grad: torch.Tensor, backup: torch.Tensor | None, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None, correction: torch.Tensor | None = None,
               correction_scale: torch.Tensor | None = None, block_of_tile: torch.Tensor | None = None,
               scalars: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
               grad_scale: torch.Tensor | None = None, first_tile_of_block: torch.Tensor | None = None,
               partials: torch.Tensor | None = None, momentum_energy: torch.Tensor | None = None, *, tile: int,
               beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool, amsgrad: bool,
               maximize: bool, lr: float, step: int, sharpness: float = 0.0) -> None:  # fmt: skip
    """``param`` <- torch's Adam (AdamW if ``decoupled``) ``step``-th step (1 for the first) taken from ``backup``
    (from ``param`` itself if ``backup`` is None); the moments (and ``max_exp_avg_sq``, given iff ``amsgrad``)
    updated in place. ``step_size``, ``bias_correction2_sqrt`` and ``decay`` (AdamW's) are derived from ``lr`` and
    ``step`` as torch does (:func:`gearsam_fused.base_step.adam_scalars`): on the host, or, with ``scalars``
    (float64 ``[2]``: lr and k; then ``lr=0.0`` and ``step=0``), by the same float64 operations on the device.
    ``correction``, ``correction_scale``, ``block_of_tile``, ``grad_scale``, ``sharpness``, ``found_inf`` and the
    momentum energy (of ``exp_avg``) as for :func:`sgd_step_`."""
    state = dict(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq)
    _check_base_buffers(param, tile, grad=grad, backup=backup, **state)
    if (max_exp_avg_sq is None) == bool(amsgrad):
        raise ValueError(
            f"max_exp_avg_sq must be given exactly when amsgrad is set (amsgrad={amsgrad}, "
            f"max_exp_avg_sq {'missing' if max_exp_avg_sq is None else 'given'})"
        )
    level = check_correction(param, tile, correction, correction_scale, block_of_tile, grad_scale, sharpness)
    corrected = _correction_pointers(correction, correction_scale, block_of_tile, grad_scale)
    check_device_step("adam_step_", param, scalars, found_inf, lr=lr, step=step)
    energy = check_momentum_energy(param, tile, True, found_inf, first_tile_of_block, partials, momentum_energy)
    kernel, device_args = _pick(
        _adam_kernel, _adam_corrected_kernel, _adam_device_kernel, corrected, scalars, found_inf
    )
    n_tiles = param.numel() // tile
    if n_tiles and launches(kernel, param):
        _launch_adam(kernel, param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, corrected, level, device_args,
                     scalars, found_inf, partials if energy else None, tile=tile, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, lr=lr,
                     step=step, sharpness=sharpness)  # fmt: skip
    if energy:
        _block_sums(partials, first_tile_of_block, momentum_energy, n_tiles, 1)


def _launch_adam(kernel, param, grad, backup, exp_avg, exp_avg_sq, max_exp_avg_sq, corrected, level, device_args,
                 scalars, found_inf, partials, *, tile, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize,
                 lr, step, sharpness):  # fmt: skip
    """adam_step_'s launch of the picked kernel over every tile (partials as for _launch_sgd)."""
    n_tiles = param.numel() // tile
    if scalars is None:
        step_size, bias_correction2_sqrt, decay = adam_scalars(lr, beta1, beta2, weight_decay, step)
    else:  # derived in the kernel; these are not read
        step_size, bias_correction2_sqrt, decay = 0.0, 1.0, 1.0
    lerp_weight, one_minus_beta2, neg_step_size = 1.0 - beta1, 1.0 - beta2, -step_size
    pointers = (
        param,
        grad,
        param if backup is None else backup,
        exp_avg,
        exp_avg_sq,
        exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq,  # a placeholder pointer, never dereferenced
        *(_device_pointers(param, corrected, scalars, found_inf) if device_args else corrected),
    )
    device_flags = _flags(level, device_args, scalars, found_inf, backup)
    wrap_triton(kernel)[(n_tiles,)](
        *pointers,
        *((beta1,) if device_args else ()),
        *pairs(lerp_weight, beta2, one_minus_beta2, eps, weight_decay, decay, neg_step_size, bias_correction2_sqrt),
        *_sharpness_arguments(corrected, device_args, lr, sharpness),
        HAS_WEIGHT_DECAY=weight_decay != 0,
        DECOUPLED=bool(decoupled),
        AMSGRAD=bool(amsgrad),
        MAXIMIZE=bool(maximize),
        # ATen picks the lerp's anchor from the weight as rounded to C, so decide on that value
        LERP_SMALL=abs(in_compute(lerp_weight, param.dtype)) < 0.5,
        **device_flags,
        TILE=tile,
        COMPUTE=compute_type(param.dtype),
        partial_ptr=param if partials is None else partials,  # as in _launch_sgd
        ENERGY=partials is not None,
        enable_fp_fusion=False,
    )

"""The fused base steps' two extensions, on every kernel module: LookSAM's gradient correction
``g = fma(C(correction_scale[block]), correction, grad)`` (C rounding once to the buffers' type, the fma once), and a
step with no ``backup`` (``None``: w is read from ``param`` itself); and the SAM family's mix of the gradient with the
kept one, ``mix_gradient_``: ``g = fma(C(correction_scale[block]), correction, C(grad_scale[block]) * g)``.

The oracle of the correction is exact: each element's ``scale * correction + grad`` is computed in rational arithmetic
and rounded once to the dtype, so nothing depends on how the host rounds (a float64 sum rounded again to float32 could
round twice, and ATen's ``add(alpha=)`` is an fma only by construction of its CPU kernels). A kernel given the
correction must then equal, bit for bit, the same kernel given that gradient without one: the correction changes only
the gradient, the same code (and on every device the same square root) does the rest, so there is no rounding
difference left to tolerate on any device."""

import os
import subprocess
import sys
from fractions import Fraction
from functools import cache
from pathlib import Path

import pytest
import torch

from gearsam_fused.backends.cpp_backend import cpp_installed
from gearsam_fused.backends.triton_backend import triton_installed

from conftest import KERNELS, kernel_module

FLOATS = [torch.float32, torch.float64]
TILE = 64  # small tiles, so a short bucket holds many of them
TILE_BLOCK = [0, 0, 1, 2, 2, 3, 1, 3, 3, 0, 2]  # 11 tiles in 4 blocks, not in block order
SCALES = [0.37, 0.0, -1.25, 3.3e-3]  # per block: 0 leaves grad as it is (but for its sign of zero), one negative
N = TILE * len(TILE_BLOCK)

SGD_FLAGS = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "nesterov-wd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "dampening-maximize": dict(lr=0.0123, momentum=0.5, dampening=0.1, maximize=True),
    "wd-maximize": dict(lr=0.02, weight_decay=5e-4, maximize=True),
}
ADAM_FLAGS = {
    "adam": dict(lr=1e-2),
    "adam-l2-amsgrad": dict(lr=1e-2, weight_decay=1e-2, amsgrad=True),
    "adam-betas-maximize": dict(lr=1e-3, betas=(0.3, 0.8), maximize=True),
    "adamw-amsgrad": dict(lr=1e-3, weight_decay=0.01, amsgrad=True, decoupled=True),
}


def _round_once(x: Fraction, dtype: torch.dtype) -> float:
    """The exact value x rounded to nearest-even in dtype, once."""
    if dtype == torch.float64:
        return float(x)  # int / int true division: correctly rounded
    near = torch.tensor(float(x), dtype=torch.float32)  # within one float32 step of the answer (double rounding)
    steps = [torch.nextafter(near, torch.tensor(v, dtype=torch.float32)) for v in (-float("inf"), float("inf"))]
    candidates = [near, *steps]
    return min(candidates, key=lambda c: (abs(Fraction(c.item()) - x), c.view(torch.int32).item() & 1)).item()


def scales_in(dtype: torch.dtype) -> list[float]:
    """C(correction_scale[b]): each block's float64 scale rounded once to dtype."""
    return torch.tensor(SCALES, dtype=torch.float64).to(dtype).tolist()


@cache
def _exact_corrected(dtype: torch.dtype) -> torch.Tensor:
    grad, correction = buffers(dtype)[1:3]
    scales = scales_in(dtype)
    values = [
        _round_once(Fraction(scales[TILE_BLOCK[i // TILE]]) * Fraction(c) + Fraction(g), dtype)
        for i, (g, c) in enumerate(zip(grad.tolist(), correction.tolist()))
    ]
    return torch.tensor(values, dtype=dtype)


def corrected_grad(dtype: torch.dtype) -> torch.Tensor:
    """The gradient the corrected step must use, from the exact oracle."""
    return _exact_corrected(dtype).clone()


def buffers(dtype: torch.dtype, seed: int = 0):
    """(backup, grad, correction): random, with a zero tail in grad (as padding has) and correction magnitudes that
    span several binades, so the corrected sum rounds in many different ways."""
    g = torch.Generator().manual_seed(seed)
    backup = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    grad[-20:] = 0
    exponents = torch.randint(-4, 4, (N,), generator=g).to(torch.float64)
    correction = (torch.randn(N, generator=g, dtype=torch.float64) * 10.0**exponents).to(dtype)
    return backup, grad, correction


def correction_args(dtype: torch.dtype, device: str) -> dict:
    _, _, correction = buffers(dtype)
    return dict(
        correction=correction.to(device),
        correction_scale=torch.tensor(SCALES, dtype=torch.float64, device=device),
        block_of_tile=torch.tensor(TILE_BLOCK, dtype=torch.int32, device=device),
    )


def sgd_kwargs(flags: str, first: bool) -> dict:
    return {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False,
            "first": first, "tile": TILE, **SGD_FLAGS[flags]}  # fmt: skip


def run_sgd(module, backup, grad, kw: dict, device: str, buffer=None, alias=False, **extra):
    """(param, momentum buffer) after one sgd_step_ from backup (from param itself, backup None, if alias; else into a
    NaN-filled param)."""
    param = backup.to(device, copy=True) if alias else torch.full_like(backup, float("nan"), device=device)
    if kw["momentum"]:
        buffer = (torch.randn(N, generator=torch.Generator().manual_seed(2)) if buffer is None else buffer).to(grad)
        buffer = buffer.to(device, copy=True)
    module.sgd_step_(param, grad.to(device), None if alias else backup.to(device), buffer, **kw, **extra)
    return param.cpu(), None if buffer is None else buffer.cpu()


def adam_kwargs(flags: str, step: int = 3) -> dict:
    kw = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
          "decoupled": False, **ADAM_FLAGS[flags]}  # fmt: skip
    beta1, beta2 = kw.pop("betas")
    return dict(kw, tile=TILE, beta1=beta1, beta2=beta2, lr=kw.pop("lr"), step=step + 1)


def run_adam(module, backup, grad, kw: dict, device: str, alias=False, **extra):
    """(param, exp_avg, exp_avg_sq, max_exp_avg_sq or None) after one adam_step_ from a fixed nonzero state."""
    g = torch.Generator().manual_seed(1)
    state = [0.1 * torch.randn(N, generator=g), 0.01 * torch.rand(N, generator=g)]
    state.append(state[1] * 1.5 if kw["amsgrad"] else None)
    state = [None if s is None else s.to(device, grad.dtype) for s in state]
    param = backup.to(device, copy=True) if alias else torch.full_like(backup, float("nan"), device=device)
    module.adam_step_(param, grad.to(device), None if alias else backup.to(device), *state, **kw, **extra)
    return [None if t is None else t.cpu() for t in (param, *state)]


def assert_bitwise(got, expected):
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"output {i}: {(a != b).sum().item()} of {a.numel()} elements differ"


# ------------------------------------------------------------------------------------------- the family's mix
MIX_FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
GRAD_SCALES = [1.37, 1.0, -0.5, 2.0**-3]  # per block, beside SCALES as the correction's


def _exact_mixed(dtype: torch.dtype) -> torch.Tensor:
    """mix_gradient_'s result from rational arithmetic: in the compute type C (float64 for float64, else float32),
    the product C(a) * g rounded once, the fma with C(c) * correction rounded once, then once to the stored dtype."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    _, grad, correction = buffers(dtype)
    a, c = (torch.tensor(v, dtype=torch.float64).to(compute).tolist() for v in (GRAD_SCALES, SCALES))
    values = []
    for i, (g, k) in enumerate(zip(grad.to(compute).tolist(), correction.to(compute).tolist())):
        b = TILE_BLOCK[i // TILE]
        product = _round_once(Fraction(a[b]) * Fraction(g), compute)
        values.append(_round_once(Fraction(c[b]) * Fraction(k) + Fraction(product), compute))
    return torch.tensor(values, dtype=compute).to(dtype)


@pytest.mark.parametrize("dtype", MIX_FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_mixed_gradient_is_the_rounded_product_then_one_fma(backend, device, dtype):
    _, grad, correction = buffers(dtype)
    grad, correction = grad.to(device), correction.to(device)
    scales = (torch.tensor(v, dtype=torch.float64, device=device) for v in (GRAD_SCALES, SCALES))
    block_of_tile = torch.tensor(TILE_BLOCK, dtype=torch.int32, device=device)
    kernel_module(backend).mix_gradient_(grad, correction, *scales, block_of_tile, tile=TILE)
    assert torch.equal(grad.cpu(), _exact_mixed(dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_mix_oracle_fuses_the_add(dtype):
    """The oracle differs from rounding the second product and the sum separately on some elements: the comparison
    above tells the kernels' fma from a multiply then an add (in float32 and float64; rounded on to bfloat16 or
    float16, the two agree on these values)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    _, grad, correction = buffers(dtype)
    per_element = torch.tensor(TILE_BLOCK).repeat_interleave(TILE)
    a, c = (torch.tensor(v, dtype=torch.float64).to(compute)[per_element] for v in (GRAD_SCALES, SCALES))
    assert (_exact_mixed(dtype) != (a * grad.to(compute) + c * correction.to(compute)).to(dtype)).any()


@pytest.mark.parametrize("dtype", MIX_FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_exchanged_sharpness_is_the_difference_rounded_once(backend, device, dtype):
    """WSAM's exchange: the gradient takes the kept one's bits, the kept one the difference in the compute type
    rounded once to the dtype (zero where both are, as in the padding)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    _, grad, correction = buffers(dtype)
    expected = ((grad.to(compute) - correction.to(compute)).to(dtype), correction.clone())
    grad, correction = grad.to(device), correction.to(device)
    kernel_module(backend).exchange_sharpness_(grad, correction, tile=TILE)
    assert torch.equal(correction.cpu(), expected[0]) and torch.equal(grad.cpu(), expected[1])


# ------------------------------------------------------------------------------------------- F-SAM's ascent
#: (sigma, lmbda): a small lerp weight 1 - lmbda (torch's lerp anchors at m), a large one (anchored at g, with the
#: weight minus 1), and one just below 0.5 in float64 that rounds to 0.5 in float32 (large there, small in float64:
#: the anchor is decided on the weight in the compute type)
FRIENDLY = {"small-weight": (1.0, 0.9), "large-weight": (0.7, 0.3), "weight-at-half": (0.3, 0.5 + 2.0**-30)}


def _exact_friendly(grad: torch.Tensor, m: torch.Tensor, sigma: float, lmbda: float):
    """friendly_ascent_'s (grad, m) from rational arithmetic, in the compute type C (float64 for float64, else
    float32): fma(-C(sigma), m, g) rounded once; the lerp's g - m rounded once, then its fma rounded once (anchored at
    m with C(1 - lmbda) where that is below 0.5 in size, else at g with C(1 - lmbda) - 1, rounded once); each then
    rounded once to the stored dtype."""
    dtype = grad.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    s, w = (torch.tensor(v, dtype=torch.float64).to(compute).item() for v in (sigma, 1.0 - lmbda))
    small = abs(w) < 0.5
    coeff = w if small else _round_once(Fraction(w) - 1, compute)
    ascent, ema = [], []
    for g, mi in zip(grad.to(compute).tolist(), m.to(compute).tolist()):
        ascent.append(_round_once(Fraction(g) - Fraction(s) * Fraction(mi), compute))
        diff = _round_once(Fraction(g) - Fraction(mi), compute)
        ema.append(_round_once(Fraction(coeff) * Fraction(diff) + Fraction(mi if small else g), compute))
    return tuple(torch.tensor(v, dtype=compute).to(dtype) for v in (ascent, ema))


@pytest.mark.parametrize("flags", list(FRIENDLY))
@pytest.mark.parametrize("dtype", MIX_FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_friendly_ascent_rounds_each_fma_once(backend, device, dtype, flags):
    """F-SAM's ascent on a range of a bucket at any offset and length (a whole number of vectors or not, aligned or
    not): the exact oracle's bits in both buffers, and nothing outside the range touched. The first step copies the
    gradient into the EMA and leaves the gradient as it is."""
    sigma, lmbda = FRIENDLY[flags]
    # three buffers' worth: ranges longer than two of the Triton kernel's programs
    grad, m = (torch.cat([t, 1e-3 * t.flip(0), 8.0 * t]) for t in buffers(dtype)[1:])
    module = kernel_module(backend)
    for start, end in [(0, 3 * N), (1, 3 * N - 3), (5, 6), (64, 64 + 37)]:
        g_dev, m_dev = grad.to(device, copy=True), m.to(device, copy=True)
        module.friendly_ascent_(g_dev[start:end], m_dev[start:end], sigma=sigma, lmbda=lmbda, first=False)
        expected = _exact_friendly(grad[start:end], m[start:end], sigma, lmbda)
        for got, before, exact in zip((g_dev.cpu(), m_dev.cpu()), (grad, m), expected):
            assert torch.equal(got[start:end], exact), (start, end)
            assert torch.equal(got[:start], before[:start]) and torch.equal(got[end:], before[end:]), (start, end)
    start, end = 3, N + 5
    g_dev, m_dev = grad.to(device, copy=True), m.to(device, copy=True)
    module.friendly_ascent_(g_dev[start:end], m_dev[start:end], sigma=sigma, lmbda=lmbda, first=True)
    assert torch.equal(g_dev.cpu(), grad)
    assert torch.equal(m_dev.cpu(), torch.cat([m[:start], grad[start:end], m[end:]]))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_friendly_oracle_fuses_its_products(dtype):
    """The oracle's ascent and EMA differ on some elements from rounding each product on its own: the comparison above
    tells the kernels' fmas from a multiply then an add."""
    _, grad, m = buffers(dtype)
    for sigma, lmbda in (FRIENDLY["small-weight"], FRIENDLY["large-weight"]):  # 0.5's products are exact
        ascent, ema = _exact_friendly(grad, m, sigma, lmbda)
        s, w = (torch.tensor(v, dtype=torch.float64).to(dtype) for v in (sigma, 1.0 - lmbda))
        unfused_ema = m + w * (grad - m) if w < 0.5 else grad + (w - 1) * (grad - m)
        assert (ema != unfused_ema).any()
        assert sigma == 1.0 or (ascent != grad - s * m).any()  # a product by 1 is exact: nothing to fuse


def test_the_friendly_oracle_anchors_the_lerp_by_the_weight_in_the_compute_type():
    """At a weight just below 0.5 that rounds to 0.5 in float32, the float32 oracle anchors at g and differs, on some
    elements, from anchoring at m: the kernels' choice is checked, not just their arithmetic."""
    _, grad, m = buffers(torch.float32)
    sigma, lmbda = FRIENDLY["weight-at-half"]
    w = torch.tensor(1.0 - lmbda, dtype=torch.float64).to(torch.float32)
    assert w.item() == 0.5 and 1.0 - lmbda < 0.5
    _, ema = _exact_friendly(grad, m, sigma, lmbda)
    anchored_at_m = [_round_once(Fraction(w.item()) * Fraction(_round_once(Fraction(g) - Fraction(mi), torch.float32))
                                 + Fraction(mi), torch.float32) for g, mi in zip(grad.tolist(), m.tolist())]  # fmt: skip
    assert (ema != torch.tensor(anchored_at_m)).any()


@pytest.mark.parametrize("first", [False, True], ids=["later", "first"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("flags", ["small-weight", "large-weight"])
@pytest.mark.parametrize("dtype", MIX_FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_friendly_energy_is_the_ascent_then_the_energies(backend, device, dtype, flags, adaptive, first):
    """friendly_energy_ on a whole bucket: the bits of friendly_ascent_ then block_energy, in the gradient, the EMA,
    every tile's partial and every block's energy (blocks of 2, 3, 0 and 6 tiles). Later steps' energies are not the
    first gradient's: the sums are of the new gradient."""
    sigma, lmbda = FRIENDLY[flags]
    param, grad, m = (t.to(device) for t in buffers(dtype))
    first_tile_of_block = torch.tensor([0, 2, 5, 5, len(TILE_BLOCK)], device=device)
    module = kernel_module(backend)
    energy_kw = dict(tile=TILE, adaptive=adaptive, eta=0.01)
    g_two, m_two, g_one, m_one = grad.clone(), m.clone(), grad.clone(), m.clone()
    partials_two, partials_one = (torch.full((len(TILE_BLOCK),), float("nan"), dtype=torch.float64, device=device)
                                  for _ in range(2))  # fmt: skip
    module.friendly_ascent_(g_two, m_two, sigma=sigma, lmbda=lmbda, first=first)
    expected = module.block_energy(g_two, param, first_tile_of_block, partials_two, **energy_kw)
    energy = module.friendly_energy_(g_one, m_one, param, first_tile_of_block, partials_one, **energy_kw, sigma=sigma,
                                     lmbda=lmbda, first=first)  # fmt: skip
    for got, want in ((g_one, g_two), (m_one, m_two), (partials_one, partials_two), (energy, expected)):
        assert torch.equal(got, want)
    before = module.block_energy(grad, param, first_tile_of_block, partials_two, **energy_kw)
    assert torch.equal(energy, before) == first


# ------------------------------------------------------------------------------------------- the correction
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_oracle_is_a_fused_multiply_add(dtype):
    """The exact oracle is a single rounding: it differs from rounding the product and the sum separately on some
    elements, so the comparisons below tell an fma from a multiply then an add."""
    _, grad, correction = buffers(dtype)
    scale = torch.tensor(scales_in(dtype), dtype=dtype)[torch.tensor(TILE_BLOCK).repeat_interleave(TILE)]
    assert (corrected_grad(dtype) != grad + scale * correction).any()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_corrected_gradient_is_one_fma(backend, device, dtype):
    """SGD's first momentum step stores the step's gradient itself: it is the exact, once-rounded fma."""
    backup, grad, _ = buffers(dtype)
    kw = sgd_kwargs("momentum", first=True)
    _, buffer = run_sgd(kernel_module(backend), backup, grad, kw, device, **correction_args(dtype, device))
    assert torch.equal(buffer, corrected_grad(dtype))


def mix_args(dtype: torch.dtype, device: str) -> dict:
    """The correction's arguments with grad_scale beside them: the step's gradient is mix_gradient_'s."""
    return dict(
        correction_args(dtype, device), grad_scale=torch.tensor(GRAD_SCALES, dtype=torch.float64, device=device)
    )


#: the gradient a corrected step takes, by its extra arguments: LookSAM's correction, or with grad_scale the SAM
#: family's descent folded into the step (mix_gradient_'s formula); (arguments, exact oracle)
STEP_GRADIENTS = {"looksam": (correction_args, corrected_grad), "mix": (mix_args, _exact_mixed)}


@pytest.mark.parametrize("kind", list(STEP_GRADIENTS))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("flags", list(SGD_FLAGS), ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_corrected_sgd_is_sgd_on_the_corrected_gradient(backend, device, flags, first, dtype, kind):
    """The bits of the exact oracle's gradient, then the plain step (on SGD's first momentum step, the buffer stores
    that gradient itself)."""
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    kw = sgd_kwargs(flags, first)
    arguments, oracle = STEP_GRADIENTS[kind]
    got = run_sgd(module, backup, grad, kw, device, **arguments(dtype, device))
    assert_bitwise(got, run_sgd(module, backup, oracle(dtype), kw, device))
    if flags == "momentum" and first:  # no weight decay, no sign: the buffer is the gradient itself
        assert torch.equal(got[1], oracle(dtype))


@pytest.mark.parametrize("kind", list(STEP_GRADIENTS))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("flags", list(ADAM_FLAGS), ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_corrected_adam_is_adam_on_the_corrected_gradient(backend, device, flags, dtype, kind):
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    kw = adam_kwargs(flags)
    arguments, oracle = STEP_GRADIENTS[kind]
    got = run_adam(module, backup, grad, kw, device, **arguments(dtype, device))
    assert_bitwise(got, run_adam(module, backup, oracle(dtype), kw, device))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_mixed_gradient_differs_from_the_corrected_one(dtype):
    """grad_scale changes the gradient the step takes: the comparisons above cannot pass by ignoring it."""
    assert (_exact_mixed(dtype) != corrected_grad(dtype)).any()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_a_skipped_step_with_a_grad_scale_restores_and_writes_nothing_else(backend, device, dtype):
    """found_inf set: w <- backup, the state keeps its bits, whatever the mix (the device kernels' path)."""
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    found_inf = torch.ones((), dtype=torch.float32, device=device)
    kw = sgd_kwargs("momentum", first=False)
    param, buffer = run_sgd(module, backup, grad, kw, device, found_inf=found_inf, **mix_args(dtype, device))
    _, untouched = run_sgd(module, backup, grad, sgd_kwargs("plain", True), device)  # no buffer: None
    assert torch.equal(param, backup) and untouched is None
    assert torch.equal(buffer, torch.randn(N, generator=torch.Generator().manual_seed(2)).to(dtype))


# ------------------------------------------------------------------------------------------- the sharpness step
SHARPNESS = 2.7  # WSAM's weight a = gamma / (1 - gamma) at gamma 0.73


def _exact_sharpened(w_new: torch.Tensor, dtype: torch.dtype, lr: float) -> torch.Tensor:
    """WSAM's decoupled sharpness step after an update to w_new, from rational arithmetic: C(-lr * a) * (grad -
    correction) + w_new rounded once, the difference rounded once to dtype first (the kept ``h - g`` of the exchange)."""
    _, grad, correction = buffers(dtype)
    factor = torch.tensor(-lr * SHARPNESS, dtype=torch.float64).to(dtype).item()
    differences = (grad - correction).tolist()
    values = [
        _round_once(Fraction(factor) * Fraction(d) + Fraction(w), dtype) for d, w in zip(differences, w_new.tolist())
    ]
    return torch.tensor(values, dtype=dtype)


def sharpness_args(dtype: torch.dtype, device: str) -> dict:
    """The mix's arguments with a sharpness step after the update."""
    return dict(mix_args(dtype, device), sharpness=SHARPNESS)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("flags", list(SGD_FLAGS), ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_sgd_with_a_sharpness_step_is_the_step_then_one_fma(backend, device, flags, first, dtype):
    """The state of the plain step on the mixed gradient; the parameter that step writes, then the exact sharpness
    step rounded once."""
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    kw = sgd_kwargs(flags, first)
    param, buffer = run_sgd(module, backup, grad, kw, device, **sharpness_args(dtype, device))
    stepped, expected_buffer = run_sgd(module, backup, _exact_mixed(dtype), kw, device)
    assert_bitwise((param, buffer), (_exact_sharpened(stepped, dtype, kw["lr"]), expected_buffer))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("flags", list(ADAM_FLAGS), ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_adam_with_a_sharpness_step_is_the_step_then_one_fma(backend, device, flags, dtype):
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    kw = adam_kwargs(flags)
    got = run_adam(module, backup, grad, kw, device, **sharpness_args(dtype, device))
    stepped, *state = run_adam(module, backup, _exact_mixed(dtype), kw, device)
    assert_bitwise(got, (_exact_sharpened(stepped, dtype, kw["lr"]), *state))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_sharpness_oracle_fuses_the_add(dtype):
    """The exact step differs from rounding the product and the sum separately on some elements, and from the
    update alone: the comparisons above tell the kernels' fma, and that it happened."""
    w_new = buffers(dtype, seed=3)[0]
    _, grad, correction = buffers(dtype)
    factor = torch.tensor(-0.05 * SHARPNESS, dtype=torch.float64).to(dtype)
    exact = _exact_sharpened(w_new, dtype, 0.05)
    assert (exact != w_new + factor * (grad - correction)).any() and (exact != w_new).any()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_the_sharpness_step_takes_the_lr_of_the_scalars(backend, device, dtype):
    """With scalars, -lr * a is taken from the device's lr in float64 and rounded once: the host call's bits."""
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    args = sharpness_args(dtype, device)
    sgd = sgd_kwargs("nesterov-wd", first=False)
    scalars = torch.tensor([sgd["lr"], 2.0], dtype=torch.float64, device=device)
    on_device = run_sgd(module, backup, grad, dict(sgd, lr=0.0), device, scalars=scalars, **args)
    assert_bitwise(on_device, run_sgd(module, backup, grad, sgd, device, **args))
    adam = adam_kwargs("adamw-amsgrad")
    scalars = torch.tensor([adam["lr"], adam["step"]], dtype=torch.float64, device=device)
    on_device = run_adam(module, backup, grad, dict(adam, lr=0.0, step=0), device, scalars=scalars, **args)
    assert_bitwise(on_device, run_adam(module, backup, grad, adam, device, **args))


# ------------------------------------------------------------------------------------------- no backup
@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "corrected"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_sgd_from_param_itself_equals_sgd_from_a_copy(backend, device, dtype, corrected):
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    extra = correction_args(dtype, device) if corrected else {}
    for flags in ("nesterov-wd", "wd-maximize"):
        kw = sgd_kwargs(flags, first=False)
        got = run_sgd(module, backup, grad, kw, device, alias=True, **extra)
        assert_bitwise(got, run_sgd(module, backup, grad, kw, device, **extra))


@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "corrected"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_adam_from_param_itself_equals_adam_from_a_copy(backend, device, dtype, corrected):
    module = kernel_module(backend)
    backup, grad, _ = buffers(dtype)
    extra = correction_args(dtype, device) if corrected else {}
    for flags in ("adam-l2-amsgrad", "adamw-amsgrad"):
        kw = adam_kwargs(flags)
        got = run_adam(module, backup, grad, kw, device, alias=True, **extra)
        assert_bitwise(got, run_adam(module, backup, grad, kw, device, **extra))


# ------------------------------------------------------------------------------------------- refused arguments
def _sgd_call(module, **extra):
    backup, grad, _ = buffers(torch.float32)
    module.sgd_step_(backup.clone(), grad, backup, None, **sgd_kwargs("plain", True), **extra)


def _adam_call(module, **extra):
    backup, grad, _ = buffers(torch.float32)
    state = (torch.zeros_like(grad), torch.zeros_like(grad), None)
    module.adam_step_(backup.clone(), grad, backup, *state, **adam_kwargs("adam"), **extra)


PARTIAL = {  # given -> the message's list of what is missing
    ("correction",): "correction_scale, block_of_tile",
    ("correction_scale",): "correction, block_of_tile",
    ("block_of_tile",): "correction, correction_scale",
    ("correction", "correction_scale"): "block_of_tile",
    ("correction", "block_of_tile"): "correction_scale",
    ("correction_scale", "block_of_tile"): "correction",
}
WRONG = {  # argument -> (replacement, message)
    "correction_scale": (
        torch.ones(4, dtype=torch.float32),
        "correction_scale must be torch.float64, got torch.float32",
    ),
    "block_of_tile": (
        torch.zeros(len(TILE_BLOCK), dtype=torch.int64),
        "block_of_tile must be torch.int32, got torch.int64",
    ),
    "correction": (
        torch.ones(N, dtype=torch.float64),
        r"correction \(torch.float64 \(704,\) on cpu\) must match param",
    ),
}
CPU_KERNELS = [c for c in KERNELS if c.values[1] == "cpu"]


@pytest.mark.parametrize("call", [_sgd_call, _adam_call], ids=["sgd", "adam"])
@pytest.mark.parametrize("given", list(PARTIAL), ids="+".join)
@pytest.mark.parametrize("backend,device", CPU_KERNELS)
def test_a_partial_correction_is_refused_naming_what_is_missing(backend, device, call, given):
    extra = {k: v for k, v in correction_args(torch.float32, "cpu").items() if k in given}
    message = f"correction, correction_scale and block_of_tile must be given together, missing {PARTIAL[given]}$"
    with pytest.raises(ValueError, match=message):
        call(kernel_module(backend), **extra)


@pytest.mark.parametrize("call", [_sgd_call, _adam_call], ids=["sgd", "adam"])
@pytest.mark.parametrize("wrong", list(WRONG) + ["tile_count"])
@pytest.mark.parametrize("backend,device", CPU_KERNELS)
def test_a_wrong_correction_buffer_is_refused_by_name(backend, device, call, wrong):
    extra = correction_args(torch.float32, "cpu")
    if wrong == "tile_count":
        extra["block_of_tile"], message = extra["block_of_tile"][:-1], "block_of_tile has 10 entries for 11 tiles"
    else:
        extra[wrong], message = WRONG[wrong]
    with pytest.raises(ValueError, match=message):
        call(kernel_module(backend), **extra)


@pytest.mark.parametrize("call", [_sgd_call, _adam_call], ids=["sgd", "adam"])
@pytest.mark.parametrize("backend,device", CPU_KERNELS)
def test_a_grad_scale_without_a_correction_is_refused(backend, device, call):
    grad_scale = torch.tensor(GRAD_SCALES, dtype=torch.float64)
    with pytest.raises(ValueError, match="^grad_scale scales the gradient beside a correction: give correction, "):
        call(kernel_module(backend), grad_scale=grad_scale)


SHARPNESS_WRONG = {  # what the step is given beside sharpness -> (sharpness, message)
    "without-grad-scale": (
        "correction",
        0.5,
        "^sharpness steps along grad - correction after the update from a mixed ",
    ),
    "alone": ("nothing", 0.5, "^sharpness steps along grad - correction after the update from a mixed "),
    "nan": ("mix", float("nan"), "^sharpness must be a finite real number, got nan$"),
    "inf": ("mix", float("inf"), "^sharpness must be a finite real number, got inf$"),
}


def _sharpness_case(wrong: str) -> tuple[dict, str]:
    """The step's extra arguments for a SHARPNESS_WRONG case, and the message it is refused with."""
    beside, sharpness, message = SHARPNESS_WRONG[wrong]
    extra = {"correction": correction_args, "mix": mix_args, "nothing": lambda *_: {}}[beside](torch.float32, "cpu")
    return dict(extra, sharpness=sharpness), message


@pytest.mark.parametrize("call", [_sgd_call, _adam_call], ids=["sgd", "adam"])
@pytest.mark.parametrize("wrong", list(SHARPNESS_WRONG))
@pytest.mark.parametrize("backend,device", CPU_KERNELS)
def test_a_sharpness_without_a_mix_or_not_finite_is_refused(backend, device, call, wrong):
    extra, message = _sharpness_case(wrong)
    with pytest.raises(ValueError, match=message):
        call(kernel_module(backend), **extra)


GRAD_SCALE_WRONG = {  # grad_scale -> message
    "float32": (torch.ones(4, dtype=torch.float32), "grad_scale must be torch.float64, got torch.float32"),
    "length": (torch.ones(3, dtype=torch.float64), "correction_scale has 4 entries, grad_scale 3: one per block each"),
}


@pytest.mark.parametrize("call", [_sgd_call, _adam_call], ids=["sgd", "adam"])
@pytest.mark.parametrize("wrong", list(GRAD_SCALE_WRONG))
@pytest.mark.parametrize("backend,device", CPU_KERNELS)
def test_a_wrong_grad_scale_is_refused_by_name(backend, device, call, wrong):
    bad, message = GRAD_SCALE_WRONG[wrong]
    with pytest.raises(ValueError, match=message):
        call(kernel_module(backend), **correction_args(torch.float32, "cpu"), grad_scale=bad)


def test_both_modules_refuse_with_the_same_words():
    if not (cpp_installed() and triton_installed()):
        pytest.skip("needs both kernel modules")
    args = correction_args(torch.float32, "cpu")
    cases = [{"correction": args["correction"]}, {**args, "block_of_tile": args["block_of_tile"][:-1]}]
    cases += [{**args, k: v} for k, (v, _) in WRONG.items()]
    cases += [{"grad_scale": v} for v, _ in GRAD_SCALE_WRONG.values()]
    cases += [{**args, "grad_scale": v} for v, _ in GRAD_SCALE_WRONG.values()]
    cases += [_sharpness_case(wrong)[0] for wrong in SHARPNESS_WRONG]
    for extra in cases:
        for call in (_sgd_call, _adam_call):
            messages = []
            for module in (kernel_module("triton"), kernel_module("cpp")):
                with pytest.raises(ValueError) as info:
                    call(module, **extra)
                messages.append(str(info.value))
            assert messages[0] == messages[1]


# ------------------------------------------------------------------------------------------- compiled for the GPU
_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, {tests!r})
from compile_kernels import base_step_variants
from gearsam_fused.triton_kernels import base_step
compiled = 0
for name, plain, signature, constexprs in base_step_variants():
    kernel = {{base_step._sgd_kernel: base_step._sgd_corrected_kernel,
              base_step._adam_kernel: base_step._adam_corrected_kernel}}[plain]
    signature = dict(signature, corr_ptr=signature["param_ptr"], cscale_ptr="*fp64", gscale_ptr="*fp64",
                     block_of_tile_ptr="*i32", sharpness_step32="fp32", sharpness_step64="fp64", sharpness64="fp64")
    for level in (1, 2, 3):  # LookSAM's correction; the SAM family's mix; and WSAM's sharpness step after it
        flags = dict(constexprs, CORRECTED=level)
        source = ASTSource(fn=kernel, signature={{**signature, **{{k: "constexpr" for k in flags}}}}, constexprs=flags)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={{"enable_fp_fusion": False}}).asm["ptx"]
        approx = sum(".approx" in line or "div.full" in line for line in ptx.splitlines())
        assert ptx.count("fma.rn") and not approx, (name, level, approx)
        compiled += 1
print("ok", compiled)
"""


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
def test_corrected_triton_kernels_compile_for_hopper():
    """The corrected twins compiled for sm_90 (no GPU needed) at their three levels (LookSAM's correction, the mix
    with grad_scale, the mix with WSAM's sharpness step), as tests/kernels/compile_kernels.py compiles the others: they lower,
    and every division and root stays correctly rounded."""
    pytest.importorskip("triton")
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = _COMPILE.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stderr[-3000:]
    assert int(done.stdout.split()[1]) == 3 * 4, done.stdout  # three levels of SGD and Adam, float32 and float64

"""Each fused operation (block energy, allocation, perturb, restore) of the torch, triton and cpp backends against the
reference backend, per dtype, over sizes and partitions that hit the edge cases of the flat layout."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gearsam_fused import GEARSAM
from gearsam_fused.allocation import GEAR_RULE, RULES, SAM_RULE, gear_allocate, sam_allocate
from gearsam_fused.backends import BACKENDS
from gearsam_fused.backends.reference import ReferenceBackend
from gearsam_fused.flat import TILE
from gearsam_fused.partition import Block

from conftest import FUSED, KERNELS, kernel_module

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

#: Block energies: float32 accumulation (float64 for float64) against the reference's float64 sums.
ENERGY_RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float16: 1e-6, torch.float64: 1e-13}


def ulp_tolerance(dtype: torch.dtype) -> dict:
    """One unit in the last place of the stored dtype, for values of order one: the most a contracted multiply-add
    can move ``w + scale * g`` after rounding."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=eps, atol=eps)


# Each layout: blocks of parameter specs (shape, gradient kind). Sizes 1, 7, 4097 (= 2 * TILE + 1), exact tiles and
# other non-multiples of the tile, empty blocks, all-zero gradients and parameters without a gradient.
LAYOUTS = {
    "one-block": [[((1,), "randn"), ((7,), "randn"), ((4097,), "randn"), ((3, 5, 7), "randn")]],
    "edge-cases": [
        [((1,), "randn"), ((7,), "randn"), ((4097,), "randn")],
        [],  # empty block
        [((300,), "zeros"), ((5, 1), "zeros")],  # gradient exactly zero
        [((2049,), "none"), ((33,), "randn")],  # a parameter that got no gradient this step
        [((TILE,), "randn")],  # exactly one tile
        [((2, TILE + 3), "randn"), ((1,), "none")],
    ],
    "per-tensor": [[((n,), "randn")] for n in (1, 7, 64, 4097, 2 * TILE - 1)],
}


def make_blocks(layout: str, dtype: torch.dtype, device: str, seed: int = 0) -> list[Block]:
    """Fresh parameters and gradients; the same arguments always give the same values."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for b, specs in enumerate(LAYOUTS[layout]):
        block = Block(f"block{b}")
        for i, (shape, grad) in enumerate(specs):
            p = nn.Parameter(torch.randn(shape, generator=g).to(device, dtype))
            values = torch.randn(shape, generator=g).to(device, dtype)
            p.grad = {"randn": values, "zeros": torch.zeros_like(values), "none": None}[grad]
            block.params.append(p)
            block.param_names.append(f"block{b}.p{i}")
        blocks.append(block)
    return blocks


def params_of(blocks):
    return [p for b in blocks for p in b.params]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.detach().view(ints), b.detach().view(ints))


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_block_energy_matches_reference(backend, device, layout, dtype, adaptive):
    reference = ReferenceBackend(make_blocks(layout, dtype, device), torch.device(device))
    fused = BACKENDS[backend](make_blocks(layout, dtype, device), torch.device(device))
    expected = reference.block_energy(adaptive, eta=0.01)
    energy = fused.block_energy(adaptive, eta=0.01)
    assert energy.dtype == torch.float64 and energy.device.type == device
    torch.testing.assert_close(energy, expected, rtol=ENERGY_RTOL[dtype], atol=0)
    if layout == "edge-cases":
        assert energy[1] == 0 and energy[2] == 0  # empty block, all-zero gradients


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_perturb_matches_reference_and_restore_is_exact(backend, device, layout, dtype, adaptive):
    reference_blocks, fused_blocks = make_blocks(layout, dtype, device), make_blocks(layout, dtype, device)
    originals = [p.detach().clone() for p in params_of(fused_blocks)]
    reference = ReferenceBackend(reference_blocks, torch.device(device))
    fused = BACKENDS[backend](fused_blocks, torch.device(device))
    scale = torch.linspace(0.5, 2.0, len(fused_blocks), dtype=torch.float64, device=device)

    reference.block_energy(adaptive, 0.01)
    fused.block_energy(adaptive, 0.01)  # the flow of a step: energies read the gradients first
    reference.perturb_(scale, adaptive, 0.01)
    fused.perturb_(scale, adaptive, 0.01)
    # The Triton and C++ kernels round exactly like the reference's separate multiply and add (never contracted);
    # torch's addcmul may contract them into one FMA, which moves the result by at most one unit in the last place.
    exact = backend in ("triton", "cpp")
    for p, q, w in zip(params_of(fused_blocks), params_of(reference_blocks), originals):
        if exact:
            assert bitwise_equal(p, q)
        else:
            torch.testing.assert_close(p.detach(), q.detach(), **ulp_tolerance(dtype))
        if q.grad is None or not q.grad.any():
            assert torch.equal(p, w)  # no gradient, or a zero one: no perturbation
        elif p.numel() > 1:
            assert not torch.equal(p, w)
    fused.restore_()
    assert all(bitwise_equal(p, w) for p, w in zip(params_of(fused_blocks), originals))


@pytest.mark.parametrize("backend,device", KERNELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_a_perturbation_that_keeps_the_gradients_is_the_two_passes(backend, device, layout, dtype, adaptive):
    """perturb_(keep=True) on the kernel backends: the perturbation's bits, and the kept buffer keep_gradient_'s (the
    gradients' bits; zeros where a parameter has none), from one pass."""
    runs = []
    for keep in (True, False):
        blocks = make_blocks(layout, dtype, device)
        fused = BACKENDS[backend](blocks, torch.device(device))
        scale = torch.linspace(0.5, 2.0, len(blocks), dtype=torch.float64, device=device)
        scale[len(blocks) // 2] = 0.0  # a block this step skips still has its gradient kept
        fused.block_energy(adaptive, 0.01)
        if not keep:
            fused.keep_gradient_()
        fused.perturb_(scale, adaptive, 0.01, keep=keep)
        runs.append(([p.detach().clone() for p in params_of(blocks)], fused.buffer_tensors("correction")))
        fused.restore_()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params_of(blocks)]
        assert all(bitwise_equal(k, g) for k, g in zip(runs[-1][1], grads, strict=True))
    for got, expected in zip(*runs, strict=True):
        assert all(bitwise_equal(a, b) for a, b in zip(got, expected, strict=True))


# ------------------------------------------------------------------------------------------- allocation
def _allocation_cases():
    g = torch.Generator().manual_seed(3)
    many = torch.rand(3000, generator=g, dtype=torch.float64)  # more blocks than one loop iteration covers
    mixed = torch.tensor([4.0, 0.0, 9.0, 1e-30, 2.5e6], dtype=torch.float64)
    return {
        "mixed": (mixed, torch.tensor([1.0, 2.0, 0.0, 0.0, 3.0], dtype=torch.float64)),
        "first-step": (mixed, torch.zeros(5, dtype=torch.float64)),
        "all-zero": (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)),
        "one-block": (torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)),
        "3000-blocks": (many, torch.rand(3000, generator=g, dtype=torch.float64)),
        "non-finite": (
            torch.tensor([4.0, math.inf, 9.0, math.nan], dtype=torch.float64),
            torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64),
        ),
    }


@pytest.mark.parametrize("backend,device", KERNELS)
@pytest.mark.parametrize("case", list(_allocation_cases()))
@pytest.mark.parametrize("rule", RULES)
def test_allocate_kernel_matches_torch_allocation(backend, device, case, rule):
    energy, ema = (t.to(device) for t in _allocation_cases()[case])
    ema_kernel, ema_torch = ema.clone(), ema.clone()
    gear = rule == GEAR_RULE
    scale, radius = kernel_module(backend).allocate(energy, ema_kernel, gear=gear, rho=0.3, beta=0.9, delta=1e-12)
    if gear:
        expected_scale, expected_radius = gear_allocate(energy, ema_torch, 0.3, 0.9, 1e-12)
    else:
        expected_scale, expected_radius = sam_allocate(energy, 0.3, 1e-12)
    torch.testing.assert_close(ema_kernel, ema_torch, rtol=1e-15, atol=0)
    torch.testing.assert_close(radius, expected_radius, rtol=1e-14, atol=0)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-14, atol=0)
    assert torch.isfinite(scale).all() and torch.isfinite(ema_kernel).all()
    if not energy.isfinite().all():  # such blocks are skipped: the EMA keeps their score, they get no radius
        skipped = ~energy.isfinite()
        assert torch.equal(ema_kernel[skipped], ema[skipped]) and not radius[skipped].any() and not scale[skipped].any()
        if rule == SAM_RULE:  # SAM has one scale: a non-finite total skips the whole step
            assert not radius.any() and not scale.any()
        else:
            assert radius[~skipped].all()
    elif ema_kernel.any() if gear else energy.any():
        assert math.isclose(radius.square().sum().item(), 0.09, rel_tol=1e-13)  # sum_b r_b^2 = rho^2
    else:
        assert not radius.any()


# ------------------------------------------------------------------------------------------- bad buffers
@pytest.mark.parametrize("backend,device", [case for case in KERNELS if case.values[1] == "cpu"])
def test_launchers_name_the_bad_buffer(backend, device):
    k = kernel_module(backend)

    flat = torch.zeros(2 * TILE)
    tables = dict(first_tile_of_block=torch.tensor([0, 2]), partials=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad has 4095 elements, not a multiple of the tile"):
        k.block_energy(torch.zeros(4095), torch.zeros(4095), **tables, tile=TILE, adaptive=False, eta=0.0)
    with pytest.raises(ValueError, match="param .* must match grad"):
        k.block_energy(flat, flat.double(), **tables, tile=TILE, adaptive=False, eta=0.0)
    with pytest.raises(ValueError, match="partials has 1 entries for 2 tiles"):
        k.block_energy(
            flat,
            flat,
            tables["first_tile_of_block"],
            torch.zeros(1, dtype=torch.float64),
            tile=TILE,
            adaptive=False,
            eta=0.0,
        )
    with pytest.raises(ValueError, match=r"^partials has 2 entries for 2 tiles \(two per tile with other\)$"):
        k.block_energy(flat, flat, **tables, tile=TILE, adaptive=False, eta=0.0, other=flat)
    with pytest.raises(ValueError, match="block_of_tile must be torch.int32"):
        k.perturb_(
            flat,
            flat,
            flat.clone(),
            torch.ones(1, dtype=torch.float64),
            torch.zeros(2, dtype=torch.int64),
            tile=TILE,
            adaptive=False,
            eta=0.0,
        )
    with pytest.raises(ValueError, match="backup .* must match param"):
        k.restore_(flat, torch.zeros(TILE), tile=TILE)
    strided = torch.zeros(4 * TILE)[::2]  # the right length, but every other element
    with pytest.raises(ValueError, match="grad must be a contiguous 1-D tensor"):
        k.perturb_(flat, strided, flat.clone(), torch.ones(2, dtype=torch.float64),
                   torch.zeros(2, dtype=torch.int32), tile=TILE, adaptive=False, eta=0.0)  # fmt: skip
    with pytest.raises(ValueError, match="backup must be a contiguous 1-D tensor"):
        k.restore_(flat, strided, tile=TILE)
    sgd = dict(tile=TILE, lr=0.1, weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=False, maximize=False)
    with pytest.raises(ValueError, match="momentum_buffer must be a contiguous 1-D tensor"):
        k.sgd_step_(flat, flat.clone(), flat.clone(), strided, first=False, **sgd)
    with pytest.raises(ValueError, match="scale must be a contiguous 1-D tensor"):
        k.perturb_(
            flat,
            flat,
            flat.clone(),
            torch.ones(2, 1, dtype=torch.float64),
            torch.zeros(2, dtype=torch.int32),
            tile=TILE,
            adaptive=False,
            eta=0.0,
        )
    # a registered op's schema refuses a non-bool before the launcher runs: the dispatcher's error names the argument
    with pytest.raises((TypeError, RuntimeError), match="gear"):
        k.allocate(
            torch.zeros(2, dtype=torch.float64),
            torch.zeros(2, dtype=torch.float64),
            gear="sam",
            rho=0.1,
            beta=0.9,
            delta=1e-12,
        )


@pytest.mark.parametrize("backend,device", [case for case in FUSED if case.values[1] == "cpu"] + [("reference", "cpu")])
def test_backends_refuse_an_unknown_rule(backend, device):
    blocks = make_blocks("edge-cases", torch.float32, device)
    zeros = torch.zeros(len(blocks), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"unknown allocation rule 'gear'; expected one of \('sam', 'gear-sam'\)"):
        BACKENDS[backend](blocks, torch.device(device)).allocate("gear", zeros, zeros.clone(), 0.1, 0.9, 1e-12)


# ------------------------------------------------------------------------------------- compiled for the GPU
def test_every_kernel_compiles_for_hopper_without_atomics():
    """Compiles each kernel variant for sm_90 (no GPU needed): the GPU code path type-checks and lowers, and no kernel
    uses atomics, so reductions keep their fixed order."""
    pytest.importorskip("triton")
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_kernels.py")
    done = subprocess.run([sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # 4 dtypes x (3 energy: plain, adaptive, product + 4 perturb: plain, adaptive, each keeping g or not + 1 restore
    # + 1 mix + 1 exchange + 3 friendly ascent: first, later with a small and a large lerp weight + those 3 with the
    # energies, plain or adaptive) + block sum + 2 allocation rules + 2 dtypes x (sgd + adam)
    assert len(report) == 83
    # no atomics (fixed-order reductions), and every division and root correctly rounded, as the reference's
    assert all(v["ptx_lines"] > 10 and v["atomics"] == 0 and v["approx"] == 0 for v in report.values()), report


def test_the_torch_backends_perturbation_in_pieces_is_the_whole_bucket_at_once():
    """The ``torch`` backend perturbs a bucket a bounded piece at a time: over a bucket of several pieces (1614 tiles,
    four blocks, one of them skipped), the bits of the formula applied to the whole bucket in one operation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 1500), nn.Linear(1500, 1200))
    opt = GEARSAM(list(model.parameters()), torch.optim.SGD, backend="torch", partition="tensor", model=model, lr=0.1)
    model(torch.randn(8, 1000)).square().mean().backward()
    backend = opt.backend
    backend.layout.sync()
    (bucket,) = backend.layout.buckets
    assert bucket.n_tiles * bucket.tile > 3 * (1 << 20)  # several pieces
    scale = torch.tensor([0.3, 0.0, -0.7, 1e-3], dtype=torch.float64)
    w, g = (t.view(bucket.n_tiles, bucket.tile).clone() for t in (bucket.param, bucket.grad))
    tile_scale = scale[bucket.block_of_tile].float().unsqueeze(1)
    expected = torch.where(tile_scale == 0, w, w.addcmul(g, tile_scale)).view(-1)
    backend._bucket_perturb(bucket, scale, False, 0.0)
    assert torch.equal(bucket.param, expected) and torch.equal(bucket.backup, w.view(-1))

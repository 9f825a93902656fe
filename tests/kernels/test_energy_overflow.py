"""Block energies of gradients whose squares overflow float32 but not the float64 energy, on every backend.

A float32 square overflows from |x| of about 1.8e19 (the square root of FLT_MAX), and a float32 sum of squares sooner
(a tile of 2048 values of 1e19); the energy, a float64, holds up to 1.8e308, and the reference backend squares in
float64. The fused backends square and sum in float32 (float64 for float64 buffers), and take a tile whose float32 sum
is not finite again with its terms formed and summed in float64 (``csrc/README.md``): so a finite gradient has a finite
energy and a finite perturbation, the reference's within the suite's tolerances, and only a gradient that holds an inf
or a NaN is non-finite. Each case sits at a threshold of its dtype: float32 and bfloat16 values just above the square
root of FLT_MAX (one value, a tile of them, a block of two tiles of them), values below it whose sums overflow, ASAM's
``|w| + eta`` taking ``T g`` past it; float16, whose largest values (65504) cannot overflow a float32 sum of a tile,
at its largest; float64 just below the square root of DBL_MAX. Past DBL_MAX a float64 sum is infinite in every
backend's arithmetic, the reference's too: that is a float64 energy that does not exist, see
:func:`test_a_float64_energy_past_dbl_max_is_non_finite_on_every_backend`.
"""

import math

import pytest
import torch
from torch import nn

from gearsam_fused.allocation import GEAR_RULE, SAM_RULE
from gearsam_fused.backends import BACKENDS
from gearsam_fused.backends.base import Direction
from gearsam_fused.backends.flat_buffer import RETAKEN_TILES
from gearsam_fused.backends.reference import ReferenceBackend
from gearsam_fused.flat import TILE
from gearsam_fused.partition import Block

from conftest import FUSED, KERNELS, kernel_module

# Triton's interpreter computes with numpy, which warns where float32 overflows: here on purpose.
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)

#: The square root of FLT_MAX (about 1.8447e19): a float32 whose square overflows lies above it.
SQRT_FLT_MAX = math.sqrt(torch.finfo(torch.float32).max)
#: Just above it, in float32 and in bfloat16 alike (test_the_cases_are_at_the_thresholds).
ABOVE = 1.9e19
#: The energies' tolerance against the reference (float64 sums), as test_sam_kernels.py's ENERGY_RTOL.
ENERGY_RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float16: 1e-6, torch.float64: 1e-13}
ETA = 0.01


def _param_tolerance(dtype: torch.dtype) -> dict:
    """A perturbed parameter against the reference's: 1e-6 relative in float32 (the energies, and so the scales, agree
    to about 1e-7), one unit in the last place of a low-precision dtype (a scale that differs in its last float64 bits
    may round w + eps the other way)."""
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, torch.finfo(dtype).eps)
    return dict(rtol=tol, atol=tol)


def _filled(n: int, value: float, seed: int) -> torch.Tensor:
    """n values of magnitude ``value`` with random signs."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs.double() * value


def _up_to(n: int, value: float, seed: int) -> torch.Tensor:
    """n values of magnitude between value / 2 and value, every fourth exactly ``value``, with random signs: sums of
    such squares do not all round alike, as a tile of one repeated value's would (in the torch backend's float32
    norms, by a few parts in a million)."""
    magnitudes = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 0.5 + 0.5
    magnitudes[::4] = 1.0
    return _filled(n, value, seed) * magnitudes


def _randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _one_huge(n: int, value: float, seed: int) -> torch.Tensor:
    g = _randn(n, seed)
    g[n // 3] = value
    return g


# Each case: (dtype, blocks), each block a list of (weights, gradient) in float64 before the cast to dtype. Parameters
# of whole tiles start on tiles of their own (a block always does), so "a tile" and "a block" mean what they say.
CASES = {
    # the failure as found: one element past the square root of FLT_MAX in an otherwise ordinary gradient
    "f32-one-above": (torch.float32, [[(_randn(4097, 1), _one_huge(4097, 2e19, 2))], [(_randn(7, 3), _randn(7, 4))]]),
    # a whole tile of them: every square overflows, the tile's float64 sum (7.4e41) does not
    "f32-tile-above": (torch.float32, [[(_randn(TILE, 5), _filled(TILE, ABOVE, 6))], [(_randn(5, 7), _randn(5, 8))]]),
    # a block of two tiles of them
    "f32-block-above": (
        torch.float32,
        [[(_randn(2 * TILE, 9), _filled(2 * TILE, ABOVE, 10))], [(_randn(33, 11), _randn(33, 12))]],
    ),
    # every square finite (1e38), the tile's float32 sum not
    "f32-sum-overflows": (
        torch.float32,
        [[(_randn(TILE, 13), _filled(TILE, 1e19, 14))], [(_randn(64, 15), _randn(64, 16))]],
    ),
    # ASAM: g alone squares finely, T g = (|w| + eta) g does not
    "f32-asam-weights": (
        torch.float32,
        [[(_filled(TILE, 1e12, 17), _filled(TILE, 1e12, 18))], [(_randn(9, 19), _randn(9, 20))]],
    ),
    "bf16-one-above": (
        torch.bfloat16,
        [[(_randn(4097, 21), _one_huge(4097, 2e19, 22))], [(_randn(7, 23), _randn(7, 24))]],
    ),
    "bf16-block-above": (
        torch.bfloat16,
        [[(_randn(2 * TILE, 25), _filled(2 * TILE, ABOVE, 26))], [(_randn(5, 27), _randn(5, 28))]],
    ),
    # float16's largest values: a float32 sum of a tile of their squares (ASAM's too) stays finite
    "f16-largest": (
        torch.float16,
        [[(_up_to(TILE, 65504.0, 29), _up_to(TILE, 65504.0, 30))], [(_randn(7, 31), _randn(7, 32))]],
    ),
    # float64 just below the square root of DBL_MAX (1.34e154): the square, 1.69e308, is finite
    "f64-below-sqrt-max": (
        torch.float64,
        [[(_randn(300, 33), _one_huge(300, 1.3e154, 34))], [(_randn(7, 35), _randn(7, 36))]],
    ),
}


def make_blocks(case: str, device: str) -> list[Block]:
    dtype, specs = CASES[case]
    blocks = []
    for b, tensors in enumerate(specs):
        block = Block(f"block{b}")
        for i, (w, g) in enumerate(tensors):
            p = nn.Parameter(w.to(device, dtype, copy=True))  # copies: the steps write into them
            p.grad = g.to(device, dtype, copy=True)
            block.params.append(p)
            block.param_names.append(f"block{b}.p{i}")
        blocks.append(block)
    return blocks


def params_of(blocks):
    return [p for b in blocks for p in b.params]


@pytest.mark.parametrize("case", list(CASES))
def test_the_cases_are_at_the_thresholds(case):
    """Each case holds finite values only, and sits where it says: a float32 sum of its first block's squares (of
    ASAM's T g for ``f32-asam-weights``) is infinite for the float32 and bfloat16 cases, finite for float16's
    largest values, and float64's largest square is finite and more than half of DBL_MAX."""
    dtype, specs = CASES[case]
    w, g = (t.to(dtype).double() for t in specs[0][0])
    assert torch.isfinite(w).all() and torch.isfinite(g).all()
    v = (w.abs() + ETA) * g if case == "f32-asam-weights" else g
    squares = v.float().square()
    if dtype in (torch.float32, torch.bfloat16):
        assert squares.sum() == math.inf
        assert case != "f32-asam-weights" or g.float().square().sum() < math.inf  # ASAM's T alone takes it past
    elif dtype == torch.float16:
        assert ((w.abs() + ETA) * g).float().square().sum() < math.inf and v.abs().max() == 65504
    else:
        assert v.square().sum() < math.inf and v.abs().max() ** 2 > torch.finfo(torch.float64).max / 2


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("source", ["gradient", "direction"])
def test_energies_past_float32_squares_are_the_references(backend, device, case, adaptive, source):
    """block_energy (and direction_energy, MomentumSAM's energy of a direction given per tensor) of each case: finite
    and the reference's float64 sums within ENERGY_RTOL."""
    if case == "f32-asam-weights" and not adaptive:
        pytest.skip("the case's point is ASAM's T g")
    dtype = CASES[case][0]
    reference = ReferenceBackend(make_blocks(case, device), torch.device(device))
    blocks = make_blocks(case, device)
    fused = BACKENDS[backend](blocks, torch.device(device))
    if source == "gradient":
        expected, energy = reference.block_energy(adaptive, ETA), fused.block_energy(adaptive, ETA)
    else:
        direction = Direction([[p.grad.clone() for p in block.params] for block in blocks])
        expected = reference.direction_energy(direction, adaptive, ETA)
        energy = fused.direction_energy(direction, adaptive, ETA)
    assert torch.isfinite(expected).all() and torch.isfinite(energy).all(), (energy, expected)
    torch.testing.assert_close(energy, expected, rtol=ENERGY_RTOL[dtype], atol=0)


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rule", [SAM_RULE, GEAR_RULE])
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_the_perturbation_past_float32_squares_is_the_references(backend, device, case, rule, adaptive):
    """A step's first half (energies, allocation, perturbation) on each case: every block's radius is nonzero (none
    counts as non-finite, none is skipped) and the reference's (the ratios of two energies: twice their tolerance),
    and the perturbed weights are the reference's within _param_tolerance."""
    if case == "f32-asam-weights" and not adaptive:
        pytest.skip("the case's point is ASAM's T g")
    dtype = CASES[case][0]
    results = []
    for cls in (ReferenceBackend, BACKENDS[backend]):
        blocks = make_blocks(case, device)
        backend_ = cls(blocks, torch.device(device))
        energy = backend_.block_energy(adaptive, ETA)
        ema = torch.zeros_like(energy)
        scale, radius = backend_.allocate(rule, energy, ema, 0.05, 0.9, 1e-12)
        backend_.perturb_(scale, adaptive, ETA)
        results.append((energy, radius, [p.detach().clone() for p in params_of(blocks)]))
    (_, ref_radius, ref_params), (energy, radius, params) = results
    assert torch.isfinite(energy).all() and int(energy.isfinite().logical_not().sum()) == 0
    assert (radius > 0).all() and (ref_radius > 0).all(), (radius, ref_radius)
    torch.testing.assert_close(radius, ref_radius, rtol=2 * ENERGY_RTOL[dtype], atol=0)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, **_param_tolerance(dtype))
    if case not in ("f16-largest", "f32-asam-weights"):  # weights of order one
        first_weights = CASES[case][1][0][0][0].to(device, dtype)
        assert not torch.equal(params[0], first_weights)  # the block with the large gradient moved


@pytest.mark.parametrize("backend,device", [("reference", "cpu"), *FUSED])
def test_a_float64_energy_past_dbl_max_is_non_finite_on_every_backend(backend, device):
    """float64 values near the square root of DBL_MAX (1.34e154) whose squares' sum passes DBL_MAX (1.8e308): the
    energy is the sum of the squares in float64, the widest type there is, so it is infinite on every backend, the
    reference's included. A float64 energy past DBL_MAX does not exist; the block counts as non-finite, as one whose
    gradient holds an inf does: GEAR-SAM leaves it unperturbed and perturbs the others, SAM perturbs nothing. One such
    value alone (its square 1.69e308) is finite: test_energies_past_float32_squares_are_the_references'
    ``f64-below-sqrt-max``."""
    blocks = [Block("huge"), Block("ordinary")]
    for b, g in zip(blocks, (_filled(3, 1.3e154, 40), _randn(5, 41)), strict=True):
        p = nn.Parameter(_randn(g.numel(), 42).to(device))
        p.grad = g.to(device)
        b.params.append(p)
        b.param_names.append(f"{b.name}.p0")
    fused = BACKENDS[backend](blocks, torch.device(device))
    energy = fused.block_energy(False, 0.0)
    assert energy[0] == math.inf and torch.isfinite(energy[1])
    before = [p.detach().clone() for p in params_of(blocks)]
    scale, radius = fused.allocate(GEAR_RULE, energy, torch.zeros_like(energy), 0.05, 0.9, 1e-12)
    assert radius[0] == 0 and radius[1] > 0
    fused.perturb_(scale, False, 0.0)
    assert torch.equal(blocks[0].params[0], before[0]) and not torch.equal(blocks[1].params[0], before[1])
    fused.restore_()
    _, radius = fused.allocate(SAM_RULE, energy, torch.zeros_like(energy), 0.05, 0.9, 1e-12)
    assert (radius == 0).all()


@pytest.mark.parametrize("backend,device", [("reference", "cpu"), *FUSED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_a_gradient_holding_inf_or_nan_is_still_non_finite(backend, device, dtype, value, adaptive):
    """Beside values past the square root of FLT_MAX (taken again in float64), a real inf or NaN in the gradient still
    gives the block a non-finite energy on every backend, so that GEAR-SAM skips that block alone."""
    large = {torch.float16: 6e4, torch.float64: 1e154}.get(dtype, ABOVE)  # the largest of each dtype's cases
    blocks = [Block("bad"), Block("good")]
    for b, n in zip(blocks, (TILE + 5, 9), strict=True):
        p = nn.Parameter(_randn(n, 50).to(device, dtype))
        g = _one_huge(n, large, 51) if b.name == "bad" else _randn(n, 52)
        if b.name == "bad":
            g[7] = value
        p.grad = g.to(device, dtype)
        b.params.append(p)
        b.param_names.append(f"{b.name}.p0")
    energy = BACKENDS[backend](blocks, torch.device(device)).block_energy(adaptive, ETA)
    assert not torch.isfinite(energy[0]) and torch.isfinite(energy[1])
    assert math.isnan(energy[0]) == math.isnan(value)


def _two_buffers(device, dtype, seed: int):
    """A block of two tiles and a small one: gradients whose products with the kept ones pass FLT_MAX in float32."""
    blocks = [Block("big"), Block("small")]
    for b, n in zip(blocks, (2 * TILE, 7), strict=True):
        p = nn.Parameter(_randn(n, seed).to(device, dtype))
        p.grad = (_filled(n, ABOVE, seed + 1) if b.name == "big" else _randn(n, seed + 2)).to(device, dtype)
        b.params.append(p)
        b.param_names.append(f"{b.name}.p0")
    return blocks


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inner_products_past_float32_are_the_references(backend, device, dtype):
    """block_dot_energy, LookSAM's and GSAM's inner products of the kept gradient with the new one and the new one's
    energies in one read (block_energy's ``other``): products of values above the square root of FLT_MAX, finite and
    the reference's float64 sums; and block_dot alone the same."""
    results = []
    for cls in (ReferenceBackend, BACKENDS[backend]):
        blocks = _two_buffers(device, dtype, 60)
        backend_ = cls(blocks, torch.device(device))
        backend_.keep_gradient_()
        for p in params_of(blocks):
            p.grad.mul_(-0.75)
        results.append((*backend_.block_dot_energy(), backend_.block_dot()))
    for got, expected in zip(results[1], results[0], strict=True):
        assert torch.isfinite(got).all(), got
        torch.testing.assert_close(got, expected, rtol=ENERGY_RTOL[dtype], atol=0)


@pytest.mark.parametrize("backend,device", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_friendly_energy_past_float32_is_the_references(backend, device, dtype, adaptive):
    """F-SAM's friendly_energy_ (the ascent, then the energies of the new direction; one kernel on cpp and triton):
    on the first step (m <- g, the energies of g) and the next (g - sigma m), finite and the reference's."""
    results = []
    for cls in (ReferenceBackend, BACKENDS[backend]):
        blocks = _two_buffers(device, dtype, 70)
        backend_ = cls(blocks, torch.device(device))
        started = [False] * 2
        first = backend_.friendly_energy_(0.5, 0.9, started, adaptive, ETA)
        second = backend_.friendly_energy_(0.5, 0.9, [True] * 2, adaptive, ETA)
        results.append((first, second))
    for got, expected in zip(results[1], results[0], strict=True):
        assert torch.isfinite(got).all(), got
        torch.testing.assert_close(got, expected, rtol=ENERGY_RTOL[dtype], atol=0)


@pytest.mark.parametrize("backend,device", KERNELS)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_the_base_steps_momentum_energy_past_float32_is_block_energys(backend, device, kind):
    """MomentumSAM's one pass: a base step summing the new momentum (SGD's buffer, Adam's exp_avg) of values above the
    square root of FLT_MAX gives block_energy's bits of it (the same rescue, tile by tile as it writes it), finite and
    the float64 sums within 1e-6."""
    kernels = kernel_module(backend)
    n = 3 * TILE
    g = _filled(n, ABOVE, 80)
    g[TILE:] = _randn(2 * TILE, 81)
    g[2 * TILE + 5] = 2e19  # one value in the last tile
    grad = g.float().to(device)
    param = _randn(n, 82).float().to(device)
    first_tile_of_block = torch.tensor([0, 1, 3], device=device)
    partials = torch.full((3,), math.nan, dtype=torch.float64, device=device)
    energy = torch.full((2,), math.nan, dtype=torch.float64, device=device)
    outputs = dict(first_tile_of_block=first_tile_of_block, partials=partials, momentum_energy=energy)
    backup = param.clone()
    if kind == "sgd":
        buffer = torch.zeros_like(grad)
        kernels.sgd_step_(param, grad, backup, buffer, tile=TILE, lr=0.1, weight_decay=0.0, momentum=0.9,
                          dampening=0.0, nesterov=False, maximize=False, first=True, **outputs)  # fmt: skip
    else:
        buffer, second = torch.zeros_like(grad), torch.zeros_like(grad)
        # exp_avg = 0.1 g: from ABOVE / 0.1 on, its squares overflow float32 as ABOVE's do
        grad.mul_(10.0)
        kernels.adam_step_(param, grad, backup, buffer, second, None, tile=TILE, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.0, decoupled=False, amsgrad=False, maximize=False, lr=1e-3, step=1,
                           **outputs)  # fmt: skip
    assert buffer.abs().max() > SQRT_FLT_MAX
    expected = kernels.block_energy(buffer, param, first_tile_of_block, torch.empty_like(partials), tile=TILE,
                                    adaptive=False, eta=0.0)  # fmt: skip
    assert torch.equal(energy, expected)
    wide = buffer.double().square()
    torch.testing.assert_close(energy, torch.stack([wide[:TILE].sum(), wide[TILE:].sum()]), rtol=1e-6, atol=0)


def test_the_torch_backend_takes_again_as_many_tiles_as_it_says():
    """The torch backend cannot choose on the device which tiles to read again without a read back to the host, so it
    reads the RETAKEN_TILES largest: a bucket with that many overflowing tiles is exact, and the cases above stay
    within it."""
    assert RETAKEN_TILES >= 2  # the block cases above: two tiles
    blocks = [Block("big")]
    p = nn.Parameter(_randn(RETAKEN_TILES * TILE, 90).float())
    p.grad = _filled(RETAKEN_TILES * TILE, ABOVE, 91).float()
    blocks[0].params.append(p)
    blocks[0].param_names.append("big.p0")
    energy = BACKENDS["torch"](blocks, torch.device("cpu")).block_energy(False, 0.0)
    torch.testing.assert_close(energy, p.grad.double().square().sum().reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend,device", [case for case in KERNELS if case.values[0] == "cpp"])
def test_the_cpp_retake_is_the_same_for_any_number_of_threads(backend, device):
    """The CPU kernels split a bucket's tiles between threads; a tile taken again in float64 is taken by the thread
    that has it, over the same elements in the same order: the same bits on one thread or four."""
    kernels = kernel_module(backend)
    n_tiles = 64  # several tasks' worth of tiles (cpu/tiles.h)
    g = _randn(n_tiles * TILE, 100)
    for t in (0, 17, 18, 40, 63):
        g[t * TILE : (t + 1) * TILE] = _filled(TILE, ABOVE, 101 + t)
    grad, param = g.float().to(device), _randn(n_tiles * TILE, 110).float().to(device)
    first_tile_of_block = torch.tensor([0, 17, 40, n_tiles], device=device)
    results = []
    for threads in (1, 4):
        torch.set_num_threads(threads)
        partials = torch.empty(2 * n_tiles, dtype=torch.float64, device=device)
        for adaptive in (False, True):
            results.append(kernels.block_energy(grad, param, first_tile_of_block, partials[:n_tiles], tile=TILE,
                                                adaptive=adaptive, eta=ETA))  # fmt: skip
        results.append(kernels.block_energy(grad, param, first_tile_of_block, partials, tile=TILE, adaptive=False,
                                            eta=0.0, other=-grad))  # fmt: skip
    assert all(torch.isfinite(r).all() for r in results)
    assert all(torch.equal(a, b) for a, b in zip(results[:3], results[3:], strict=True))

"""The compiled kernels as torch.library operators, ``torch.ops.gearsam_fused.*`` (``csrc/library.cpp``, fakes in
``gearsam_fused/backends/cpp_fakes.py``): ``torch.library.opcheck`` on each of them (schema and mutations, fake
tensors, AOT dispatch with dynamic shapes), their results against the math they stand for, bit for bit, the fakes'
shapes and checks, and a torch.compile'd SAM step equal to eager."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gearsam_fused.allocation import gear_allocate, sam_allocate
from gearsam_fused.backends.cpp_backend import cpp_built_with_cuda, cpp_installed
from gearsam_fused.base_step import adam_scalars

from conftest import CUDA, correctly_rounded_sqrt

pytestmark = pytest.mark.skipif(not cpp_installed(), reason="the C++ extension is not built")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"),
            pytest.mark.skipif(not cpp_built_with_cuda(), reason="the C++ extension has no CUDA kernels"),
        ],
    ),
]
#: The buffer types of the energy and the perturbation; the base steps take the first two only.
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BASE_FLOATS = FLOATS[:2]

TILE = 8
TILES_PER_BLOCK = [1, 3, 2]  # 3 blocks, 6 tiles
N_TILES = sum(TILES_PER_BLOCK)
N = TILE * N_TILES
SCALE = [0.5, 0.0, 2.0]  # per block; 0 skips its block

SGD_FLAGS = {
    "plain": dict(),
    "momentum": dict(momentum=0.9, dampening=0.1),
    "nesterov-maximize": dict(momentum=0.9, nesterov=True, maximize=True),
    "first": dict(momentum=0.9, first=True),
}
#: (decoupled, amsgrad, maximize) of each Adam variant: Adam with L2 decay, AdamW, AdamW with amsgrad, maximizing.
ADAM_FLAGS = {"adam": (False, False, False), "adamw": (True, False, False), "adamw-amsgrad": (True, True, True)}
LR, WEIGHT_DECAY, BETAS, EPS, STEP = 1e-2, 1e-2, (0.9, 0.999), 1e-8, 3


def ops():
    return torch.ops.gearsam_fused


# ------------------------------------------------------------------------------------------- the arguments
def tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first_tile_of_block int64 [B + 1], block_of_tile int32 [n_tiles]) of the bucket."""
    per_block = torch.tensor(TILES_PER_BLOCK)
    first_tile_of_block = torch.cat([torch.zeros(1, dtype=torch.int64), per_block.cumsum(0)])
    block_of_tile = torch.repeat_interleave(torch.arange(len(per_block), dtype=torch.int32), per_block)
    return first_tile_of_block.to(device), block_of_tile.to(device)


def randn(count: int, dtype, device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(count)]


def per_block(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=device)


def energy_args(dtype, device, adaptive: bool):
    param, grad = randn(2, dtype, device)
    partials = torch.empty(N_TILES, dtype=torch.float64, device=device)
    return (grad, param, tables(device)[0], partials), dict(tile=TILE, adaptive=adaptive, eta=0.01)


def allocate_args(device, gear: bool):
    energy, ema = per_block([4.0, 0.0, 9.0], device), per_block([1.0, 2.0, 0.5], device)
    return (energy, ema), dict(gear=gear, rho=0.05, beta=0.9, delta=1e-12)


def perturb_args(dtype, device, adaptive: bool):
    param, grad = randn(2, dtype, device)
    backup = torch.empty_like(param)
    kw = dict(tile=TILE, adaptive=adaptive, eta=0.01)
    return (param, grad, backup, per_block(SCALE, device), tables(device)[1]), kw


def restore_args(dtype, device):
    return tuple(randn(2, dtype, device)), dict(tile=TILE)


def mix_args(dtype, device):
    """mix_gradient_ with per-block coefficients: a negative one, a zero one, and 1 and 0 (g kept as it is)."""
    grad, kept = randn(2, dtype, device)
    scales = per_block([1.5, 1.0, -0.25], device), per_block([-0.4, 0.0, 2.0], device)
    return (grad, kept, *scales, tables(device)[1]), dict(tile=TILE)


def correction(dtype, device, corrected: bool | str) -> dict:
    """LookSAM's three keywords, with a negative and a zero block scale; with ``"mix"``, the SAM family's grad_scale
    beside them; with ``"sharpness"``, WSAM's sharpness step as well."""
    extra = {"grad_scale": per_block([1.5, -0.25, 1.0], device)} if corrected in ("mix", "sharpness") else {}
    extra.update({"sharpness": 2.5} if corrected == "sharpness" else {})
    return dict(correction=randn(1, dtype, device, seed=1)[0], correction_scale=per_block([0.37, 0.0, -1.25], device),
                block_of_tile=tables(device)[1], **extra)  # fmt: skip


def sgd_args(dtype, device, flags: str, with_backup: bool, corrected: bool):
    """sgd_step_ from backup (given) or from param itself (None)."""
    kw = {"tile": TILE, "lr": 0.1, "weight_decay": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False,
          "maximize": False, "first": False, **SGD_FLAGS[flags]}  # fmt: skip
    param, grad, backup, buffer = randn(4, dtype, device)
    extra = correction(dtype, device, corrected) if corrected else {}
    return (param, grad, backup if with_backup else None, buffer if kw["momentum"] else None), {**kw, **extra}


def adam_args(dtype, device, flags: str, with_backup: bool, corrected: bool):
    """adam_step_ at step STEP."""
    decoupled, amsgrad, maximize = ADAM_FLAGS[flags]
    param, grad, backup = randn(3, dtype, device)
    g = torch.Generator().manual_seed(2)
    exp_avg = (0.1 * torch.randn(N, generator=g)).to(device, dtype)
    exp_avg_sq, max_exp_avg_sq = ((0.01 * torch.rand(N, generator=g) * c).to(device, dtype) for c in (1.0, 1.5))
    kw = dict(tile=TILE, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=decoupled,
              amsgrad=amsgrad, maximize=maximize, lr=LR, step=STEP)  # fmt: skip
    state = (exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad else None)
    extra = correction(dtype, device, corrected) if corrected else {}
    return (param, grad, backup if with_backup else None, *state), {**kw, **extra}


# ------------------------------------------------------------------------------------------- opcheck
def momentum_energy(device) -> dict:
    """The base steps' momentum energy outputs for the test bucket (their bits: test_base_step.py)."""
    first_tile_of_block = tables(device)[0]
    return dict(first_tile_of_block=first_tile_of_block,
                partials=torch.full((N // TILE,), float("nan"), dtype=torch.float64, device=device),
                momentum_energy=torch.full((first_tile_of_block.numel() - 1,), float("nan"), dtype=torch.float64,
                                           device=device))  # fmt: skip


def opcheck(name: str, args, kwargs) -> None:
    torch.library.opcheck(getattr(ops(), name).default, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_opcheck_energy_and_perturb(dtype, adaptive, device):
    opcheck("block_energy", *energy_args(dtype, device, adaptive))
    opcheck("perturb_", *perturb_args(dtype, device, adaptive))
    args, kw = perturb_args(dtype, device, adaptive)
    opcheck("perturb_", args, {**kw, "kept": torch.empty_like(args[0])})  # g kept in the same pass
    if not adaptive:  # the inner product with another buffer
        (grad, param, *tables_), kw = energy_args(dtype, device, adaptive)
        partials = torch.empty(2 * N_TILES, dtype=torch.float64, device=device)  # two per tile
        opcheck("block_energy", (grad, param, tables_[0], partials), {**kw, "other": randn(1, dtype, device)[0]})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", ["restore_", "restore_discarding_backup_"])
def test_opcheck_restore(dtype, device, name):
    opcheck(name, *restore_args(dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_opcheck_mix_gradient(dtype, device):
    opcheck("mix_gradient_", *mix_args(dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_opcheck_exchange_sharpness(dtype, device):
    opcheck("exchange_sharpness_", tuple(randn(2, dtype, device)), dict(tile=TILE))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("first", [False, True], ids=["later", "first"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_opcheck_friendly_ascent(dtype, device, first):
    grad, momentum = randn(2, dtype, device)
    opcheck("friendly_ascent_", (grad[3:-5], momentum[3:-5]), dict(sigma=0.7, lmbda=0.9, first=first))


def friendly_energy_args(dtype, device, adaptive: bool, first: bool):
    (grad, param, first_tile_of_block, partials), kw = energy_args(dtype, device, adaptive)
    momentum = randn(1, dtype, device)[0].flip(0)
    return (grad, momentum, param, first_tile_of_block, partials), dict(**kw, sigma=0.7, lmbda=0.9, first=first)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("first", [False, True], ids=["later", "first"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_opcheck_friendly_energy(dtype, adaptive, first, device):
    opcheck("friendly_energy_", *friendly_energy_args(dtype, device, adaptive, first))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gear", [False, True], ids=["sam-rule", "gear-rule"])
def test_opcheck_allocate(gear, device):
    opcheck("allocate", *allocate_args(device, gear))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("corrected", [False, True, "mix", "sharpness"], ids=["plain", "looksam", "mix", "sharpness"])
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(SGD_FLAGS))
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_opcheck_sgd_step(dtype, flags, with_backup, corrected, device):
    opcheck("sgd_step_", *sgd_args(dtype, device, flags, with_backup, corrected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("corrected", [False, True, "mix", "sharpness"], ids=["plain", "looksam", "mix", "sharpness"])
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(ADAM_FLAGS))
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_opcheck_adam_step(dtype, flags, with_backup, corrected, device):
    opcheck("adam_step_", *adam_args(dtype, device, flags, with_backup, corrected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_opcheck_base_steps_summing_the_momentum(dtype, with_backup, device):
    """MomentumSAM's step: the new momentum's energies summed as it is written (their bits: test_base_step.py)."""
    args, kw = sgd_args(dtype, device, "momentum", with_backup, False)
    opcheck("sgd_step_", args, {**kw, **momentum_energy(device)})
    args, kw = adam_args(dtype, device, "adamw-amsgrad", with_backup, False)
    opcheck("adam_step_", args, {**kw, **momentum_energy(device)})


# ------------------------------------------------------------------------------------------- the bits
def dyadic(count: int, dtype, device) -> list[torch.Tensor]:
    """Multiples of 1/4 in [-2, 2]: every square, product and sum the energy takes of them is exact in any order."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(-8, 9, (N,), generator=g) / 4).to(device, dtype) for _ in range(count)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_energy_is_the_sum_of_squares(dtype, adaptive, device):
    """On values whose sums are exact, so that the kernel's summation order cannot show: bit for bit."""
    param, grad = dyadic(2, dtype, device)
    first_tile_of_block = tables(device)[0]
    partials = torch.full((N_TILES,), float("nan"), dtype=torch.float64, device=device)
    energy = ops().block_energy(grad, param, first_tile_of_block, partials, tile=TILE, adaptive=adaptive, eta=0.5)
    t = param.double().abs() + 0.5 if adaptive else 1.0
    per_tile = (t * grad.double()).square().view(N_TILES, TILE).sum(1)
    assert torch.equal(partials, per_tile)
    lengths = torch.tensor(TILES_PER_BLOCK, device=device)
    assert torch.equal(energy, torch.segment_reduce(per_tile, "sum", lengths=lengths))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_energy_with_other_is_the_energy_and_the_inner_product(dtype, device):
    """The SAM family's ||h||^2 and <h, g> per block in one pass, on values whose sums are exact: bit for bit; param is
    not read."""
    grad, other = dyadic(2, dtype, device)
    first_tile_of_block = tables(device)[0]
    partials = torch.full((2 * N_TILES,), float("nan"), dtype=torch.float64, device=device)
    unread = torch.full_like(grad, float("nan"))
    both = ops().block_energy(grad, unread, first_tile_of_block, partials, tile=TILE, adaptive=False, eta=0.5,
                              other=other)  # fmt: skip
    per_tile = torch.cat([(grad.double() * x.double()).view(N_TILES, TILE).sum(1) for x in (grad, other)])
    assert torch.equal(partials, per_tile)
    lengths = torch.tensor(TILES_PER_BLOCK, device=device)
    assert torch.equal(both, torch.segment_reduce(per_tile.view(2, N_TILES), "sum", lengths=lengths.expand(2, -1),
                                                  axis=1))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gear", [False, True], ids=["sam-rule", "gear-rule"])
def test_allocate_is_the_rule(gear, device):
    """On scores whose norms are exact and a power-of-two rho, every quantity rounds once: gearsam_fused.allocation's
    rules bit for bit (and the SAM rule leaves ema alone)."""
    # GEAR: s = (ema + e) / 2 = [4, 2, 4], t = s / max s = [1, 0.5, 1], ||t|| = 1.5; SAM: sqrt(sum e) = 3
    energy, ema = per_block([4.0, 1.0, 4.0], device), per_block([4.0, 3.0, 4.0], device)
    expected_ema = ema.clone()
    scale, radius = ops().allocate(energy, ema, gear=gear, rho=0.5, beta=0.5, delta=0.0)
    if gear:
        expected = gear_allocate(energy, expected_ema, 0.5, 0.5, 0.0)
    else:
        expected = sam_allocate(energy, 0.5, 0.0)
    assert torch.equal(ema, expected_ema)
    assert torch.equal(scale, expected[0]) and torch.equal(radius, expected[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_perturb_and_restore_are_the_reference_math(dtype, adaptive, device):
    """w + (T^2 g) * scale[b] in the compute type (float32 for bf16/fp16), multiply and add rounded apart, then
    rounded to the buffer; w itself where scale[b] is 0. restore_ brings back the stored bits."""
    (param, grad, backup, scale, block_of_tile), kw = perturb_args(dtype, device, adaptive)
    w0 = param.clone()
    ops().perturb_(param, grad, backup, scale, block_of_tile, **kw)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    w, direction = w0.to(compute), grad.to(compute)
    if adaptive:
        direction = (w.abs() + kw["eta"]).square() * direction
    s = scale[block_of_tile.long()].repeat_interleave(TILE).to(compute)
    assert torch.equal(backup, w0)
    assert torch.equal(param, torch.where(s == 0, w, w + direction * s).to(dtype))
    ops().restore_(param, backup, tile=TILE)
    assert torch.equal(param, w0)
    param.copy_(grad)
    ops().restore_discarding_backup_(param, backup, tile=TILE)  # SAM's restore: the same bits
    assert torch.equal(param, w0)


def torch_step(cls, kwargs: dict, w: torch.Tensor, grad: torch.Tensor, state: dict):
    """torch's own optimizer (foreach=False), one step over a CPU parameter holding ``w``: (new w, new state)."""
    p = torch.nn.Parameter(w.cpu().clone())
    p.grad = grad.cpu().clone()
    opt = cls([p], foreach=False, **kwargs)
    opt.state[p] = {k: v.cpu().clone() for k, v in state.items()}
    opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(SGD_FLAGS))
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_sgd_step_is_torchs_sgd(dtype, flags, with_backup, device):
    """From backup, or (None) from param's own values: torch.optim.SGD bit for bit, on every device."""
    (param, grad, backup, buffer), kw = sgd_args(dtype, device, flags, with_backup, corrected=False)
    w = param.clone() if backup is None else backup
    state = {} if buffer is None or kw["first"] else {"momentum_buffer": buffer}
    torch_kw = {k: kw[k] for k in ("lr", "weight_decay", "momentum", "dampening", "nesterov", "maximize")}
    expected_w, expected = torch_step(torch.optim.SGD, torch_kw, w, grad, state)
    ops().sgd_step_(param, grad, backup, buffer, **kw)
    assert torch.equal(param.cpu(), expected_w)
    if buffer is not None:
        assert torch.equal(buffer.cpu(), expected["momentum_buffer"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(ADAM_FLAGS))
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_adam_step_is_torchs_adam(dtype, flags, with_backup, device):
    """torch.optim.Adam / AdamW from step STEP - 1: the moments bit for bit; the weights within the ulp that torch's
    CPU square root may miss the correctly rounded one by (which the kernels take: gearsam_fused/base_step.py), and on
    the CPU bit for bit against torch's step with the correctly rounded root."""
    (param, grad, backup, *moments), kw = adam_args(dtype, device, flags, with_backup, corrected=False)
    w = param.clone() if backup is None else backup
    names = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    state = {"step": torch.tensor(STEP - 1.0), **{k: v for k, v in zip(names, moments) if v is not None}}
    cls = torch.optim.AdamW if kw["decoupled"] else torch.optim.Adam
    torch_kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, amsgrad=kw["amsgrad"])
    torch_kw["maximize"] = kw["maximize"]
    expected_w, expected = torch_step(cls, torch_kw, w, grad, state)
    with correctly_rounded_sqrt():
        oracle_w, _ = torch_step(cls, torch_kw, w, grad, state)
    ops().adam_step_(param, grad, backup, *moments, **kw)
    for name, moment in zip(names, moments):
        if moment is not None:
            assert torch.equal(moment.cpu(), expected[name]), name
    eps = torch.finfo(dtype).eps
    step_size = adam_scalars(LR, *BETAS, WEIGHT_DECAY, STEP)[0]
    torch.testing.assert_close(param.cpu(), expected_w, rtol=2 * eps, atol=4 * eps * step_size)
    if device == "cpu":
        assert torch.equal(param, oracle_w)


# ------------------------------------------------------------------------------------------- fake tensors
def test_fakes_give_the_shapes_of_the_outputs():
    """Under FakeTensorMode: the energy (block_energy's, friendly_energy_'s) is float64 [B] on grad's device,
    allocate's scale and radius are like it, the other operators return nothing. On the meta device too: one entry per block, however many tiles."""
    (grad, param, first_tile_of_block, partials), kw = energy_args(torch.bfloat16, "cpu", adaptive=True)
    perturb, perturb_kw = perturb_args(torch.bfloat16, "cpu", adaptive=True)
    sgd, sgd_kw = sgd_args(torch.float64, "cpu", "momentum", with_backup=False, corrected=True)
    friendly, friendly_kw = friendly_energy_args(torch.bfloat16, "cpu", adaptive=True, first=False)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor
        energy = ops().block_energy(fake(grad), fake(param), fake(first_tile_of_block), fake(partials), **kw)
        assert (energy.shape, energy.dtype, energy.device) == ((3,), torch.float64, grad.device)
        scale, radius = ops().allocate(energy, torch.zeros_like(energy), gear=True, rho=0.05, beta=0.9, delta=1e-12)
        for out in (scale, radius):
            assert (out.shape, out.dtype, out.device) == ((3,), torch.float64, grad.device)
        assert ops().perturb_(*map(fake, perturb), **perturb_kw) is None
        sgd_kw = {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in sgd_kw.items()}
        assert ops().sgd_step_(*(None if t is None else fake(t) for t in sgd), **sgd_kw) is None
        energy = ops().friendly_energy_(*map(fake, friendly), **friendly_kw)
        assert (energy.shape, energy.dtype, energy.device) == ((3,), torch.float64, grad.device)
    meta = dict(device="meta")
    energy = ops().block_energy(torch.empty(64 * 16, **meta), torch.empty(64 * 16, **meta),
                                torch.zeros(5, dtype=torch.int64, **meta), torch.empty(64, dtype=torch.float64, **meta),
                                tile=16, adaptive=False, eta=0.0)  # fmt: skip
    assert (energy.shape, energy.dtype, energy.device.type) == ((4,), torch.float64, "meta")


def _wrong_calls():
    """For each kind of check, (the argument at fault, a function giving the operator's name and a call with that
    argument wrong); the argument is None where the fault is a scalar argument's value, which the fakes do not check."""
    f32, f64, i32 = torch.float32, torch.float64, torch.int32

    def energy(**change):
        (grad, param, first_tile_of_block, partials), kw = energy_args(f32, "cpu", True)
        args = {
            "grad": grad,
            "param": param,
            "first_tile_of_block": first_tile_of_block,
            "partials": partials,
            **kw,
            **change,
        }
        return "block_energy", args

    def perturb(**change):
        (param, grad, backup, scale, block_of_tile), kw = perturb_args(f32, "cpu", False)
        args = {"param": param, "grad": grad, "backup": backup, "scale": scale, "block_of_tile": block_of_tile, **kw}
        return "perturb_", {**args, **change}

    def mix(**change):
        (grad, kept, grad_scale, kept_scale, block_of_tile), kw = mix_args(f32, "cpu")
        args = {"grad": grad, "correction": kept, "grad_scale": grad_scale, "correction_scale": kept_scale}
        return "mix_gradient_", {**args, "block_of_tile": block_of_tile, **kw, **change}

    def exchange(**change):
        grad, kept = randn(2, f32, "cpu")
        return "exchange_sharpness_", {"grad": grad, "correction": kept, "tile": TILE, **change}

    def friendly(**change):
        grad, momentum = randn(2, f32, "cpu")
        return "friendly_ascent_", {"grad": grad, "momentum": momentum, "sigma": 1.0, "lmbda": 0.9, "first": False,
                                    **change}  # fmt: skip

    def friendly_energy(**change):
        (grad, momentum, param, first_tile_of_block, partials), kw = friendly_energy_args(f32, "cpu", True, False)
        args = {"grad": grad, "momentum": momentum, "param": param, "first_tile_of_block": first_tile_of_block}
        return "friendly_energy_", {**args, "partials": partials, **kw, **change}

    def sgd(**change):
        (param, grad, backup, buffer), kw = sgd_args(f32, "cpu", "momentum", True, corrected=True)
        return "sgd_step_", {"param": param, "grad": grad, "backup": backup, "momentum_buffer": buffer, **kw, **change}

    def adam(**change):
        (param, grad, backup, m, v, vmax), kw = adam_args(f64, "cpu", "adamw-amsgrad", True, corrected=False)
        args = {"param": param, "grad": grad, "backup": backup, "exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax}
        return "adam_step_", {**args, **kw, **change}

    def allocate(**change):
        (energy, ema), kw = allocate_args("cpu", gear=True)
        return "allocate", {"energy": energy, "ema": ema, **kw, **change}

    bf16 = {
        k: torch.zeros(N, dtype=torch.bfloat16) for k in ("param", "grad", "backup", "momentum_buffer", "correction")
    }
    no_correction = dict.fromkeys(("correction", "correction_scale", "block_of_tile"))
    summed = momentum_energy("cpu")
    return {
        "tile": ("tile", lambda: energy(tile=0)),
        "not-a-multiple": ("grad", lambda: energy(tile=7)),
        "int-grad": ("grad", lambda: energy(grad=torch.zeros(N, dtype=i32), param=torch.zeros(N, dtype=i32))),
        "param-dtype": ("param", lambda: energy(param=torch.zeros(N, dtype=f64))),
        "first_tile_of_block-dtype": (
            "first_tile_of_block",
            lambda: energy(first_tile_of_block=tables("cpu")[0].int()),
        ),
        "partials-count": ("partials", lambda: energy(partials=torch.zeros(N_TILES + 1, dtype=f64))),
        "no-blocks": ("first_tile_of_block", lambda: energy(first_tile_of_block=torch.zeros(0, dtype=torch.int64))),
        "other-shape": ("other", lambda: energy(adaptive=False, other=torch.zeros(N + TILE))),
        "strided-grad": ("grad", lambda: perturb(grad=torch.zeros(2 * N)[::2])),
        "backup-shape": ("backup", lambda: perturb(backup=torch.zeros(N + TILE))),
        "scale-dtype": ("scale", lambda: perturb(scale=torch.zeros(3))),
        "block_of_tile-count": ("block_of_tile", lambda: perturb(block_of_tile=tables("cpu")[1][:-1])),
        "2-d-param": ("param", lambda: perturb(param=torch.zeros(N_TILES, TILE))),
        "mix-int-grad": ("grad", lambda: mix(grad=torch.zeros(N, dtype=i32), correction=torch.zeros(N, dtype=i32))),
        "mix-correction-shape": ("correction", lambda: mix(correction=torch.zeros(N + TILE))),
        "grad_scale-dtype": ("grad_scale", lambda: mix(grad_scale=torch.zeros(3, dtype=f32))),
        "correction_scale-count": ("correction_scale", lambda: mix(correction_scale=per_block([1.0, 2.0], "cpu"))),
        "mix-block_of_tile-count": ("block_of_tile", lambda: mix(block_of_tile=tables("cpu")[1][:-1])),
        "exchange-tile": ("grad", lambda: exchange(tile=7)),
        "exchange-correction-dtype": ("correction", lambda: exchange(correction=torch.zeros(N, dtype=f64))),
        "friendly-int-grad": (
            "grad",
            lambda: friendly(grad=torch.zeros(N, dtype=i32), momentum=torch.zeros(N, dtype=i32)),
        ),
        "friendly-momentum-shape": ("momentum", lambda: friendly(momentum=torch.zeros(N - 1))),
        "friendly-strided-grad": ("grad", lambda: friendly(grad=torch.zeros(2 * N)[::2])),
        "friendly-energy-tile": ("grad", lambda: friendly_energy(tile=7)),
        "friendly-energy-partials-count": (
            "partials",
            lambda: friendly_energy(partials=torch.zeros(N_TILES - 1, dtype=f64)),
        ),
        "friendly-energy-momentum-dtype": ("momentum", lambda: friendly_energy(momentum=torch.zeros(N, dtype=f64))),
        "base-step-dtype": ("param", lambda: sgd(**bf16)),
        "momentum-missing": ("momentum_buffer", lambda: sgd(momentum_buffer=None)),
        "momentum-unneeded": ("momentum_buffer", lambda: sgd(momentum=0.0)),
        "correction-partial": ("correction_scale", lambda: sgd(correction_scale=None)),
        "grad_scale-alone": ("grad_scale", lambda: sgd(**no_correction, grad_scale=per_block(SCALE, "cpu"))),
        "correction-dtype": ("correction", lambda: sgd(correction=torch.zeros(N, dtype=f64))),
        "correction_scale-dtype": ("correction_scale", lambda: sgd(correction_scale=torch.zeros(3, dtype=f32))),
        "amsgrad-missing": ("max_exp_avg_sq", lambda: adam(max_exp_avg_sq=None)),
        "exp_avg-shape": ("exp_avg", lambda: adam(exp_avg=torch.zeros(N - TILE, dtype=f64))),
        "ema-shape": ("ema", lambda: allocate(ema=per_block([1.0], "cpu"))),
        "energy-dtype": ("energy", lambda: allocate(energy=torch.ones(3), ema=torch.ones(3))),
        # the base steps' momentum energy
        "momentum_energy-partial": ("momentum_energy", lambda: sgd(partials=summed["partials"])),
        "momentum_energy-no-momentum": ("momentum_energy", lambda: sgd(momentum=0.0, momentum_buffer=None, **summed)),
        "momentum_energy-found_inf": ("found_inf", lambda: adam(found_inf=torch.zeros(()), **summed)),
        "momentum_energy-partials-count": (
            "partials",
            lambda: sgd(**{**summed, "partials": torch.zeros(1, dtype=f64)}),
        ),
        "momentum_energy-count": (
            "momentum_energy",
            lambda: adam(**{**summed, "momentum_energy": torch.zeros(2, dtype=f64)}),
        ),
        # capturable steps' device values
        "scalars-dtype": ("scalars", lambda: sgd(scalars=torch.zeros(2, dtype=f32), lr=0.0)),
        "scalars-2-d": ("scalars", lambda: adam(scalars=torch.zeros(1, 2, dtype=f64), lr=0.0, step=0)),
        "scalars-count-allocate": ("scalars", lambda: allocate(scalars=torch.zeros(3, dtype=f64), rho=0.0)),
        "scalars-count-sgd": ("scalars", lambda: sgd(scalars=torch.zeros(3, dtype=f64), lr=0.0)),
        "scalars-count-adam": ("scalars", lambda: adam(scalars=torch.zeros(1, dtype=f64), lr=0.0, step=0)),
        "found_inf-dtype": ("found_inf", lambda: adam(found_inf=torch.zeros((), dtype=f64))),
        "found_inf-count": ("found_inf", lambda: sgd(found_inf=torch.zeros(2, dtype=f32))),
        "found_inf-empty": ("found_inf", lambda: allocate(found_inf=torch.zeros(0, dtype=f32))),
        # the values of scalar arguments: the kernels refuse them, the fakes (which check tensors) leave them be
        "other-adaptive": (None, lambda: energy(other=torch.zeros(N))),
        "friendly-sigma": (None, lambda: friendly(sigma=float("nan"))),
        "friendly-lmbda": (None, lambda: friendly(lmbda=float("inf"))),
        "friendly-energy-sigma": (None, lambda: friendly_energy(sigma=float("-inf"))),
        "sharpness-alone": (None, lambda: sgd(sharpness=0.5)),
        "rho-with-scalars": (None, lambda: allocate(scalars=torch.zeros(1, dtype=f64))),
        "lr-with-scalars-sgd": (None, lambda: sgd(scalars=torch.zeros(2, dtype=f64))),
        "first-with-scalars": (None, lambda: sgd(scalars=torch.zeros(2, dtype=f64), lr=0.0, first=True)),
        "step-with-scalars": (None, lambda: adam(scalars=torch.zeros(2, dtype=f64), lr=0.0)),
    }


def as_meta(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the meta device with its strides (``to`` would make a strided view contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("case", list(_wrong_calls()))
def test_fakes_refuse_what_the_kernels_refuse_naming_the_argument(case):
    """A wrong call on CPU tensors is refused by ops.cpp's checks (ValueError). Where what is wrong is visible without
    data (a shape, dtype, device, layout, or a tensor given or missing), the fake refuses it too, run by FakeTensorMode
    and as the Meta kernel: torch._check's RuntimeError, naming the argument at fault."""
    offending, call = _wrong_calls()[case]
    name, kwargs = call()
    op = getattr(ops(), name)
    with pytest.raises(ValueError):
        op(**kwargs)
    if offending is None:
        return
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=rf"\b{offending}\b") as fake:
        op(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    with pytest.raises(RuntimeError, match=rf"\b{offending}\b") as meta:
        op(**{k: as_meta(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    # torch._check's own type, not a subclass such as NotImplementedError
    assert type(fake.value) is RuntimeError and type(meta.value) is RuntimeError


# ------------------------------------------------------------------------------------------- torch.compile
def sam_step(grad, param, backup, first_tile_of_block, partials, block_of_tile, ema, buffer):
    """A whole GEAR-SAM step on one bucket, from its operators alone: energy, allocation, perturbation, and the fused
    restore with SGD (a second step from the weights themselves, backup None)."""
    energy = ops().block_energy(grad, param, first_tile_of_block, partials, tile=TILE, adaptive=True, eta=0.01)
    scale, radius = ops().allocate(energy, ema, gear=True, rho=0.05, beta=0.9, delta=1e-12)
    ops().perturb_(param, grad, backup, scale, block_of_tile, tile=TILE, adaptive=True, eta=0.01)
    sgd = dict(tile=TILE, lr=0.1, weight_decay=5e-4, momentum=0.9, dampening=0.0, nesterov=True, maximize=False)
    ops().sgd_step_(param, grad, backup, buffer, first=True, **sgd)
    ops().sgd_step_(param, grad, None, buffer, first=False, **sgd)
    return energy, radius


def test_compiled_step_gives_the_bits_of_eager():
    """torch.compile(fullgraph=True, inductor) traces the operators through their fakes and functionalises their
    writes: its outputs and every buffer the step writes are the eager ones, bit for bit."""
    (grad, param, first_tile_of_block, partials), _ = energy_args(torch.float32, "cpu", adaptive=True)
    block_of_tile = tables("cpu")[1]

    def fresh():
        return [grad, param.clone(), torch.empty_like(param), first_tile_of_block, partials.clone(), block_of_tile,
                per_block([0.5, 2.0, 1.0], "cpu"), torch.empty_like(param)]  # fmt: skip

    eager, compiled = fresh(), fresh()
    expected = sam_step(*eager)
    got = torch.compile(sam_step, fullgraph=True, backend="inductor")(*compiled)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert not torch.equal(eager[1], param)  # the step moved the weights


# ------------------------------------------------------------------------------------------- capturable steps
# scalars (float64: (rho,) or (lr, k)) and found_inf (float32, one element) read from the buffers' device.
def with_scalars(name: str, kw: dict, device, k: int | None = None) -> dict:
    """``kw`` with the host values a capturable step reads from ``scalars`` moved there and set to 0: rho for
    allocate; lr and k (Adam's ``step``, or ``k`` for SGD, default 1 if ``first`` else 2) for the base steps."""
    f64 = dict(dtype=torch.float64, device=device)
    if name == "allocate":
        return {**kw, "rho": 0.0, "scalars": torch.tensor([kw["rho"]], **f64)}
    if name == "adam_step_":
        return {**kw, "lr": 0.0, "step": 0, "scalars": torch.tensor([kw["lr"], float(kw["step"])], **f64)}
    k = (1 if kw["first"] else 2) if k is None else k
    return {**kw, "lr": 0.0, "first": False, "scalars": torch.tensor([kw["lr"], float(k)], **f64)}


def flag(value: float, device, shape=()) -> torch.Tensor:
    """found_inf: GradScaler's is 0-d."""
    return torch.full(shape, value, dtype=torch.float32, device=device)


def capturable(name: str, args, kw: dict, device, scalars: bool, found_inf: float | None):
    kw = with_scalars(name, kw, device) if scalars else kw
    return args, kw if found_inf is None else {**kw, "found_inf": flag(found_inf, device)}


#: (scalars given, found_inf value or None) of the opcheck tests
DEVICE_VALUES = {"scalars": (True, None), "finite": (False, 0.0), "overflow": (False, 1.0),
                 "scalars-overflow": (True, 1.0), "scalars-finite": (True, 0.0)}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("values", list(DEVICE_VALUES))
@pytest.mark.parametrize("gear", [False, True], ids=["sam-rule", "gear-rule"])
def test_opcheck_allocate_capturable(gear, values, device):
    opcheck("allocate", *capturable("allocate", *allocate_args(device, gear), device, *DEVICE_VALUES[values]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("values", list(DEVICE_VALUES))
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", ["momentum", "first"])
def test_opcheck_sgd_step_capturable(flags, with_backup, values, device):
    args = sgd_args(torch.float32, device, flags, with_backup, corrected=True)
    opcheck("sgd_step_", *capturable("sgd_step_", *args, device, *DEVICE_VALUES[values]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("values", list(DEVICE_VALUES))
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("flags", list(ADAM_FLAGS))
def test_opcheck_adam_step_capturable(flags, with_backup, values, device):
    args = adam_args(torch.float64, device, flags, with_backup, corrected=True)
    opcheck("adam_step_", *capturable("adam_step_", *args, device, *DEVICE_VALUES[values]))


def run_both(name: str, args, kw: dict, device_kw: dict):
    """The operator on two copies of ``args``, with ``kw`` and with ``device_kw``: the two lists of tensors after
    the call (inputs, then outputs)."""
    results = []
    for call_kw in (kw, device_kw):
        copies = [None if t is None else t.clone() for t in args]
        out = getattr(ops(), name)(*copies, **call_kw)
        results.append(copies + (list(out) if out is not None else []))
    return results


def assert_same_bits(got: list, expected: list) -> None:
    for i, (a, b) in enumerate(zip(got, expected)):
        assert (a is None and b is None) or torch.equal(a, b), i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 7])
@pytest.mark.parametrize("flags", ["plain", "momentum", "nesterov-maximize"])
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_sgd_scalars_give_the_bits_of_the_host_call(dtype, flags, k, device):
    """scalars=(lr, k) against lr and first=(k == 1) (weight decay in every case): bit for bit, on every device (SGD
    derives nothing from k)."""
    args, kw = sgd_args(dtype, device, flags, with_backup=True, corrected=False)
    kw = {**kw, "first": k == 1}
    expected, got = run_both("sgd_step_", args, kw, with_scalars("sgd_step_", kw, device, k))
    assert_same_bits(got, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "looksam"])
@pytest.mark.parametrize("k", [1, 2, 7])
@pytest.mark.parametrize("flags", list(ADAM_FLAGS))
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_adam_scalars_give_the_bits_of_the_host_call(dtype, flags, k, corrected, device):
    """scalars=(lr, k) against lr and step=k: bit for bit on the CPU (the same constructor on the same doubles); on
    CUDA the kernel derives the constants with the device's pow (within 2 ulp), so within a few ulp."""
    args, kw = adam_args(dtype, device, flags, with_backup=True, corrected=corrected)
    kw = {**kw, "step": k}
    expected, got = run_both("adam_step_", args, kw, with_scalars("adam_step_", kw, device))
    if device == "cpu":
        assert_same_bits(got, expected)
    else:
        for a, b in zip(got, expected):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=8 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gear", [False, True], ids=["sam-rule", "gear-rule"])
def test_allocate_scalars_give_the_bits_of_the_host_call(gear, device):
    args, kw = allocate_args(device, gear)
    expected, got = run_both("allocate", args, kw, with_scalars("allocate", kw, device))
    assert_same_bits(got, expected)


def overflowed_grad(args: list, index: int = 1) -> list:
    """The base step's arguments with inf, -inf and NaN in grad (the kernels must not read it)."""
    grad = args[index].clone()
    grad[::3], grad[1::3], grad[2::3] = float("inf"), float("-inf"), float("nan")
    return [*args[:index], grad, *args[index + 1 :]]


STEPS = {"sgd": ("sgd_step_", sgd_args, "momentum"), "adam": ("adam_step_", adam_args, "adamw-amsgrad")}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-d", "1-d"])
@pytest.mark.parametrize("scalars", [False, True], ids=["host", "scalars"])
@pytest.mark.parametrize("with_backup", [True, False], ids=["backup", "no-backup"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", BASE_FLOATS, ids=str)
def test_overflow_restores_param_and_keeps_the_state(dtype, step, with_backup, scalars, shape, device):
    """found_inf nonzero: param = backup bit for bit (untouched without backup), every state buffer untouched, grad
    not read (inf and NaN in it), with or without scalars and LookSAM's correction."""
    name, make, flags = STEPS[step]
    args, kw = make(dtype, device, flags, with_backup, corrected=True)
    args = overflowed_grad(list(args))
    kw = with_scalars(name, kw, device) if scalars else kw
    before = [None if t is None else t.clone() for t in args]
    getattr(ops(), name)(*args, **kw, found_inf=flag(1.0, device, shape))
    param, _, backup, *state = args
    assert torch.equal(param, before[2] if with_backup else before[0])
    assert all(t is None or torch.equal(t, b) for t, b in zip([backup, *state], [before[2], *before[3:]]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scalars", [False, True], ids=["host", "scalars"])
@pytest.mark.parametrize("gear", [False, True], ids=["sam-rule", "gear-rule"])
def test_overflow_allocates_nothing_and_keeps_the_ema(gear, scalars, device):
    (energy, ema), kw = allocate_args(device, gear)
    energy = torch.tensor([float("inf"), float("nan"), 1.0], dtype=torch.float64, device=device)
    kw = with_scalars("allocate", kw, device) if scalars else kw
    expected_ema = ema.clone()
    scale, radius = ops().allocate(energy, ema, **kw, found_inf=flag(2.0, device, (1,)))
    assert torch.equal(scale, torch.zeros_like(energy)) and torch.equal(radius, torch.zeros_like(energy))
    assert torch.equal(ema, expected_ema)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scalars", [False, True], ids=["host", "scalars"])
@pytest.mark.parametrize("case", ["sgd", "adam", "allocate-gear", "allocate-sam"])
def test_finite_found_inf_changes_nothing(case, scalars, device):
    """found_inf zero: the bits of the call without it."""
    if case.startswith("allocate"):
        name, (args, kw) = "allocate", allocate_args(device, case == "allocate-gear")
    else:
        name, make, flags = STEPS[case]
        args, kw = make(torch.float32, device, flags, True, corrected=True)
    kw = with_scalars(name, kw, device) if scalars else kw
    expected, got = run_both(name, args, kw, {**kw, "found_inf": flag(0.0, device)})
    assert_same_bits(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_capturable_step_is_a_whole_step_with_the_scalars_of_the_device(device):
    """One tensor of scalars advanced between two steps (as a graph replay sees it), the second skipped: the bits of
    the host calls with the same lr and k, and the skipped step writes the backup only."""
    args, kw = adam_args(torch.float32, device, "adam", with_backup=True, corrected=False)
    host = [t.clone() for t in args if t is not None]
    dev = [t.clone() for t in args if t is not None]
    scalars = torch.tensor([LR, 1.0], dtype=torch.float64, device=device)
    found_inf = flag(0.0, device)
    base = {**kw, "lr": 0.0, "step": 0}
    for k in (1, 2):
        ops().adam_step_(*host[:5], None, **{**kw, "step": k})
        ops().adam_step_(*dev[:5], None, **base, scalars=scalars, found_inf=found_inf)
        scalars[1] += 1
    assert_same_bits(dev, host)
    found_inf.fill_(1.0)
    before = [t.clone() for t in dev]
    ops().adam_step_(*dev[:5], None, **base, scalars=scalars, found_inf=found_inf)
    assert torch.equal(dev[0], before[2]) and all(torch.equal(a, b) for a, b in zip(dev[1:], before[1:]))


def test_fakes_refuse_device_values_elsewhere():
    """The device checks, which CPU tensors alone cannot reach in ops.cpp: a meta found_inf or scalars beside CPU
    buffers, refused by the fakes (fake tensors keep their devices) and by the Triton launchers' check."""
    from gearsam_fused.checks import check_device_step

    (param, *args), kw = sgd_args(torch.float32, "cpu", "momentum", with_backup=True, corrected=False)
    elsewhere = {
        "found_inf": dict(found_inf=torch.zeros((), device="meta")),
        "scalars": with_scalars("sgd_step_", {"lr": 0.1, "first": False}, "meta"),
    }
    for name, change in elsewhere.items():
        with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=rf"^{name} .*on meta"):
            fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in {**kw, **change}.items()}
            ops().sgd_step_(*map(mode.from_tensor, (param, *args)), **fake)
    with pytest.raises(ValueError, match=r"^found_inf is on meta, the buffers on cpu$"):
        check_device_step("sgd_step_", param, None, torch.zeros((), device="meta"))
    with pytest.raises(ValueError, match=r"^scalars is on meta, the buffers on cpu$"):
        check_device_step("adam_step_", param, torch.zeros(2, dtype=torch.float64, device="meta"), None)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or not cpp_built_with_cuda(), reason="needs a CUDA GPU and the CUDA kernels")
def test_device_values_must_be_on_the_buffers_device():
    (energy, ema), kw = allocate_args("cuda", gear=True)
    with pytest.raises(ValueError, match=r"^found_inf is on cpu, the buffers on cuda:0$"):
        ops().allocate(energy, ema, **kw, found_inf=flag(0.0, "cpu"))
    args, kw = sgd_args(torch.float32, "cuda", "momentum", True, corrected=False)
    with pytest.raises(ValueError, match=r"^scalars is on cpu, the buffers on cuda:0$"):
        ops().sgd_step_(*args, **with_scalars("sgd_step_", kw, "cpu"))

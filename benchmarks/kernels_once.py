"""Run every fused kernel once on CUDA, on the sizes that reach the edges of the flat layout: a driver for
``compute-sanitizer`` (see ``gpu_suite.sh``), which checks each launch for out-of-bounds or misaligned accesses
(memcheck), shared-memory races (racecheck), reads of memory nothing wrote (initcheck) and misused barriers
(synccheck).

For the ``triton`` and ``cpp`` backends, every dtype (float32, bfloat16, float16, float64), plain and adaptive, GEAR
and SAM allocation, it runs one whole step through the backend: block energy (tile partials, then block sums),
allocation, perturb, restore; the inner products, the mix, the exchange and F-SAM's ascent of the SAM family
(``block_dot``, ``mix_gradient_``, ``exchange_sharpness_``, ``friendly_ascent_``, and ``friendly_energy_`` against
the two kernels it replaces); and the fused base steps (SGD, Adam(W)) against torch's own. The blocks hold parameters
of 1, 7 and 4097 elements, an empty block, a block whose gradient is all zeros, a parameter without a gradient and
one exactly a tile long. The C++ kernels also have a scalar variant for buffers that do not allow 16-byte
access; it runs on a tile of 7 elements and on buffers that start one element past an aligned address. A parameter of
3000 tiles makes every C++ thread block loop over several tiles. ``--big`` adds a bfloat16 parameter of 2**31 + 6149
elements, so that 64-bit offsets are exercised (about 13 GiB of GPU memory).

Each step is checked against the reference backend (energies, radii, the perturbed weights, the exact restore), so
the script also fails when a kernel computes garbage without touching memory it should not. It prints the CUDA
kernels it launched (``--list``, without the sanitizer: the profiler and the sanitizer do not mix).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from gearsam_fused.allocation import GEAR_RULE, RULES
from gearsam_fused.backends import BACKENDS, available_backends
from gearsam_fused.backends.cpp_backend import cpp_built_with_cuda
from gearsam_fused.backends.reference import ReferenceBackend
from gearsam_fused.flat import TILE
from gearsam_fused.partition import Block

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (numel, gradient) per parameter, per block
BLOCKS = [
    [(1, "randn"), (7, "randn"), (4097, "randn")],
    [],  # an empty block
    [(300, "zeros")],  # a gradient of exact zeros
    [(2049, None), (33, "randn")],  # a parameter without a gradient
    [(TILE, "randn")],  # exactly one tile
]
ETA = 0.01


def make_blocks(dtype: torch.dtype, seed: int) -> list[Block]:
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for b, specs in enumerate(BLOCKS):
        block = Block(f"block{b}")
        for i, (n, grad) in enumerate(specs):
            p = nn.Parameter(torch.randn(n, generator=g).to("cuda", dtype))
            values = torch.randn(n, generator=g).to("cuda", dtype)
            p.grad = {"randn": values, "zeros": torch.zeros_like(values), None: None}[grad]
            block.params.append(p)
            block.param_names.append(f"block{b}.p{i}")
        blocks.append(block)
    return blocks


def one_step(backend, rule: str, adaptive: bool):
    """energy, allocation, perturb; returns (energy, radius) and leaves the parameters perturbed."""
    energy = backend.block_energy(adaptive, ETA)
    ema = torch.full_like(energy, 0.5)
    scale, radius = backend.allocate(rule, energy, ema, rho=0.05, beta=0.9, delta=1e-12)
    backend.perturb_(scale, adaptive, ETA)
    return energy, radius


def check_backend(name: str, dtype: torch.dtype, rule: str, adaptive: bool) -> None:
    ours, ref = make_blocks(dtype, seed=1), make_blocks(dtype, seed=1)
    before = [p.detach().clone() for b in ours for p in b.params]
    fused, reference = BACKENDS[name](ours, torch.device("cuda")), ReferenceBackend(ref, torch.device("cuda"))
    energy, radius = one_step(fused, rule, adaptive)
    ref_energy, ref_radius = one_step(reference, rule, adaptive)
    where = f"{name} {dtype} {rule} adaptive={adaptive}"
    torch.testing.assert_close(energy, ref_energy, rtol=1e-6, atol=0, msg=lambda m: f"{where}: energy: {m}")
    torch.testing.assert_close(radius, ref_radius, rtol=1e-6, atol=0, msg=lambda m: f"{where}: radius: {m}")
    eps = torch.finfo(dtype).eps
    for p, q in zip((p for b in ours for p in b.params), (q for b in ref for q in b.params)):
        torch.testing.assert_close(p, q, rtol=eps, atol=eps, msg=lambda m: f"{where}: perturbed weights: {m}")
    fused.restore_()
    assert all(torch.equal(p, w) for p, w in zip((p for b in ours for p in b.params), before)), f"{where}: restore"


def check_inner_products(name: str, dtype: torch.dtype) -> None:
    """The energy kernel's inner-product variant (``block_energy`` with ``other``), reached through the backend's
    ``block_dot`` as the SAM family reaches it: per block, the sum of the kept gradient times a new gradient, against
    the same products in float64, within what the kernels' short sums in the compute dtype (8 terms, float32 for
    every dtype but float64) may lose: 1e-6 of the sum of the products' magnitudes. Then ``block_dot_energy``, GSAM's
    one read: the bits of ``block_dot`` and of the energy pass."""
    blocks = make_blocks(dtype, seed=3)
    backend = BACKENDS[name](blocks, torch.device("cuda"))
    backend.keep_gradient_()
    kept = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for b in blocks for p in b.params]
    g = torch.Generator().manual_seed(4)
    for p in (p for b in blocks for p in b.params if p.grad is not None):
        p.grad = torch.randn(p.shape, generator=g).to("cuda", dtype)
    products, i = [], 0
    for block in blocks:
        terms = []
        for p in block.params:
            if p.grad is not None:
                terms.append(kept[i].double() * p.grad.double())
            i += 1
        products.append(torch.cat(terms) if terms else torch.zeros(0, dtype=torch.float64, device="cuda"))
    expected = torch.stack([t.sum() for t in products])
    bound = 1e-6 * torch.stack([t.abs().sum() for t in products])
    error = (backend.block_dot() - expected).abs()
    assert bool((error <= bound).all()), (
        f"{name} {dtype}: inner products off by {error.tolist()}, bounds {bound.tolist()}"
    )
    # GSAM's one read for <g, h> and ||h||^2: the bits of the two passes it replaces
    dot, energy = backend.block_dot_energy()
    assert torch.equal(dot, backend.block_dot()), f"{name} {dtype}: block_dot_energy's inner products"
    assert torch.equal(energy, backend.block_energy(False, 0.0)), f"{name} {dtype}: block_dot_energy's energies"


def check_mix(name: str, dtype: torch.dtype) -> None:
    """The SAM family's mix (``mix_gradient_``), reached through the backend as GSAM reaches it: per block,
    ``g <- a * g + c * kept``, against the same sum in float64: within two units in the last place of the dtype,
    and 8 of them absolutely (the terms reach 8 while their sum may cancel); then WSAM's exchange and F-SAM's ascent
    on the same backend (:func:`check_friendly_ascent`)."""
    blocks = make_blocks(dtype, seed=5)
    backend = BACKENDS[name](blocks, torch.device("cuda"))
    backend.keep_gradient_()
    kept = [p.grad.clone() for b in blocks for p in b.params if p.grad is not None]
    g = torch.Generator().manual_seed(6)
    for p in (p for b in blocks for p in b.params if p.grad is not None):
        p.grad = torch.randn(p.shape, generator=g).to("cuda", dtype)
    before = [p.grad.clone() for b in blocks for p in b.params if p.grad is not None]
    a = torch.linspace(-1.5, 2.0, len(blocks), dtype=torch.float64, device="cuda")
    c = torch.linspace(0.75, -0.5, len(blocks), dtype=torch.float64, device="cuda")
    backend.mix_gradient_(a, c)
    block_of = [b for b, block in enumerate(blocks) for p in block.params if p.grad is not None]
    after = [p.grad for b in blocks for p in b.params if p.grad is not None]
    eps = torch.finfo(dtype).eps
    for b, h, k, out in zip(block_of, before, kept, after):
        expected = (a[b] * h.double() + c[b] * k.double()).to(dtype)
        torch.testing.assert_close(out, expected, rtol=2 * eps, atol=8 * eps, msg=lambda m: f"{name} {dtype} mix: {m}")
    # WSAM's exchange: the gradients take the kept ones, the kept buffer their difference (in float64 here)
    mixed = [t.clone() for t in after]
    backend.exchange_sharpness_()
    sharpness = [t for t, p in zip(backend.buffer_tensors("correction"), (p for b in blocks for p in b.params))
                 if p.grad is not None]  # fmt: skip
    for out, k, diff, h in zip(after, kept, sharpness, mixed):
        assert torch.equal(out, k), f"{name} {dtype} exchange: the gradient is not the kept one"
        torch.testing.assert_close(diff, (h.double() - k.double()).to(dtype), rtol=eps, atol=0,
                                   msg=lambda m: f"{name} {dtype} exchange: {m}")  # fmt: skip
    check_friendly_ascent(name, dtype, backend, blocks)


def check_friendly_ascent(name: str, dtype: torch.dtype, backend, blocks) -> None:
    """F-SAM's ascent (``friendly_ascent_``) through the backend, as FriendlySAM reaches it: its first step copies the
    gradients into the EMA, a later one gives ``g - sigma * m`` and ``lerp(m, g, 1 - lmbda)`` (against float64, within
    two units in the last place, 8 absolutely), and a parameter without a gradient keeps its EMA."""
    params = [p for b in blocks for p in b.params]
    g = torch.Generator().manual_seed(7)
    for p, m in zip(params, backend.buffer_tensors("momentum")):
        if p.grad is None:  # an EMA from the steps where it had one: no step without a gradient may touch it
            m.copy_(torch.randn(m.shape, generator=g))
    kept = [m.clone() for m in backend.buffer_tensors("momentum")]
    backend.friendly_ascent_(0.7, 0.9, started=[False] * len(params))
    first = [m.clone() for m in backend.buffer_tensors("momentum")]
    for p, m in zip(params, first):
        if p.grad is not None:
            assert torch.equal(m, p.grad), f"{name} {dtype} friendly ascent: the first EMA is not the gradient"
    for p in (p for p in params if p.grad is not None):
        p.grad = torch.randn(p.shape, generator=g).to("cuda", dtype)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    backend.friendly_ascent_(0.7, 0.9, started=[True] * len(params))
    eps = torch.finfo(dtype).eps
    for p, h, m_old, m, m_kept in zip(params, before, first, backend.buffer_tensors("momentum"), kept):
        if h is None:
            assert torch.equal(m, m_kept), (
                f"{name} {dtype} friendly ascent: the EMA of a parameter without a gradient moved"
            )
            continue
        for got, expected, what in ((p.grad, h.double() - 0.7 * m_old.double(), "ascent"),
                                    (m, 0.9 * m_old.double() + 0.1 * h.double(), "EMA")):  # fmt: skip
            torch.testing.assert_close(got, expected.to(dtype), rtol=2 * eps, atol=8 * eps,
                                       msg=lambda msg: f"{name} {dtype} friendly {what}: {msg}")  # fmt: skip


def check_scalar_cpp_kernels(dtype: torch.dtype, adaptive: bool) -> None:
    """The C++ kernels' one-element-at-a-time variants: a tile of 7, and buffers one element off alignment."""
    kernels = torch.ops.gearsam_fused  # registered when available_backends() loaded the extension
    for tile, offset in ((7, 0), (TILE, 1)):
        n_tiles = 3
        n = n_tiles * tile
        # one allocation per buffer, sliced past its start, so a wrong offset reads outside it
        param, grad, backup = (torch.randn(n + offset, device="cuda").to(dtype)[offset:] for _ in range(3))
        first_tile_of_block = torch.tensor([0, 1, 1, n_tiles], dtype=torch.int64, device="cuda")  # block 1 is empty
        block_of_tile = torch.tensor([0, 2, 2], dtype=torch.int32, device="cuda")
        partials = torch.empty(n_tiles, dtype=torch.float64, device="cuda")
        energy = kernels.block_energy(grad, param, first_tile_of_block, partials, tile=tile, adaptive=adaptive, eta=ETA)
        t = (param.double().abs() + ETA) if adaptive else torch.ones_like(param, dtype=torch.float64)
        per_tile = ((t * grad.double()) ** 2).view(n_tiles, tile).sum(1)
        expected = torch.stack([per_tile[0], per_tile.new_zeros(()), per_tile[1:].sum()])
        torch.testing.assert_close(energy, expected, rtol=1e-6, atol=0, msg=lambda m: f"scalar energy {dtype}: {m}")
        scale, _ = kernels.allocate(energy, torch.zeros_like(energy), gear=True, rho=0.05, beta=0.9, delta=1e-12)
        original = param.clone()
        kernels.perturb_(param, grad, backup, scale, block_of_tile, tile=tile, adaptive=adaptive, eta=ETA)
        assert torch.equal(backup, original), f"scalar perturb {dtype}: backup"
        kernels.restore_(param, backup, tile=tile)
        assert torch.equal(param, original), f"scalar restore {dtype}"


def check_many_tiles(name: str) -> None:
    """More tiles than the C++ kernels launch thread blocks (8 per SM), so each block loops over several tiles and
    reuses its shared-memory scratch: the case racecheck must see."""
    g = torch.Generator().manual_seed(2)
    params = [nn.Parameter(torch.randn(n, generator=g).cuda()) for n in (3000 * TILE + 1, 5)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).cuda()
    blocks = [Block("many", [params[0]], ["many"]), Block("few", [params[1]], ["few"])]
    backend = BACKENDS[name](blocks, torch.device("cuda"))
    energy, _ = one_step(backend, GEAR_RULE, adaptive=True)
    expected = torch.stack([((p.detach().double().abs() + ETA) * p.grad.double()).square().sum() for p in params])
    torch.testing.assert_close(energy, expected, rtol=1e-6, atol=0, msg=lambda m: f"{name} many tiles: energy: {m}")
    backend.restore_()


def check_base_steps(name: str) -> None:
    """The fused base steps (``sgd_step_``, ``adam_step_``) with every optional buffer in use, float32 and float64, on
    one tile, on 3000 tiles (every thread loops) and, for the C++ kernels' scalar variant, on a tile of 7 and on
    buffers one element off alignment; each against torch's CPU optimizer on the same values, and SGD's with the SAM
    family's mix and WSAM's sharpness step folded in (:func:`check_folded_mix`); and on the same buffers F-SAM's
    ascent with its energies (:func:`check_friendly_energy`)."""
    if name == "triton":
        from gearsam_fused import triton_kernels as kernels
    else:
        kernels = torch.ops.gearsam_fused
    shapes = [(TILE, 1, 0), (TILE, 3000, 0)] + ([(7, 3, 0), (TILE, 3, 1)] if name == "cpp" else [])
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        for tile, n_tiles, offset in shapes:
            n = tile * n_tiles

            def buffers(count, scale=1.0):
                # one allocation per buffer, sliced past its start, so a wrong offset reads outside it
                made = [scale * torch.rand(n + offset, generator=g, dtype=dtype) for _ in range(count)]
                return [t[offset:] for t in made], [t.to("cuda")[offset:] for t in made]

            (w, grad, buf), (w_d, grad_d, buf_d) = buffers(3)
            param_d = torch.full_like(w_d, float("nan"))
            kernels.sgd_step_(param_d, grad_d, w_d, buf_d, tile=tile, lr=0.1, weight_decay=1e-3, momentum=0.9,
                              dampening=0.0, nesterov=True, maximize=True, first=False)  # fmt: skip
            p = nn.Parameter(w.clone())
            p.grad = grad.clone()
            sgd = torch.optim.SGD([p], lr=0.1, weight_decay=1e-3, momentum=0.9, nesterov=True,
                                  maximize=True, foreach=False)  # fmt: skip
            sgd.state[p]["momentum_buffer"] = buf.clone()
            sgd.step()
            where = f"{name} sgd_step_ {dtype} tile={tile} x {n_tiles} offset={offset}"
            assert torch.equal(param_d.cpu(), p.detach()), where
            assert torch.equal(buf_d.cpu(), sgd.state[p]["momentum_buffer"]), where
            check_folded_mix(kernels, where, w_d, grad_d, buf_d, buffers(1)[1][0], tile)
            check_friendly_energy(kernels, where.replace("sgd_step_", "friendly_energy_"), w_d, grad_d, buf_d, tile)

            (w, grad, m, v), (w_d, grad_d, m_d, v_d) = buffers(4)
            vmax_d = v_d * 1.5
            param_d = torch.full_like(w_d, float("nan"))
            step, lr, beta1, beta2 = 5, 1e-3, 0.9, 0.999
            kernels.adam_step_(param_d, grad_d, w_d, m_d, v_d, vmax_d, tile=tile, beta1=beta1, beta2=beta2, eps=1e-8,
                               weight_decay=0.01, decoupled=True, amsgrad=True, maximize=False, lr=lr,
                               step=step)  # fmt: skip
            p = nn.Parameter(w.clone())
            p.grad = grad.clone()
            adamw = torch.optim.AdamW([p], lr=lr, weight_decay=0.01, amsgrad=True, foreach=False)
            adamw.state[p].update(step=torch.tensor(step - 1.0), exp_avg=m.clone(), exp_avg_sq=v.clone(),
                                  max_exp_avg_sq=v * 1.5)  # fmt: skip
            adamw.step()
            where = f"{name} adam_step_ {dtype} tile={tile} x {n_tiles} offset={offset}"
            assert torch.equal(m_d.cpu(), adamw.state[p]["exp_avg"]), where
            assert torch.equal(v_d.cpu(), adamw.state[p]["exp_avg_sq"]), where
            # the square root is correctly rounded on CUDA and may be an ulp off on the CPU (see tests/kernels/test_base_step)
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(param_d.cpu(), p.detach(), rtol=2 * eps, atol=4 * eps * lr / (1 - beta1**step),
                                       msg=lambda msg: f"{where}: {msg}")  # fmt: skip


def check_folded_mix(kernels, where: str, w, grad, buf, kept, tile: int) -> None:
    """The SAM family's mix folded into ``sgd_step_`` (``grad_scale`` beside the correction): the bits of
    ``mix_gradient_`` followed by the plain step, on the same device; and WSAM's decoupled step (the mix ``0 * h +
    1 * g`` with ``sharpness``): the plain step with ``g``, then ``w + (-lr * a) * (h - g)`` by torch's CPU ``add_``
    (one fma)."""
    block_of_tile = torch.arange(w.numel() // tile, dtype=torch.int32, device=w.device) % 3
    a, c = (torch.tensor(v, dtype=torch.float64, device=w.device) for v in ([1.25, -0.5, 1.0], [-0.4, 0.3, 0.0]))
    hyper = dict(tile=tile, lr=0.1, weight_decay=1e-3, momentum=0.9, dampening=0.0, nesterov=True, maximize=False,
                 first=False)  # fmt: skip
    folded, folded_buf = torch.full_like(w, float("nan")), buf.clone()
    kernels.sgd_step_(folded, grad, w, folded_buf, correction=kept, correction_scale=c, block_of_tile=block_of_tile,
                      grad_scale=a, **hyper)  # fmt: skip
    mixed = grad.clone()
    kernels.mix_gradient_(mixed, kept, a, c, block_of_tile, tile=tile)
    plain, plain_buf = torch.full_like(w, float("nan")), buf.clone()
    kernels.sgd_step_(plain, mixed, w, plain_buf, **hyper)
    assert torch.equal(folded, plain) and torch.equal(folded_buf, plain_buf), f"{where}: the folded mix"
    sharpened, sharpened_buf = torch.full_like(w, float("nan")), buf.clone()
    kernels.sgd_step_(sharpened, grad, w, sharpened_buf, correction=kept, correction_scale=torch.ones_like(c),
                      block_of_tile=block_of_tile, grad_scale=torch.zeros_like(a), sharpness=2.5, **hyper)  # fmt: skip
    stepped, stepped_buf = torch.full_like(w, float("nan")), buf.clone()
    kernels.sgd_step_(stepped, kept, w, stepped_buf, **hyper)
    expected = stepped.cpu().add_((grad - kept).cpu(), alpha=-hyper["lr"] * 2.5)
    assert torch.equal(sharpened.cpu(), expected) and torch.equal(sharpened_buf, stepped_buf), f"{where}: sharpness"


def check_friendly_energy(kernels, where: str, w, grad, m, tile: int) -> None:
    """F-SAM's ascent with the energies of its direction in one read (``friendly_energy_``, plain and adaptive, first
    step and later): the bits of ``friendly_ascent_`` then ``block_energy`` in the gradient, the EMA, the partials and
    the energies, over three blocks."""
    n_tiles = w.numel() // tile
    first_tile_of_block = torch.tensor([0, n_tiles // 3, n_tiles // 3, n_tiles], device=w.device)
    for adaptive in (False, True):
        for first in (True, False):
            kw = dict(tile=tile, adaptive=adaptive, eta=0.01)
            one = [grad.clone(), m.clone(), torch.full((n_tiles,), float("nan"), dtype=torch.float64, device=w.device)]
            two = [t.clone() for t in one]
            energy = kernels.friendly_energy_(one[0], one[1], w, first_tile_of_block, one[2], **kw, sigma=0.7,
                                              lmbda=0.9, first=first)  # fmt: skip
            kernels.friendly_ascent_(two[0], two[1], sigma=0.7, lmbda=0.9, first=first)
            expected = kernels.block_energy(two[0], w, first_tile_of_block, two[2], **kw)
            same = all(torch.equal(a, b) for a, b in zip(one + [energy], two + [expected]))
            assert same, f"{where} adaptive={adaptive} first={first}: not the two kernels' bits"


def check_big(name: str) -> None:
    """A bfloat16 buffer past 2**31 elements: the last elements are read and written where they belong."""
    n = 2**31 + 3 * TILE + 5
    big = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device="cuda"))
    small = nn.Parameter(torch.ones(7, dtype=torch.bfloat16, device="cuda"))
    big.grad = torch.zeros_like(big)
    big.grad[-5:] = 1.0
    small.grad = torch.ones_like(small)
    backend = BACKENDS[name]([Block("big", [big], ["big"]), Block("small", [small], ["small"])], torch.device("cuda"))
    energy, radius = one_step(backend, GEAR_RULE, adaptive=False)
    assert energy.tolist() == [5.0, 7.0], energy
    scale = radius[0].item() / (5**0.5 + 1e-12)
    assert torch.equal(big[-5:].float(), torch.full((5,), scale, device="cuda").bfloat16().float()), f"{name}: big tail"
    assert not big[-5 - 2 * TILE : -5].any() and not big[: 2 * TILE].any(), f"{name}: big perturbed outside its tail"
    backend.restore_()
    assert not big.any(), f"{name}: big restore"
    del backend, big, small
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", action="store_true", help="also a bfloat16 buffer of more than 2**31 elements")
    parser.add_argument("--list", action="store_true", help="print the CUDA kernels launched (torch profiler)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_once.py needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [n for n in ("triton", "cpp") if n in available_backends()]
    if "cpp" in names and not cpp_built_with_cuda():
        names.remove("cpp")

    def run_all():
        for name in names:
            for dtype in DTYPES:
                for adaptive in (False, True):
                    for rule in RULES:
                        check_backend(name, dtype, rule, adaptive)
                    if name == "cpp":
                        check_scalar_cpp_kernels(dtype, adaptive)
                check_inner_products(name, dtype)
                check_mix(name, dtype)
            check_many_tiles(name)
            check_base_steps(name)
            if args.big:
                check_big(name)
        torch.cuda.synchronize()

    if args.list:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_all()
        ours = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
        print("CUDA kernels and copies launched:", *ours, sep="\n  ")
    else:
        run_all()
    print(f"kernels_once: backends {names}, {len(DTYPES)} dtypes, big={args.big}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

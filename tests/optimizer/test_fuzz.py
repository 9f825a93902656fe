"""Property-based parity: every fused backend against the per-tensor ``reference`` backend, over random shapes,
dtypes, partitions, allocation rules and hyperparameters.

Each example builds two bitwise-identical parameter sets, gives both the same gradients and runs a few SAM steps
through the public API. Every step it compares, with the tolerances derived below:

* the perturbed weights after ``first_step``, against the reference's and, exactly for the kernels, against the
  paper's formula applied with the scale the optimizer handed its backend;
* ``block_stats()`` against the reference's, and the reference's own against float64 sums written here;
* the weights after ``second_step``: bitwise equal to the reference's (the restore is exact and the base optimizer
  sees the same gradients), and to the weights before the step when the base optimizer does nothing.

Profiles (environment variable ``GEARSAM_FUZZ_PROFILE``), the first two of a fixed set of examples (derandomized):

* ``default`` (the default tier's): 40 examples per test;
* ``full`` (the full tier's): 150 examples per test;
* ``long``: 1,500 examples, drawn afresh every run, steered towards the tolerances.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import strategies as st
from torch import nn

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.allocation import GEAR_RULE, RULES
from gearsam_fused.flat import TILE

import tiers
from conftest import ALL, FUSED, SGD_KW, NoStep

for name, examples in (("default", 40), ("full", 150)):
    settings.register_profile(
        name, max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        # hill-climbing towards the tolerances would spend a small budget on variations of one example
        phases=[Phase.explicit, Phase.generate, Phase.shrink, Phase.explain],
    )  # fmt: skip
settings.register_profile(
    "long", max_examples=1500, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
# Applied per test rather than loaded globally, so other test modules keep hypothesis' defaults.
PROFILE = settings.get_profile(os.environ.get("GEARSAM_FUZZ_PROFILE", "full" if tiers.FULL else "default"))

#: The Triton interpreter runs every tile in Python: keep each example small.
MAX_ELEMENTS = 20_000

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# ----------------------------------------------------------------------------------------------- tolerances
#: Unit roundoff of the float32 and float64 arithmetic that the energies are accumulated in.
UNIT = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}

#: First-order bounds, in units of roundoff, on the relative error of one tile's energy as each backend computes it
#: (all terms are non-negative, so a bound on every partial sum bounds the block's sum too). Each adds two roundings
#: for the product T * g and its square to the additions a term goes through:
#: Triton sums a tile by a tree (log2(TILE) levels); the C++ kernels sum runs of 8 squares per lane in the compute type,
#: then in float64; torch's vector_norm keeps 8 lanes that each add TILE / 8 squares one after another, then combines
#: the lanes and rounds the norm back to the compute type before it is squared in float64 (a few roundings more).
#: One term far larger than the rest is enough to lose most of a lane's bound: torch's really is ~TILE/8 units (1.5e-5
#: in float32); the reference adds its float64 per-tensor sums tensor by tensor.
ENERGY_UNITS = {"triton": TILE.bit_length() - 1 + 2, "cpp": 8 + 2, "torch": TILE // 8 + 8}
REFERENCE_UNITS = TILE // 8 + 8  # the reference's float64 sums, against float64 fused ones


def energy_rtol(backend: str, dtype: torch.dtype) -> float:
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return ENERGY_UNITS[backend] * UNIT[compute] + REFERENCE_UNITS * UNIT[torch.float64]


#: Multiples of the energy error that each statistic can carry: the EMA is a convex combination of energies, SAM's
#: score is their square root; a radius rho * s_b / ||s|| (or rho * sqrt(e_b / sum e)) adds the error of the norm;
#: the share squares the radius.
STAT_FACTOR = {"energy": 1.0, "score": 1.0, "radius": 2.0, "share": 4.0}

#: Relative error of eps = scale_b * T**2 * g, in energy errors. scale_b = rho * s_b / (||s|| * (sqrt(e_b) + delta))
#: carries at most 2.5 of them; the remaining half (at least 5 units of roundoff, as every energy bound is 10 or more)
#: covers the cast of the scale and the product with it on either side (torch's fused multiply-add saves one).
EPS_FACTOR = 3.0


def store_rtol(dtype: torch.dtype) -> float:
    """Two roundings to nearest of values that agree up to the eps error land at most one unit in the last place of
    the stored dtype apart (bounded by ``finfo.eps * |x|`` for normal numbers). Half and bfloat16 weights first
    round ``w + eps`` to float32 and then to their own dtype, which adds float32's unit to that."""
    extra = torch.finfo(torch.float32).eps if dtype in (torch.bfloat16, torch.float16) else 0.0
    return torch.finfo(dtype).eps + extra


def store_atol(dtype: torch.dtype) -> float:
    """Spacing of the subnormals: the unit in the last place where ``finfo.eps * |x|`` no longer bounds it."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


# ----------------------------------------------------------------------------------------------- examples
#: Sizes at the edges of the flat layout: empty, one element, 0-d, around the 64-element alignment and the tile, two
#: tiles plus one, and multi-dimensional shapes (which may also be given transposed strides).
SPECIAL_SHAPES = [
    (0,), (2, 0), (), (1,), (7,), (63,), (64,), (65,), (TILE - 1,), (TILE,), (TILE + 1,), (2 * TILE + 1,),
    (3, 5), (2, 3, 4), (1, 1, 1), (5, 1), (17, 33),
]  # fmt: skip
TINY_SHAPES = [(), (1,), (2,), (3,), (1, 2)]


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: int
    transposed: bool  # dense, but with reversed strides
    frozen: bool  # requires_grad=False: no block may hold it, nothing may change it
    w_scale: float
    g_scale: float


@dataclass(frozen=True)
class Case:
    rule: str  # one of RULES
    tensors: tuple[Tensor, ...]
    n_blocks: int
    partition: str  # "mapping", "callable", "tensor" or "global"
    groups: bool  # two param groups with different learning rates
    adaptive: bool
    eta: float
    rho: float
    beta: float
    delta: float
    base: str  # "nostep" or "sgd"
    flow: str  # "manual" (first_step / second_step) or "closure" (step)
    zero_grad_first: bool
    zero_grad_second: bool
    grad_update: str  # "assign" (new tensors) or "inplace" (zero_grad(set_to_none=False), then copy into .grad)
    kinds: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]  # [step][pass][tensor]: "randn", "zeros" or "none"
    seed: int

    @property
    def steps(self) -> int:
        return len(self.kinds)


@st.composite
def shapes(draw) -> list[tuple[int, ...]]:
    layout = draw(st.sampled_from(["mixed", "tiny", "single"]))
    if layout == "tiny":
        candidates = draw(st.lists(st.sampled_from(TINY_SHAPES), min_size=16, max_size=96))
    else:
        random_shape = st.lists(st.integers(1, 16), min_size=1, max_size=3).map(tuple)
        shape = st.one_of(st.sampled_from(SPECIAL_SHAPES), random_shape)
        size = (1, 1) if layout == "single" else (2, 10)
        candidates = draw(st.lists(shape, min_size=size[0], max_size=size[1]))
    chosen, total = [], 0
    for s in candidates:
        n = torch.Size(s).numel()
        if chosen and total + n > MAX_ELEMENTS:
            continue
        chosen.append(s)
        total += n
    return chosen


@st.composite
def cases(draw, rule: str) -> Case:
    dims = draw(shapes())
    n = len(dims)
    # repeated entries weigh the draw: mixed buckets and several blocks are where the layouts get interesting
    dtype_mode = draw(st.sampled_from([*DTYPES, "mixed", "mixed"]))
    partition = draw(st.sampled_from(["mapping", "callable", "mapping", "callable", "tensor", "global"]))
    n_blocks = min(draw(st.sampled_from([3, 2, 4, 1, 6])), n + 1)  # n + 1: a mapping may leave a block empty
    # round-robin plus a drawn offset: the simplest draws still spread the tensors over every block
    offsets = [draw(st.integers(0, n_blocks - 1)) for _ in range(n)]
    tensors = []
    for i, shape in enumerate(dims):
        tensors.append(Tensor(
            shape=shape,
            dtype=draw(st.sampled_from(DTYPES)) if dtype_mode == "mixed" else dtype_mode,
            block=(i + offsets[i]) % n_blocks,
            transposed=len(shape) >= 2 and draw(st.booleans()),
            frozen=i > 0 and draw(st.integers(0, 7)) == 0,  # the first stays trainable: a partition needs one
            w_scale=draw(st.sampled_from([1.0, 1e-2, 10.0])),
            g_scale=draw(st.sampled_from([1.0, 1e-3, 1e3])),
        ))  # fmt: skip

    kind = st.sampled_from(["randn", "randn", "randn", "zeros", "none"])
    steps = draw(st.integers(1, 3))
    trainable = [i for i, t in enumerate(tensors) if not t.frozen]
    kinds = []
    for _ in range(steps):
        first = [draw(kind) if i in trainable else "none" for i in range(n)]
        if all(first[i] == "none" for i in trainable):
            first[trainable[0]] = "randn"  # first_step refuses to run without a single gradient
        second = [draw(kind) if i in trainable else "none" for i in range(n)]
        if all(second[i] == "none" for i in trainable):
            second[trainable[0]] = "randn"  # second_step refuses a step without a gradient computed at w + eps
        kinds.append((tuple(first), tuple(second)))

    flow = draw(st.sampled_from(["manual", "closure"]))
    return Case(
        rule=rule,
        tensors=tuple(tensors),
        n_blocks=n_blocks,
        partition=partition,
        groups=n >= 2 and draw(st.booleans()),
        adaptive=draw(st.booleans()),
        eta=draw(st.one_of(st.just(0.0), st.just(0.01), st.floats(0.0, 0.5))),
        rho=draw(st.one_of(st.sampled_from([0.05, 0.5, 2.0, 0.0]), st.floats(1e-3, 2.0))),
        # beta of 1e-6 and above: a tinier one makes s ~ beta * s_prev so small that s**2 underflows (see the
        # allocation test below)
        beta=draw(st.one_of(st.sampled_from([0.0, 0.9]), st.floats(1e-6, 0.999))) if rule == GEAR_RULE else 0.0,
        delta=draw(st.sampled_from([1e-12, 1e-6, 1e-2])),
        base=draw(st.sampled_from(["sgd", "nostep"])),
        flow=flow,
        # step(closure) always zeroes between the passes (set_to_none)
        zero_grad_first=flow == "closure" or draw(st.booleans()),
        zero_grad_second=draw(st.booleans()),
        grad_update=draw(st.sampled_from(["assign", "inplace"])),
        kinds=tuple(kinds),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ----------------------------------------------------------------------------------------------- building
class Holder(nn.Module):
    """Gives the parameters names, for the callable partition."""

    def __init__(self, params):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"t{i}", p)


def make_params(case: Case, device: str) -> list[nn.Parameter]:
    """The same case always gives bitwise the same parameters."""
    g = torch.Generator().manual_seed(case.seed)
    params = []
    for t in case.tensors:
        if t.transposed:
            w = torch.randn(t.shape[::-1], generator=g, dtype=torch.float64).permute(*reversed(range(len(t.shape))))
        else:
            w = torch.randn(t.shape, generator=g, dtype=torch.float64)
        # .to keeps the strides of a dense tensor
        params.append(nn.Parameter((w * t.w_scale).to(device, t.dtype), requires_grad=not t.frozen))
    return params


def make_grads(case: Case, device: str) -> list[list[list[torch.Tensor | None]]]:
    """[step][pass][tensor] gradients (None where the tensor gets none)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    out = []
    for step_kinds in case.kinds:
        passes = []
        for pass_kinds in step_kinds:
            grads = []
            for t, kind in zip(case.tensors, pass_kinds):
                values = torch.randn(t.shape, generator=g, dtype=torch.float64) * t.g_scale
                if kind == "none":
                    grads.append(None)
                else:
                    grads.append((values if kind == "randn" else torch.zeros_like(values)).to(device, t.dtype))
            passes.append(grads)
        out.append(passes)
    return out


def make_optimizer(case: Case, params: list[nn.Parameter], backend: str):
    blocks = [f"b{t.block}" for t in case.tensors]
    model = None
    if case.partition == "mapping":
        partition = {f"b{k}": [p for p, b in zip(params, blocks) if b == f"b{k}"] for k in range(case.n_blocks)}
    elif case.partition == "callable":
        model = Holder(params)
        partition = lambda name, p: blocks[int(name[1:])]  # noqa: E731
    else:
        partition = case.partition
    if case.groups:
        half = len(params) // 2
        param_arg = [{"params": params[:half]}, {"params": params[half:], "lr": 3 * SGD_KW["lr"]}]
    else:
        param_arg = params
    base, base_kw = (torch.optim.SGD, SGD_KW) if case.base == "sgd" else (NoStep, {})
    common = dict(model=model, partition=partition, rho=case.rho, adaptive=case.adaptive, eta=case.eta,
                  delta=case.delta, backend=backend)  # fmt: skip
    if case.rule == GEAR_RULE:
        return GEARSAM(param_arg, base, beta=case.beta, **common, **base_kw)
    return SAM(param_arg, base, **common, **base_kw)


def set_grads(case: Case, opt, params, grads) -> None:
    if case.grad_update == "inplace":
        opt.zero_grad(set_to_none=False)
    for p, g in zip(params, grads):
        if g is None:
            p.grad = None
        elif case.grad_update == "inplace" and p.grad is not None:
            p.grad.copy_(g)
        elif case.base == "sgd":
            # torch's elementwise kernels may round low-precision results differently when their operands' memory
            # layouts differ, so the base step sees gradients laid out as backward lays them out: like the parameter
            p.grad = torch.empty_like(p).copy_(g)
        else:
            p.grad = g.clone()  # contiguous whatever the parameter's strides: re-homing must copy across layouts


# ----------------------------------------------------------------------------------------------- checks
def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().view(ints), b.detach().view(ints))


def block_of(opt) -> dict[int, int]:
    return {id(p): b for b, block in enumerate(opt.blocks) for p in block.params}


def own_scales(case: Case, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-block scale an optimizer used, recomputed in float64 from what it reports."""
    if case.rule == GEAR_RULE:
        return stats["radius"] / (stats["energy"].sqrt() + case.delta)
    denominator = stats["energy"].sum().sqrt() + case.delta
    return (torch.full_like(denominator, case.rho) / denominator).expand_as(stats["energy"])  # a true division


def formula(case: Case, w: torch.Tensor, g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w + scale * T**2 * g`` exactly as the paper's step is specified: in float32 (float64 for float64 weights),
    multiply and add rounded separately, one rounding to the stored dtype."""
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    w_c, direction = w.to(dtype), g.to(dtype)
    if case.adaptive:
        direction = (w_c.abs() + case.eta).square() * direction
    return (w_c + direction * scale.to(dtype)).to(w.dtype)


def scale_rtol(n_blocks: int) -> float:
    """The scale a backend used against the one its block_stats() imply, recomputed here in float64. SAM's sum_j e_j
    may be added in another order (each order is within (B - 1) units of the exact sum, the square root halves their
    difference); the kernels divide rho / x where torch's ``rho / tensor`` computes rho * (1 / x); adding delta and
    the square root round once more."""
    return (n_blocks + 4) * UNIT[torch.float64]


def check_own_formula(case, opt, params, exact, perturbed, before, grads, stats, used_scale) -> None:
    """Perturbed weights against the formula applied with the scale the optimizer handed its backend. The Triton and
    C++ kernels (and the reference) round exactly like it. torch's addcmul may contract into a fused multiply-add,
    which skips the rounding of the product (up to one unit of the compute dtype times |scale * T**2 * g|, many units
    of the result when w and eps nearly cancel) and may then round the sum the other way (one unit of the stored
    dtype)."""
    torch.testing.assert_close(
        used_scale, own_scales(case, stats), rtol=scale_rtol(len(used_scale)), atol=0,
        msg=lambda m: f"{opt.backend_name}: the scale used is not the one block_stats() implies: {m}",
    )  # fmt: skip
    owner = block_of(opt)
    for i, (t, p, w, g) in enumerate(zip(case.tensors, perturbed, before, grads)):
        if g is None:
            continue
        s = used_scale[owner[id(params[i])]].to(p.device)
        expected = formula(case, w, g, s)
        if exact:
            ok = bitwise_equal_elementwise(p, expected)
        else:
            p64, w64, e64 = p.double(), w.double(), expected.double()
            compute_eps = torch.finfo(torch.float64 if t.dtype == torch.float64 else torch.float32).eps
            bound = (
                compute_eps * (e64 - w64).abs()
                + torch.finfo(t.dtype).eps * torch.maximum(p64.abs(), e64.abs())
                + store_atol(t.dtype)
            )
            ok = (p64 - e64).abs() <= bound
        if not ok.all():
            k = int((~ok).reshape(-1).nonzero()[0])
            pytest.fail(
                f"{opt.backend_name}: tensor {i} {t}: perturbed weight {p.reshape(-1)[k].item()!r}, the formula with "
                f"the optimizer's scale {s.item()!r} gives {expected.reshape(-1)[k].item()!r} "
                f"(from w = {w.reshape(-1)[k].item()!r}, g = {g.reshape(-1)[k].item()!r})"
            )


def bitwise_equal_elementwise(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.detach().view(ints) == b.detach().view(ints)


def check_against_reference(case, perturbed, expected, before, grads, eps_rtol) -> float:
    """Perturbed weights of the backend against the reference's; returns the worst error as a fraction of its bound."""
    worst = 0.0
    for i, (t, p, q, w, g) in enumerate(zip(case.tensors, perturbed, expected, before, grads)):
        if g is None or not g.any():
            # nothing to add: the weight must stay (an added -0.0 may turn a -0.0 into +0.0, hence equal, not bitwise)
            assert torch.equal(p, w) and torch.equal(q, w), f"tensor {i} {t} moved without a gradient"
            continue
        p64, q64, w64 = p.double(), q.double(), w.double()
        bound = (
            eps_rtol * (q64 - w64).abs()
            + store_rtol(t.dtype) * torch.maximum(p64.abs(), q64.abs())
            + store_atol(t.dtype)
        )
        error = (p64 - q64).abs()
        ratio = (error / bound).max().item() if error.numel() else 0.0
        if ratio > 1.0:
            k = int((error / bound).reshape(-1).argmax())
            pytest.fail(
                f"tensor {i} {t}: perturbed weight {p64.reshape(-1)[k].item()!r} vs reference "
                f"{q64.reshape(-1)[k].item()!r} (from {w64.reshape(-1)[k].item()!r}): error "
                f"{error.reshape(-1)[k].item():.3e} > bound {bound.reshape(-1)[k].item():.3e}"
            )
        worst = max(worst, ratio)
    return worst


def check_stats(stats, expected, rtol_energy) -> float:
    worst = 0.0
    for key, factor in STAT_FACTOR.items():
        a, e = stats[key], expected[key]
        assert a.dtype == torch.float64 and a.shape == e.shape == (len(stats["energy"]),), key
        rtol = factor * rtol_energy
        torch.testing.assert_close(a, e, rtol=rtol, atol=0, msg=lambda m, key=key: f"block_stats()[{key!r}]: {m}")
        nonzero = e != 0
        if nonzero.any():
            worst = max(worst, ((a - e).abs()[nonzero] / (rtol * e.abs()[nonzero])).max().item())
    return worst


def check_reference_stats(case, ref, ref_params, stats, previous_ema, before, grads) -> None:
    """The oracle itself, against float64 arithmetic written here from the paper's equations."""
    owner = block_of(ref)
    energy = torch.zeros(len(ref.blocks), dtype=torch.float64)
    for p, w, g in zip(ref_params, before, grads):
        if g is not None:
            v = g.double().cpu()
            if case.adaptive:
                v = (w.double().cpu().abs() + case.eta) * v
            energy[owner[id(p)]] += v.square().sum()
    close = dict(rtol=2 * REFERENCE_UNITS * UNIT[torch.float64], atol=0)
    torch.testing.assert_close(stats["energy"], energy, **close)
    e = stats["energy"]
    if case.rule == GEAR_RULE:
        score = case.beta * previous_ema + (1 - case.beta) * e
        norm = score.norm()
        radius = case.rho * score / norm if norm > 0 else torch.zeros_like(score)
    else:
        score = e.sqrt()
        radius = case.rho * score / e.sum().sqrt() if e.sum() > 0 else torch.zeros_like(score)
    torch.testing.assert_close(stats["score"], score, **close)
    torch.testing.assert_close(stats["radius"], radius, **close)
    if case.rho > 0 and radius.any():
        assert abs(stats["share"].sum().item() - 1.0) <= 1e-12, stats  # the budget rho**2 is split, never changed
    else:
        assert not stats["share"].any(), stats


# ----------------------------------------------------------------------------------------------- the property
def run_and_compare(case: Case, backend: str, device: str) -> None:
    ref_params, params = make_params(case, device), make_params(case, device)
    ref = make_optimizer(case, ref_params, "reference")
    opt = make_optimizer(case, params, backend)
    used_scales = {}
    for o in (opt, ref):  # records the scale each first_step hands to its backend (Backend.perturb_'s contract)

        def perturb_(scale, adaptive, eta, keep=False, o=o, inner=o.backend.perturb_):
            used_scales[o] = scale.detach().to("cpu", copy=True)
            return inner(scale, adaptive, eta, keep=keep)

        o.backend.perturb_ = perturb_
    assert opt.backend_name == backend and ref.backend_name == "reference"
    assert opt.block_names == ref.block_names
    # every block's scale reads ||s|| or sum_j e_j: the loosest dtype bounds them all
    rtol = max(energy_rtol(backend, t.dtype) for t in case.tensors if not t.frozen)
    grads = make_grads(case, device)
    ref_ema = torch.zeros(len(ref.blocks), dtype=torch.float64)
    worst_weights = worst_stats = 0.0

    for step in range(case.steps):
        first, second = grads[step]
        before = [p.detach().clone() for p in ref_params]
        # the runs are in lockstep: what second_step leaves must be bitwise equal
        assert all(bitwise_equal(p, q) for p, q in zip(params, ref_params))
        snapshots = {}
        for o, ps in ((opt, params), (ref, ref_params)):
            set_grads(case, o, ps, first)
            if case.flow == "manual":
                o.first_step(zero_grad=case.zero_grad_first)
                snapshots[o] = [p.detach().clone() for p in ps]
                set_grads(case, o, ps, second)
                o.second_step(zero_grad=case.zero_grad_second)
            else:

                def closure(o=o, ps=ps):
                    snapshots[o] = [p.detach().clone() for p in ps]
                    set_grads(case, o, ps, second)
                    return torch.zeros(())

                o.step(closure)
                if case.zero_grad_second:
                    o.zero_grad()

        stats, expected = opt.block_stats(), ref.block_stats()
        check_reference_stats(case, ref, ref_params, expected, ref_ema, before, first)
        ref_ema = expected["score"].clone()  # the previous step's EMA, for the next check
        worst_stats = max(worst_stats, check_stats(stats, expected, rtol))

        perturbed, ref_perturbed = snapshots[opt], snapshots[ref]
        for t, p, q in zip(case.tensors, perturbed, ref_perturbed):
            assert p.dtype == q.dtype == t.dtype and p.shape == q.shape == t.shape
        check_own_formula(case, ref, ref_params, True, ref_perturbed, before, first, expected, used_scales[ref])
        check_own_formula(case, opt, params, backend != "torch", perturbed, before, first, stats, used_scales[opt])
        worst_weights = max(worst_weights, check_against_reference(
            case, perturbed, ref_perturbed, before, first, EPS_FACTOR * rtol
        ))  # fmt: skip

        # restore is exact and the base optimizer sees the same gradients: both runs are bitwise equal again
        for i, (t, p, q, w) in enumerate(zip(case.tensors, params, ref_params, before)):
            assert p.stride() == q.stride()
            assert bitwise_equal(p, q), f"step {step}, tensor {i} {t}: differs from the reference after second_step"
            if case.base == "nostep" or t.frozen:
                assert bitwise_equal(q, w), f"step {step}, tensor {i} {t}: not restored exactly"

    # steer the long profile towards the examples that come closest to the tolerances
    target(worst_weights, label="perturbed-weight error / tolerance")
    target(worst_stats, label="block_stats error / tolerance")


@pytest.mark.parametrize("backend,device", FUSED)
@PROFILE
@given(data=st.data())
@pytest.mark.parametrize("rule", RULES)
def test_step_matches_reference(backend, device, rule, data):
    run_and_compare(data.draw(cases(rule), label="case"), backend, device)


# ----------------------------------------------------------------------------------------------- found by fuzzing
@pytest.mark.parametrize("backend,device", ALL)
def test_block_stats_is_a_snapshot(backend, device):
    """What block_stats() returned stays as it was: later steps (which update the EMA in place) do not change it, and
    writing to it does not change the optimizer."""
    p = nn.Parameter(torch.ones(3, device=device))
    opt = GEARSAM([p], NoStep, partition="global", rho=0.05, beta=0.9, backend=backend)
    returned, copies = [], []
    for k in range(3):
        p.grad = torch.full_like(p, float(k + 1))
        opt.first_step()
        opt.second_step()
        stats = opt.block_stats()
        returned.append(stats)
        copies.append({key: v.clone() for key, v in stats.items()})
    # energies 3 * (k + 1)**2: s_1 = 0.1 * 3, s_2 = 0.9 * s_1 + 0.1 * 12, s_3 = 0.9 * s_2 + 0.1 * 27
    expected_ema = torch.tensor([0.3, 1.47, 4.023], dtype=torch.float64)
    torch.testing.assert_close(torch.cat([c["score"] for c in copies]), expected_ema)
    for stats, copy in zip(returned, copies):
        assert all(torch.equal(stats[key], copy[key]) for key in copy), "a later step changed returned statistics"
    returned[-1]["score"].zero_()
    assert torch.equal(opt.block_stats()["score"], copies[-1]["score"])


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("magnitude", [1e-150, 1e-100, 1e100, 1e149])
def test_gear_radius_at_extreme_float64_gradients(backend, device, magnitude):
    """Energies from 4e-300 to 2e299 are ordinary float64 numbers whose squares are not: rho must still be split in
    full, r_b ~ s_b (the norm of the scores is taken after dividing them by their largest)."""
    a = nn.Parameter(torch.zeros(4, dtype=torch.float64, device=device))
    b = nn.Parameter(torch.zeros(4, dtype=torch.float64, device=device))
    opt = GEARSAM([a, b], NoStep, partition={"a": [a], "b": [b]}, rho=0.05, beta=0.0, backend=backend)
    a.grad, b.grad = torch.full_like(a, magnitude), torch.full_like(b, 2 * magnitude)
    opt.first_step()
    # beta = 0: s = e = (4, 16) * magnitude**2, so r = rho * (1, 4) / sqrt(17)
    expected = 0.05 * torch.tensor([1.0, 4.0], dtype=torch.float64) / 17**0.5
    torch.testing.assert_close(opt.block_stats()["radius"], expected, rtol=1e-12, atol=0)
    if magnitude > 1:  # here delta is negligible next to sqrt(e_b), so the weights move by rho_b in each block
        moved = torch.stack([a.detach().norm(), b.detach().norm()]).cpu()
        torch.testing.assert_close(moved, expected, rtol=1e-12, atol=0)

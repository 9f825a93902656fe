"""The SAM family (:mod:`gearsam_fused.family`): GSAM, WSAM and F-SAM against pytorch_optimizer's implementations,
every variant and its GEAR-SAM composition against a float64 re-computation of the papers' steps on every backend,
resume, the helpers, and bad input."""

import copy
import io

import pytest
import torch

from gearsam_fused import (
    GEARSAM,
    GSAM,
    SAM,
    WSAM,
    FriendlyAscent,
    FriendlySAM,
    SAMScaler,
    SurrogateGap,
    WeightedSharpness,
    accumulated_step,
)  # fmt: skip
from gearsam_fused.backends.base import Backend
from gearsam_fused.schedules import Adaptive, Every, LookSAM, Random

from conftest import (
    ALL,
    FP32_STEP_RTOL,
    FP64_STEP_RTOL,
    FUSED,
    KERNELS,
    SGD_KW,
    NoStep,
    batches,
    flat,
    grad_at,
    loss_fn,
    mlp,
    mlp_data,
    mse,
    rel_err,
    run_steps,
    sam_step,
    tiny_resnet,
)  # fmt: skip

STEPS = 30
RHO = 0.05

# ------------------------------------------------------------------------------------------- against the peer
#: Largest relative error of the whole weight vector, per step, against pytorch_optimizer 4.1 (30 steps of the tiny
#: ResNet, SGD with momentum and weight decay, with and without ASAM's scaling). Our SAM meets ~3e-8 against its SAM;
#: the variants differ further because the peer (1) takes the gradient norms in float32 (ours: float64 energies),
#: (2) for GSAM and WSAM restores w by subtracting the perturbation, w + e - e, which is not w in floating point (ours
#: puts w back bit for bit), and (3) for WSAM without decoupling mixes by lerp(h, g, 1 - a) with 1 - a = -8 at gamma
#: 0.9, which multiplies the rounding of g - h by 8 (ours: a * h + (1 - a) * g). Measured maxima on CPU (plain / ASAM):
#: F-SAM 3.7e-8 / 3.5e-8, GSAM 6.4e-8 / 1.0e-7, WSAM 9.0e-8 / 1.2e-7, WSAM coupled 2.3e-7 / 2.9e-7; each bound is
#: about three times the larger.
PEER_RTOL = {"friendly-sam": 1e-7, "gsam": 3e-7, "wsam": 4e-7, "wsam-coupled": 1e-6}
assert max(PEER_RTOL.values()) <= FP32_STEP_RTOL


class ConstantRho:
    """pytorch_optimizer's GSAM takes its radius from a scheduler (``ProportionScheduler`` ties it to the learning
    rate); ours reads ``rho`` from ``param_groups``, which any scheduler may set. A constant one maps the two."""

    def __init__(self, rho: float):
        self.rho = rho

    def step(self) -> float:
        return self.rho


def gsam_peer_step(peer, model, xy):
    """pytorch_optimizer's ``GSAM.step`` without its closure and BatchNorm switches (our loop runs both passes in
    training mode, as this one does): perturb, second gradient, decompose, undo the perturbation, base step."""
    loss_fn(model, xy).backward()
    peer.perturb_weights(rho=peer.rho_t)
    model.zero_grad()
    loss_fn(model, xy).backward()
    peer.gradient_decompose(peer.alpha)
    peer.un_perturb()
    peer.base_optimizer.step()
    model.zero_grad()


def make_pair(name, ours_model, peer_model, backend, adaptive=False):
    """(our optimizer, one step of the peer's) for variant ``name``, the same hyperparameters; ``adaptive``: ASAM's
    scaling (the peer's ``adaptive=True`` is ours with ``eta=0``)."""
    po = pytest.importorskip("pytorch_optimizer")
    ours_kw, peer_kw = dict(backend=backend, adaptive=adaptive), dict(adaptive=adaptive)
    if name == "gsam":
        ours = GSAM(ours_model.parameters(), torch.optim.SGD, rho=RHO, alpha=0.3, **ours_kw, **SGD_KW)
        base = torch.optim.SGD(peer_model.parameters(), **SGD_KW)
        peer = po.GSAM(peer_model.parameters(), base, peer_model, ConstantRho(RHO), alpha=0.3, **peer_kw)
        return ours, lambda xy: gsam_peer_step(peer, peer_model, xy)
    if name.startswith("wsam"):
        decouple = name == "wsam"
        ours = WSAM(ours_model.parameters(), torch.optim.SGD, rho=RHO, gamma=0.9, decouple=decouple, **ours_kw,
                    **SGD_KW)  # fmt: skip
        peer = po.WSAM(peer_model, peer_model.parameters(), torch.optim.SGD, rho=RHO, gamma=0.9, decouple=decouple,
                       **peer_kw, **SGD_KW)  # fmt: skip
    else:
        ours = FriendlySAM(ours_model.parameters(), torch.optim.SGD, rho=RHO, sigma=1.0, lmbda=0.9, **ours_kw,
                           **SGD_KW)  # fmt: skip
        peer = po.FriendlySAM(peer_model.parameters(), torch.optim.SGD, rho=RHO, sigma=1.0, lmbda=0.9, **peer_kw,
                              **SGD_KW)  # fmt: skip
    return ours, lambda xy: sam_step(peer, peer_model, xy)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("name", list(PEER_RTOL))
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_variant_matches_pytorch_optimizer(twin, name, adaptive, backend, device, record_property):
    ours_model, peer_model = (m.to(device) for m in twin)
    ours, peer_step = make_pair(name, ours_model, peer_model, backend, adaptive)
    start, worst = flat(ours_model), 0.0
    for xy in batches(STEPS, device=device):
        sam_step(ours, ours_model, xy)
        peer_step(xy)
        worst = max(worst, rel_err(flat(ours_model), flat(peer_model)))
    record_property("max_step_rel_err", worst)  # in the JUnit XML: where PEER_RTOL comes from
    assert worst <= PEER_RTOL[name]
    assert rel_err(flat(ours_model), start) > 1e-3  # the run really moved


# ----------------------------------------------------------------------- against the papers' steps in float64
#: The tiny ResNet's "coarse" blocks, written out by hand (independent of gearsam_fused.partition).
PREFIXES = [("stem", ("conv1.", "bn1.")), ("layer1", ("layer1.",)), ("layer2", ("layer2.",)), ("classifier", ("fc.",))]

#: Variants by name: (our optimizer's class and arguments, the parts for the float64 computation).
VARIANTS = {
    "gsam": (SAM, dict(descent=SurrogateGap(0.3))),
    "gear-gsam": (GEARSAM, dict(descent=SurrogateGap(0.3))),
    "wsam": (SAM, dict(descent=WeightedSharpness(0.8))),
    "gear-wsam-coupled": (GEARSAM, dict(descent=WeightedSharpness(0.7, decouple=False))),
    "friendly-sam": (SAM, dict(ascent=FriendlyAscent(0.8, 0.6))),
    "gear-friendly-gsam": (GEARSAM, dict(ascent=FriendlyAscent(), descent=SurrogateGap(0.1))),
}


def _blocks(model):
    named = list(model.named_parameters())
    return [[p for n, p in named if n.startswith(pre)] for _, pre in PREFIXES]


def _per_rule(values: torch.Tensor, gear: bool) -> torch.Tensor:
    return values if gear else values.sum().expand_as(values)


def family_float64(model, data, *, gear, ascent=None, descent=None, rho, beta=0.9, delta=1e-12, lr, momentum,
                   weight_decay, sam_steps=None):  # fmt: skip
    """The step of :mod:`gearsam_fused.family` with SGD (momentum, weight decay) over whole float64 vectors, straight
    from the papers' formulas; yields the weights after each step. ``sam_steps``: whether each step takes the second
    pass (all where not given); a step without it has no perturbation, so h = g and every descent is g: the base step
    with g, no ascent (F-SAM's EMA is of the SAM steps' gradients), GEAR-SAM's EMA taking g's energies."""
    blocks = _blocks(model)
    params = [p for b in blocks for p in b]
    sizes = [sum(p.numel() for p in b) for b in blocks]
    split = lambda v: v.split(sizes)  # noqa: E731
    per_block = lambda fn, *vs: torch.stack([fn(*parts) for parts in zip(*map(split, vs))])  # noqa: E731
    spread = lambda c: torch.cat([c[b].expand(n) for b, n in enumerate(sizes)])  # noqa: E731  [B] -> per element

    w = torch.nn.utils.parameters_to_vector(params).detach().clone()
    s, m, buf = torch.zeros(len(blocks), dtype=torch.float64), None, None
    for i, xy in enumerate(data):
        g = grad_at(model, params, w, xy)
        if sam_steps is not None and not sam_steps[i]:
            if gear:
                s = beta * s + (1 - beta) * per_block(lambda v: (v**2).sum(), g)
            step = g + weight_decay * w
            buf = step.clone() if buf is None else momentum * buf + step
            w = w - lr * buf
            yield w
            continue
        d = g
        if ascent is not None:  # F-SAM: the gradient minus sigma times the EMA of past gradients
            d = g if m is None else g - ascent.sigma * m
            m = g.clone() if m is None else ascent.lmbda * m + (1 - ascent.lmbda) * g
        e = per_block(lambda v: (v**2).sum(), d)
        if gear:
            s = beta * s + (1 - beta) * e
            scale = rho * s / torch.sqrt((s**2).sum()) / (torch.sqrt(e) + delta)
        else:
            scale = torch.full_like(e, rho / (torch.sqrt(e.sum()) + delta))
        h = grad_at(model, params, w + spread(scale) * d, xy)
        descent_grad, after = h, None
        if isinstance(descent, SurrogateGap):  # GSAM: minus alpha times g's part orthogonal to h
            dot = _per_rule(per_block(lambda a, b: (a * b).sum(), g, h), gear)
            nh, ng = (_per_rule(per_block(lambda v: (v**2).sum(), v), gear).sqrt() for v in (h, g))
            c = dot / (nh * ng + descent.eps) * ng / (nh + descent.eps)
            descent_grad = h - descent.alpha * (g - spread(c) * h)
        elif isinstance(descent, WeightedSharpness):  # WSAM: a * h + (1 - a) * g, or g then the sharpness step
            a = descent.gamma / (1 - descent.gamma)
            descent_grad = g if descent.decouple else a * h + (1 - a) * g
            after = -lr * a * (h - g) if descent.decouple else None
        step = descent_grad + weight_decay * w
        buf = step.clone() if buf is None else momentum * buf + step
        w = w - lr * buf
        if after is not None:
            w = w + after
        yield w


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_equals_float64_computation(name, backend, device):
    cls, parts = VARIANTS[name]
    model = tiny_resnet(dtype=torch.float64)
    twin = copy.deepcopy(model)
    model.to(device)
    opt = cls(model, torch.optim.SGD, rho=0.1, backend=backend, partition="coarse", **parts, **SGD_KW)
    assert opt.block_names == [name for name, _ in PREFIXES]
    data = batches(10, dtype=torch.float64)
    expected = family_float64(twin, data, gear=cls is GEARSAM, rho=0.1, **parts, **SGD_KW)
    for (x, y), w in zip(data, expected):
        sam_step(opt, model, (x.to(device), y.to(device)))
        assert rel_err(flat(model).cpu(), w) <= FP64_STEP_RTOL


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_schedule_skips_the_second_pass_as_the_float64_computation_does(name, backend, device):
    """With a step schedule (Every(3)), a step that skips the second pass has no perturbation, so h = g: the base step
    with the first gradient for every variant (no F-SAM ascent, GEAR-SAM's EMA taking g's energies); the SAM steps
    between are the variant's. Against the float64 computation of the papers' steps with the same steps skipped."""
    cls, parts = VARIANTS[name]
    model = tiny_resnet(dtype=torch.float64)
    twin = copy.deepcopy(model)
    model.to(device)
    opt = cls(model, torch.optim.SGD, rho=0.1, backend=backend, partition="coarse", schedule=Every(3), **parts,
              **SGD_KW)  # fmt: skip
    data = batches(7, dtype=torch.float64)
    weights, sams = [], []
    for x, y in data:
        sams += run_steps(opt, model, [(x.to(device), y.to(device))])
        weights.append(flat(model).cpu())
    assert sams == [True, False, False, True, False, False, True]
    expected = family_float64(twin, data, gear=cls is GEARSAM, rho=0.1, sam_steps=sams, **parts, **SGD_KW)
    for step, (w, e) in enumerate(zip(weights, expected, strict=True)):
        assert rel_err(w, e) <= FP64_STEP_RTOL, step


@pytest.mark.parametrize("name", ["wsam", "friendly-sam", "gear-gsam"])
def test_a_random_schedule_resumes_a_variant_bit_for_bit(name):
    """A variant under a Random schedule, saved after three steps and loaded into a fresh optimizer: the next steps
    (skipped or not, as the schedule's saved state decides) give the same bits as the run that went on."""
    cls, parts = VARIANTS[name]
    data = batches(6)

    def make(model):
        return cls(model, torch.optim.SGD, rho=RHO, schedule=Random(0.5, seed=3), **copy.deepcopy(parts), **SGD_KW)

    model = tiny_resnet()
    opt = make(model)
    first = run_steps(opt, model, data[:3])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    went_on = run_steps(opt, model, data[3:])
    resumed = tiny_resnet()
    resumed.load_state_dict(saved[0])
    again = make(resumed)
    again.load_state_dict(saved[1])
    assert run_steps(again, resumed, data[3:]) == went_on
    assert torch.equal(flat(model), flat(resumed))
    assert True in first + went_on and False in first + went_on  # both kinds of step were taken


@pytest.mark.parametrize("backend", ["reference", "torch", "cpp"])
@pytest.mark.parametrize("name, adaptive, ascent", [("gsam", False, False), ("gear-gsam", False, False),
                                                    ("gsam-asam", True, False), ("gsam-friendly", False, True)])  # fmt: skip
def test_gsam_takes_the_first_gradients_energies_from_its_first_step(name, adaptive, ascent, backend, monkeypatch):
    """Where the first step's energy pass ran over g itself (no ascent, no ASAM scaling), GSAM's ||g|| comes from it:
    no pass over the kept gradient, and the same bits as with that pass. Otherwise it takes the pass."""
    if backend == "cpp":
        pytest.importorskip("gearsam_fused._C")
    cls = GEARSAM if name.startswith("gear") else SAM
    parts = dict(descent=SurrogateGap(0.3), ascent=FriendlyAscent(0.5, 0.8) if ascent else None)
    runs, calls = [], []
    for reuse in (True, False):
        if not reuse:  # as if the first step had no energies of g: the kept gradient's pass, every time
            before_update = SurrogateGap.before_update
            monkeypatch.setattr(SurrogateGap, "before_update",
                                lambda self, *args, first_energy=None, **kw: before_update(self, *args, **kw))  # fmt: skip
        model = tiny_resnet()
        opt = cls(model, torch.optim.SGD, rho=RHO, backend=backend, adaptive=adaptive, **parts, **SGD_KW)
        kept_energy = type(opt.backend).kept_energy
        count = [0]
        monkeypatch.setattr(type(opt.backend), "kept_energy", lambda self: (count.__setitem__(0, count[0] + 1),
                                                                            kept_energy(self))[1])  # fmt: skip
        for xy in batches(3):
            sam_step(opt, model, xy)
        runs.append(flat(model))
        calls.append(count[0])
        monkeypatch.undo()
    assert torch.equal(*runs)
    assert calls == ([3, 3] if adaptive or ascent else [0, 3])


@pytest.mark.parametrize("backend,device", ALL)
def test_the_inner_products_and_the_energies_are_those_of_the_two_passes(backend, device, monkeypatch):
    """GSAM's <g, h> and ||h||^2 per block (block_dot_energy): the bits of block_dot and block_energy, on every
    backend; on the kernel backends from one kernel call per bucket, not two."""
    model = tiny_resnet().to(device)
    opt = GEARSAM(model, torch.optim.SGD, rho=RHO, backend=backend, descent=SurrogateGap(0.3), **SGD_KW)
    (xy,) = batches(1, device=device)
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)  # keeps g
    loss_fn(model, xy).backward()
    calls = []
    kernels = getattr(opt.backend, "kernels", None)
    if kernels is not None:
        energy_kernel = kernels.block_energy
        monkeypatch.setattr(kernels, "block_energy", lambda *a, **kw: (calls.append(kw.get("other") is not None),
                                                                       energy_kernel(*a, **kw))[1])  # fmt: skip
    dot, energy = opt.backend.block_dot_energy()
    one_pass = list(calls)
    assert torch.equal(dot, opt.backend.block_dot()) and torch.equal(energy, opt.backend.block_energy(False, 0.0))
    assert dot.ne(0).all() and energy.gt(0).all()  # every block has a gradient: nothing compared is trivially zero
    if kernels is not None:
        assert one_pass == [True] * len(opt.backend.layout.buckets)
    opt.second_step(zero_grad=True)


@pytest.mark.parametrize("name", ["gsam", "gear-friendly-gsam", "wsam"])
@pytest.mark.parametrize("base", ["adamw", "sgd-per-tensor"])
def test_fused_and_per_tensor_base_steps_agree(name, base):
    """The descent rewrites the gradients before the base step: the fused step and torch's own give the same run."""
    cls, parts = VARIANTS[name]
    base_cls, kw = (
        (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)) if base == "adamw" else (torch.optim.SGD, SGD_KW)
    )
    runs = []
    for mode in ("fused", "per-tensor"):
        model = tiny_resnet()
        opt = cls(model, base_cls, rho=RHO, backend="torch", base_step=mode, **parts, **kw)
        for xy in batches(5):
            sam_step(opt, model, xy)
        runs.append(flat(model))
    assert rel_err(*runs) <= 5 * FP32_STEP_RTOL


#: the family's own passes over the buffers, which the kernel backends fold into the step's
FAMILY_PASSES = ("keep_gradient_", "mix_gradient_", "exchange_sharpness_", "add_kept_")


@pytest.mark.parametrize("backend,device", KERNELS)
@pytest.mark.parametrize("base", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["gsam", "gear-gsam", "gear-wsam-coupled", "wsam", "gear-friendly-gsam"])
def test_the_kernels_fold_the_descent_into_the_step(name, base, backend, device, monkeypatch):
    """On the kernel backends the descent's passes ride on the step's: the perturbation keeps g as it reads it (no
    keep_gradient_ pass, unless an ascent replaces g first), and the fused base step takes GSAM's and the coupled
    WSAM's mix of h and g as it reads the gradients (no mix_gradient_ pass), and the decoupled WSAM's step with g
    followed by its sharpness step (no exchange_sharpness_ and add_kept_ passes). The same bits as those passes, and
    the gradients keep h (where the passes leave the descent gradient, or g, in them)."""
    cls, parts = VARIANTS[name]
    base_cls, kw = (
        (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)) if base == "adamw" else (torch.optim.SGD, SGD_KW)
    )
    runs, grads, calls = [], [], []
    for folds in (True, False):
        model = tiny_resnet().to(device)
        opt = cls(model, base_cls, rho=RHO, backend=backend, base_step="fused", **parts, **kw)
        monkeypatch.setattr(opt.backend, "folds_mix", folds)
        monkeypatch.setattr(opt.backend, "folds_keep", folds)
        count = dict.fromkeys(FAMILY_PASSES, 0)
        for method in count:
            original = getattr(type(opt.backend), method)
            monkeypatch.setattr(type(opt.backend), method, lambda self, *a, _m=method, _f=original: (
                count.__setitem__(_m, count[_m] + 1), _f(self, *a))[1])  # fmt: skip
        for xy in batches(3, device=device):
            loss_fn(model, xy).backward()
            opt.first_step(zero_grad=True)
            loss_fn(model, xy).backward()
            h = torch.cat([p.grad.flatten() for p in model.parameters()])  # a copy
            opt.second_step()
            after = torch.cat([p.grad.flatten() for p in model.parameters()])
            opt.zero_grad()
        runs.append(flat(model).cpu())
        grads.append((after.cpu(), h.cpu()))
        calls.append(count)
        monkeypatch.undo()
    assert torch.equal(*runs)
    kept_by_hand = 3 if "ascent" in parts else 0  # the ascent replaces g before the perturbation reads it
    decoupled = getattr(parts["descent"], "decouple", False)
    unfolded = dict(zip(FAMILY_PASSES, (3, 0, 3, 3) if decoupled else (3, 3, 0, 0), strict=True))
    assert calls == [{**dict.fromkeys(FAMILY_PASSES, 0), "keep_gradient_": kept_by_hand}, unfolded]
    assert torch.equal(*grads[0]) and not torch.equal(*grads[1])


@pytest.mark.parametrize("backend,device", KERNELS)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("name", ["friendly-sam", "gear-friendly-gsam"])
def test_the_kernels_take_the_ascent_in_the_energy_pass(name, adaptive, backend, device, monkeypatch):
    """On the kernel backends F-SAM's ascent and the energies of its direction are one kernel call per bucket
    (friendly_energy_) where every parameter has a gradient, not the ascent's and then the energy kernel's: the same
    bits as those two passes (Backend.friendly_energy_), first step and later ones."""
    cls, parts = VARIANTS[name]
    runs, calls = [], []
    for fused in (True, False):
        model = tiny_resnet().to(device)
        opt = cls(model, torch.optim.SGD, rho=RHO, backend=backend, adaptive=adaptive, **copy.deepcopy(parts),
                  **SGD_KW)  # fmt: skip
        if not fused:
            monkeypatch.setattr(type(opt.backend), "friendly_energy_", Backend.friendly_energy_)
        count = {"friendly_ascent_": 0, "friendly_energy_": 0, "block_energy": 0}
        for op in count:
            kernel = getattr(opt.backend.kernels, op)
            monkeypatch.setattr(opt.backend.kernels, op, lambda *a, _op=op, _k=kernel, **kw: (
                count.__setitem__(_op, count[_op] + 1), _k(*a, **kw))[1])  # fmt: skip
        for xy in batches(3, device=device):
            loss_fn(model, xy).backward()
            opt.first_step(zero_grad=True)
            loss_fn(model, xy).backward()
            opt.second_step(zero_grad=True)
        runs.append(flat(model).cpu())
        calls.append(count)
        monkeypatch.undo()
    assert torch.equal(*runs)
    per_step = len(opt.backend.layout.buckets)
    # GSAM's ||g|| (kept_energy: the ascent's energies are not g's) and its ||h||^2 with <g, h> (block_dot_energy)
    second = 2 * per_step if "descent" in parts else 0
    assert calls == [
        {"friendly_ascent_": 0, "friendly_energy_": 3 * per_step, "block_energy": 3 * second},
        {"friendly_ascent_": 3 * per_step, "friendly_energy_": 0, "block_energy": 3 * (per_step + second)},
    ]


class SometimesUsed(torch.nn.Module):
    """``extra`` takes part in the loss on even steps only: on odd steps its parameters have no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra, self.head = torch.nn.Linear(6, 12), torch.nn.Linear(12, 12), torch.nn.Linear(12, 3)
        self.step = 0

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h + self.extra(h) if self.step % 2 == 0 else h)


@pytest.mark.parametrize("backend,device", [case for case in ALL if case.values[0] != "reference"])
@pytest.mark.parametrize("name", ["friendly-sam", "wsam", "gear-gsam"])
def test_a_parameter_without_a_gradient_is_left_as_the_reference_leaves_it(name, backend, device):
    """As torch's optimizers and the peers do, a parameter without a gradient this step is not perturbed, keeps its
    F-SAM EMA and takes no sharpness step: the flat-buffer backends' whole-bucket passes must not touch it."""
    cls, parts = VARIANTS[name]
    runs = []
    for which in (backend, "reference"):
        model = SometimesUsed().to(device)
        opt = cls(model, torch.optim.SGD, rho=RHO, backend=which, **copy.deepcopy(parts), **SGD_KW)
        for step, xy in enumerate(mlp_data(6)):
            model.step = step
            sam_step(opt, model, (xy[0].to(device), xy[1].to(device)))
        runs.append(flat(model))
    assert rel_err(*runs) <= FP32_STEP_RTOL


@pytest.mark.parametrize("backend,device", ALL)
def test_an_ema_starts_at_its_parameters_first_gradient(backend, device):
    """F-SAM's EMA starts per parameter, as its authors' code and pytorch_optimizer's start it: a parameter without a
    gradient on the first step (``extra``, used on odd steps here) takes its first gradient as its ascent and its EMA
    when that comes, not an EMA started from zero. The same run as the peer's, the late parameter moved."""
    po = pytest.importorskip("pytorch_optimizer")
    ours_model, peer_model = SometimesUsed().to(device), SometimesUsed().to(device)
    ours = FriendlySAM(ours_model.parameters(), torch.optim.SGD, rho=RHO, sigma=1.0, lmbda=0.9, backend=backend,
                       **SGD_KW)  # fmt: skip
    peer = po.FriendlySAM(peer_model.parameters(), torch.optim.SGD, rho=RHO, sigma=1.0, lmbda=0.9, **SGD_KW)
    late = ours_model.extra.weight.detach().clone()
    for step, xy in enumerate(mlp_data(5)):
        ours_model.step = peer_model.step = step + 1  # extra has no gradient on the first step
        xy = (xy[0].to(device), xy[1].to(device))
        sam_step(ours, ours_model, xy)
        sam_step(peer, peer_model, xy)
        if step == 0:
            assert torch.equal(ours_model.extra.weight, late)  # not stepped without a gradient
    assert rel_err(flat(ours_model), flat(peer_model)) <= PEER_RTOL["friendly-sam"]
    assert not torch.equal(ours_model.extra.weight, late)


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("backend", ["reference", "torch", "cpp"])
@pytest.mark.parametrize("name", ["gear-friendly-gsam", "friendly-sam", "wsam"])
def test_a_resumed_run_continues_bit_for_bit(name, backend):
    if backend == "cpp":
        pytest.importorskip("gearsam_fused._C")
    cls, parts = VARIANTS[name]
    data = batches(6)

    def build(model):
        return cls(model, torch.optim.SGD, rho=RHO, backend=backend, **copy.deepcopy(parts), **SGD_KW)

    straight = tiny_resnet()
    opt = build(straight)
    for xy in data:
        sam_step(opt, straight, xy)
    resumed = tiny_resnet()
    first = build(resumed)
    for xy in data[:3]:
        sam_step(first, resumed, xy)
    saved = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "opt": first.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    resumed = tiny_resnet(seed=5)
    resumed.load_state_dict(checkpoint["model"])
    second = build(resumed)
    second.load_state_dict(checkpoint["opt"])
    for xy in data[3:]:
        sam_step(second, resumed, xy)
    assert torch.equal(flat(resumed), flat(straight))


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_a_resumed_run_starts_a_late_ema_where_the_straight_run_does(backend):
    """Saved while one parameter's EMA has not started (no gradient yet), the resumed run starts it at that
    parameter's first gradient, bit for bit with the run that went straight on; a state saved before the EMA started
    per parameter (no ``ascent_started``) loads as every EMA started."""
    if backend == "cpp":
        pytest.importorskip("gearsam_fused._C")
    data = mlp_data(4)

    def run(model, opt, steps):
        for step in steps:
            model.step = step + 1  # extra has no gradient on the first step
            sam_step(opt, model, data[step])

    def build(model):
        return FriendlySAM(model.parameters(), torch.optim.SGD, rho=RHO, sigma=0.8, lmbda=0.6, backend=backend,
                           **SGD_KW)  # fmt: skip

    straight = SometimesUsed()
    run(straight, build(straight), range(4))
    first = SometimesUsed()
    opt = build(first)
    run(first, opt, range(1))
    saved = copy.deepcopy((first.state_dict(), opt.state_dict()))
    assert saved[1]["param_groups"][0]["gearsam"]["ascent_started"] == [True, True, False, False, True, True]
    resumed = SometimesUsed()
    resumed.load_state_dict(saved[0])
    again = build(resumed)
    again.load_state_dict(saved[1])
    run(resumed, again, range(1, 4))
    assert torch.equal(flat(resumed), flat(straight))
    del saved[1]["param_groups"][0]["gearsam"]["ascent_started"]  # as saved before the EMA started per parameter
    older = build(SometimesUsed())
    older.load_state_dict(saved[1])
    assert older.state_dict()["param_groups"][0]["gearsam"]["ascent_started"] == [True] * 6


def test_a_state_saved_with_other_parts_is_refused():
    model = tiny_resnet()
    opt = FriendlySAM(model, torch.optim.SGD, lr=0.1)
    sam_step(opt, model, batches(1)[0])
    state = opt.state_dict()
    with pytest.raises(ValueError, match=r"saved with ascent=FriendlyAscent\(sigma=1.0, lmbda=0.9\), this optimizer"):
        SAM(tiny_resnet(), torch.optim.SGD, lr=0.1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with descent=None, this optimizer has descent=SurrogateGap"):
        GSAM(tiny_resnet(), torch.optim.SGD, lr=0.1).load_state_dict(
            SAM(tiny_resnet(), torch.optim.SGD, lr=0.1).state_dict()
        )


def test_memory_overhead_reports_the_kept_buffers():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, ascent=FriendlyAscent(), descent=SurrogateGap(), backend="reference", lr=0.1)
    before = opt.memory_overhead()
    sam_step(opt, model, batches(1)[0])
    after = opt.memory_overhead()
    size = sum(p.nbytes for p in model.parameters())
    assert before["correction"] == before["momentum"] == 0
    assert after["correction"] == after["momentum"] == size
    assert after["total"] == after["backup"] + 2 * size


# --------------------------------------------------------------------------------------- the helpers
@pytest.mark.parametrize("name", ["gear-gsam", "wsam", "friendly-sam"])
def test_accumulated_micro_batches_equal_one_large_batch(name):
    cls, parts = VARIANTS[name]
    large, micro = tiny_resnet().eval(), tiny_resnet().eval()  # BatchNorm with frozen statistics is per-example
    large_opt, micro_opt = (cls(m, torch.optim.SGD, rho=RHO, **copy.deepcopy(parts), **SGD_KW) for m in (large, micro))
    for x, y in batches(4, batch=12):
        sam_step(large_opt, large, (x, y))
        accumulated_step(micro_opt, lambda mb: loss_fn(micro, mb), list(zip(x.chunk(3), y.chunk(3))))
    assert rel_err(flat(micro), flat(large)) <= 10 * FP32_STEP_RTOL


@pytest.mark.parametrize("name", ["gear-gsam", "wsam"])
def test_loss_scaling_gives_the_unscaled_steps(name):
    """Power-of-two loss scales unscale exactly: the run through SAMScaler is the unscaled one, bit for bit."""
    cls, parts = VARIANTS[name]
    scaled_model, plain_model = tiny_resnet(), tiny_resnet()
    scaled, plain = (
        cls(m, torch.optim.SGD, rho=RHO, **copy.deepcopy(parts), **SGD_KW) for m in (scaled_model, plain_model)
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    amp = SAMScaler(scaled, scaler)
    for xy in batches(4):
        scaler.scale(loss_fn(scaled_model, xy)).backward()
        assert amp.first_step()
        scaler.scale(loss_fn(scaled_model, xy)).backward()
        amp.second_step(zero_grad=True)
        scaler.update()
        sam_step(plain, plain_model, xy)
        assert torch.equal(flat(scaled_model), flat(plain_model))


DDP_VARIANTS = ["gear-friendly-gsam", "wsam"]
DDP_BACKENDS = ["reference", "cpp"]


def _ddp_trajectories(rank: int, data) -> dict:
    """Every DDP_VARIANTS x DDP_BACKENDS run on this rank's half of each batch, driven by gearsam_fused.distributed's
    sam_step (both passes all-reduced); the weights after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gearsam_fused.distributed import sam_step as distributed_sam_step

    out = {}
    for name in DDP_VARIANTS:
        for backend in DDP_BACKENDS:
            cls, parts = VARIANTS[name]
            model = mlp()
            ddp = DDP(model)
            opt = cls(ddp, torch.optim.SGD, rho=RHO, backend=backend, **copy.deepcopy(parts), **SGD_KW)
            trajectory = []
            for x, y in data:
                half = slice(rank * len(x) // 2, (rank + 1) * len(x) // 2)
                opt.zero_grad()
                distributed_sam_step(opt, ddp, lambda: mse(ddp, (x[half], y[half])).backward())
                opt.zero_grad()
                trajectory.append(flat(model))
            out[name, backend] = trajectory
    return out


def test_ddp_ranks_agree_bitwise_and_equal_one_process_on_the_whole_batch():
    from ranks import run_ranks

    data = mlp_data(4)
    ranks = run_ranks(_ddp_trajectories, data, world=2)
    for (name, backend), trajectory in ranks[0].items():
        cls, parts = VARIANTS[name]
        model = mlp()
        opt = cls(model, torch.optim.SGD, rho=RHO, backend=backend, **copy.deepcopy(parts), **SGD_KW)
        for step, xy in enumerate(data):
            mse(model, xy).backward()
            opt.first_step(zero_grad=True)
            mse(model, xy).backward()
            opt.second_step(zero_grad=True)
            assert torch.equal(ranks[1][name, backend][step], trajectory[step]), (name, backend, step)
            assert rel_err(trajectory[step], flat(model)) <= FP32_STEP_RTOL, (name, backend, step)


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: SurrogateGap(alpha=-0.1), r"alpha must lie in \[0.0, 1.0\]"),
        (lambda: SurrogateGap(alpha=1.5), r"alpha must lie in \[0.0, 1.0\]"),
        (lambda: WeightedSharpness(gamma=1.0), r"gamma must lie in \[0.0, 1.0\)"),
        (lambda: WeightedSharpness(decouple="yes"), "decouple must be a bool"),
        (lambda: FriendlyAscent(sigma=-1), r"sigma must lie in \[0.0, inf\)"),
        (lambda: FriendlyAscent(lmbda=float("nan")), "lmbda must be a finite real number"),
        (lambda: SAM(tiny_resnet(), torch.optim.SGD, descent="gsam", lr=0.1), "descent must be None, a SurrogateGap"),
        (
            lambda: SAM(tiny_resnet(), torch.optim.SGD, ascent=SurrogateGap(), lr=0.1),
            "ascent must be None or a Friendly",
        ),
        (
            lambda: GSAM(tiny_resnet(), torch.optim.SGD, schedule=LookSAM(2), lr=0.1),
            r"schedule LookSAM\(k=2, alpha=0.7\) with SurrogateGap\(alpha=0.4, eps=1e-12\): LookSAM's correction "
            r"keeps the first gradient",
        ),
        (
            lambda: FriendlySAM(tiny_resnet(), torch.optim.SGD, schedule=LookSAM(3), lr=0.1),
            r"schedule LookSAM\(k=3, alpha=0.7\) with FriendlyAscent\(sigma=1.0, lmbda=0.9\): LookSAM's correction",
        ),
        (
            lambda: FriendlySAM(tiny_resnet(), torch.optim.SGD, schedule=Adaptive(0.5), lr=0.1),
            r"schedule Adaptive\(c=0.5, beta=0.9\) with FriendlyAscent\(sigma=1.0, lmbda=0.9\): the schedule decides "
            r"from the first gradient's energy, .* use Every or Random",
        ),
        (
            lambda: WSAM(tiny_resnet(), NoStep),
            r"WeightedSharpness\(gamma=0.9, decouple=True\) takes the sharpness step with each param group's lr, and "
            r"NoStep's param groups have none",
        ),
        (
            lambda: FriendlySAM(tiny_resnet(), torch.optim.SGD, capturable=True, backend="cpp", lr=0.1),
            r"capturable=True with FriendlyAscent",
        ),
    ],
)
def test_bad_input_is_refused_naming_it(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


COMPILED_PARTS = {
    "gsam": lambda model, backend: GSAM(model, torch.optim.SGD, lr=0.1, momentum=0.9, backend=backend),
    "gear-gsam-adamw": lambda model, backend: GEARSAM(model, torch.optim.AdamW, lr=1e-2, partition="fine",
                                                      descent=SurrogateGap(0.3), backend=backend),
    "wsam-coupled": lambda model, backend: WSAM(model, torch.optim.SGD, lr=0.1, decouple=False, backend=backend),
    "wsam": lambda model, backend: WSAM(model, torch.optim.AdamW, lr=1e-2, backend=backend),
    "friendly-sam": lambda model, backend: FriendlySAM(model, torch.optim.SGD, lr=0.1, momentum=0.9,
                                                       backend=backend),
    "gear-friendly-gsam": lambda model, backend: GEARSAM(model, torch.optim.SGD, lr=0.1, partition="fine",
                                                         ascent=FriendlyAscent(0.5, 0.8), descent=SurrogateGap(0.3),
                                                         backend=backend),
}  # fmt: skip


@pytest.mark.parametrize(
    "backend, device, name",
    [
        pytest.param(*case.values, name, marks=case.marks)
        for case in FUSED
        if case.values[0] != "torch" and case.values[1] == "cpu"
        for name in (COMPILED_PARTS if case.values[0] == "cpp" else ["gsam", "wsam", "friendly-sam"])
    ],
)
def test_parts_of_registered_operators_compile_to_the_eager_bits(backend, device, name):
    """GSAM's descent, WSAM's (coupled, and decoupled where the fused base step takes its sharpness step) and F-SAM's
    ascent run only registered operators on the kernel backends (the inner products, norms, the mix and the ascent):
    first_step and second_step compile with fullgraph=True and give the eager bits."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    models = [mlp()]
    models.append(copy.deepcopy(models[0]))
    eager, opt = (COMPILED_PARTS[name](model, backend) for model in models)
    first, second = torch.compile(opt.first_step, fullgraph=True), torch.compile(opt.second_step, fullgraph=True)
    for model, steps in ((models[0], (eager.first_step, eager.second_step)), (models[1], (first, second))):
        for xy in mlp_data(3):
            mse(model, xy).backward()
            steps[0](zero_grad=True)
            mse(model, xy).backward()
            steps[1](zero_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(*(model.parameters() for model in models)))


@pytest.mark.parametrize(
    "make, backend, match",
    [
        (lambda m, b: GSAM(m, torch.optim.SGD, lr=0.1, backend=b), "torch",
         r"part SurrogateGap\(alpha=0.4, eps=1e-12\) runs keep_gradient_, block_dot_energy, kept_energy, "
         r"mix_gradient_ on backend 'torch' .* use backend='cpp' or 'triton'"),
        (lambda m, b: WSAM(m, torch.optim.SGD, lr=0.1, backend=b, base_step="per-tensor"), "cpp",
         r"part WeightedSharpness\(gamma=0.9, decouple=True\) runs add_kept_ on backend 'cpp' \(the base step does "
         r"not take the descent this step: base_step='per-tensor'\) as torch operations, .* copies of the flat "
         r"buffers; run the step eagerly"),
        (lambda m, b: FriendlySAM(m, torch.optim.SGD, lr=0.1, backend=b), "torch",
         r"part FriendlyAscent\(sigma=1.0, lmbda=0.9\) runs friendly_energy_ on backend 'torch' .* use "
         r"backend='cpp' or 'triton'"),
    ],
    ids=["gsam-torch", "wsam-decoupled-cpp-per-tensor", "friendly-sam-torch"],
)  # fmt: skip
@pytest.mark.parametrize("which", ["first", "second"])
def test_a_compiled_step_is_refused_naming_the_part(make, backend, match, which):
    """A part that would write the flat gradient buffers with torch operations under torch.compile: refused, naming
    the part, those operations and the backend (and the backends where it compiles, if any)."""
    if backend == "cpp":
        pytest.importorskip("gearsam_fused._C")
    torch._dynamo.reset()
    model = mlp()
    opt = make(model, backend)
    xy = mlp_data(1)[0]
    mse(model, xy).backward()
    first = torch.compile(opt.first_step, fullgraph=True) if which == "first" else opt.first_step
    with pytest.raises(RuntimeError, match=match) as refused:
        first()
        mse(model, xy).backward()
        torch.compile(opt.second_step, fullgraph=True)()
    assert str(refused.value).startswith("the SAM family's part "), str(refused.value)  # ours, not dynamo's words


@pytest.mark.parametrize("name", ["friendly-sam", "gear-friendly-gsam"])
def test_a_cancelled_step_leaves_no_trace(name):
    """cancel_step() after first_step(cancellable=True) puts back w, the GEAR EMA and F-SAM's gradient EMA: the run
    with a cancelled step in the middle is the run without it, bit for bit."""
    cls, parts = VARIANTS[name]
    data = batches(3)
    runs = []
    for cancel in (False, True):
        model = tiny_resnet()
        opt = cls(model, torch.optim.SGD, rho=RHO, **copy.deepcopy(parts), **SGD_KW)
        for step, xy in enumerate(data):
            if cancel and step == 1:
                loss_fn(model, data[2]).backward()
                opt.first_step(zero_grad=True, cancellable=True)
                opt.cancel_step()
            sam_step(opt, model, xy)
        runs.append(flat(model))
    assert torch.equal(*runs)

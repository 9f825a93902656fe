"""MomentumSAM, the one-pass momentum SAM (``gearsam_fused/momentum.py``).

* the ``reference`` backend against the step written out by hand from its equations, several steps, float32 and
  float64, SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW, SAM's and GEAR-SAM's allocation;
* every other backend against ``reference`` on parameters of awkward sizes (1, 7, 4097 elements, many tiny tensors, one
  without a gradient on some steps, a frozen one), in float32, float64 and bfloat16 (where the fused step declines);
* the restore of ``w`` bit for bit: ``eval()`` shows what torch's own SGD makes of the same gradients, whatever radius
  the look-ahead used; ``train()`` the look-ahead point's own bits;
* the first step, a block without momentum, state dicts in either mode, bad input;
* what works for SAM: param groups and an LR scheduler, ``zero_grad``, torch's ``GradScaler`` with an overflowing step,
  autocast, accumulation, ``capturable=True``, ``torch.compile``, telemetry.

Tolerances, explicit per dtype: against the equations, computed in float64, a step's whole vector within its roundings
(:data:`STEP_RTOL`); between backends, element by element (:data:`BACKEND_TOL`), where the fused energies' tile-wise
sums and ``addcmul``'s contraction move a look-ahead point by an ulp. Where a test says bit for bit, it is.
"""

import copy
import functools
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_capturable import set_rho
from torch import nn

from gearsam_fused import GEARSAM, SAM, Every, MomentumSAM, SurrogateGap
from gearsam_fused.backends.cpp_backend import cpp_installed

from conftest import FP32_STEP_RTOL, mlp, mlp_data, mse, on_device, rel_err, stream_threshold_elements

#: The base optimizers, with every option of their update that touches the momentum or the weight decay.
BASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "sgd-dampened-wd": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.02)),
    "sgd-nesterov-wd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02)),
    "adam-wd": (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.02)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
}
#: Relative error of the whole vector a step against the equations, which are computed in float64.
STEP_RTOL = {torch.float32: FP32_STEP_RTOL, torch.float64: 1e-12}
#: (atol, rtol) of one element between two backends' runs of five steps. float32 and float64: a few ulps of weights of
#: order one, which an ulp's difference in a look-ahead point (the fused energies' tile-wise sums, ``addcmul``'s
#: contraction) and the gradient taken there grow to. bfloat16: one ulp (2**-7 relative) of any element.
BACKEND_TOL = {torch.float32: (5e-7, 1e-6), torch.float64: (1e-14, 1e-12), torch.bfloat16: (1e-2, 2**-7)}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
RHO = 0.2


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_bits(a: list[torch.Tensor], b) -> bool:
    b = list(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def one_step(opt, model, xy, loss=mse) -> None:
    loss(model, xy).backward()
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------------------------------ the equations, by hand
class Equations:
    """MomentumSAM over plain float64 tensors, one per parameter, grouped in blocks. Between steps ``w`` is the point
    the base optimizer moves and ``look`` the look-ahead point the caller takes the gradient at. A step with the
    gradient ``g`` taken at ``look``:

    * the base optimizer's update of ``w`` (not of ``look``: weight decay reads ``w``), as torch's SGD and Adam(W)
      state it;
    * ``v`` the new momentum (SGD's buffer, Adam's first moment), ``T = |w| + eta`` (ASAM) or 1,
      ``e_b = sum_{p in b} ||T_p v_p||^2``;
    * SAM: ``scale_b = rho / (sqrt(sum_b e_b) + delta)``; GEAR-SAM: ``s_b <- beta s_b + (1 - beta) e_b``,
      ``r_b = rho s_b / ||s||``, ``scale_b = r_b / (sqrt(e_b) + delta)``;
    * ``look_p = w_p - scale_b * T_p**2 * v_p`` (``w_p`` where ``p`` has no momentum yet).
    """

    def __init__(self, blocks, base: str, *, rho, allocation, beta=0.9, delta=1e-12, adaptive=False, eta=0.0):
        self.w = [[p.detach().double().clone() for p in block] for block in blocks]
        self.look = [[w.clone() for w in block] for block in self.w]
        self.cls, self.h = BASES[base]
        self.state = [[{} for _ in block] for block in blocks]
        self.s = torch.zeros(len(blocks), dtype=torch.float64)
        self.rho, self.allocation, self.beta, self.delta, self.adaptive, self.eta = (
            rho, allocation, beta, delta, adaptive, eta
        )  # fmt: skip

    def step(self, grads: list[list[torch.Tensor | None]]) -> None:
        for b, block in enumerate(self.w):
            for i, w in enumerate(block):
                if grads[b][i] is not None:
                    update = self._sgd if self.cls is torch.optim.SGD else self._adam
                    block[i] = update(w, grads[b][i].double(), self.state[b][i])
        key = "momentum_buffer" if self.cls is torch.optim.SGD else "exp_avg"
        v = [[state.get(key) for state in block] for block in self.state]
        t = [[w.abs() + self.eta if self.adaptive else torch.ones_like(w) for w in block] for block in self.w]
        e = torch.stack([
            sum(((tp * vp) ** 2).sum() for tp, vp in zip(tb, vb) if vp is not None) + torch.zeros((), dtype=torch.float64)
            for tb, vb in zip(t, v)
        ])  # fmt: skip
        if self.allocation == "sam":
            scale = (self.rho / (e.sum().sqrt() + self.delta)).expand_as(e)
        else:
            self.s = self.beta * self.s + (1 - self.beta) * e
            r = self.rho * self.s / self.s.norm() if self.s.any() else torch.zeros_like(self.s)
            scale = r / (e.sqrt() + self.delta)
        self.look = [
            [w if vp is None else w - scale[b] * tp**2 * vp for w, tp, vp in zip(self.w[b], t[b], v[b])]
            for b in range(len(self.w))
        ]

    def _sgd(self, w, g, state):
        h = self.h
        d = g + h.get("weight_decay", 0.0) * w
        buf = state.get("momentum_buffer")
        buf = d if buf is None else h["momentum"] * buf + (1 - h.get("dampening", 0.0)) * d
        state["momentum_buffer"] = buf
        u = d + h["momentum"] * buf if h.get("nesterov", False) else buf
        return w - h["lr"] * u

    def _adam(self, w, g, state):
        h = self.h
        beta1, beta2 = h.get("betas", (0.9, 0.999))
        wd, lr = h.get("weight_decay", 0.0), h["lr"]
        if self.cls is torch.optim.AdamW:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        k = state["step"] = state.get("step", 0) + 1
        m = state["exp_avg"] = beta1 * state.get("exp_avg", torch.zeros_like(w)) + (1 - beta1) * g
        v = state["exp_avg_sq"] = beta2 * state.get("exp_avg_sq", torch.zeros_like(w)) + (1 - beta2) * g * g
        if h.get("amsgrad", False):
            v = state["max_exp_avg_sq"] = torch.maximum(state.get("max_exp_avg_sq", v), v)
        denom = v.sqrt() / (1 - beta2**k) ** 0.5 + h.get("eps", 1e-8)
        return w - lr / (1 - beta1**k) * m / denom

    def flat(self, which: str) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for block in getattr(self, which) for t in block])


def mlp3(dtype=torch.float32) -> nn.Sequential:
    """Three linear layers: three blocks by the coarse partition."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def mlp3_blocks(model, partition: str) -> list[list[nn.Parameter]]:
    """The blocks of ``partition`` written out by hand, in the model's parameter order."""
    layers = [list(model[i].parameters()) for i in (0, 2, 4)]
    return layers if partition == "coarse" else [layers[0] + layers[1], layers[2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("partition", ["mapping", "coarse"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["plain", "adaptive"])
@pytest.mark.parametrize("base", list(BASES))
def test_reference_follows_the_equations(base, adaptive, partition, allocation, dtype):
    model = mlp3(dtype)
    twin = copy.deepcopy(model)  # takes the gradients at the equations' look-ahead points
    blocks = mlp3_blocks(model, partition)
    spec = "coarse" if partition == "coarse" else {"hidden": blocks[0], "head": blocks[1]}
    hyper = dict(rho=RHO, allocation=allocation, adaptive=adaptive, eta=0.01 if adaptive else 0.0)
    cls, kwargs = BASES[base]
    opt = MomentumSAM(model, cls, partition=spec, backend="reference", **hyper, **kwargs)
    assert len(opt.blocks) == len(blocks)
    equations = Equations(mlp3_blocks(twin, partition), base, **hyper)
    start = equations.flat("w")
    for x, y in mlp_data(5):
        xy = (x.to(dtype), y.to(dtype))
        with torch.no_grad():
            for p, look in zip(twin.parameters(), (t for block in equations.look for t in block)):
                p.copy_(look)
        twin.zero_grad()
        mse(twin, xy).backward()
        equations.step([[p.grad for p in block] for block in mlp3_blocks(twin, partition)])
        one_step(opt, model, xy)
        assert rel_err(flat64(model), equations.flat("look")) <= STEP_RTOL[dtype]
        opt.eval()
        assert rel_err(flat64(model), equations.flat("w")) <= STEP_RTOL[dtype]
        opt.train()
    assert rel_err(equations.flat("w"), start) > 1e-3  # the run really moved
    assert rel_err(equations.flat("look"), equations.flat("w")) > 1e-3  # and looked ahead


def flat64(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


# ------------------------------------------------------------------------------ every backend against the reference
class Awkward(nn.Module):
    """Parameters of awkward sizes for the flat buffers: one element, seven, 4097 (one past a power of two), many tiny
    tensors, one that the loss uses on some steps only (no gradient on the others) and a frozen one."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(0)

        def param(n, requires_grad=True):
            return nn.Parameter((0.5 * torch.randn(n, generator=gen)).to(dtype), requires_grad=requires_grad)

        self.one, self.seven, self.big = param(1), param(7), param(4097)
        self.tiny = nn.ParameterList(param(1 + i % 3) for i in range(12))
        self.sometimes = param(5)
        self.frozen = param(3, requires_grad=False)

    def forward(self, x, use_sometimes: bool = True):
        out = torch.tanh(x[:, :7] * self.seven + self.one).sum(1)
        out = out + torch.tanh(x * self.big).mean(1)
        for i, t in enumerate(self.tiny):
            out = out + torch.tanh(t.sum() * x[:, i])
        if use_sometimes:
            out = out + torch.tanh(x[:, :5] @ self.sometimes)
        return out + x[:, :3] @ self.frozen

    def blocks(self) -> dict[str, list[nn.Parameter]]:
        return {"small": [self.one, self.seven], "big": [self.big], "tiny": [*self.tiny, self.sometimes]}


def awkward_data(n: int, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(8, 4097, generator=gen).to(device, dtype), torch.randn(8, generator=gen).to(device, dtype))
        for _ in range(n)
    ]


def awkward_loss(step: int):
    """The loss of step ``step``: ``sometimes`` has no gradient on step 3 (the fused step declines; it comes back on
    step 4 for SGD, while Adam's step counts differ from then on)."""
    return lambda model, xy: F.mse_loss(model(xy[0], use_sometimes=step != 3), xy[1])


def run_awkward(backend, device, base, allocation, dtype, adaptive, steps=5):
    model = Awkward(dtype).to(device)
    cls, kwargs = BASES[base]
    opt = MomentumSAM(model.parameters(), cls, rho=RHO, allocation=allocation, partition=model.blocks(),
                      adaptive=adaptive, eta=0.01 if adaptive else 0.0, backend=backend, **kwargs)  # fmt: skip
    trajectory, modes = [], []
    for i, xy in enumerate(awkward_data(steps, dtype, device)):
        one_step(opt, model, xy, awkward_loss(i))
        modes.append(opt.base_step_mode)
        look = snapshot(model)
        opt.eval()
        trajectory.append((look, snapshot(model)))
        opt.train()
    return model, opt, trajectory, modes


BACKENDS = [on_device(b, d) for d in ("cpu", "cuda") for b in ("torch", "cpp", "triton", "sharded")]


@pytest.mark.parametrize("adaptive", [False, True], ids=["plain", "adaptive"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("base", ["sgd-dampened-wd", "sgd-nesterov-wd", "adam-wd", "adamw"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_every_backend_follows_the_reference(backend, device, base, allocation, dtype, adaptive):
    dtype = DTYPES[dtype]
    _, _, expected, _ = run_awkward("reference", device, base, allocation, dtype, adaptive)
    model, opt, trajectory, modes = run_awkward(backend, device, base, allocation, dtype, adaptive)
    atol, rtol = BACKEND_TOL[dtype]
    names = [name for name, _ in model.named_parameters()]
    for step, ((look, w), (ref_look, ref_w)) in enumerate(zip(trajectory, expected)):
        for what, ours, ref in (("look-ahead", look, ref_look), ("w", w, ref_w)):
            for name, a, b in zip(names, ours, ref):
                torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"step {step}, {what} {name}: {m}")
    frozen = Awkward(dtype).frozen.to(device)
    assert torch.equal(model.frozen, frozen) and model.frozen not in opt.state
    # the fused step where it can run, torch's own step on the step a parameter has no gradient, and after it
    fused = backend != "sharded" and dtype != torch.bfloat16
    sgd = base.startswith("sgd")
    first, last = ("fused" if fused else "per-tensor"), ("fused" if fused and sgd else "per-tensor")
    assert modes == [first] * 3 + ["per-tensor", last], (modes, opt.base_step_reason)
    if fused and not sgd:
        assert "different Adam steps" in opt.base_step_reason
    if backend != "sharded" and dtype == torch.bfloat16:
        assert "bfloat16 parameters" in opt.base_step_reason


class SeparateEnergy(MomentumSAM):
    """MomentumSAM taking the new momentum's energies in a pass of their own after the update (as it does for ASAM),
    not from the update that writes the momentum."""

    def _base_update(self, updates):
        return self._flat_step.run(updates, self._backend, perturbed=self.perturbed)


@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("base", ["sgd-nesterov-wd", "adamw"])
@pytest.mark.parametrize("backend,device", [case for case in BACKENDS if case.values[0] != "sharded"])
def test_the_energies_the_update_sums_are_those_of_their_own_pass(backend, device, base, allocation):
    """Where the update sums the new momentum's block energies as it writes it (the kernel backends), the trajectory,
    the radii and the energies are bit for bit those of energies read afterwards, in a pass of their own."""
    runs = []
    for cls in (MomentumSAM, SeparateEnergy):
        model = Awkward(torch.float32).to(device)
        opt_cls, kwargs = BASES[base]
        opt = cls(model.parameters(), opt_cls, rho=RHO, allocation=allocation, partition=model.blocks(),
                  backend=backend, **kwargs)  # fmt: skip
        trajectory = []
        for i, xy in enumerate(awkward_data(4, torch.float32, device)):
            one_step(opt, model, xy, awkward_loss(i))
            stats = opt.block_stats()
            trajectory.append((snapshot(model), stats["energy"].clone(), stats["radius"].clone()))
        runs.append(trajectory)
    for step, (ours, theirs) in enumerate(zip(*runs)):
        assert same_bits(ours[0], theirs[0]), f"step {step}"
        assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2]), f"step {step}"


# ------------------------------------------------------------------------------------------ w, bit for bit
EXACT = [on_device(b, d) for d in ("cpu", "cuda") for b in ("reference", "torch", "cpp", "sharded")]
EVERY = [on_device(b, d) for d in ("cpu", "cuda") for b in ("reference", "torch", "cpp", "triton", "sharded")]
CPU_EVERY = [case for case in EVERY if case.values[1] == "cpu"]


def on(device: str, data: list) -> list:
    return [(x.to(device), y.to(device)) for x, y in data]


def give_gradients(model, twin, xy, loss=mse) -> None:
    """The gradient at ``model``'s parameters (the look-ahead point), handed to ``twin``'s parameters as it is."""
    loss(model, xy).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.to(q.device, copy=True)


def oracle_device(backend: str, device: str) -> str:
    """Where torch's own optimizer makes a backend's bits: the kernels round as ATen's CPU loops do on every device
    (tests/kernels/test_base_step.py); the other backends run torch's operations on the parameters' device."""
    return "cpu" if backend in ("cpp", "triton") else device


def same_weights(a, b) -> bool:
    """Bit for bit, wherever each lives."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def build(backend, device, base, allocation, seed=0, model=None, **options):
    model = mlp(seed).to(device) if model is None else model
    cls, kwargs = BASES[base]
    return model, MomentumSAM(model, cls, rho=RHO, allocation=allocation, backend=backend, **options, **kwargs)


@pytest.mark.parametrize("base", ["sgd", "sgd-dampened-wd", "sgd-nesterov-wd"])
@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("backend,device", EXACT)
def test_eval_shows_what_torchs_sgd_makes_of_the_same_gradients(backend, device, allocation, base):
    """The gradients taken at the look-ahead points, handed to torch's own SGD on a copy of the model: after every step
    eval() shows SGD's weights and the momentum buffers are SGD's, bit for bit, also when rho changed since the
    look-ahead was made (step 2: the restore puts back the saved w, never w~ plus a perturbation made again with
    the new rho) and when it is 0 (step 3: the look-ahead is w itself). eval() and train() are idempotent, and train()
    gives back the look-ahead point's own bits, whatever rho became in between."""
    model = mlp().to(device)
    twin = copy.deepcopy(model).to(oracle_device(backend, device))
    _, opt = build(backend, device, base, allocation, model=model)
    cls, kwargs = BASES[base]
    plain = cls(twin.parameters(), foreach=False, **kwargs)
    for i, xy in enumerate(on(device, mlp_data(6))):
        opt.param_groups[0]["rho"] = {2: 3 * RHO, 3: 0.0}.get(i, RHO)
        give_gradients(model, twin, xy)
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
        look = snapshot(model)
        assert same_weights(look, twin.parameters()) == (i == 3), f"step {i}: rho {opt.param_groups[0]['rho']}"
        for leave in (opt.eval, lambda: opt.train(False)):
            leave()
            assert not opt.training and same_weights(twin.parameters(), model.parameters()), f"step {i}: not w"
        for p, q in zip(model.parameters(), twin.parameters()):
            assert same_weights([opt.state[p]["momentum_buffer"]], [plain.state[q]["momentum_buffer"]]), f"step {i}"
        opt.param_groups[0]["rho"] = 2 * RHO  # changed in eval mode: for the next look-ahead, not this one
        for _ in range(2):
            opt.train()
            assert opt.training and same_bits(look, model.parameters()), f"step {i}: train() moved elsewhere"


def test_kernels_that_exchange_the_buffers_memory_restore_w_bit_for_bit():
    """Past the stream threshold the ``cpp`` CPU kernels exchange the memory of the parameter and backup buffers rather
    than copying (csrc/cpu/exchange.h): the look-ahead point and w trade places at every perturbation and restore.
    eval(), train() and state_dict() (which puts w in and the look-ahead back) give SGD's w and the look-ahead's own
    bits all the same."""
    pytest.importorskip("gearsam_fused._C", reason="the C++ extension is not built")
    features = math.isqrt(stream_threshold_elements(torch.float32)) + 64
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, features), nn.Tanh(), nn.Linear(features, 2))
    twin = copy.deepcopy(model)
    _, opt = build("cpp", "cpu", "sgd-nesterov-wd", "gear", model=model)
    plain = torch.optim.SGD(twin.parameters(), foreach=False, **BASES["sgd-nesterov-wd"][1])
    gen = torch.Generator().manual_seed(1)
    addresses = []
    for i in range(3):
        give_gradients(model, twin, (torch.randn(4, features, generator=gen), torch.randn(4, 2, generator=gen)))
        opt.step()
        plain.step()
        opt.zero_grad()
        look = snapshot(model)
        opt.state_dict()
        assert same_bits(look, model.parameters()), f"step {i}: state_dict() moved the look-ahead"
        addresses.append(model[0].weight.data_ptr())
        opt.eval()
        assert same_bits(snapshot(twin), model.parameters()), f"step {i}: eval() is not SGD's w"
        addresses.append(model[0].weight.data_ptr())
        opt.train()
        assert same_bits(look, model.parameters()), f"step {i}: train() moved elsewhere"
    assert len(set(addresses[0::2])) == len(set(addresses[1::2])) == 1 and addresses[0] != addresses[1]  # exchanged


# ------------------------------------------------------------------------------------------ the first step
@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("base", ["sgd", "adamw"])
@pytest.mark.parametrize("backend,device", EVERY)
def test_the_first_gradient_is_taken_at_w_and_a_block_without_momentum_stays_at_w(backend, device, base, allocation):
    """Before the first step there is no momentum to look ahead along: the parameters are w, and the first gradient
    is torch's optimizer's own. The middle layer's gradient is zero on every step, so its momentum (SGD's buffer,
    AdamW's first moment, weight decay decoupled) is zero: its block is never moved off w, bit for bit."""
    model = mlp3().to(device)
    at_w = copy.deepcopy(model)  # takes the first gradient at w
    twin = copy.deepcopy(model).to(oracle_device(backend, device))
    cls, kwargs = BASES[base]
    opt = MomentumSAM(model, cls, rho=RHO, allocation=allocation, partition="coarse", backend=backend, **kwargs)
    plain = cls(twin.parameters(), foreach=False, **kwargs)
    opt.eval()
    opt.train()  # nothing to put back, nowhere to look ahead
    assert same_bits(snapshot(at_w), model.parameters())
    for i, xy in enumerate(on(device, mlp_data(4))):
        if i == 0:
            mse(at_w, xy).backward()
        give_gradients(model, twin, xy)
        if i == 0:
            assert same_bits([p.grad for p in at_w.parameters()], (p.grad for p in model.parameters()))
        for m in (model, twin):
            for p in m[2].parameters():
                p.grad.zero_()
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
        look = snapshot(model)
        opt.eval()
        # Adam's root is torch's or the correctly rounded one, by backend: w is SGD's alone bit for bit
        assert base == "adamw" or same_weights(twin.parameters(), model.parameters()), f"step {i}: eval() is not w"
        assert same_bits([look[2], look[3]], model[2].parameters()), f"step {i}: a block without momentum moved"
        assert not same_bits(look[:2], model[0].parameters())  # the others did
        opt.train()
        stats = opt.block_stats()
        assert stats["radius"][1] == 0 and stats["energy"][1] == 0


# ------------------------------------------------------------------------------------------ state dicts
def state_of(opt, model) -> list[torch.Tensor]:
    return [t for p in model.parameters() for t in opt.state[p].values()]


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("base", ["sgd-nesterov-wd", "adamw"])
@pytest.mark.parametrize("backend,device", EVERY)
def test_a_checkpoint_resumes_bit_for_bit(backend, device, base, allocation, mode, order):
    """Four steps, a checkpoint of the model and the optimizer saved in train mode (the model holds the look-ahead
    point) or in eval mode (it holds w), three more; a new model and optimizer load it, in either order, and take the
    same three steps: the same bits as the run that went on, in both modes, state and GEAR EMA included."""
    data = on(device, mlp_data(7))
    model, opt = build(backend, device, base, allocation)
    for xy in data[:4]:
        one_step(opt, model, xy)
    if mode == "eval":
        opt.eval()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    opt.train()
    for xy in data[4:]:
        one_step(opt, model, xy)

    buffer.seek(0)
    saved = torch.load(buffer)
    fresh, fresh_opt = build(backend, device, base, allocation, seed=5)
    loads = [lambda: fresh.load_state_dict(saved["model"]), lambda: fresh_opt.load_state_dict(saved["opt"])]
    for load in loads if order == "model-first" else loads[::-1]:
        load()
    assert fresh_opt.training == (mode == "train")
    assert same_bits(list(saved["model"].values()), fresh.parameters())
    fresh_opt.train()
    for xy in data[4:]:
        one_step(fresh_opt, fresh, xy)
    assert same_bits(snapshot(model), fresh.parameters())
    assert same_bits(state_of(opt, model), state_of(fresh_opt, fresh))
    assert torch.equal(opt.step_statistics.ema, fresh_opt.step_statistics.ema)
    opt.eval()
    fresh_opt.eval()
    assert same_bits(snapshot(model), fresh.parameters())


@pytest.mark.parametrize("backend,device", CPU_EVERY)
def test_a_plain_sgd_checkpoint_is_adopted(backend, device):
    """A run switched to MomentumSAM from torch's SGD: the momentum buffers are taken over, the first step has no
    look-ahead yet (its gradient is taken at w) and makes SGD's own update."""
    kwargs = BASES["sgd-nesterov-wd"][1]
    data = mlp_data(5)
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), foreach=False, **kwargs)
    for xy in data[:3]:
        one_step(sgd, model, xy)
    resumed, opt = build(backend, device, "sgd-nesterov-wd", "gear", seed=5)
    resumed.load_state_dict(copy.deepcopy(model.state_dict()))
    with pytest.warns(UserWarning, match="GEAR-SAM's EMA of block energies starts at zero"):
        opt.load_state_dict(copy.deepcopy(sgd.state_dict()))
    assert same_bits([sgd.state[p]["momentum_buffer"] for p in model.parameters()],
                     (opt.state[p]["momentum_buffer"] for p in resumed.parameters()))  # fmt: skip
    for i, xy in enumerate(data[3:]):
        if i == 0:
            assert same_bits(snapshot(model), resumed.parameters())
        give_gradients(resumed, model, xy)
        opt.step()
        sgd.step()
        opt.zero_grad()
        sgd.zero_grad()
        opt.eval()
        assert same_bits(snapshot(model), resumed.parameters())
        opt.train()
    assert not same_bits(snapshot(model), resumed.parameters())  # it looks ahead from then on


@pytest.mark.parametrize("allocation,two_pass", [("sam", SAM), ("gear", GEARSAM)])
def test_two_pass_and_one_pass_state_dicts_refuse_each_other(allocation, two_pass):
    """A state dict of SAM or GEARSAM is refused by MomentumSAM with the same allocation rule and the other way round,
    saying why; a refused state dict changes nothing (the look-ahead point and the saved w stay)."""
    model, opt = build("torch", "cpu", "sgd", allocation)
    for xy in mlp_data(2):
        one_step(opt, model, xy)
    other_model = mlp()
    other = two_pass(other_model, torch.optim.SGD, rho=RHO, **BASES["sgd"][1])
    look = snapshot(model)
    opt.eval()
    w = snapshot(model)
    opt.train()
    with pytest.raises(ValueError, match=r"saved by a two-pass optimizer \(SAM's first_step/second_step\), cannot "
                                         r"load it into MomentumSAM"):  # fmt: skip
        opt.load_state_dict(other.state_dict())
    assert same_bits(look, model.parameters()) and opt.training
    opt.eval()
    assert same_bits(w, model.parameters())
    opt.train()
    with pytest.raises(ValueError, match=f"saved by a one-pass MomentumSAM, cannot load it into {two_pass.__name__}"):
        other.load_state_dict(copy.deepcopy(opt.state_dict()))
    with pytest.raises(ValueError, match=r"saved by MomentumSAM with allocation='(sam|gear)', this optimizer has "
                                         r"allocation='(sam|gear)'"):  # fmt: skip
        build("torch", "cpu", "sgd", "gear" if allocation == "sam" else "sam")[1].load_state_dict(opt.state_dict())
    one_step(opt, model, mlp_data(3)[2])  # still steps


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_is_refused_with_clear_messages():
    model = mlp()
    with pytest.raises(ValueError, match=r"param group 0 has momentum=0: MomentumSAM looks ahead along the base "
                                         r"optimizer's momentum, which needs momentum > 0"):  # fmt: skip
        MomentumSAM(model, torch.optim.SGD, rho=RHO, lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 has betas\[0\]=0.0: .* needs betas\[0\] > 0"):
        MomentumSAM(model, torch.optim.Adam, rho=RHO, lr=0.1, betas=(0.0, 0.99))
    with pytest.raises(ValueError, match=r"momentum of torch.optim.SGD \(momentum > 0\), Adam or AdamW; got RMSprop"):
        MomentumSAM(model, torch.optim.RMSprop, rho=RHO, lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"base_optimizer must be an optimizer class \(or factory\) such as "
                                        r"torch.optim.SGD.*got an instance of SGD"):  # fmt: skip
        MomentumSAM(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rho=RHO)
    with pytest.raises(TypeError, match=r"MomentumSAM takes no descent, schedule: a step schedule skips second passes"):
        MomentumSAM(model, torch.optim.SGD, rho=RHO, lr=0.1, momentum=0.9, schedule=Every(2), descent=SurrogateGap())
    factory = functools.partial(torch.optim.SGD, momentum=0.9)  # a factory of a supported class: its momentum
    assert MomentumSAM(mlp(), factory, rho=RHO, lr=0.1).momentum_key == "momentum_buffer"
    with pytest.raises(ValueError, match=r"allocation must be one of \['gear', 'gear-sam', 'sam'\], got 'looksam'"):
        MomentumSAM(model, torch.optim.SGD, rho=RHO, allocation="looksam", lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"rho must lie in \[0.0, inf\)"):
        MomentumSAM(model, torch.optim.SGD, rho=-1.0, lr=0.1, momentum=0.9)
    opt = MomentumSAM(model, torch.optim.SGD, rho=RHO, lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match=r"step\(\) found no gradients: call loss.backward\(\) before step\(\)"):
        opt.step()
    one_step(opt, model, mlp_data(1)[0])
    look = snapshot(model)
    for call in (opt.first_step, opt.second_step):
        with pytest.raises(RuntimeError, match=r"MomentumSAM takes one gradient per step: call loss.backward\(\) and "
                                               r"then step\(\) \(first_step\(\) and second_step\(\) belong to"):  # fmt: skip
            call()
    opt.param_groups[0]["momentum"] = 0.0
    mse(model, mlp_data(2)[1]).backward()
    with pytest.raises(ValueError, match="param group 0 has momentum=0.0"):
        opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    opt.eval()
    with pytest.raises(RuntimeError, match=r"step\(\) in eval mode: the parameters hold w, not the look-ahead point "
                                           r".* call opt.train\(\) before training"):  # fmt: skip
        opt.step()
    opt.train()
    assert same_bits(look, model.parameters())  # nothing refused moved anything


# ------------------------------------------------------------------------------------------ as SAM does
@pytest.mark.parametrize("backend,device", [case for case in EXACT if case.values[1] == "cpu"])
def test_param_groups_and_an_lr_scheduler_drive_it_as_they_drive_torchs_sgd(backend, device):
    """Two groups with their own lr and weight decay, a StepLR on each optimizer: eval() shows SGD's weights bit for
    bit, and no warning that the scheduler stepped before the optimizer."""
    model = mlp()
    twin = copy.deepcopy(model)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.1, "weight_decay": 0.0}, {"params": m[2].parameters()}]

    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.01)
    opt = MomentumSAM(groups(model), torch.optim.SGD, model=model, rho=RHO, allocation="gear", backend=backend,
                      **kwargs)  # fmt: skip
    plain = torch.optim.SGD(groups(twin), foreach=False, **kwargs)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, plain)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xy in mlp_data(5):
            give_gradients(model, twin, xy)
            opt.step()
            plain.step()
            opt.zero_grad()
            plain.zero_grad()
            for scheduler in schedulers:
                scheduler.step()
            opt.eval()
            assert same_bits(snapshot(twin), model.parameters())
            opt.train()
    assert [group["lr"] for group in opt.param_groups] == [0.1 * 0.25, 0.02 * 0.25]


@pytest.mark.parametrize("backend,device", CPU_EVERY)
def test_zero_grad_to_none_or_in_place_steps_alike(backend, device):
    runs = []
    for set_to_none in (True, False):
        model, opt = build(backend, device, "sgd-nesterov-wd", "gear")
        for xy in mlp_data(4):
            mse(model, xy).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            assert all(p.grad is None if set_to_none else not p.grad.any() for p in model.parameters())
        runs.append(snapshot(model))
    assert same_bits(*runs)


def test_a_closure_step_is_the_step_after_backward():
    """``step(closure)`` as torch's optimizers take it: the closure computes the loss and its gradient at the
    parameters (the look-ahead point); its loss is returned."""
    runs = []
    for with_closure in (False, True):
        model, opt = build("cpp" if cpp_installed() else "torch", "cpu", "adamw", "gear")
        for xy in mlp_data(3):
            if with_closure:

                def closure():
                    loss = mse(model, xy)
                    loss.backward()
                    return loss

                with torch.no_grad():
                    at_look_ahead = mse(model, xy)
                assert torch.equal(opt.step(closure).detach(), at_look_ahead)
            else:
                one_step(opt, model, xy)
            opt.zero_grad()
        runs.append(snapshot(model))
    assert same_bits(*runs)


@pytest.mark.parametrize("backend,device", CPU_EVERY)
def test_a_frozen_parameter_and_one_without_a_gradient_stay_where_they_are(backend, device):
    """A frozen bias (in no block) and a parameter the loss never uses (in a block of its own, never given a
    gradient, so never given momentum): neither moves, in train or eval mode; the others step as torch's SGD."""
    model = mlp()
    model[0].bias.requires_grad_(False)
    unused = nn.Parameter(torch.randn(5))
    twin, twin_unused = copy.deepcopy(model), copy.deepcopy(unused)
    kwargs = BASES["sgd-nesterov-wd"][1]
    opt = MomentumSAM([*model.parameters(), unused], torch.optim.SGD, model=model, rho=RHO, allocation="gear",
                      backend=backend, **kwargs)  # fmt: skip
    assert opt.block_names[-1] == "other"
    plain = torch.optim.SGD([*twin.parameters(), twin_unused], foreach=False, **kwargs)
    for xy in mlp_data(3):
        give_gradients(model, twin, xy)
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
        for which in ("train", "eval"):
            getattr(opt, which)()
            assert torch.equal(model[0].bias, twin[0].bias) and torch.equal(unused, twin_unused), which
        assert same_bits(snapshot(twin), model.parameters())
        opt.train()
    assert unused not in opt.state and model[0].bias not in opt.state


def autocast_loss(dtype):
    def loss(model, xy):
        with torch.autocast("cpu", dtype=dtype):
            out = model(xy[0])
        assert out.dtype == dtype
        return F.mse_loss(out.float(), xy[1])

    return loss


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend,device", CPU_EVERY)
def test_gradscaler_skips_an_overflowing_step_without_a_trace(backend, device, dtype):
    """torch's own GradScaler, around an autocast forward: the step whose gradient overflowed is skipped, leaving the
    look-ahead point, w, the base optimizer's state (AdamW's step counts too) and the GEAR EMA as they were, and the
    scale halved; the other steps are the steps of the same run without loss scaling."""
    loss = autocast_loss(dtype)
    data = mlp_data(5)
    model, opt = build(backend, device, "adamw", "gear")
    unscaled_model, unscaled = build(backend, device, "adamw", "gear")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for i, xy in enumerate(data):
        scaler.scale(loss(model, xy)).backward()
        if i == 2:
            model[0].weight.grad.view(-1)[3] = float("inf")
            look, state = snapshot(model), [t.clone() for t in state_of(opt, model)]
            ema = opt.step_statistics.ema.clone()
            opt.eval()
            w = snapshot(model)
            opt.train()
        else:
            one_step(unscaled, unscaled_model, xy, loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == 2:
            assert same_bits(look, model.parameters()) and same_bits(state, state_of(opt, model))
            assert torch.equal(ema, opt.step_statistics.ema) and scaler.get_scale() == 2.0**11
            opt.eval()
            assert same_bits(w, model.parameters())
            opt.train()
        assert rel_err(flat64(model), flat64(unscaled_model)) <= FP32_STEP_RTOL, f"step {i}"


@pytest.mark.parametrize("backend,device", [case for case in CPU_EVERY if case.values[0] != "reference"])
def test_bf16_autocast_follows_the_reference(backend, device):
    runs = {}
    for name, dtype in ((backend, torch.bfloat16), ("reference", torch.bfloat16), ("fp32", torch.float32)):
        model, opt = build("reference" if name == "fp32" else name, device, "sgd-nesterov-wd", "gear")
        trajectory = []
        for xy in mlp_data(5):
            one_step(opt, model, xy, autocast_loss(dtype) if dtype != torch.float32 else mse)
            trajectory.append(flat64(model))
        runs[name] = trajectory
    errors = [rel_err(ours, ref) for ours, ref in zip(runs[backend], runs["reference"])]
    assert max(errors) <= FP32_STEP_RTOL, errors
    assert rel_err(runs["reference"][-1], runs["fp32"][-1]) > 1e-5  # the bf16 forward really ran


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "in-place"])
@pytest.mark.parametrize("backend,device", CPU_EVERY)
def test_micro_batches_equal_one_large_batch(backend, device, set_to_none):
    """Four micro-batches' gradients (loss / 4) accumulated before one step: the step of the whole batch."""
    runs = []
    for k in (1, 4):
        model, opt = build(backend, device, "sgd-nesterov-wd", "gear")
        trajectory = []
        for x, y in mlp_data(4):
            for xy in zip(x.chunk(k), y.chunk(k)):
                (mse(model, xy) / k).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            trajectory.append(flat64(model))
        runs.append(trajectory)
    for step, (a, b) in enumerate(zip(*runs)):
        assert rel_err(a, b) <= FP32_STEP_RTOL, f"step {step}"


@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("base", ["sgd-nesterov-wd", "adam-wd"])
@pytest.mark.parametrize("backend,device", [on_device(b, d) for d in ("cpu", "cuda") for b in ("cpp", "triton")])
def test_a_capturable_step_gives_the_bits_of_the_default(backend, device, base, allocation):
    """rho, the lrs and the step counts on the device (a StepLR halving lr every two steps, rho changed at step 2):
    the look-ahead points, w, the state and the GEAR EMA of the default run, bit for bit."""
    runs = []
    for capturable in (False, True):
        model, opt = build(backend, device, base, allocation, capturable=capturable)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        trajectory = []
        for i, xy in enumerate(on(device, mlp_data(5))):
            if i == 2:
                set_rho(opt, 3 * RHO)
            one_step(opt, model, xy)
            scheduler.step()
            look = snapshot(model)
            opt.eval()
            trajectory.append((look, snapshot(model)))
            opt.train()
        runs.append((trajectory, state_of(opt, model), opt.step_statistics.ema, opt))
    (expected, state, ema, _), (trajectory, capturable_state, capturable_ema, opt) = runs
    for step, ((look, w), (ref_look, ref_w)) in enumerate(zip(trajectory, expected)):
        assert same_bits(look, ref_look) and same_bits(w, ref_w), f"step {step}"
    assert same_bits([t.double() for t in state], (t.cpu().double() for t in capturable_state))
    assert torch.equal(ema, capturable_ema)
    assert opt.base_step_mode == "fused" and isinstance(opt.param_groups[0]["lr"], torch.Tensor)


@pytest.fixture
def fresh_dynamo():
    """Compiles from nothing: a graph cached by another test's optimizer would be reused."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


COMPILED = [on_device(b, d) for d in ("cpu", "cuda") for b in ("torch", "cpp", "triton")]


@pytest.mark.heavy  # compiles the step
@pytest.mark.parametrize("base", ["sgd-nesterov-wd", "adamw"])
@pytest.mark.parametrize("backend,device", COMPILED)
def test_the_compiled_step_matches_eager(backend, device, base, fresh_dynamo):
    """``torch.compile(opt.step, fullgraph=True)``: the kernels are registered operators that the compiled step calls
    as they are, so ``cpp`` and ``triton`` agree with eager bit for bit; Inductor fuses the ``torch`` backend's
    operations into kernels of its own, which round differently (within ``FP32_STEP_RTOL`` a step)."""
    data = on(device, mlp_data(4))
    eager_model, eager = build(backend, device, base, "gear")
    model, opt = build(backend, device, base, "gear")
    step = torch.compile(opt.step, fullgraph=True)
    exact = backend != "torch"
    for i, xy in enumerate(data):
        one_step(eager, eager_model, xy)
        mse(model, xy).backward()
        step()
        opt.zero_grad()
        for a, b in ((snapshot(eager_model), snapshot(model)), (state_of(eager, eager_model), state_of(opt, model))):
            if exact:
                assert same_bits(a, b), f"step {i}"
            else:
                assert rel_err(torch.cat([t.reshape(-1) for t in a]), torch.cat([t.reshape(-1) for t in b])) <= (
                    FP32_STEP_RTOL
                ), f"step {i}"
    assert opt.base_step_mode == "fused", opt.base_step_reason
    eager.eval()
    opt.eval()
    assert rel_err(flat64(eager_model), flat64(model)) <= (0 if exact else FP32_STEP_RTOL)


@pytest.mark.full  # compiles a model's forward and backward with the step
def test_a_whole_training_step_compiles_and_matches_eager(fresh_dynamo):
    """forward, backward and step under one ``torch.compile`` (graph breaks allowed, as in any compiled training step
    with a backward)."""
    results = []
    for compiled in (False, True):
        model, opt = build("cpp", "cpu", "sgd-nesterov-wd", "gear", model=mlp3())

        def train_step(xy):
            loss = mse(model, xy)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = torch.compile(train_step) if compiled else train_step
        losses = torch.stack([step(xy) for xy in mlp_data(4)])
        opt.eval()
        results.append((losses, flat64(model)))
    (eager_losses, eager_weights), (losses, weights) = results
    assert rel_err(eager_losses, losses) <= 1e-5
    assert rel_err(eager_weights, weights) <= 1e-5


@pytest.mark.parametrize("allocation", ["sam", "gear"])
@pytest.mark.parametrize("backend,device", CPU_EVERY)
def test_block_stats_describe_the_look_ahead(backend, device, allocation):
    """The energies are the new momentum's, GEAR-SAM's score is their EMA (not the gradients'), the radii's squares sum
    to rho**2 and each block moved by its radius against its momentum: ``w~_b - w_b = -r_b v_b / ||v_b||``."""
    model = mlp3()
    opt = MomentumSAM(model, torch.optim.SGD, rho=RHO, allocation=allocation, partition="coarse", backend=backend,
                      beta=0.8, lr=0.05, momentum=0.9)  # fmt: skip
    ema = torch.zeros(3, dtype=torch.float64)
    for xy in mlp_data(4):
        one_step(opt, model, xy)
        look = snapshot(model)
        opt.eval()
        offsets = [a.double() - b.double() for a, b in zip(look, model.parameters())]
        opt.train()
        stats = opt.block_stats()
        momenta = [opt.state[p]["momentum_buffer"].double() for p in model.parameters()]
        energy = torch.stack([sum(v.square().sum() for v in momenta[2 * b : 2 * b + 2]) for b in range(3)])
        torch.testing.assert_close(stats["energy"], energy, rtol=1e-6, atol=0)
        ema = 0.8 * ema + 0.2 * energy
        torch.testing.assert_close(stats["score"], ema if allocation == "gear" else energy.sqrt(), rtol=1e-6, atol=0)
        assert abs(stats["radius"].square().sum().item() - RHO**2) <= 1e-12 * RHO**2
        assert abs(stats["share"].sum().item() - 1.0) <= 1e-12 and ((0 < stats["share"]) & (stats["share"] < 1)).all()
        for b in range(3):
            offset = torch.cat([t.reshape(-1) for t in offsets[2 * b : 2 * b + 2]])
            v = torch.cat([t.reshape(-1) for t in momenta[2 * b : 2 * b + 2]])
            assert abs(offset.norm().item() / stats["radius"][b].item() - 1) <= 1e-5, f"block {b}"
            assert F.cosine_similarity(offset, v, dim=0).item() <= -1 + 1e-6, f"block {b}: not against the momentum"

"""The base optimizer's step fused with SAM's restore (``gearsam_fused.base_step``): the kernels against torch's own
SGD and Adam(W), whole trajectories against the same optimizer stepping per tensor, which steps are fused and why
others are not, and the state it keeps in torch's format."""

import contextlib
import copy
import math

import pytest
import torch

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.accumulation import accumulated_step
from gearsam_fused.amp import SAMScaler
from gearsam_fused.base_step import FUSED_OPTIMIZERS

from conftest import (
    FP32_STEP_RTOL,
    FP64_STEP_RTOL,
    FUSED,
    KERNELS,
    batches,
    correct_root,
    flat,
    kernel_module,
    loss_fn,
    rel_err,
    sam_step,
    tiny_resnet,
    torch_adam_oracle,
)

TILE = 2048
FLOATS = [torch.float32, torch.float64]

SGD_FLAGS = {
    "plain": dict(lr=0.1),
    "momentum-wd": dict(lr=0.05, momentum=0.9, weight_decay=5e-4),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "dampening-maximize": dict(lr=0.0123, momentum=0.5, dampening=0.1, maximize=True),
}
ADAM_FLAGS = {
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam-l2-amsgrad": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2, amsgrad=True)),
    "adam-betas-maximize": (torch.optim.Adam, dict(lr=1e-3, betas=(0.3, 0.8), maximize=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01, amsgrad=True, betas=(0.8, 0.99))),
}


def adam_tolerance(dtype: torch.dtype, step_size: float) -> dict:
    """An Adam parameter against torch's: torch's CPU ``sqrt`` (MKL's vector one on x86) may be one unit in the last
    place off the correctly rounded root the kernels take, which moves the update ``step_size * m / denom`` (of order
    ``step_size``) by about one part in 1e7 (float32) and the rounded sum by an ulp of ``w``. The moments, which take
    no root, are compared bit for bit."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=4 * eps * step_size)


def flat_buffers(dtype: torch.dtype, seed: int = 0, n: int = 3 * TILE):
    g = torch.Generator().manual_seed(seed)
    backup = torch.randn(n, generator=g).to(dtype)
    grad = torch.randn(n, generator=g).to(dtype)
    backup[-100:] = 0  # a padded tail: zero weights and gradients
    grad[-100:] = 0
    return backup, grad


def torch_step(cls, kwargs: dict, backup, grad, state: dict):
    """torch's own optimizer, one step from ``state``, over a parameter holding ``backup``: (new w, new state)."""
    p = torch.nn.Parameter(backup.clone())
    p.grad = grad.clone()
    opt = cls([p], foreach=False, **kwargs)
    if state:
        opt.state[p] = {k: v.clone() for k, v in state.items()}
    opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("flags", list(SGD_FLAGS), ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_sgd_kernel_is_torchs_sgd_bit_for_bit(backend, device, flags, first, dtype):
    """Against torch's CPU SGD on every device: the kernels round as ATen's CPU loops do (CUDA included)."""
    kw = {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False,
          **SGD_FLAGS[flags]}  # fmt: skip
    backup, grad = flat_buffers(dtype)
    momentum = kw["momentum"] != 0
    state = {} if first or not momentum else {"momentum_buffer": torch.randn_like(backup)}
    expected_w, expected_state = torch_step(torch.optim.SGD, kw, backup, grad, state)
    # the kernel must read backup, never the perturbed weights
    param = torch.full_like(backup, float("nan"), device=device)
    buffer = state["momentum_buffer"].clone() if state else (torch.zeros_like(backup) if momentum else None)
    buffer = buffer.to(device) if momentum else None
    kernel_module(backend).sgd_step_(param, grad.to(device), backup.to(device), buffer, tile=TILE, first=first, **kw)
    assert torch.equal(param.cpu(), expected_w)
    if momentum:
        assert torch.equal(buffer.cpu(), expected_state["momentum_buffer"])


def test_the_oracle_root_is_correctly_rounded():
    """correctly_rounded_sqrt's root, the oracle of the kernels' square root, checked exactly: for float32, r is the
    correctly rounded root of x when x lies between the squares of r's two rounding boundaries (half way to its
    neighbours), computed without error in float64; for float64, it equals the C library's root element by element."""
    x = torch.cat([torch.rand(20000), torch.rand(20000) * 1e-6, torch.rand(20000) * 1e6, torch.tensor([0.0, 1.0, 4.0])])
    r = correct_root(x)
    below, above = (torch.nextafter(r, torch.tensor(v)).double() for v in (0.0, float("inf")))
    lower, upper = (r.double() + below) / 2, (r.double() + above) / 2
    assert (lower**2 <= x.double()).all() and (x.double() <= upper**2).all()
    y = torch.rand(2000, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (2000,))
    assert correct_root(y).tolist() == [math.sqrt(v) for v in y.tolist()]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("step", [0, 4, 99])
@pytest.mark.parametrize("flags", list(ADAM_FLAGS), ids=str)
@pytest.mark.parametrize("backend,device", KERNELS)
def test_adam_kernel_is_torchs_adam(backend, device, flags, step, dtype):
    """Against torch's CPU Adam(W) on every device, within :func:`adam_tolerance`, the moments bit for bit; the C++ CPU
    kernel also bit for bit against torch's Adam with the correctly rounded root it takes
    (:func:`conftest.torch_adam_oracle`)."""
    cls, kw = ADAM_FLAGS[flags]
    kw = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False, **kw}
    backup, grad = flat_buffers(dtype)
    g = torch.Generator().manual_seed(1)
    state = {}
    if step:
        state = {"step": torch.tensor(float(step)), "exp_avg": 0.1 * torch.randn(backup.shape, generator=g).to(dtype),
                 "exp_avg_sq": 0.01 * torch.rand(backup.shape, generator=g).to(dtype)}  # fmt: skip
        if kw["amsgrad"]:
            state["max_exp_avg_sq"] = state["exp_avg_sq"] * 1.5
    expected_w, expected = torch_step(cls, kw, backup, grad, state)
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kw["amsgrad"] else [])
    buffers = [state[k].clone() if state else torch.zeros_like(backup) for k in names]
    buffers = [b.to(device) for b in buffers]
    param = torch.full_like(backup, float("nan"), device=device)
    beta1, beta2 = kw["betas"]
    t = float(step + 1)
    step_size = kw["lr"] / (1 - beta1**t)
    kernel_module(backend).adam_step_(
        param, grad.to(device), backup.to(device), *buffers, *([] if kw["amsgrad"] else [None]), tile=TILE, beta1=beta1, beta2=beta2,
        eps=kw["eps"], weight_decay=kw["weight_decay"], decoupled=cls is torch.optim.AdamW, amsgrad=kw["amsgrad"],
        maximize=kw["maximize"], lr=kw["lr"], step=step + 1,
    )  # fmt: skip
    for name, buffer in zip(names, buffers):
        assert torch.equal(buffer.cpu(), expected[name]), name
    torch.testing.assert_close(param.cpu(), expected_w, **adam_tolerance(dtype, step_size))
    if (backend, device) == ("cpp", "cpu"):
        with torch_adam_oracle(backend, device):
            oracle_w, _ = torch_step(cls, kw, backup, grad, state)
        assert torch.equal(param, oracle_w)


@pytest.mark.parametrize("backend,device", [c for c in KERNELS if c.values[1] == "cpu"])
def test_kernels_refuse_what_they_cannot_update(backend, device):
    kernels = kernel_module(backend)
    backup, grad = flat_buffers(torch.float32)
    sgd = dict(tile=TILE, lr=0.1, weight_decay=0.0, dampening=0.0, nesterov=False, maximize=False, first=True)
    half = backup.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 and float64.*bfloat16"):
        kernels.sgd_step_(half, half.clone(), half.clone(), None, momentum=0.0, **sgd)
    with pytest.raises(ValueError, match="momentum_buffer"):
        kernels.sgd_step_(backup.clone(), grad, backup, None, momentum=0.9, **sgd)
    adam = dict(tile=TILE, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, maximize=False,
                lr=1e-3, step=1)  # fmt: skip
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        kernels.adam_step_(backup.clone(), grad, backup, grad.clone(), grad.clone(), None, amsgrad=True, **adam)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        kernels.adam_step_(backup.clone(), grad, backup, grad.clone(), grad[:TILE].clone(), None, amsgrad=False, **adam)


# ---------------------------------------------------------------------------------------------- the momentum's energies
#: flat_buffers' three tiles in blocks of 0, 1 and 2 tiles (an empty block's energy is 0)
MOMENTUM_BLOCKS = [0, 0, 1, 3]
MOMENTUM_CASES = {
    "sgd-first": ("sgd", dict(lr=0.1, momentum=0.9, first=True)),
    "sgd-nesterov-dampening": ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, nesterov=True, weight_decay=1e-3)),
    "sgd-from-param": ("sgd", dict(lr=0.05, momentum=0.5, backup=None)),
    "sgd-scalars": ("sgd", dict(lr=0.0, momentum=0.9, scalars=[0.05, 3.0])),
    "adam": ("adam", dict(lr=1e-2, step=5)),
    "adamw-amsgrad": ("adam", dict(lr=1e-3, step=1, weight_decay=0.05, decoupled=True, amsgrad=True)),
    "adam-scalars": ("adam", dict(lr=0.0, step=0, scalars=[1e-2, 4.0])),
}


def _momentum_step(kernels, kind: str, kw: dict, dtype, device, **outputs):
    """One base step of MOMENTUM_CASES' kind from fixed buffers: (param, state) after it."""
    backup, grad = (t.to(device) for t in flat_buffers(dtype))
    g = torch.Generator().manual_seed(2)
    state = [0.1 * torch.randn(backup.shape, generator=g).to(dtype).to(device)]
    kw = dict(kw)
    param = backup.clone() if kw.get("backup", backup) is None else torch.full_like(backup, float("nan"))
    backup = kw.pop("backup", backup)
    if "scalars" in kw:
        kw["scalars"] = torch.tensor(kw["scalars"], dtype=torch.float64, device=device)
    if kind == "sgd":
        kw = {"weight_decay": 0.0, "dampening": 0.0, "nesterov": False, "maximize": False, "first": False, **kw}
        kernels.sgd_step_(param, grad, backup, state[0], tile=TILE, **kw, **outputs)
    else:
        state.append(0.01 * torch.rand(grad.shape, generator=g).to(dtype).to(device))
        amsgrad = kw.pop("amsgrad", False)
        state.append(state[1] * 1.5 if amsgrad else None)
        kw = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "decoupled": False, "maximize": False,
              **kw}  # fmt: skip
        kernels.adam_step_(param, grad, backup, *state, tile=TILE, amsgrad=amsgrad, **kw, **outputs)
    return param, state


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", list(MOMENTUM_CASES))
@pytest.mark.parametrize("backend,device", KERNELS)
def test_base_steps_sum_the_new_momentum_as_block_energy_does(backend, device, case, dtype):
    """Given first_tile_of_block, partials and momentum_energy, a base step writes what it writes without them and
    momentum_energy holds block_energy of the momentum it wrote (SGD's buffer, Adam's exp_avg), bit for bit: the CPU
    and Triton kernels sum each tile as they write it (MomentumSAM's one pass)."""
    kernels = kernel_module(backend)
    kind, kw = MOMENTUM_CASES[case]
    param, state = _momentum_step(kernels, kind, kw, dtype, device)
    outputs = dict(first_tile_of_block=torch.tensor(MOMENTUM_BLOCKS, device=device),
                   partials=torch.full((3,), math.nan, dtype=torch.float64, device=device),
                   momentum_energy=torch.full((3,), math.nan, dtype=torch.float64, device=device))  # fmt: skip
    summed_param, summed_state = _momentum_step(kernels, kind, kw, dtype, device, **outputs)
    assert torch.equal(summed_param, param)
    for buffer, expected in zip(summed_state, state):
        assert buffer is None or torch.equal(buffer, expected)
    partials = torch.empty(3, dtype=torch.float64, device=device)
    expected = kernels.block_energy(state[0], param, outputs["first_tile_of_block"], partials, tile=TILE,
                                    adaptive=False, eta=0.0)  # fmt: skip
    assert torch.equal(outputs["momentum_energy"], expected)
    assert expected[0] == 0 and (expected[1:] > 0).all()


@pytest.mark.parametrize("backend", ["cpp", "triton", "cpp-meta"])
def test_momentum_energy_outputs_are_checked(backend):
    """All three or none, beside a momentum the step writes, never with found_inf, and sized for the bucket: by the
    kernels (ValueError) and by the compiled extension's fake implementations (meta tensors; torch._check's
    RuntimeError)."""
    device = "meta" if backend.endswith("meta") else "cpu"
    refused = RuntimeError if device == "meta" else ValueError
    kernels = kernel_module(backend.removesuffix("-meta"))
    backup, grad = (t.to(device) for t in flat_buffers(torch.float32))
    sgd = dict(tile=TILE, lr=0.1, weight_decay=0.0, dampening=0.0, nesterov=False, maximize=False, first=False)
    blocks = torch.tensor(MOMENTUM_BLOCKS, device=device)

    def outputs(n_partials=3, n_energy=3):
        return dict(first_tile_of_block=blocks, partials=torch.empty(n_partials, dtype=torch.float64, device=device),
                    momentum_energy=torch.empty(n_energy, dtype=torch.float64, device=device))  # fmt: skip

    def step(momentum=0.9, **kw):
        buffer = torch.zeros_like(backup) if momentum else None
        kernels.sgd_step_(backup.clone(), grad, backup, buffer, momentum=momentum, **sgd, **kw)

    with pytest.raises(refused, match="given together or not at all"):
        step(partials=outputs()["partials"])
    with pytest.raises(refused, match="this step keeps none"):
        step(momentum=0.0, **outputs())
    with pytest.raises(refused, match="not taken with found_inf"):
        step(found_inf=torch.zeros((), device=device), **outputs())
    with pytest.raises(refused, match="partials has 2 entries for 3 tiles"):
        step(**outputs(n_partials=2))
    with pytest.raises(refused, match="momentum_energy has 4 entries for 3 blocks"):
        step(**outputs(n_energy=4))
    adam = dict(tile=TILE, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, amsgrad=False,
                maximize=False, lr=1e-3, step=1)  # fmt: skip
    with pytest.raises(refused, match="momentum_energy has 2 entries for 3 blocks"):
        kernels.adam_step_(
            backup.clone(), grad, backup, grad.clone(), grad.clone(), None, **adam, **outputs(n_energy=2)
        )


# ---------------------------------------------------------------------------------------------- whole trajectories
BASES = {f"sgd-{k}": (torch.optim.SGD, kw) for k, kw in SGD_FLAGS.items()} | ADAM_FLAGS


def grouped(model, lr: float) -> list[dict]:
    """Two param groups with their own lr and weight decay (weights decay, biases and norms do not), so buckets are
    split by group and each is updated with its own hyperparameters."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": rest, "lr": lr * 0.5, "weight_decay": 0.0}]


def trajectory(backend: str, base: str, dtype, base_step: str, foreach: bool, steps: int, device: str = "cpu"):
    model = tiny_resnet(dtype=dtype, device=device)
    base_cls, kw = BASES[base]
    opt = GEARSAM(grouped(model, kw["lr"]), base_cls, model=model, rho=0.05, backend=backend, base_step=base_step,
              foreach=foreach, **kw)  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    modes = set()
    for xy in batches(steps, dtype, device=device):
        sam_step(opt, model, xy)
        schedule.step()
        modes.add(opt.base_step_mode)
    return model, opt, modes


# every base and flag set in float32; float64 for one of each optimizer
TRAJECTORIES = [(base, torch.float32) for base in BASES] + [
    ("sgd-nesterov", torch.float64),
    ("adamw-amsgrad", torch.float64),
]


@pytest.mark.parametrize("base,dtype", TRAJECTORIES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("backend,device", FUSED)
def test_fused_trajectory_equals_the_base_optimizer_stepping_per_tensor(backend, device, base, dtype):
    """50 steps of GEAR-SAM with two param groups and an LR schedule: fused, against the same backend calling the base
    optimizer's own step (foreach=False and True). On the CPU, SGD is bit for bit on every backend, and so is Adam on
    ``torch`` (torch's own operations over the flat buffer) and on ``cpp`` against torch's Adam with the correctly
    rounded root it takes (:func:`conftest.torch_adam_oracle`); Triton's Adam, with a correctly rounded root, is within the suite's relative error per step (float32 1e-6, float64 1e-10), over the
    steps. On CUDA torch's own kernels round differently (e.g. a multiply by a reciprocal), so all are held to that
    tolerance there."""
    steps = 20 if (backend, device) == ("triton", "cpu") else 50  # the interpreter is slow; 20 steps cross every state
    fused, opt, modes = trajectory(backend, base, dtype, "auto", foreach=False, steps=steps, device=device)
    assert modes == {"fused"}, opt.base_step_reason
    # see test_adam_kernel_is_torchs_adam
    exact = device == "cpu" and (base.startswith("sgd") or backend in ("torch", "cpp"))
    for foreach in (False, True):
        with torch_adam_oracle(backend, device):
            plain, plain_opt, plain_modes = trajectory(backend, base, dtype, "per-tensor", foreach, steps, device)
        assert plain_modes == {"per-tensor"}
        if exact:
            assert torch.equal(flat(fused), flat(plain)), f"foreach={foreach}"
            for p, q in zip(fused.parameters(), plain.parameters()):
                for key, value in plain_opt.state[q].items():
                    assert torch.equal(opt.state[p][key], value), key
        else:
            rtol = (FP32_STEP_RTOL if dtype == torch.float32 else FP64_STEP_RTOL) * steps
            err = rel_err(flat(fused), flat(plain))
            assert err <= rtol, f"foreach={foreach}: relative error {err:.3g} > {rtol:.3g}"


@pytest.mark.parametrize("base", ["sgd-momentum-wd", "adamw"])
@pytest.mark.parametrize("backend,device", FUSED)
def test_rho_zero_is_the_base_optimizer(backend, device, base):
    """SAM with rho = 0 and a fused base step is the base optimizer itself: on the CPU bit for bit where the update's
    arithmetic is torch's (SGD everywhere, Adam on ``torch``, and on ``cpp`` with the correctly rounded root), within
    the per-step tolerance on Triton's Adam and on CUDA (see the trajectory test)."""
    base_cls, kw = BASES[base]
    model, twin = tiny_resnet(device=device), tiny_resnet(device=device)
    opt = SAM(model.parameters(), base_cls, rho=0.0, backend=backend, **kw)
    plain = base_cls(twin.parameters(), foreach=False, **kw)
    for xy in batches(5, device=device):
        sam_step(opt, model, xy)
        loss_fn(twin, xy).backward()
        with torch_adam_oracle(backend, device):
            plain.step()
        plain.zero_grad()
    assert opt.base_step_mode == "fused"
    if device == "cpu" and (base.startswith("sgd") or backend in ("torch", "cpp")):
        assert torch.equal(flat(model), flat(twin))
    else:
        assert rel_err(flat(model), flat(twin)) <= 5 * FP32_STEP_RTOL


# ---------------------------------------------------------------------------------------------- which path, and why
class SubclassedSGD(torch.optim.SGD):
    pass


@pytest.mark.parametrize(
    "base_cls,kw,reason",
    [
        (torch.optim.RMSprop, dict(lr=0.01), "covers torch's SGD, Adam, AdamW; RMSprop steps per tensor"),
        (SubclassedSGD, dict(lr=0.01), "SubclassedSGD steps per tensor"),
        (torch.optim.SGD, dict(lr=torch.tensor(0.01, requires_grad=True)), "lr is a tensor that needs gradients"),
        (torch.optim.Adam, dict(lr=0.01, fused=True), "fused=True asks for torch's own fused kernel"),
    ],
    ids=["rmsprop", "subclass", "lr-with-grad", "torch-fused"],
)
def test_what_is_not_fused_steps_per_tensor_and_says_why(base_cls, kw, reason):
    model = tiny_resnet()
    opt = SAM(model, base_cls, rho=0.05, backend="torch", **kw)
    sam_step(opt, model, batches(1)[0])
    assert opt.base_step_mode == "per-tensor"
    assert reason in opt.base_step_reason
    # asked for strictly, the same optimizer is refused: at construction, or at the step that cannot be fused
    strict_model = tiny_resnet()
    with pytest.raises((ValueError, RuntimeError), match="base_step='fused' cannot be honoured"):
        strict = SAM(strict_model, base_cls, rho=0.05, backend="torch", base_step="fused", **kw)
        sam_step(strict, strict_model, batches(1)[0])


def test_reference_backend_and_low_precision_step_per_tensor():
    model = tiny_resnet()
    opt = SAM(model, torch.optim.SGD, rho=0.05, backend="reference", lr=0.1)
    assert (opt.base_step_mode, opt.base_step_reason) == (
        "per-tensor",
        "backend 'reference' steps the base optimizer per tensor",
    )
    half = tiny_resnet(dtype=torch.bfloat16)
    opt = SAM(half, torch.optim.SGD, rho=0.05, backend="torch", lr=0.1)
    sam_step(opt, half, batches(1, torch.bfloat16)[0])
    assert opt.base_step_mode == "per-tensor"
    assert "bfloat16 parameters" in opt.base_step_reason


def test_a_parameter_without_a_gradient_makes_the_step_per_tensor_and_is_named():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend="torch", lr=0.1, momentum=0.9)
    model.fc.bias.requires_grad_(False)  # takes no gradient from now on (and torch's SGD skips it)
    model.fc.bias.grad = None
    xy = batches(1)[0]
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)
    loss_fn(model, xy).backward()
    opt.second_step()
    assert opt.base_step_mode == "per-tensor"
    assert "'fc.bias' has no gradient" in opt.base_step_reason


@pytest.mark.parametrize("base", ["sgd-dampening-maximize", "adamw"])
@pytest.mark.parametrize("backend,device", [case for case in FUSED if case.values[1] == "cpu"])
def test_a_plan_declined_at_a_later_bucket_leaves_no_state_of_its_own(backend, device, base):
    """The first step plans the buckets in order: a later bucket with a parameter without a gradient makes torch's
    own step run for all of them, and the state the plan had made for the earlier buckets (zeros) is gone, so that
    torch starts it from the gradient: SGD's dampened momentum buffer is the first gradient, not a dampened one."""
    base_cls, kw = BASES[base]
    runs = []
    for base_step in ("auto", "per-tensor"):
        torch.manual_seed(0)
        used, unused = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), torch.nn.Linear(4, 2)
        groups = [{"params": list(used.parameters())}, {"params": list(unused.parameters()), "lr": 0.5 * kw["lr"]}]
        opt = SAM(groups, base_cls, model=torch.nn.ModuleList([used, unused]), rho=0.05, backend=backend,
                  base_step=base_step, **kw)  # fmt: skip
        x = torch.randn(8, 4)
        for _ in range(3):
            used(x).pow(2).sum().backward()
            opt.first_step(zero_grad=True)
            used(x).pow(2).sum().backward()
            opt.second_step(zero_grad=True)
        assert opt.base_step_mode == "per-tensor", base_step
        runs.append((used, opt))
    (fused, opt), (plain, plain_opt) = runs
    assert "'1.weight' has no gradient" in opt.base_step_reason
    assert torch.equal(flat(fused), flat(plain))
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert opt.state[p].keys() == plain_opt.state[q].keys()


@pytest.mark.parametrize("backend,device", [case for case in FUSED if case.values[1] == "cpu"])
def test_amsgrad_switched_on_after_the_first_steps_fails_as_torchs_adam_does(backend, device):
    """The state torch's Adam made without amsgrad lacks ``max_exp_avg_sq``: torch's own step raises a KeyError. The
    fused step declines such state (naming the parameter and the key; ``base_step="fused"`` refuses it) rather than
    start every moment and the step count afresh, so torch's step runs and raises as it does without us."""
    for base_step, error, match in (
        ("auto", KeyError, "max_exp_avg_sq"),
        ("per-tensor", KeyError, "max_exp_avg_sq"),
        ("fused", RuntimeError, r"parameter 'conv1.weight' has optimizer state without 'max_exp_avg_sq' \(an option "
                                "switched on after its first step"),
    ):  # fmt: skip
        model = tiny_resnet()
        opt = SAM(model, torch.optim.Adam, rho=0.05, backend=backend, base_step=base_step, lr=1e-2)
        data = batches(3)
        for xy in data[:2]:
            sam_step(opt, model, xy)
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(error, match=match):
            sam_step(opt, model, data[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("base", ["adam", "adamw"])
def test_a_tensor_lr_gives_torchs_bits(base, dtype):
    """torch's Adam computes its step size (and AdamW its decay factor) from a tensor lr in the tensor's precision: a
    float32 lr steps per tensor, saying why; a float64 one is fused, with torch's bits on the ``torch`` backend."""
    base_cls, kw = BASES[base]
    runs = []
    for base_step in ("auto", "per-tensor"):
        model = tiny_resnet()
        opt = SAM(model, base_cls, rho=0.05, backend="torch", base_step=base_step,
                  **{**kw, "lr": torch.tensor(kw["lr"], dtype=dtype)})  # fmt: skip
        for xy in batches(3):
            sam_step(opt, model, xy)
        runs.append((flat(model), opt))
    (fused, opt), (plain, _) = runs
    assert torch.equal(fused, plain)
    if dtype == torch.float32:
        assert opt.base_step_mode == "per-tensor"
        assert "lr holds a float32 tensor, in whose precision torch's Adam rounds" in opt.base_step_reason
    else:
        assert opt.base_step_mode == "fused", opt.base_step_reason


def test_base_step_argument_is_checked():
    with pytest.raises(ValueError, match="base_step must be one of"):
        SAM(tiny_resnet(), torch.optim.SGD, lr=0.1, base_step="fast")
    with pytest.raises(ValueError, match="base_step='fused' cannot be honoured: backend 'reference'"):
        SAM(tiny_resnet(), torch.optim.SGD, lr=0.1, backend="reference", base_step="fused")


def test_the_fused_step_runs_the_base_optimizers_step_hooks():
    model = tiny_resnet()
    opt = SAM(model, torch.optim.AdamW, rho=0.05, backend="torch", lr=1e-3)
    calls = []
    opt.base_optimizer.register_step_pre_hook(lambda o, args, kw: calls.append(("pre", o)))
    opt.base_optimizer.register_step_post_hook(lambda o, args, kw: calls.append(("post", o)))
    sam_step(opt, model, batches(1)[0])
    assert opt.base_step_mode == "fused"
    assert calls == [("pre", opt.base_optimizer), ("post", opt.base_optimizer)]


@pytest.mark.parametrize("base_step", ["fused", "per-tensor"])
def test_what_a_step_pre_hook_returns_is_used_or_refused_as_torch_does(base_step):
    """A pre-hook may hand the step new (args, kwargs), here a closure, which the step runs and the post-hooks see;
    any other return is an error. The fused step behaves as torch's own step() (the per-tensor path)."""
    model = tiny_resnet()
    opt = SAM(model, torch.optim.SGD, rho=0.05, backend="torch", base_step=base_step, lr=0.1)
    ran, seen = [], []
    closure = lambda: ran.append(1)  # noqa: E731
    handle = opt.base_optimizer.register_step_pre_hook(lambda o, args, kw: (args, {"closure": closure}))
    opt.base_optimizer.register_step_post_hook(lambda o, args, kw: seen.append((args, kw)))
    sam_step(opt, model, batches(1)[0])
    assert opt.base_step_mode == base_step
    assert ran == [1] and seen == [((opt.base_optimizer,), {"closure": closure})]
    handle.remove()
    opt.base_optimizer.register_step_pre_hook(lambda o, args, kw: "not a pair")
    before = flat(model)
    with pytest.raises(RuntimeError, match="must return None or a tuple of \\(new_args, new_kwargs\\)"):
        sam_step(opt, model, batches(1)[0])
    assert not opt.perturbed and torch.equal(flat(model), before)


# ---------------------------------------------------------------------------------------------- state
@pytest.mark.parametrize("backend,device", [c for c in FUSED if c.values[1] == "cpu"])
def test_state_is_torchs_per_parameter_state_as_views_of_flat_buffers(backend, device):
    model = tiny_resnet()
    opt = SAM(grouped(model, 1e-3), torch.optim.AdamW, model=model, rho=0.05, backend=backend, lr=1e-3, amsgrad=True)
    for xy in batches(3):
        sam_step(opt, model, xy)
    assert opt.base_step_mode == "fused"
    for p in model.parameters():
        state = opt.state[p]
        assert list(state) == ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        assert state["step"].device.type == "cpu" and state["step"].dim() == 0 and state["step"].item() == 3
        assert all(state[k].shape == p.shape for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    # one flat buffer per state name and param group: no per-parameter copies
    storages = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 2


@pytest.mark.parametrize("base", ["sgd-momentum-wd", "adam-l2-amsgrad", "adamw"])
def test_state_dict_goes_to_and_from_a_plain_torch_optimizer(base):
    """Our state dict loads into torch's optimizer over the same parameters, and torch's into ours; both continue
    exactly as the uninterrupted run (torch backend: its update is torch's own)."""
    base_cls, kw = BASES[base]
    data = batches(6)
    model = tiny_resnet()
    opt = SAM(model, base_cls, rho=0.0, backend="torch", **kw)
    for xy in data[:3]:
        sam_step(opt, model, xy)
    saved = copy.deepcopy(opt.state_dict())
    plain_model = copy.deepcopy(model)
    plain = base_cls(plain_model.parameters(), foreach=False, **kw)
    plain.load_state_dict(saved)  # our own entry rides in the first param group, which a plain optimizer ignores
    for xy in data[3:]:
        sam_step(opt, model, xy)
        loss_fn(plain_model, xy).backward()
        plain.step()
        plain.zero_grad()
    assert torch.equal(flat(model), flat(plain_model))
    # and back: the plain optimizer's state continues in ours
    ours_model = copy.deepcopy(plain_model)
    ours = SAM(ours_model, base_cls, rho=0.0, backend="torch", **kw)
    ours.load_state_dict(plain.state_dict())
    for xy in data[:2]:
        sam_step(ours, ours_model, xy)
        loss_fn(plain_model, xy).backward()
        plain.step()
        plain.zero_grad()
    assert ours.base_step_mode == "fused"
    assert torch.equal(flat(ours_model), flat(plain_model))


@pytest.mark.parametrize("base", ["sgd-nesterov", "adamw-amsgrad"])
@pytest.mark.parametrize("backend,device", FUSED)
def test_resume_is_bit_for_bit(backend, device, base):
    base_cls, kw = BASES[base]
    data = batches(6, device=device)
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, base_cls, rho=0.05, backend=backend, **kw)
    for xy in data[:3]:
        sam_step(opt, model, xy)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for xy in data[3:]:
        sam_step(opt, model, xy)
    resumed = tiny_resnet(seed=1, device=device)
    resumed.load_state_dict(saved_model)
    resumed_opt = GEARSAM(resumed, base_cls, rho=0.05, backend=backend, **kw)
    resumed_opt.load_state_dict(saved_opt)
    for xy in data[3:]:
        sam_step(resumed_opt, resumed, xy)
    assert resumed_opt.base_step_mode == "fused"
    assert torch.equal(flat(resumed), flat(model))


def test_every_fused_optimizer_is_covered_here():
    assert {cls for cls, _ in BASES.values()} == set(FUSED_OPTIMIZERS)


HELPER_CASES = [c for c in FUSED if c.values[1] == "cpu"]


@pytest.mark.parametrize("base", ["sgd-momentum-wd", "adamw"])
@pytest.mark.parametrize("backend,device", HELPER_CASES)
def test_the_helpers_drive_the_fused_step_as_they_drive_the_per_tensor_one(backend, device, base):
    """accumulated_step with loss scaling (one step overflows and is skipped whole) and frozen BatchNorm statistics:
    with the base step fused, the same bits as with it per tensor, where the arithmetic is torch's (for ``cpp``'s Adam,
    with the correctly rounded root: :func:`conftest.torch_adam_oracle`). Triton's Adam takes
    the correctly rounded square root, which torch's CPU one may miss by a unit in the last place (see
    test_adam_kernel_is_torchs_adam): its weights and moments are within the suite's float32 relative error per step,
    over the 3 steps taken; its step counts are exact."""
    base_cls, kw = BASES[base]
    runs = {}
    for mode, oracle in (("fused", contextlib.nullcontext()), ("per-tensor", torch_adam_oracle(backend, "cpu"))):
        model = tiny_resnet()
        opt = GEARSAM(model, base_cls, rho=0.05, backend=backend, base_step=mode, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        amp = SAMScaler(opt, scaler)
        skipped = []
        with oracle:
            for i, (x, y) in enumerate(batches(4)):
                factor = float("inf") if i == 2 else 1.0  # this step's first pass overflows

                def loss(mb, factor=factor):
                    return loss_fn(model, mb) * factor

                accumulated_step(opt, loss, [(x[:8], y[:8]), (x[8:], y[8:])], amp=amp, model=model)
                scaler.update()
                skipped.append(amp.last.skipped)
        assert opt.base_step_mode == mode
        runs[mode] = flat(model), opt.state_dict(), skipped
    (fused, fused_state, fused_skips), (plain, plain_state, plain_skips) = runs["fused"], runs["per-tensor"]
    assert fused_skips == plain_skips == [False, False, True, False]
    if backend == "triton" and base == "adamw":
        rtol = FP32_STEP_RTOL * 3
        assert rel_err(fused, plain) <= rtol
        for i, entry in plain_state["state"].items():
            assert torch.equal(fused_state["state"][i]["step"], entry["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert rel_err(fused_state["state"][i][key].double(), entry[key].double()) <= rtol, key
        return
    assert torch.equal(fused, plain)
    for i, entry in plain_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(fused_state["state"][i][key], value), key

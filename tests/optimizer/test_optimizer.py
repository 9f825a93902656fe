"""Every backend against independent implementations, the paper's identities, resume, and bad input."""

import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import gearsam_fused
from gearsam_fused import GEARSAM, SAM, compact_state_dict, format_partition
from gearsam_fused.allocation import gear_allocate, sam_allocate

from conftest import (
    ALL,
    FP32_STEP_RTOL,
    FP64_STEP_RTOL,
    SGD_KW,
    batches,
    flat,
    grad_at,
    loss_fn,
    rel_err,
    sam_step,
    tiny_resnet,
)

STEPS = 25


# ---------------------------------------------------------------------------------------------- SAM vs the peer
@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_sam_matches_pytorch_optimizer(twin, adaptive, backend, device):
    peer_module = pytest.importorskip("pytorch_optimizer")
    ours_model, peer_model = (m.to(device) for m in twin)
    ours = SAM(ours_model.parameters(), torch.optim.SGD, rho=0.05, adaptive=adaptive, backend=backend, **SGD_KW)
    peer = peer_module.SAM(peer_model.parameters(), torch.optim.SGD, rho=0.05, adaptive=adaptive, **SGD_KW)
    start = flat(ours_model)
    for xy in batches(STEPS, device=device):
        sam_step(ours, ours_model, xy)
        sam_step(peer, peer_model, xy)
        assert rel_err(flat(ours_model), flat(peer_model)) <= FP32_STEP_RTOL
    assert rel_err(flat(ours_model), start) > 1e-3  # the run really moved


# ---------------------------------------------------------------- GEAR-SAM vs a float64 re-computation of Alg. 1
def _paper_blocks(model):
    """Coarse blocks of the tiny ResNet written out by hand (independent of gearsam_fused.partition)."""
    prefixes = [
        ("stem", ("conv1.", "bn1.")),
        ("layer1", ("layer1.",)),
        ("layer2", ("layer2.",)),
        ("classifier", ("fc.",)),
    ]
    named = list(model.named_parameters())
    return [[p for n, p in named if n.startswith(pre)] for _, pre in prefixes], [name for name, _ in prefixes]


def _gear_sam_float64(model, data, rho, beta, delta, lr, momentum, weight_decay, adaptive, eta):
    """Algorithm 1 with SGD (momentum, weight decay) over whole float64 vectors; yields the weights after each step."""
    blocks, _ = _paper_blocks(model)
    params = [p for b in blocks for p in b]
    sizes = [sum(p.numel() for p in b) for b in blocks]
    s = torch.zeros(len(blocks), dtype=torch.float64)
    buf = None

    w = torch.nn.utils.parameters_to_vector(params).detach().clone()
    for xy in data:
        g = grad_at(model, params, w, xy)
        t = w.abs() + eta if adaptive else torch.ones_like(w)
        e = (
            torch.stack([((t * g) ** 2).sum() for t, g in zip(t.split(sizes), g.split(sizes))])
            if adaptive
            else torch.stack([(gb**2).sum() for gb in g.split(sizes)])
        )
        s = beta * s + (1 - beta) * e
        r = rho * s / torch.sqrt((s**2).sum()) if (s > 0).any() else torch.zeros_like(s)
        eps = torch.cat(
            [
                r[b] * (tb**2) * gb / (torch.sqrt(e[b]) + delta)
                for b, (tb, gb) in enumerate(zip(t.split(sizes), g.split(sizes)))
            ]
        )
        G = grad_at(model, params, w + eps, xy)
        d = G + weight_decay * w
        buf = d.clone() if buf is None else momentum * buf + d
        w = w - lr * buf
        yield w


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("adaptive,eta", [(False, 0.0), (True, 0.01)], ids=["gear", "gear-asam"])
def test_gearsam_equals_float64_algorithm(adaptive, eta, backend, device):
    model = tiny_resnet(dtype=torch.float64)
    twin = copy.deepcopy(model)
    model.to(device)
    hp = dict(rho=0.1, beta=0.9, delta=1e-12)
    opt = GEARSAM(model, torch.optim.SGD, backend=backend, adaptive=adaptive, eta=eta, **hp, **SGD_KW)
    assert opt.block_names == _paper_blocks(twin)[1]
    data = batches(STEPS, dtype=torch.float64)
    expected = _gear_sam_float64(twin, data, **hp, **SGD_KW, adaptive=adaptive, eta=eta)
    for (x, y), w in zip(data, expected):
        sam_step(opt, model, (x.to(device), y.to(device)))
        assert rel_err(flat(model).cpu(), w) <= FP64_STEP_RTOL


# ---------------------------------------------------------------------------------------- paper identities
def _perturbation(opt, model, xy):
    """eps actually applied by first_step (then restored by second_step)."""
    before = flat(model)
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)
    eps = flat(model) - before
    loss_fn(model, xy).backward()
    opt.second_step(zero_grad=True)
    return eps


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_budget_is_preserved_and_perturbation_within_radius(cls, backend, device):
    model = tiny_resnet(device=device)
    opt = cls(model, torch.optim.SGD, rho=0.07, backend=backend, **SGD_KW)
    assert len(opt.block_names) == 4
    for xy in batches(5, device=device):
        eps = _perturbation(opt, model, xy)
        stats = opt.block_stats()
        assert math.isclose(stats["radius"].square().sum().item(), 0.07**2, rel_tol=1e-12)  # Prop. 1 / Obs. 1
        assert math.isclose(stats["share"].sum().item(), 1.0, rel_tol=1e-12)
        assert (stats["radius"] > 0).all()
        # ||eps|| <= rho, and equals it up to float32 rounding when delta is negligible
        assert 0.07 * (1 - 1e-5) <= eps.norm().item() <= 0.07 * (1 + 1e-6)


@pytest.mark.parametrize("backend,device", ALL)
def test_zero_scores_mean_zero_perturbation(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.first_step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    stats = opt.block_stats()
    assert torch.equal(stats["radius"], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(stats["score"], torch.zeros(4, dtype=torch.float64))
    opt.second_step()


@pytest.mark.parametrize("backend,device", ALL)
def test_block_with_zero_gradient_gets_no_perturbation_but_keeps_its_history(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    sam_step(opt, model, batches(1, device=device)[0])
    xy = batches(1, seed=7, device=device)[0]
    loss_fn(model, xy).backward()
    for p in model.layer1.parameters():
        p.grad.zero_()
    layer1_before = [p.detach().clone() for p in model.layer1.parameters()]
    opt.first_step()
    assert all(torch.equal(a, p) for a, p in zip(layer1_before, model.layer1.parameters()))
    stats = opt.block_stats()
    assert stats["energy"][1] == 0 and stats["radius"][1] > 0  # the EMA still allots it a radius
    opt.second_step()


@pytest.mark.parametrize("backend,device", ALL)
def test_global_partition_gearsam_is_sam(backend, device):
    a, b = tiny_resnet(device=device), tiny_resnet(device=device)
    sam = SAM(a.parameters(), torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    gear = GEARSAM(b, torch.optim.SGD, partition="global", rho=0.05, beta=0.9, backend=backend, **SGD_KW)
    for xy in batches(STEPS, device=device):
        sam_step(sam, a, xy)
        sam_step(gear, b, xy)
        assert torch.equal(flat(a), flat(b))


def test_radii_invariant_to_common_rescaling_of_scores():
    g = torch.Generator().manual_seed(0)
    energy = torch.rand(6, generator=g, dtype=torch.float64)
    ema = torch.rand(6, generator=g, dtype=torch.float64)
    _, radius = gear_allocate(energy, ema.clone(), rho=0.3, beta=0.8, delta=1e-12)
    for c in (1e-8, 3.0, 1e6):
        _, scaled = gear_allocate(c * energy, c * ema, rho=0.3, beta=0.8, delta=1e-12)
        torch.testing.assert_close(scaled, radius, rtol=1e-14, atol=0)
    _, sam_radius = sam_allocate(energy, 0.3, 1e-12)
    _, sam_scaled = sam_allocate(1e4 * energy, 0.3, 1e-12)
    torch.testing.assert_close(sam_scaled, sam_radius, rtol=1e-14, atol=0)


def test_radii_invariant_to_loss_scaling_through_the_optimizer():
    radii = []
    for scale in (1.0, 1024.0):
        model = tiny_resnet()
        opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
        for xy in batches(3):
            (scale * loss_fn(model, xy)).backward()
            opt.first_step(zero_grad=True)
            loss_fn(model, xy).backward()
            opt.second_step(zero_grad=True)
        radii.append(opt.block_stats()["radius"])
    torch.testing.assert_close(radii[1], radii[0], rtol=1e-5, atol=0)


def test_allocation_formulas():
    energy = torch.tensor([4.0, 0.0, 9.0], dtype=torch.float64)
    ema = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    scale, radius = gear_allocate(energy, ema, rho=2.0, beta=0.5, delta=1e-12)
    torch.testing.assert_close(ema, torch.tensor([2.5, 1.0, 4.5], dtype=torch.float64))
    expected_r = 2.0 * ema / ema.norm()
    torch.testing.assert_close(radius, expected_r, rtol=1e-15, atol=0)
    torch.testing.assert_close(scale, expected_r / (energy.sqrt() + 1e-12), rtol=1e-15, atol=0)
    scale, radius = sam_allocate(energy, rho=2.0, delta=1e-12)
    torch.testing.assert_close(scale, torch.full((3,), 2.0 / (13**0.5 + 1e-12), dtype=torch.float64))
    torch.testing.assert_close(radius, 2.0 * energy.sqrt() / 13**0.5)
    zero_scale, zero_radius = sam_allocate(torch.zeros(3, dtype=torch.float64), 2.0, 1e-12)
    assert torch.equal(zero_radius, torch.zeros(3, dtype=torch.float64)) and torch.isfinite(zero_scale).all()


# -------------------------------------------------------------------------------------- API behaviour
@pytest.mark.parametrize("backend,device", ALL)
def test_restore_is_bitwise_and_parameters_without_grad_are_untouched(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, batches(1, device=device)[0]).backward()
    model.fc.bias.grad = None
    opt.first_step()
    assert torch.equal(model.fc.bias, before[-1])
    assert not torch.equal(model.conv1.weight, before[0])
    opt.backend.restore_()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_closure_step_equals_two_pass_step(twin):
    a, b = twin
    opt_a = GEARSAM(a, torch.optim.SGD, rho=0.05, **SGD_KW)
    opt_b = GEARSAM(b, torch.optim.SGD, rho=0.05, **SGD_KW)
    for xy in batches(5):
        sam_step(opt_a, a, xy)

        def closure():
            loss = loss_fn(b, xy)
            loss.backward()
            return loss

        loss_fn(b, xy).backward()
        loss = opt_b.step(closure)
        opt_b.zero_grad()
        assert loss.ndim == 0 and torch.isfinite(loss)
        assert torch.equal(flat(a), flat(b))


def test_param_groups_are_shared_and_lr_scheduler_works_without_warnings():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
    assert opt.param_groups is opt.base_optimizer.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xy in batches(4):
            sam_step(opt, model, xy)
            sched.step()
    assert opt.base_optimizer.param_groups[0]["lr"] == pytest.approx(0.0025)


def test_param_groups_dicts_and_module_params():
    model = tiny_resnet()
    groups = [
        {"params": model.fc.parameters(), "lr": 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("fc")]},
    ]
    opt = GEARSAM(groups, torch.optim.SGD, model=model, rho=0.05, lr=0.01)
    assert opt.block_names == ["stem", "layer1", "layer2", "classifier"]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    # a model with parameters the optimizer does not own: blocks keep only the owned ones, empty blocks are dropped,
    # and a single block (GEAR-SAM = SAM) is pointed out
    with pytest.warns(UserWarning, match=r"partition 'coarse' gives a single block \('classifier'\), so GEAR-SAM's "
                                         r"allocation is plain SAM's here; pass partition= a finer strategy"):  # fmt: skip
        head_only = GEARSAM(model.fc.parameters(), torch.optim.SGD, model=model, lr=0.1)
    assert head_only.block_names == ["classifier"] and len(head_only.blocks[0].params) == 2
    sam_step(head_only, model, batches(1)[0])
    assert head_only.block_stats()["share"][0] == pytest.approx(1.0)


@pytest.mark.parametrize("backend,device", ALL)
def test_state_dict_round_trip_continues_bitwise(backend, device):
    data = batches(12, device=device)
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
    for xy in data[:6]:
        sam_step(opt, model, xy)
        sched.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    for xy in data[6:]:
        sam_step(opt, model, xy)
        sched.step()

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = tiny_resnet(seed=123, device=device)
    resumed.load_state_dict(saved["model"])
    opt2 = GEARSAM(resumed, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=12)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert torch.equal(opt2.block_stats()["score"], saved["opt"]["param_groups"][0]["gearsam"]["ema"].cpu())
    for xy in data[6:]:
        sam_step(opt2, resumed, xy)
        sched2.step()
    assert torch.equal(flat(resumed), flat(model))
    assert torch.equal(opt2.block_stats()["score"], opt.block_stats()["score"])


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rho=-0.1), r"rho must lie in \[0.0, inf\)"),
        (dict(rho=float("nan")), "rho must be a finite real number"),
        (dict(beta=1.0), r"beta must lie in \[0.0, 1.0\)"),
        (dict(beta=-0.5), r"beta must lie in \[0.0, 1.0\)"),
        (dict(delta=0.0), r"delta must lie in \(0.0, inf\)"),
        (dict(delta=-1e-3), r"delta must lie in \(0.0, inf\)"),
        (dict(eta=-0.01), r"eta must lie in \[0.0, inf\)"),
        (dict(partition="layers"), "unknown partition strategy 'layers'"),
        (dict(backend="cuda-magic"), "unknown backend 'cuda-magic'"),
    ],
)
def test_bad_hyperparameters_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GEARSAM(tiny_resnet(), torch.optim.SGD, lr=0.1, **kwargs)


def test_partition_errors_through_the_optimizer():
    model = tiny_resnet()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="needs the model"):
        GEARSAM(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="two partition blocks"):
        GEARSAM(params, torch.optim.SGD, partition={"a": params[:2], "b": params[1:]}, lr=0.1)
    with pytest.raises(
        ValueError, match=r"'fc.bias' \(shape \(3,\)\) is optimized but in no block of the partition mapping"
    ):
        GEARSAM(model, torch.optim.SGD, partition={"a": params[:-1]}, lr=0.1)
    with pytest.raises(ValueError, match="empty partition"):
        GEARSAM(params, torch.optim.SGD, partition={}, lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer's params"):
        GEARSAM(params[:-1], torch.optim.SGD, model=model, partition={"all": params}, lr=0.1)
    # without a model, a parameter is named by its place in the param groups, in block names as in messages
    assert GEARSAM(params, torch.optim.SGD, partition="tensor", lr=0.1).block_names[0] == "param_groups[0]['params'][0]"


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("replace", ["assign", "meta"])
def test_parameters_replaced_after_construction_are_named_when_no_gradient_is_found(backend, replace):
    """``model.load_state_dict(sd, assign=True)`` or ``model.to("meta")`` after the optimizer was built: the backward
    gives its gradients to the new tensors, and the optimizer says so rather than "call loss.backward()"; built on
    the parameters alone (no model), it cannot tell, and says the usual."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = SAM(model, torch.optim.SGD, rho=0.05, lr=0.1, backend=backend)
    alone = SAM(list(model.parameters()), torch.optim.SGD, rho=0.05, lr=0.1, backend="reference")
    if replace == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    else:
        model.to("meta")
    model(torch.randn(5, 4, device=model[0].weight.device)).sum().backward()
    with pytest.raises(RuntimeError, match=r"model's parameters are no longer the ones it was built with: 4 of them "
                       r"were replaced \(first '0.weight'\).*assign=False"):  # fmt: skip
        opt.first_step()
    with pytest.raises(RuntimeError, match=r"found no gradients: call loss.backward\(\) before first_step\(\)"):
        alone.first_step()


def test_sparse_gradients_raise_type_error():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = SAM(emb.parameters(), torch.optim.SGD, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradients"):
        opt.first_step()


def test_misuse_raises_clear_errors():
    model = tiny_resnet()
    with pytest.raises(TypeError, match="optimizer class"):
        SAM(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="different module"):
        GEARSAM(model, torch.optim.SGD, model=tiny_resnet(), lr=0.1)
    with pytest.raises(TypeError, match="adaptive must be a bool"):
        SAM(model.parameters(), torch.optim.SGD, adaptive="yes", lr=0.1)
    opt = GEARSAM(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="no gradients: call loss.backward"):
        opt.first_step()
    with pytest.raises(RuntimeError, match="needs a closure"):
        opt.step()
    with pytest.raises(RuntimeError, match="without a preceding first_step"):
        opt.second_step()
    loss_fn(model, batches(1)[0]).backward()
    opt.first_step()
    with pytest.raises(RuntimeError, match="called twice"):
        opt.first_step()
    with pytest.raises(RuntimeError, match="between first_step"):
        opt.state_dict()
    opt.second_step()
    with pytest.raises(NotImplementedError, match="every parameter group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    opt.param_groups[0]["rho"] = -1.0
    with pytest.raises(ValueError, match="rho must lie"):
        opt.first_step()


def test_groups_must_share_rho():
    model = tiny_resnet()
    groups = [
        {"params": model.fc.parameters(), "rho": 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("fc")]},
    ]
    opt = GEARSAM(groups, torch.optim.SGD, model=model, rho=0.05, lr=0.1)
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(ValueError, match="share one rho"):
        opt.first_step()


def test_load_state_dict_refuses_foreign_states():
    model = tiny_resnet()
    gear = GEARSAM(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(
        ValueError, match=r"param group 0 lacks \['dampening', 'momentum', 'nesterov'\]: it was not saved by SGD"
    ):
        gear.load_state_dict(torch.optim.Adam(model.parameters(), lr=0.1).state_dict())
    with pytest.raises(ValueError, match="saved by SAM"):
        gear.load_state_dict(SAM(model, torch.optim.SGD, lr=0.1).state_dict())
    per_tensor = GEARSAM(model, torch.optim.SGD, partition="tensor", lr=0.1)
    with pytest.raises(ValueError, match="differ from this optimizer's blocks"):
        per_tensor.load_state_dict(gear.state_dict())


@pytest.mark.parametrize("backend,device", [c for c in ALL if c.values[1] == "cpu"])
def test_init_state_creates_the_state_a_checkpoint_loads_into_and_moves_nothing(backend, device):
    """For loading in place (torch.distributed.checkpoint): the base optimizer's state exists afterwards, no parameter
    moved (AdamW with weight decay would move them at any learning rate but 0), the learning rates are back, and the
    saved state loaded over it continues exactly as the run that saved it."""
    model, data = tiny_resnet(), batches(4)
    opt = GEARSAM(model, torch.optim.AdamW, rho=0.05, backend=backend, lr=1e-2, weight_decay=0.1)
    for xy in data[:2]:
        sam_step(opt, model, xy)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    fresh = tiny_resnet(seed=1)
    fresh_opt = GEARSAM(fresh, torch.optim.AdamW, rho=0.05, backend=backend, lr=1e-2, weight_decay=0.1)
    with pytest.raises(RuntimeError, match="call init_state"):
        fresh_opt.step()
    before = flat(fresh)
    fresh_opt.init_state()
    assert torch.equal(flat(fresh), before) and all(p.grad is None for p in fresh.parameters())
    assert len(fresh_opt.state) == len(list(fresh.parameters())) and fresh_opt.param_groups[0]["lr"] == 1e-2
    fresh_opt.init_state()  # the state exists: nothing to do
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved)
    for xy in data[2:]:
        sam_step(opt, model, xy)
        sam_step(fresh_opt, fresh, xy)
    assert torch.equal(flat(fresh), flat(model))


def test_init_state_refuses_an_optimizer_in_use():
    model = tiny_resnet()
    opt = SAM(model, torch.optim.AdamW, lr=1e-2)
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"init_state\(\) belongs to a fresh optimizer"):
        opt.init_state()


@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_the_state_is_tagged_with_the_rule_and_refused_by_the_other_class(cls):
    """The state-dict tag, in the first param group, is the rule; the other rule's state is refused, naming both."""
    torch.manual_seed(0)
    model = tiny_resnet()
    opt = cls(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    sam_step(opt, model, batches(1)[0])
    state = opt.state_dict()
    assert state["param_groups"][0]["gearsam"]["rule"] == cls.rule == {SAM: "sam", GEARSAM: "gear-sam"}[cls]
    other = GEARSAM if cls is SAM else SAM
    with pytest.raises(ValueError, match=f"saved by {cls.__name__}, cannot load it into {other.__name__}"):
        other(model, torch.optim.SGD, lr=0.1).load_state_dict(copy.deepcopy(state))


@pytest.mark.parametrize("backend,device", ALL)
def test_perturbed_is_one_state_and_guards_the_state_dict(backend, device):
    model = tiny_resnet(device=device)
    opt = GEARSAM(model, torch.optim.SGD, lr=0.1, backend=backend)
    saved = opt.state_dict()
    xy = batches(1, device=device)[0]
    loss_fn(model, xy).backward()
    opt.first_step(zero_grad=True)
    assert opt.perturbed and opt.backend.perturbed
    for call in (opt.state_dict, lambda: opt.load_state_dict(saved)):
        with pytest.raises(RuntimeError, match="between first_step\\(\\) and second_step\\(\\)"):
            call()
    loss_fn(model, xy).backward()
    opt.second_step()
    assert not opt.perturbed and not opt.backend.perturbed
    opt.load_state_dict(saved)


def test_step_statistics_are_the_optimizers_own_tensors():
    """No copy (telemetry records them without a synchronisation), and block_stats() describes the same numbers."""
    torch.manual_seed(0)
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, lr=0.1, rho=0.07)
    sam_step(opt, model, batches(1)[0])
    stats = opt.step_statistics
    assert stats.ema is opt.step_statistics.ema and stats.rho == 0.07
    assert all(t.dtype == torch.float64 and t.shape == (len(opt.blocks),) for t in stats[:3])
    described = opt.block_stats()
    for key, name in (("energy", "energy"), ("score", "ema"), ("radius", "radius")):
        assert torch.equal(described[key], getattr(stats, name).cpu())
    assert isinstance(opt, gearsam_fused.SharpnessAware) and gearsam_fused.OPTIMIZERS[opt.rule] is GEARSAM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_reference_precision_contract(dtype):
    """Energies in float64 from the stored gradients; eps formed in float32 (float64 for float64) and rounded once."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    opt = GEARSAM(layers, torch.optim.SGD, partition="tensor", rho=0.1, lr=0.0, backend="reference")
    layers(torch.randn(4, 7, dtype=dtype)).square().sum().backward()
    weights = [p.detach().clone() for p in layers.parameters()]
    grads = [p.grad.clone() for p in layers.parameters()]
    opt.first_step()
    stats = opt.block_stats()
    torch.testing.assert_close(
        stats["energy"], torch.stack([g.double().square().sum() for g in grads]), rtol=1e-15, atol=0
    )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    scale = (stats["radius"] / (stats["energy"].sqrt() + 1e-12)).to(compute)
    for b, (p, w, g) in enumerate(zip(layers.parameters(), weights, grads)):
        assert p.dtype == dtype
        assert torch.equal(p, (w.to(compute) + g.to(compute) * scale[b]).to(dtype))
    opt.second_step()  # lr = 0: what remains is the restore, which must be exact in every dtype
    assert all(torch.equal(p, w) for p, w in zip(layers.parameters(), weights))


# ------------------------------------------------------------------------------------------- what users run into
SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=3),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, 5),
        ],
        milestones=[3],
    ),
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("base,kwargs", [(torch.optim.SGD, dict(lr=0.05)), (torch.optim.AdamW, dict(lr=1e-3))],
                         ids=["SGD-without-momentum", "AdamW"])  # fmt: skip
def test_schedulers_drive_the_wrapper_as_they_drive_the_base_optimizer(scheduler, base, kwargs):
    """The wrapper's defaults are the base optimizer's (plus rho): schedulers that cycle momentum find it there."""
    sequences = []
    for wrapped in (True, False):
        model = tiny_resnet()
        groups = [{"params": model.fc.parameters(), "weight_decay": 0.0}, {"params": list(model.parameters())[:-2]}]
        opt = GEARSAM(groups, base, model=model, **kwargs) if wrapped else base(groups, **kwargs)
        sched = SCHEDULERS[scheduler](opt)
        seen = []
        for xy in batches(8):
            if wrapped:
                sam_step(opt, model, xy)
            else:
                loss_fn(model, xy).backward()
                opt.step()
                opt.zero_grad()
            sched.step(1.0) if scheduler == "ReduceLROnPlateau" else sched.step()
            seen.append([(g["lr"], g.get("momentum"), g.get("betas")) for g in opt.param_groups])
        sequences.append(seen)
    assert sequences[0] == sequences[1]
    assert len({tuple(s) for s in sequences[0]}) > 1  # the schedule really moved


@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_parameters_outside_the_model_have_a_block_of_their_own(cls):
    model = tiny_resnet()
    temperature = nn.Parameter(torch.tensor(1.5))
    opt = cls([{"params": model.parameters()}, {"params": [temperature], "lr": 0.01}], torch.optim.SGD, model=model,
              rho=0.05, lr=0.1)  # fmt: skip
    assert opt.block_names == ["stem", "layer1", "layer2", "classifier", "other"]
    assert opt.blocks[-1].params == [temperature] and opt.blocks[-1].param_names == ["param_groups[1]['params'][0]"]
    assert "other" in format_partition(opt.blocks)
    xy = batches(1)[0]
    (loss_fn(model, xy) * temperature).backward()
    before = temperature.detach().clone()
    opt.first_step(zero_grad=True)
    assert temperature != before  # perturbed with the rest
    (loss_fn(model, xy) * temperature).backward()
    opt.second_step()
    assert opt.block_stats()["radius"][-1] > 0


def test_a_mapping_that_misses_a_parameter_names_it():
    model = tiny_resnet()
    temperature = nn.Parameter(torch.tensor(1.5))
    groups = [{"params": model.parameters()}, {"params": [temperature]}]
    with pytest.raises(ValueError, match=r"parameter param_groups\[1\]\['params'\]\[0\] \(shape \(\)\) is optimized "
                                         r"but in no block of the partition mapping; add it to a block"):  # fmt: skip
        GEARSAM(groups, torch.optim.SGD, model=model, partition={"all": model.parameters()}, lr=0.1)
    opt = GEARSAM(
        groups, torch.optim.SGD, model=model, partition={"net": model.parameters(), "t": [temperature]}, lr=0.1
    )
    assert opt.block_names == ["net", "t"]


def test_a_single_gear_block_is_pointed_out():
    unit = nn.Sequential(nn.Linear(4, 2), nn.LayerNorm(2))  # one parametered unit: a layer and its norm
    with pytest.warns(UserWarning, match=r"partition 'coarse' gives a single block \('model'\), so GEAR-SAM's "
                                         r"allocation is plain SAM's here; pass partition= a finer strategy.*`gearsam "
                                         r"partition`"):  # fmt: skip
        GEARSAM(unit, torch.optim.SGD, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for, or not GEAR-SAM: nothing to point out
        GEARSAM(unit, torch.optim.SGD, partition="global", lr=0.1)
        GEARSAM(unit, torch.optim.SGD, partition="tensor", lr=0.1)
        SAM(unit, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, lambda opt: __import__("pickle").dumps(opt)],
                         ids=["copy", "deepcopy", "pickle"])  # fmt: skip
def test_copying_or_pickling_refuses_at_once_and_points_to_state_dict(copier):
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"GEARSAM cannot be pickled or copied: it owns the memory of the model's "
                                        r"parameters. Save opt.state_dict\(\)"):  # fmt: skip
        copier(opt)
    sam_step(opt, model, batches(1)[0])  # the original is untouched


@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_a_saved_head_is_compact(backend):
    model = tiny_resnet()
    GEARSAM(model, torch.optim.SGD, backend=backend, lr=0.1)
    head = model.fc.state_dict()
    buffer = io.BytesIO()
    torch.save(compact_state_dict(head), buffer)
    head_bytes = sum(t.nbytes for t in head.values())
    assert buffer.tell() < head_bytes + 2048  # the head's own numbers and the file's framing, not the flat buffer
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert list(loaded) == list(head) and all(torch.equal(loaded[k], head[k]) for k in head)
    assert loaded._metadata == head._metadata
    fresh = tiny_resnet(seed=3)
    fresh.fc.load_state_dict(loaded)
    assert torch.equal(fresh.fc.weight, model.fc.weight)

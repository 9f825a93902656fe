"""Switching a run to SAM or GEAR-SAM: a plain torch optimizer's state dict loads, and the run continues exactly as a
hand-written two-pass loop continued from the same plain state."""

import copy
import warnings

import pytest
import torch

from gearsam_fused import GEARSAM, SAM

from conftest import FP32_STEP_RTOL, batches, flat, loss_fn, rel_err, sam_step, tiny_resnet

BASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=5e-4)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-4)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
}
RHO, BETA, DELTA = 0.05, 0.9, 1e-12
WARMUP, STEPS = 3, 4


def warm_up(base: str):
    """A model and its plain optimizer's state dict after a few plain steps."""
    cls, kw = BASES[base]
    model = tiny_resnet()
    plain = cls(model.parameters(), **kw)
    for xy in batches(WARMUP, seed=7):
        loss_fn(model, xy).backward()
        plain.step()
        plain.zero_grad()
    return model, copy.deepcopy(plain.state_dict())


@torch.no_grad()
def hand_written_step(model, plain, blocks, ema, xy, gear: bool) -> None:
    """One SAM or GEAR-SAM step by hand, per tensor: energies in float64, the perturbation formed in float32."""
    with torch.enable_grad():
        loss_fn(model, xy).backward()
    energy = torch.stack([sum(p.grad.double().square().sum() for p in block) for block in blocks])
    if gear:
        ema.mul_(BETA).add_((1 - BETA) * energy)
        radius = RHO * ema / ema.norm()
        scale = radius / (energy.sqrt() + DELTA)
    else:
        scale = torch.full_like(energy, RHO / (energy.sum().sqrt().item() + DELTA))
    saved = [p.clone() for p in model.parameters()]
    for block, s in zip(blocks, scale):
        for p in block:
            p.add_(p.grad * s.float())
    model.zero_grad()
    with torch.enable_grad():
        loss_fn(model, xy).backward()
    for p, w in zip(model.parameters(), saved):
        p.copy_(w)
    plain.step()
    plain.zero_grad()


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("base_step", ["fused", "per-tensor"])
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
def test_a_plain_checkpoint_continues_as_the_hand_written_loop(cls, base_step, base):
    base_cls, kw = BASES[base]
    warm, saved = warm_up(base)
    model = copy.deepcopy(warm)
    opt = cls(model, base_cls, rho=RHO, backend="torch", base_step=base_step, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(copy.deepcopy(saved))  # torch's loading keeps the dict's tensors: no sharing between runs
    said = [str(w.message) for w in caught]
    if cls is GEARSAM:
        assert len(said) == 1 and "EMA of block energies starts at zero" in said[0]
        assert opt.block_stats()["score"].eq(0).all()
    else:
        assert said == []
    assert all(group["rho"] == RHO for group in opt.param_groups)

    hand = copy.deepcopy(warm)
    plain = base_cls(hand.parameters(), foreach=False, **kw)
    plain.load_state_dict(copy.deepcopy(saved))
    names = dict(hand.named_parameters())
    blocks = [[names[n] for n in block.param_names] for block in opt.blocks]
    ema = torch.zeros(len(blocks), dtype=torch.float64)
    untaken = copy.deepcopy(warm)  # the same SAM run from a fresh base state: what not loading would give
    fresh = cls(untaken, base_cls, rho=RHO, backend="torch", base_step=base_step, **kw)
    for xy in batches(STEPS, seed=11):
        sam_step(opt, model, xy)
        sam_step(fresh, untaken, xy)
        hand_written_step(hand, plain, blocks, ema, xy, gear=cls is GEARSAM)
        assert rel_err(flat(model), flat(hand)) <= FP32_STEP_RTOL
    assert opt.base_step_mode == base_step
    assert rel_err(flat(untaken), flat(hand)) > 100 * FP32_STEP_RTOL  # the loaded state matters to the outcome
    if cls is GEARSAM:
        assert torch.allclose(opt.block_stats()["score"], ema, rtol=FP32_STEP_RTOL, atol=0)


def test_a_plain_state_of_another_optimizer_is_refused_by_name():
    model, saved = warm_up("sgd")
    opt = SAM(model, torch.optim.AdamW, lr=1e-3)
    with pytest.raises(
        ValueError, match=r"param group 0 lacks \['amsgrad', 'betas', 'eps'\]: it was not saved by AdamW"
    ):
        opt.load_state_dict(saved)

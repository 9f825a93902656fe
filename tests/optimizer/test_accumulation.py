"""Gradient accumulation: k micro-batches in both passes (loss / k, one first_step after all k first backwards, one
second_step after all k second backwards) equal one large-batch step, by hand and through accumulated_step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.accumulation import accumulated_step
from gearsam_fused.amp import SAMScaler

from conftest import ALL, FP32_STEP_RTOL, SGD_KW, batches, flat, loss_fn, rel_err, sam_step, tiny_resnet

STEPS = 8
BATCH = 24


class NoNormCNN(nn.Module):
    """A CNN with no normalisation layer, so a micro-batch's gradient does not depend on the rest of the batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = F.silu(self.conv2(F.silu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


MODELS = {
    "no-norm": lambda device: NoNormCNN().to(device),
    "bn-eval": lambda device: tiny_resnet(device=device).eval(),  # BatchNorm with frozen statistics is per-example
}


def by_hand(opt, model, micro_batches, set_to_none):
    """The documented recipe, written out."""
    k = len(micro_batches)
    for mb in micro_batches:
        (loss_fn(model, mb) / k).backward()
    opt.first_step()
    opt.zero_grad(set_to_none=set_to_none)
    for mb in micro_batches:
        (loss_fn(model, mb) / k).backward()
    opt.second_step()
    opt.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("cls", [SAM, GEARSAM])
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "in-place"])
@pytest.mark.parametrize("how", ["by-hand", "helper"])
def test_micro_batches_equal_one_large_batch(backend, device, cls, arch, set_to_none, how):
    large, micro = MODELS[arch](device), MODELS[arch](device)
    kw = dict(rho=0.05, backend=backend, **SGD_KW)
    large_opt, micro_opt = cls(large, torch.optim.SGD, **kw), cls(micro, torch.optim.SGD, **kw)
    for step, (x, y) in enumerate(batches(STEPS, batch=BATCH, device=device)):
        k = (1, 3, 4)[step % 3]  # several splits, including the trivial one
        chunks = list(zip(x.chunk(k), y.chunk(k)))
        with torch.no_grad():
            loss_at_w = loss_fn(large, (x, y))  # no side effects: neither model updates running statistics
        sam_step(large_opt, large, (x, y))
        if how == "by-hand":
            by_hand(micro_opt, micro, chunks, set_to_none)
        else:
            loss = accumulated_step(micro_opt, lambda mb: loss_fn(micro, mb), chunks, set_to_none=set_to_none)
            assert not loss.requires_grad
            torch.testing.assert_close(loss, loss_at_w, rtol=1e-6, atol=0)  # the large batch's loss at w
        assert rel_err(flat(micro), flat(large)) <= FP32_STEP_RTOL
        energies = micro_opt.block_stats()["energy"], large_opt.block_stats()["energy"]
        torch.testing.assert_close(*energies, rtol=1e-5, atol=0)
    assert rel_err(flat(large), flat(MODELS[arch](device))) > 1e-3  # the run really moved


# ------------------------------------------------------------------------------------ the helper's options
def test_helper_freezes_batchnorm_in_the_second_pass_only():
    model = tiny_resnet()
    opt = GEARSAM(model, torch.optim.SGD, rho=0.05, **SGD_KW)
    x, y = batches(1, batch=BATCH)[0]
    chunks = list(zip(x.chunk(3), y.chunk(3)))
    first_pass_only = copy.deepcopy(model)
    for mb in chunks:
        loss_fn(first_pass_only, mb)
    accumulated_step(opt, lambda mb: loss_fn(model, mb), chunks, model=model)
    expected = first_pass_only.state_dict()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, expected[name]), name
    assert model.bn1.num_batches_tracked.item() == 3 and model.bn1.track_running_stats


@pytest.mark.parametrize("backend,device", ALL)
def test_helper_with_loss_scaling(backend, device):
    scaled_model, plain_model = NoNormCNN().to(device), NoNormCNN().to(device)
    scaled = GEARSAM(scaled_model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    plain = GEARSAM(plain_model, torch.optim.SGD, rho=0.05, backend=backend, **SGD_KW)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=1000)
    amp = SAMScaler(scaled, scaler)
    calls = []

    def scaled_loss(mb):
        calls.append(mb)
        return loss_fn(scaled_model, mb)

    for step, (x, y) in enumerate(batches(4, batch=BATCH, device=device)):
        chunks = list(zip(x.chunk(4), y.chunk(4)))
        if step == 2:  # an overflow in the first pass: the second pass is not even run, and the step is skipped
            chunks[1] = (chunks[1][0] * float("inf"), chunks[1][1])
        calls.clear()
        before = flat(scaled_model)
        accumulated_step(scaled, scaled_loss, chunks, amp=amp)
        scaler.update()
        if step == 2:
            assert amp.last.skipped and not amp.last.first_pass_finite and len(calls) == 4
            assert torch.equal(flat(scaled_model), before) and scaler.get_scale() == 2.0**15
            continue
        assert not amp.last.skipped and len(calls) == 8
        accumulated_step(plain, lambda mb: loss_fn(plain_model, mb), chunks)
        # power-of-two scales are exact, so the scaled run is the plain one bit for bit
        assert torch.equal(flat(scaled_model), flat(plain_model))


def test_helper_refuses_bad_input():
    model = NoNormCNN()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1)
    x, y = batches(1)[0]
    loss = lambda mb: loss_fn(model, mb)  # noqa: E731
    with pytest.raises(TypeError, match="optimizer must be a gearsam_fused SAM or GEARSAM, got SGD"):
        accumulated_step(torch.optim.SGD(model.parameters(), lr=0.1), loss, [(x, y)])
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        accumulated_step(opt, 3.0, [(x, y)])
    with pytest.raises(TypeError, match="micro_batches must be a list of micro-batches .* got Tensor"):
        accumulated_step(opt, loss, x)
    with pytest.raises(ValueError, match="micro_batches is empty"):
        accumulated_step(opt, loss, [])
    with pytest.raises(ValueError, match=r"for micro-batch 1 it returned Tensor\(16,\)"):
        unreduced = lambda mb: F.cross_entropy(model(mb[0]), mb[1], reduction=mb[2])  # noqa: E731
        accumulated_step(opt, unreduced, [(x, y, "mean"), (x, y, "none")])
    with pytest.raises(TypeError, match="amp must be a SAMScaler, got GradScaler"):
        accumulated_step(opt, loss, [(x, y)], amp=torch.amp.GradScaler("cpu"))
    other = SAMScaler(SAM(NoNormCNN().parameters(), torch.optim.SGD, lr=0.1), torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="amp wraps a different optimizer"):
        accumulated_step(opt, loss, [(x, y)], amp=other)
    with pytest.raises(TypeError, match="model must be an nn.Module .* got list"):
        accumulated_step(opt, loss, [(x, y)], model=[model])

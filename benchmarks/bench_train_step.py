"""End-to-end training step of a CIFAR ResNet-18 on synthetic data, and the "SAM tax".

Contenders, each a whole step (forward, backward, optimizer) on the same model, batch and base optimizer (SGD with
momentum and weight decay):

* ``SGD``                  one forward/backward pass and the SGD step: what SAM is compared against
* ``per-tensor loop SAM``  :class:`contenders.PerTensorLoopSAM` with SGD
* ``pytorch_optimizer``    ``pytorch_optimizer.SAM`` with SGD (skipped with a note when it is not installed)
* ``SAM``, ``GEAR-SAM``    gearsam_fused, ``backend="auto"``, ``zero_grad(set_to_none=False)``

Two more rows time the parts: ``forward+backward`` alone and the ``base step`` alone. Then

    SAM tax = SAM step - 2 x (forward+backward) - base step

is what the SAM machinery adds to a step. Batch 128 at full width on CUDA (bf16 autocast, channels_last); on CPU the
network is narrower (width 16) and the batch 32, so a run stays within minutes; quick mode shrinks both further.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.models import resnet18

import contenders
from conftest import DEVICE, synchronize, warm_up

SGD_KW = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
ROWS = ["forward+backward", "base step", "SGD", "per-tensor loop SAM", "pytorch_optimizer", "SAM", "GEAR-SAM"]


def _setting(quick: bool) -> dict:
    if DEVICE == "cuda":
        return {"width": 64, "batch": 128, "channels_last": True, "autocast": torch.bfloat16}
    return {"width": 8 if quick else 16, "batch": 8 if quick else 32, "channels_last": False, "autocast": None}


def _problem(quick: bool):
    s = _setting(quick)
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=s["width"]).to(DEVICE)
    x = torch.randn(s["batch"], 3, 32, 32, device=DEVICE)
    y = torch.randint(0, 10, (s["batch"],), device=DEVICE)
    if s["channels_last"]:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    autocast = torch.autocast(DEVICE, dtype=s["autocast"]) if s["autocast"] is not None else contextlib.nullcontext()
    return s, model, x, y, autocast


def _step_function(name: str, model, x, y, autocast):
    def forward_backward():
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    if name == "forward+backward":
        return forward_backward
    sgd = torch.optim.SGD(model.parameters(), **SGD_KW) if name in ("base step", "SGD") else None
    if name == "base step":
        forward_backward()  # momentum buffers and gradients exist; the step alone is timed
        return sgd.step
    if name == "SGD":

        def step():
            sgd.zero_grad(set_to_none=False)
            forward_backward()
            sgd.step()

        return step
    if name == "per-tensor loop SAM":
        opt = contenders.PerTensorLoopSAM(model.parameters(), lambda params: torch.optim.SGD(params, **SGD_KW))
        holder = model  # the loop keeps no gradient buffers: the model's own gradients are zeroed
    elif name == "pytorch_optimizer":
        import pytorch_optimizer as peer

        opt = holder = peer.SAM(model.parameters(), torch.optim.SGD, rho=0.05, **SGD_KW)
    else:
        cls = SAM if name == "SAM" else GEARSAM
        opt = holder = cls(model, torch.optim.SGD, rho=0.05, **SGD_KW)

    def sam_step():
        holder.zero_grad(set_to_none=False)
        forward_backward()
        opt.first_step()
        holder.zero_grad(set_to_none=False)
        forward_backward()
        opt.second_step()

    return sam_step


@pytest.mark.parametrize("name", ROWS)
def test_train_step(benchmark, record, quick, name):
    missing = contenders.not_installed()
    if name in missing:
        pytest.skip(missing[name])
    setting, model, x, y, autocast = _problem(quick)
    step = _step_function(name, model, x, y, autocast)

    def synchronised_step():
        step()
        synchronize()

    warm_up(synchronised_step)
    benchmark.group = f"train step, CIFAR ResNet-18 width {setting['width']}, batch {setting['batch']}, {DEVICE}"
    benchmark.pedantic(synchronised_step, rounds=3 if quick else (30 if DEVICE == "cuda" else 15), iterations=1)
    fields = dict(contender=name, **{k: str(v) if k == "autocast" else v for k, v in setting.items()})
    benchmark.extra_info.update(fields)
    record(**fields)

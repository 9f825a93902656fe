"""Lightning with automatic optimization and SAM, ASAM or GEAR-SAM
(:class:`gearsam_fused.integrations.lightning.SharpnessAwareMixin`): a fit equals the manual two-pass loop over the
same micro-batches, with and without gradient accumulation and clipping, for a tiny GPT-2 and a small CNN with
BatchNorm; a fit resumed from a checkpoint equals the uninterrupted one; the blocks' shares are logged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from gearsam_fused import GEARSAM, SAM, frozen_bn_stats  # noqa: E402
from gearsam_fused.integrations.lightning import SharpnessAwareMixin  # noqa: E402
from gearsam_fused.models import resnet18  # noqa: E402

from conftest import FP32_STEP_RTOL, flat, rel_err  # noqa: E402

STEPS = 6


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU())
        self.stage = nn.Sequential(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.stage(self.stem(x)).mean((2, 3)))


def batches(kind: str, n: int) -> list:
    g = torch.Generator().manual_seed(3)
    if kind == "gpt2":
        ids = torch.randint(0, 64, (n, 2, 12), generator=g)
        return [{"input_ids": i, "labels": i} for i in ids]
    return [(torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 4, (2,), generator=g)) for _ in range(n)]


def loss_of(kind: str, net: nn.Module, batch) -> torch.Tensor:
    if kind == "gpt2":
        return net(**batch).loss
    x, y = batch
    return nn.functional.cross_entropy(net(x), y)


def make_optimizer(net: nn.Module, sam: str):
    kw = dict(rho=0.05, lr=1e-2, weight_decay=0.01)
    if sam == "gear-sam":
        return GEARSAM(net, torch.optim.AdamW, beta=0.9, **kw)
    return SAM(net, torch.optim.AdamW, adaptive=sam == "asam", eta=0.01 if sam == "asam" else 0.0, **kw)


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 0.2 * step))


class Module(SharpnessAwareMixin, L.LightningModule):
    def __init__(self, kind: str, sam: str):
        super().__init__()
        self.kind, self.sam = kind, sam
        self.net = gpt2() if kind == "gpt2" else CNN()

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.kind, self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = make_optimizer(self.net, self.sam)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}


def trainer(**kw) -> L.Trainer:
    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    return L.Trainer(**{**common, **kw})


def manual(kind: str, sam: str, data: list, acc: int, clip: float, steps: int = STEPS) -> nn.Module:
    net = gpt2() if kind == "gpt2" else CNN()
    opt = make_optimizer(net, sam)
    sched = schedule(opt)
    for step in range(steps):
        window = data[step * acc : (step + 1) * acc]
        for batch in window:
            (loss_of(kind, net, batch) / acc).backward()
        opt.first_step(zero_grad=True)
        with frozen_bn_stats(net):
            for batch in window:
                (loss_of(kind, net, batch) / acc).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.second_step(zero_grad=True)
        sched.step()
    return net


@pytest.mark.parametrize("kind", ["gpt2", "cnn"])
@pytest.mark.parametrize("sam", ["sam", "asam", "gear-sam"])
@pytest.mark.parametrize("acc,clip", [(1, 0.0), (3, 0.0), (2, 0.05)], ids=["plain", "accumulation", "acc-clip"])
def test_fit_equals_the_manual_two_pass_loop(kind, sam, acc, clip):
    data = batches(kind, STEPS * acc)
    module = Module(kind, sam)
    fit = trainer(max_steps=STEPS, accumulate_grad_batches=acc, gradient_clip_val=clip or None)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    want = manual(kind, sam, data, acc, clip)
    assert fit.global_step == STEPS
    assert rel_err(flat(module.net), flat(want)) <= FP32_STEP_RTOL
    assert rel_err(flat(module.net), flat(gpt2() if kind == "gpt2" else CNN())) > 1e-3
    if kind == "cnn":
        assert torch.equal(module.net.stem[1].running_mean, want.stem[1].running_mean)


def test_logs_rho_and_every_blocks_share_and_keeps_the_first_pass_loss():
    data = batches("gpt2", 2)
    module = Module("gpt2", "gear-sam")
    fit = trainer(max_steps=2)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    metrics = fit.callback_metrics
    names = module.optimizers().optimizer.block_names
    assert names == ["stem", "transformer.h.0", "transformer.h.1", "classifier"]
    assert metrics["sam/rho"] == 0.05
    assert sum(metrics[f"sam/share/{name}"].item() for name in names) == pytest.approx(1.0, abs=1e-6)
    # the logged loss is the last step's first pass, at w (the second pass, at w + eps, logs nothing)
    at_w = manual("gpt2", "gear-sam", data, 1, 0.0, steps=1)
    with torch.no_grad():
        assert metrics["train_loss"] == loss_of("gpt2", at_w, data[1])


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    """Two epochs of 3 steps (2 micro-batches each); a checkpoint saved after the first, loaded by a fresh module with
    ``ckpt_path=``, ends bit for bit where the uninterrupted fit ended. (Lightning restarts an epoch's data when it
    resumes mid-epoch, unless the data loader is stateful: that would be another run, not ours to match.)"""
    loader = torch.utils.data.DataLoader(batches("cnn", STEPS), batch_size=None)
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    whole = Module("cnn", "gear-sam")
    trainer(max_epochs=2, **settings).fit(whole, train_dataloaders=loader)
    first = trainer(max_epochs=1, **settings)
    first.fit(Module("cnn", "gear-sam"), train_dataloaders=loader)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = Module("cnn", "gear-sam")
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # other weights: everything must come from the checkpoint
    again = trainer(max_epochs=2, **settings)
    again.fit(resumed, train_dataloaders=loader, ckpt_path=tmp_path / "epoch1.ckpt")
    assert again.global_step == STEPS
    assert torch.equal(flat(resumed.net), flat(whole.net))
    assert torch.equal(resumed.net.stem[1].running_var, whole.net.stem[1].running_var)


def test_bf16_mixed_runs_both_passes_under_autocast():
    data = batches("gpt2", STEPS)
    runs = {}
    for precision in ("32-true", "bf16-mixed"):
        module = Module("gpt2", "gear-sam")
        trainer(max_steps=STEPS, precision=precision).fit(
            module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None)
        )
        runs[precision] = flat(module.net)
    assert 0 < rel_err(runs["bf16-mixed"], runs["32-true"]) < 2e-2


class PlainOptimizer(Module):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_optimizer_that_is_not_sam_is_refused():
    fit = trainer(max_steps=1)
    with pytest.raises(TypeError, match="needs configure_optimizers to return a SAM or GEARSAM"):
        fit.fit(
            PlainOptimizer("cnn", "sam"),
            train_dataloaders=torch.utils.data.DataLoader(batches("cnn", 1), batch_size=None),
        )


def test_16_mixed_is_refused_with_the_reason():
    """Lightning's loss scaler calls the optimizer's step() without a closure. (On CPU Lightning's 16-mixed has no
    scaler, so the test gives it the one it has on a GPU.)"""
    fit = trainer(max_steps=1, precision="16-mixed")
    if fit.precision_plugin.scaler is None:
        fit.precision_plugin.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="does not support precision='16-mixed'"):
        fit.fit(Module("cnn", "sam"), train_dataloaders=torch.utils.data.DataLoader(batches("cnn", 1), batch_size=None))


def test_the_readme_example_runs():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if b.startswith("# needs: lightning")]
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(4)]
    namespace = {"model": resnet18(width=4), "loader": torch.utils.data.DataLoader(data, batch_size=None)}
    exec(compile(block, "README.md", "exec"), namespace)
    module, fit = namespace["module"], namespace["trainer"]
    assert fit.global_step == 4  # 2 epochs of 4 micro-batches, 2 per step
    assert module.optimizers().optimizer.block_names == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
    assert "sam/share/layer4" in fit.callback_metrics

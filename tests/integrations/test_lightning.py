"""Lightning with automatic optimization and SAM, ASAM or GEAR-SAM
(:class:`gearsam_fused.integrations.lightning.SharpnessAwareMixin`): a fit equals the manual two-pass loop over the
same micro-batches bit for bit, with and without gradient accumulation and clipping, for a tiny GPT-2 and a small CNN
with BatchNorm, in float32 and with ``precision="bf16-mixed"`` (against the loop with both passes under autocast); a fit resumed from a checkpoint equals the uninterrupted one, and a fit switched to SAM from a plain
module's checkpoint equals the manual loop continued from it; the blocks' shares are logged. One-pass momentum SAM
(MomentumSAM) with MomentumSAMCallback and no mixin: training runs at the hand-written loop's look-ahead points,
validation and checkpoints see w, and a fit resumed from a checkpoint equals the uninterrupted one."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.heavy  # a trainer's whole loop a case: the default tier runs one

L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from gearsam_fused import GEARSAM, SAM, FriendlySAM, MomentumSAM, SurrogateGap, frozen_bn_stats  # noqa: E402
from gearsam_fused.integrations.lightning import MomentumSAMCallback, SharpnessAwareMixin  # noqa: E402
from gearsam_fused.models import resnet18  # noqa: E402

from conftest import flat, rel_err  # noqa: E402
from doc_blocks import needs_block  # noqa: E402

STEPS = 6
#: What GEAR-SAM says when it takes over a plain optimizer's state dict (its EMA restarts at zero).
PLAIN_STATE_WARNING = r"without a 'gearsam' entry.*EMA of block energies starts at zero"


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
    """SAM, ASAM, GEAR-SAM or the family's GEAR-SAM with GSAM's descent ("gear-gsam") and F-SAM ("friendly-sam")
    around torch's AdamW; ``"plain"``: that AdamW alone."""
    if sam == "plain":
        return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    kw = dict(rho=0.05, lr=1e-2, weight_decay=0.01)
    if sam == "gear-sam":
        return GEARSAM(net, torch.optim.AdamW, beta=0.9, **kw)
    if sam == "gear-gsam":
        return GEARSAM(net, torch.optim.AdamW, beta=0.9, descent=SurrogateGap(0.3), **kw)
    if sam == "friendly-sam":
        return FriendlySAM(net, torch.optim.AdamW, **kw)
    return SAM(net, torch.optim.AdamW, adaptive=sam == "asam", eta=0.01 if sam == "asam" else 0.0, **kw)


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 0.2 * step))


class Plain(L.LightningModule):
    """The model, training step and schedule, without the mixin (``sam="plain"``: a plain AdamW run)."""

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


class Module(SharpnessAwareMixin, Plain):
    pass


def trainer(**kw) -> L.Trainer:
    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    return L.Trainer(**{**common, **kw})


def manual(
    kind: str, sam: str, data: list, acc: int, clip: float, steps: int = STEPS, start=None, bf16=(False, False)
) -> nn.Module:
    """The two-pass loop by hand; ``start``: a Lightning checkpoint (of a plain run) to continue from, its weights,
    its base optimizer's state dict and its schedule loaded first. ``bf16``: whether the first and the second pass
    run their forward under bfloat16 autocast, as ``precision="bf16-mixed"`` runs ``training_step``."""
    net = gpt2() if kind == "gpt2" else CNN()
    opt = make_optimizer(net, sam)
    sched = schedule(opt)
    if start is not None:
        net.load_state_dict({k.removeprefix("net."): v for k, v in start["state_dict"].items()})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*" + PLAIN_STATE_WARNING)  # GEAR-SAM's, checked in the fit
            opt.load_state_dict(start["optimizer_states"][0])
        sched.load_state_dict(start["lr_schedulers"][0])
    for step in range(steps):
        window = data[step * acc : (step + 1) * acc]
        for batch in window:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16[0]):
                loss = loss_of(kind, net, batch)
            (loss / acc).backward()
        opt.first_step(zero_grad=True)
        with frozen_bn_stats(net):
            for batch in window:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16[1]):
                    loss = loss_of(kind, net, batch)
                (loss / acc).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.second_step(zero_grad=True)
        sched.step()
    return net


@pytest.mark.parametrize("kind", ["gpt2", "cnn"])
@pytest.mark.parametrize("sam", ["sam", "asam", "gear-sam", "gear-gsam", "friendly-sam"])
@pytest.mark.parametrize("acc,clip", [(1, 0.0), (3, 0.0), (2, 0.05)], ids=["plain", "accumulation", "acc-clip"])
def test_fit_equals_the_manual_two_pass_loop(kind, sam, acc, clip):
    data = batches(kind, STEPS * acc)
    module = Module(kind, sam)
    fit = trainer(max_steps=STEPS, accumulate_grad_batches=acc, gradient_clip_val=clip or None)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    want = manual(kind, sam, data, acc, clip)
    assert fit.global_step == STEPS
    assert torch.equal(flat(module.net), flat(want))
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


@pytest.mark.parametrize("kind", ["gpt2", "cnn"])
@pytest.mark.parametrize("sam", ["sam", "gear-sam"])
def test_a_fit_switched_to_sam_from_a_plain_checkpoint_continues_as_the_manual_loop(tmp_path, sam, kind):
    """An epoch of 3 steps with a plain AdamW module, checkpointed; the same module with the mixin and SAM or GEAR-SAM
    resumes from it with ``ckpt_path=`` (taking over the AdamW state, the schedule and the step) for a second epoch,
    which equals the manual two-pass loop continued from the same checkpoint, bit for bit. GEAR-SAM warns that its
    EMA starts at zero, SAM has nothing to warn of."""
    steps, acc, clip = 3, 2, 0.05
    loader = torch.utils.data.DataLoader(batches(kind, steps * acc), batch_size=None)
    first = trainer(max_epochs=1, accumulate_grad_batches=acc, gradient_clip_val=clip)
    first.fit(Plain(kind, "plain"), train_dataloaders=loader)
    first.save_checkpoint(tmp_path / "plain.ckpt")
    saved = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    assert first.global_step == steps and "gearsam" not in saved["optimizer_states"][0]["param_groups"][0]

    module = Module(kind, sam)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # other weights: everything must come from the checkpoint
    again = trainer(max_epochs=2, accumulate_grad_batches=acc, gradient_clip_val=clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.fit(module, train_dataloaders=loader, ckpt_path=tmp_path / "plain.ckpt")
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert sum(bool(re.search(PLAIN_STATE_WARNING, m)) for m in said) == (sam == "gear-sam"), said
    assert again.global_step == 2 * steps
    # AdamW's state went on from the plain run's: 3 plain steps, then 3 SAM steps
    opt = again.optimizers[0]
    assert len(opt.state) == len(list(module.parameters())) and all(s["step"].item() == 6 for s in opt.state.values())
    assert all(group["rho"] == 0.05 for group in opt.param_groups)
    want = manual(kind, sam, loader.dataset, acc, clip, steps=steps, start=saved)
    assert torch.equal(flat(module.net), flat(want))
    if kind == "cnn":
        assert torch.equal(module.net.stem[1].running_mean, want.stem[1].running_mean)


class OnePassInFloat32(Module):
    """Runs the forward of one pass (``"first"`` or ``"second"``) outside autocast: what the bf16 check must catch."""

    def __init__(self, kind: str, sam: str, plain_pass: str):
        super().__init__(kind, sam)
        self.plain_pass = plain_pass

    def training_step(self, batch, batch_idx):
        which = "second" if self.trainer.optimizers[0].perturbed else "first"
        with torch.autocast("cpu", enabled=which != self.plain_pass):
            return super().training_step(batch, batch_idx)


def bf16_fit(module: Module, data: list, acc: int, clip: float) -> nn.Module:
    fit = trainer(max_steps=STEPS, precision="bf16-mixed", accumulate_grad_batches=acc, gradient_clip_val=clip or None)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    assert fit.global_step == STEPS
    return module.net


@pytest.mark.parametrize("kind", ["gpt2", "cnn"])
@pytest.mark.parametrize("sam,acc,clip", [("gear-sam", 1, 0.0), ("sam", 2, 0.05)], ids=["gear-sam", "sam-acc-clip"])
def test_bf16_mixed_runs_both_passes_under_autocast(kind, sam, acc, clip):
    """precision="bf16-mixed" equals the manual loop with both forward passes under bfloat16 autocast, bit for bit;
    the weights stay float32."""
    data = batches(kind, STEPS * acc)
    net = bf16_fit(Module(kind, sam), data, acc, clip)
    assert next(net.parameters()).dtype == torch.float32
    assert torch.equal(flat(net), flat(manual(kind, sam, data, acc, clip, bf16=(True, True))))
    assert rel_err(flat(net), flat(manual(kind, sam, data, acc, clip))) > 1e-3  # bfloat16 is not float32


@pytest.mark.parametrize("plain_pass", ["first", "second"])
def test_the_bf16_check_catches_a_pass_run_without_autocast(plain_pass):
    """A fit whose first or second pass runs in float32 is not the manual bf16 loop (it equals the manual loop with
    that pass in float32): the bit-for-bit comparison above fails for it."""
    data = batches("gpt2", STEPS)
    net = bf16_fit(OnePassInFloat32("gpt2", "gear-sam", plain_pass), data, 1, 0.0)
    both = manual("gpt2", "gear-sam", data, 1, 0.0, bf16=(True, True))
    assert not torch.equal(flat(net), flat(both))
    one = (plain_pass == "second", plain_pass == "first")
    assert torch.equal(flat(net), flat(manual("gpt2", "gear-sam", data, 1, 0.0, bf16=one)))


class PlainOptimizer(Module):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MomentumWithMixin(Module):
    def configure_optimizers(self):
        return momentum_sam(self.net)


def test_an_optimizer_that_is_not_sam_is_refused():
    loader = torch.utils.data.DataLoader(batches("cnn", 1), batch_size=None)
    with pytest.raises(TypeError, match="needs configure_optimizers to return a SAM or GEARSAM"):
        trainer(max_steps=1).fit(PlainOptimizer("cnn", "sam"), train_dataloaders=loader)
    # one-pass momentum SAM takes no second pass: the mixin refuses it, and the callback refuses an optimizer without
    # eval() and train()
    with pytest.raises(TypeError, match="second pass, which MomentumSAM does not take: leave the mixin out"):
        trainer(max_steps=1).fit(MomentumWithMixin("cnn", "sam"), train_dataloaders=loader)
    with pytest.raises(TypeError, match="MomentumSAMCallback needs .* eval.. and train.*; got SGD"):
        trainer(max_steps=1, callbacks=[MomentumSAMCallback()]).fit(
            PlainOptimizer("cnn", "sam"), train_dataloaders=loader
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
    block, where = needs_block("# needs: lightning")  # in the documentation's integrations page
    torch.manual_seed(0)
    data = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(4)]
    namespace = {"model": resnet18(width=4), "loader": torch.utils.data.DataLoader(data, batch_size=None)}
    exec(compile(block, where, "exec"), namespace)
    module, fit = namespace["module"], namespace["trainer"]
    assert fit.global_step == 4  # 2 epochs of 4 micro-batches, 2 per step
    assert module.optimizers().optimizer.block_names == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
    assert "sam/share/layer4" in fit.callback_metrics


# ------------------------------------------------------------------------------ one-pass momentum SAM
def momentum_sam(net: nn.Module) -> MomentumSAM:
    return MomentumSAM(net, torch.optim.SGD, rho=0.5, lr=0.05, momentum=0.9, weight_decay=5e-4)


class Momentum(L.LightningModule):
    """A CNN with BatchNorm trained with MomentumSAM and Lightning's own optimizer_step; records the weights every
    training forward ran at and every validation saw (with the step it came after)."""

    def __init__(self):
        super().__init__()
        self.net = CNN()
        self.trained_at, self.validated_at = [], []

    def training_step(self, batch, batch_idx):
        self.trained_at.append(flat(self.net).clone())
        return loss_of("cnn", self.net, batch)

    def validation_step(self, batch, batch_idx):
        self.validated_at.append((self.trainer.global_step, flat(self.net).clone()))
        return loss_of("cnn", self.net, batch)

    def configure_optimizers(self):
        opt = momentum_sam(self.net)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}


def momentum_loop(data: list, steps: int) -> tuple[list, list, nn.Module]:
    """The one-call loop by hand: the look-ahead point before each step and after the last, w after each step (from
    ``opt.eval()``, then ``opt.train()`` again), and the network holding the last w."""
    net = CNN()
    opt = momentum_sam(net)
    sched = schedule(opt)
    lookahead, w = [], [flat(net).clone()]
    for batch in data[:steps]:
        lookahead.append(flat(net).clone())
        opt.zero_grad()
        loss_of("cnn", net, batch).backward()
        opt.step()
        sched.step()
        opt.eval()
        w.append(flat(net).clone())
        opt.train()
    lookahead.append(flat(net).clone())
    opt.eval()
    return lookahead, w, net


def test_momentum_sam_validates_and_checkpoints_w_and_trains_at_the_lookahead_point(tmp_path):
    """Two epochs of 3 steps, a validation before training (the sanity check) and after each epoch, a checkpoint every
    2 steps (at the end of a training batch, in train mode). Each training forward runs at the hand-written loop's
    look-ahead point (so each move to w and back was exact), each validation sees w, the checkpoints hold w and the
    optimizer's state in eval mode, and after fit the module holds w, BatchNorm statistics included."""
    data = batches("cnn", STEPS)
    module = Momentum()
    saving = L.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    fit = trainer(max_epochs=2, num_sanity_val_steps=1, enable_checkpointing=True,
                  callbacks=[MomentumSAMCallback(), saving])  # fmt: skip
    loader = torch.utils.data.DataLoader(data[:3], batch_size=None)
    fit.fit(module, train_dataloaders=loader, val_dataloaders=torch.utils.data.DataLoader(data[3:4], batch_size=None))
    lookahead, w, net = momentum_loop(data[:3] * 2, STEPS)

    assert len(module.trained_at) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(module.trained_at, lookahead[:STEPS], strict=True))
    assert [step for step, _ in module.validated_at] == [0, 3, 6]
    for step, weights in module.validated_at:
        assert torch.equal(weights, w[step]) and not (step and torch.equal(weights, lookahead[step]))
    for step in (2, 4, 6):
        (path,) = tmp_path.glob(f"*step={step}.ckpt")
        saved = torch.load(path, weights_only=False)
        weights = torch.cat([saved["state_dict"][f"net.{k}"].flatten() for k, _ in net.named_parameters()])
        assert torch.equal(weights, w[step]) and not torch.equal(weights, lookahead[step])
        assert saved["optimizer_states"][0]["param_groups"][0]["gearsam"]["training"] is False
    assert not fit.optimizers[0].training and torch.equal(flat(module.net), flat(net))
    assert torch.equal(module.net.stem[1].running_mean, net.stem[1].running_mean)


def test_momentum_sam_resumes_from_a_checkpoint_exactly(tmp_path):
    """One epoch of 3 steps saved after fit (the module at w, the optimizer in eval mode), loaded by a fresh module
    with other weights with ``ckpt_path=``: the second epoch ends bit for bit where the uninterrupted fit ended."""
    loader = torch.utils.data.DataLoader(batches("cnn", 3), batch_size=None)
    whole = Momentum()
    trainer(max_epochs=2, callbacks=[MomentumSAMCallback()]).fit(whole, train_dataloaders=loader)
    first = trainer(max_epochs=1, callbacks=[MomentumSAMCallback()])
    first.fit(Momentum(), train_dataloaders=loader)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["param_groups"][0]["gearsam"]["training"] is False  # fit ended at w
    resumed = Momentum()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # other weights: everything must come from the checkpoint
    again = trainer(max_epochs=2, callbacks=[MomentumSAMCallback()])
    again.fit(resumed, train_dataloaders=loader, ckpt_path=tmp_path / "epoch1.ckpt")
    assert again.global_step == 6
    assert torch.equal(flat(resumed.net), flat(whole.net))
    assert torch.equal(resumed.trained_at[0], whole.trained_at[3])  # the look-ahead point, restored from w
    assert torch.equal(resumed.net.stem[1].running_var, whole.net.stem[1].running_var)

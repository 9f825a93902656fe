"""The library's helpers under a step schedule (``schedule=Every(k)``, ``LookSAM``, ``Adaptive``): each equals the
hand-written loop with the same optimizer (first backward; ``if opt.first_step(): second backward; second_step()``)
bit for bit, and runs no second forward on the steps the schedule skips: ``distributed.sam_step`` in one process,
``accumulated_step`` (with and without ``SAMScaler``), ``SAMScaler`` (also when a skipped step's first pass
overflows), ``BlockTelemetry``, the Hugging Face ``SAMTrainer`` and the Lightning mixin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import GEARSAM, GSAM, SAM, WSAM, Adaptive, Every, FriendlySAM, LookSAM
from gearsam_fused.accumulation import accumulated_step
from gearsam_fused.amp import SAMScaler, ScaledStepReport
from gearsam_fused.distributed import sam_step
from gearsam_fused.telemetry import RECORD_FIELDS, BlockTelemetry

from conftest import flat, rel_err

STEPS = 7  # two whole cycles of k = 3, and the start of a third
SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)
SCHEDULES = {"every3": Every(3), "looksam3": LookSAM(3, 0.5), "adaptive": Adaptive(0.0, 0.5)}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.SiLU(), nn.Linear(12, 3))


def data(steps: int = STEPS, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def optimizer(model: nn.Module, schedule, cls=GEARSAM):
    kw = dict(partition="tensor", beta=0.9) if cls is GEARSAM else {}
    return cls(model.parameters(), torch.optim.SGD, model=model, rho=0.05, schedule=schedule, **kw, **SGD)


def loss_of(model, xy) -> torch.Tensor:
    x, y = xy
    return F.cross_entropy(model(x), y)


def manual(schedule, batches, cls=GEARSAM, micro: int = 1) -> tuple[list[torch.Tensor], list[bool]]:
    """The hand-written loop (over ``micro`` micro-batches per step): the weights after each step, and which steps
    perturbed."""
    model = mlp()
    opt = optimizer(model, schedule, cls)
    trajectory, decisions = [], []
    for xy in batches:
        parts = list(zip(xy[0].chunk(micro), xy[1].chunk(micro)))
        for mb in parts:
            (loss_of(model, mb) / micro).backward()
        if opt.first_step(zero_grad=True):
            for mb in parts:
                (loss_of(model, mb) / micro).backward()
            opt.second_step(zero_grad=True)
        opt.zero_grad()
        decisions.append(opt.step_statistics.sam_step)
        trajectory.append(flat(model))
    return trajectory, decisions


def expected_decisions(name: str) -> list[bool]:
    return [s % 3 == 0 for s in range(STEPS)] if name != "adaptive" else None


def check_decisions(name: str, decisions: list[bool]) -> None:
    if name == "adaptive":  # data-driven; this data makes it skip some steps and not others
        assert decisions[:2] == [True, True] and False in decisions and decisions.count(True) >= 3, decisions
    else:
        assert decisions == expected_decisions(name)


# ------------------------------------------------------------------------------ distributed.sam_step, one process
@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("cls", [SAM, GEARSAM, GSAM, WSAM, FriendlySAM], ids=lambda c: c.__name__)
@pytest.mark.parametrize("m_sharpness", [False, True], ids=["plain", "m-sharpness"])
def test_sam_step_equals_the_manual_loop_and_skips_the_second_call(name, cls, m_sharpness):
    """Also for the SAM family, whose skipped steps are the base step with the first gradient (LookSAM's correction is
    refused with them)."""
    schedule = SCHEDULES[name]
    if cls is not GEARSAM and name == "adaptive" and m_sharpness:
        pytest.skip("one Adaptive case with m-sharpness, GEAR-SAM's, is enough")
    if cls not in (SAM, GEARSAM) and schedule.corrects:
        pytest.skip("LookSAM's correction is refused with the SAM family (tests/optimizer/test_family.py)")
    if cls is FriendlySAM and schedule.reads_energy:
        pytest.skip(
            "a schedule that reads the first gradient's energy is refused with an ascent (tests/optimizer/test_family.py)"
        )
    batches = data()
    want, decisions = manual(schedule, batches, cls)
    check_decisions(name, decisions)
    model = mlp()
    opt = optimizer(model, schedule, cls)
    for step, xy in enumerate(batches):
        calls = []

        def closure():
            calls.append(opt.perturbed)
            loss = loss_of(model, xy)
            loss.backward()
            return loss

        sam = opt.sam_step
        loss = sam_step(opt, model, closure, m_sharpness=m_sharpness)
        assert calls == ([False, True] if decisions[step] else [False]), step  # at w, then (SAM steps) at w + eps
        assert sam == decisions[step] == opt.step_statistics.sam_step
        assert loss.ndim == 0 and torch.isfinite(loss)
        assert torch.equal(flat(model), want[step]), step
    assert rel_err(want[-1], flat(mlp())) > 1e-3


# ------------------------------------------------------------------------------ accumulated_step
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_accumulated_step_equals_the_manual_loop_and_skips_the_second_pass(name):
    micro = 3
    batches = data(n=12)
    want, decisions = manual(SCHEDULES[name], batches, micro=micro)
    check_decisions(name, decisions)
    model = mlp()
    opt = optimizer(model, SCHEDULES[name])
    for step, (x, y) in enumerate(batches):
        calls = []

        def fn(mb):
            calls.append(opt.perturbed)
            return loss_of(model, mb)

        loss = accumulated_step(opt, fn, list(zip(x.chunk(micro), y.chunk(micro))))
        assert calls == [False] * micro + ([True] * micro if decisions[step] else []), step
        assert opt.step_statistics.sam_step == decisions[step]
        assert torch.equal(flat(model), want[step]), step
        assert torch.isfinite(loss)


@pytest.mark.parametrize("name", ["every3", "looksam3"])
def test_accumulated_step_with_a_loss_scaler_equals_the_unscaled_loop(name):
    """Power-of-two loss scales are exact: with SAMScaler the steps are the unscaled loop's, bit for bit; a skipped
    step unscales once, and the scale grows after every finite step (growth_interval=1) as after a plain step."""
    micro = 2
    batches = data(n=8)
    want, decisions = manual(SCHEDULES[name], batches, micro=micro)
    model = mlp()
    opt = optimizer(model, SCHEDULES[name])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    amp = SAMScaler(opt, scaler)
    for step, (x, y) in enumerate(batches):
        calls = []

        def fn(mb):
            calls.append(opt.perturbed)
            return loss_of(model, mb)

        accumulated_step(opt, fn, list(zip(x.chunk(micro), y.chunk(micro))), amp=amp)
        assert len(calls) == micro * (2 if decisions[step] else 1), step
        assert amp.last == ScaledStepReport(False, None, True, True, 2.0 ** (4 + step), decisions[step])
        scaler.update()
        assert torch.equal(flat(model), want[step]), step


# ------------------------------------------------------------------------------ SAMScaler
def scaled_run(schedule, batches, inject: dict[int, float] | None = None, growth_interval: int = 1000):
    """Steps through SAMScaler as its docstring shows; ``inject``: {step: value} written into one first-pass
    gradient of that step. Returns the weights after each step, the reports, the scales and what first_step said."""
    model = mlp()
    opt = optimizer(model, schedule)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    amp = SAMScaler(opt, scaler)
    out = {"w": [], "reports": [], "scales": [], "second_pass": [], "calls": []}
    for step, xy in enumerate(batches):
        scaler.scale(loss_of(model, xy)).backward()
        if inject and step in inject:
            model[0].weight.grad.view(-1)[3] = inject[step]
        run_second = amp.first_step()
        out["second_pass"].append(run_second)
        if run_second:
            scaler.scale(loss_of(model, xy)).backward()
        report = amp.second_step(zero_grad=True)
        found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        out["calls"].append(found)
        scaler.update()
        out["w"].append(flat(model))
        out["reports"].append(report)
        out["scales"].append(scaler.get_scale())
    return out


@pytest.mark.parametrize("name", ["every3", "looksam3"])
def test_scaler_skipped_steps_with_a_finite_first_pass(name):
    batches = data()
    want, decisions = manual(SCHEDULES[name], batches)
    run = scaled_run(SCHEDULES[name], batches, growth_interval=1)
    assert run["second_pass"] == decisions
    for step in range(STEPS):
        assert torch.equal(run["w"][step], want[step]), step
        assert run["reports"][step] == ScaledStepReport(False, None, True, True, 2.0 ** (10 + step), decisions[step])
    # every step was finite, so (growth_interval=1) the scale doubled after each, skipped by the schedule or not
    assert run["scales"] == [2.0 ** (11 + s) for s in range(STEPS)]
    assert run["calls"] == [0.0] * STEPS


@pytest.mark.parametrize("name", ["every3", "looksam3"])
@pytest.mark.parametrize("fill", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_scaler_overflow_in_a_skipped_steps_first_pass_makes_no_update(name, fill):
    """Step 1 (one the schedule skips) overflows in its only pass: no update (weights, momentum, schedule as before),
    the scale is halved, and the step is taken again as a skipped step; the run then equals the loop without it."""
    batches = data()
    bad = 1
    run = scaled_run(SCHEDULES[name], batches, inject={bad: fill})
    want, decisions = manual(SCHEDULES[name], batches[:bad] + batches[bad + 1 :])
    assert run["second_pass"][bad] is False
    assert run["reports"][bad] == ScaledStepReport(
        True, "non-finite gradient in the first pass", False, True, 2.0**10, False
    )
    assert run["calls"][bad] == 1.0  # the first pass's record only
    assert run["scales"][bad] == 2.0**9 and run["scales"][-1] == 2.0**9
    assert torch.equal(run["w"][bad], run["w"][bad - 1])
    # the schedule did not move: the step after the overflow is still step 1 of the cycle (skipped), and so on
    assert run["second_pass"][:bad] + run["second_pass"][bad + 1 :] == decisions
    for got, expected in zip(run["w"][:bad] + run["w"][bad + 1 :], want):
        assert torch.equal(got, expected)


def test_scaler_overflow_in_a_sam_steps_first_pass_is_skipped_as_before():
    batches = data()
    run = scaled_run(Every(3), batches, inject={3: float("inf")})
    want, _ = manual(Every(3), batches[:3] + batches[4:])
    assert run["second_pass"][3] is False and run["reports"][3].sam_step is True and run["reports"][3].skipped
    assert run["second_pass"][4] is True  # the SAM step is taken again
    assert all(torch.equal(a, b) for a, b in zip(run["w"][:3] + run["w"][4:], want))


def test_scaler_disabled_follows_the_schedule():
    batches = data()
    want, decisions = manual(Every(3), batches)
    model = mlp()
    opt = optimizer(model, Every(3))
    amp = SAMScaler(opt, torch.amp.GradScaler("cpu", enabled=False))
    for step, xy in enumerate(batches):
        loss_of(model, xy).backward()
        if amp.first_step():
            loss_of(model, xy).backward()
        assert amp.second_step(zero_grad=True).sam_step == decisions[step]
        assert torch.equal(flat(model), want[step])


def test_second_step_after_a_skipped_step_names_the_schedule():
    model = mlp()
    opt = optimizer(model, Every(2))
    for step in range(2):
        loss_of(model, data(1)[0]).backward()
        if step == 0:
            assert opt.first_step(zero_grad=True)
            loss_of(model, data(1)[0]).backward()
            opt.second_step(zero_grad=True)
    assert not opt.first_step()
    with pytest.raises(RuntimeError, match="skipped"):
        opt.second_step()


# ------------------------------------------------------------------------------ BlockTelemetry
def test_telemetry_records_which_steps_perturbed_and_their_fraction():
    model = mlp()
    opt = optimizer(model, LookSAM(3, 0.5))
    telemetry = BlockTelemetry(opt, every=4)
    for xy in data():
        loss = loss_of(model, xy)
        loss.backward()
        if opt.first_step(zero_grad=True):
            perturbed = loss_of(model, xy)
            perturbed.backward()
            opt.second_step(zero_grad=True)
            telemetry.record(loss, perturbed)
        else:
            with pytest.raises(ValueError, match="did not perturb"):
                telemetry.record(loss, loss)
            telemetry.record(loss)
    telemetry.flush()
    records = telemetry.records
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    sam = [s % 3 == 0 for s in range(STEPS)]
    assert all(tuple(r) == RECORD_FIELDS for r in records)
    assert [r["sam_step"] for r in records] == sam
    assert [r["sam_fraction"] for r in records] == [sum(sam[: i + 1]) / (i + 1) for i in range(STEPS)]
    assert telemetry.sam_fraction == 3 / 7 and telemetry.sam_steps == 3 and telemetry.steps_recorded == 7
    for r, perturbs in zip(records, sam):
        assert r["loss"] is not None and all(e > 0 for e in r["energy"])
        if perturbs:
            assert r["perturbed_loss"] is not None and r["sharpness"] == r["perturbed_loss"] - r["loss"]
            assert sum(r["share"]) == pytest.approx(1.0, abs=1e-12)
        else:
            assert r["perturbed_loss"] is None and r["sharpness"] is None
            assert r["radius"] == [0.0] * len(opt.block_names) and r["share"] == [0.0] * len(opt.block_names)


def test_telemetry_without_a_schedule_counts_every_step():
    model = mlp()
    opt = optimizer(model, None)
    telemetry = BlockTelemetry(opt, every=2)
    assert telemetry.sam_fraction is None
    for xy in data(3):
        loss_of(model, xy).backward()
        opt.first_step(zero_grad=True)
        telemetry.record()
        loss_of(model, xy).backward()
        opt.second_step(zero_grad=True)
    telemetry.flush()
    records = telemetry.records
    assert [r["sam_step"] for r in records] == [True] * 3 and telemetry.sam_fraction == 1.0
    assert [r["sam_fraction"] for r in records] == [1.0] * 3


# ------------------------------------------------------------------------------ Hugging Face SAMTrainer
def _transformers():
    pytest.importorskip("transformers")
    import test_transformers as tt

    return tt


def counting_forwards(model: nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def trainer_manual(tt, trainer, schedule, steps: int, ga: int, clip: float) -> tuple[nn.Module, list[bool]]:
    """The loop by hand over the micro-batches the Trainer saw (its optimizer, param groups, LR schedule and loss
    normalisation): the first pass over the window; on a SAM step first_step, the second pass, clipping of the
    second gradient and second_step; on a skipped step clipping of the first gradient, then first_step (the update)."""
    from transformers import get_scheduler

    model = tt.gpt2()
    decay = set(trainer.get_decay_parameter_names(model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    base, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    opt = GEARSAM(groups, base, model=model, rho=0.05, beta=0.9, schedule=schedule, **kwargs)
    lr_schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)

    def backward(inputs, num_items):
        if num_items is not None:
            loss = model(**inputs, num_items_in_batch=num_items).loss
        else:
            loss = model(**inputs).loss / ga
        loss.backward()

    decisions = []
    for step in range(steps):
        window = trainer.seen[step * ga : (step + 1) * ga]
        for inputs, num_items in window:
            backward(inputs, num_items)
        decisions.append(opt.sam_step)
        if opt.sam_step:
            assert opt.first_step(zero_grad=True)
            for inputs, num_items in window:
                backward(inputs, num_items)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.second_step(zero_grad=True)
        else:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert not opt.first_step(zero_grad=True)
        lr_schedule.step()
    return model, decisions


@pytest.mark.parametrize(
    "schedule,ga,clip",
    [(Every(2), 1, 0.0), (LookSAM(2, 0.5), 1, 0.0), (LookSAM(2, 0.5), 2, 0.05)],
    ids=["every2", "looksam2", "looksam2-acc-clip"],
)
def test_trainer_under_a_schedule_equals_the_manual_loop(tmp_path, schedule, ga, clip):
    tt = _transformers()
    steps = 4 if ga > 1 else 6
    model = tt.gpt2()
    forwards = counting_forwards(model)
    trainer = tt.Recording(model=model, args=tt.arguments(tmp_path, max_steps=steps, gradient_accumulation_steps=ga,
                                                          max_grad_norm=clip), train_dataset=tt.Tokens(),
                           schedule=schedule)  # fmt: skip
    trainer.train()
    want, decisions = trainer_manual(tt, trainer, schedule, steps, ga, clip)
    assert decisions == [s % 2 == 0 for s in range(steps)]
    assert torch.equal(flat(model), flat(want))
    assert rel_err(flat(model), flat(tt.gpt2())) > 1e-3
    # the second forward runs on SAM steps only, over the whole window
    assert forwards[0] == ga * sum(2 if d else 1 for d in decisions)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["sam/sam_fraction"] for entry in logs] == [float(d) for d in decisions]


def test_trainer_resumes_mid_cycle_exactly(tmp_path):
    """LookSAM(2) saved after step 3 of 6 (step 3 is skipped and uses the stored direction): the resumed run ends
    where the uninterrupted one did, bit for bit."""
    tt = _transformers()
    common = dict(max_steps=6, gradient_accumulation_steps=2, max_grad_norm=0.05, save_strategy="steps", save_steps=3)
    model = tt.gpt2()
    tt.SAMTrainer(model=model, args=tt.arguments(tmp_path / "run", **common), train_dataset=tt.Tokens(),
                  schedule=LookSAM(2, 0.5)).train()  # fmt: skip
    saved = torch.load(tmp_path / "run" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    entry = saved["param_groups"][0]["gearsam"]["schedule"]
    assert entry["steps_done"] == 3 and entry["next_sam"] is False
    torch.manual_seed(123)
    resumed = type(model)(tt.gpt2().config)
    trainer = tt.SAMTrainer(model=resumed, args=tt.arguments(tmp_path / "resumed", **common),
                            train_dataset=tt.Tokens(), schedule=LookSAM(2, 0.5))  # fmt: skip
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert torch.equal(flat(resumed), flat(model))


# ------------------------------------------------------------------------------ Lightning
def _lightning():
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    import test_lightning as tl

    class Scheduled(tl.Module):
        """The CNN module of test_lightning with a scheduled GEAR-SAM; counts training_step calls."""

        def __init__(self, sam_schedule):
            super().__init__("cnn", "gear-sam")
            self.sam_schedule = sam_schedule
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            opt = GEARSAM(self.net, torch.optim.AdamW, beta=0.9, rho=0.05, lr=1e-2, weight_decay=0.01,
                          schedule=self.sam_schedule)  # fmt: skip
            return {"optimizer": opt, "lr_scheduler": {"scheduler": tl.schedule(opt), "interval": "step"}}

    return tl, Scheduled


def lightning_manual(tl, schedule, data, acc: int, clip: float, steps: int) -> tuple[nn.Module, list[bool]]:
    from gearsam_fused import frozen_bn_stats

    net = tl.CNN()
    opt = GEARSAM(net, torch.optim.AdamW, beta=0.9, rho=0.05, lr=1e-2, weight_decay=0.01, schedule=schedule)
    lr_schedule = tl.schedule(opt)
    decisions = []
    for step in range(steps):
        window = data[step * acc : (step + 1) * acc]
        for batch in window:
            (tl.loss_of("cnn", net, batch) / acc).backward()
        decisions.append(opt.sam_step)
        if opt.sam_step:
            assert opt.first_step(zero_grad=True)
            with frozen_bn_stats(net):
                for batch in window:
                    (tl.loss_of("cnn", net, batch) / acc).backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.second_step(zero_grad=True)
        else:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            assert not opt.first_step(zero_grad=True)
        lr_schedule.step()
    return net, decisions


@pytest.mark.parametrize(
    "schedule,acc,clip",
    [(Every(2), 1, 0.0), (LookSAM(2, 0.5), 1, 0.0), (LookSAM(2, 0.5), 2, 0.05)],
    ids=["every2", "looksam2", "looksam2-acc-clip"],
)
def test_lightning_under_a_schedule_equals_the_manual_loop(schedule, acc, clip):
    tl, Scheduled = _lightning()
    steps = 6 if acc == 1 else 4
    data = tl.batches("cnn", steps * acc)
    module = Scheduled(schedule)
    fit = tl.trainer(max_steps=steps, accumulate_grad_batches=acc, gradient_clip_val=clip or None)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    want, decisions = lightning_manual(tl, schedule, data, acc, clip, steps)
    assert fit.global_step == steps and decisions == [s % 2 == 0 for s in range(steps)]
    assert torch.equal(flat(module.net), flat(want))
    assert torch.equal(module.net.stem[1].running_mean, want.stem[1].running_mean)
    assert rel_err(flat(module.net), flat(tl.CNN())) > 1e-3
    assert module.calls == acc * sum(2 if d else 1 for d in decisions)  # no second pass on skipped steps
    assert fit.callback_metrics["sam/sam_fraction"].item() == 0.5


def test_lightning_resumes_mid_cycle_exactly(tmp_path):
    """LookSAM(2), two epochs of 3 steps; the checkpoint after the first (step 3 is skipped next, with the stored
    direction) resumed by a fresh module ends bit for bit where the uninterrupted fit ended."""
    tl, Scheduled = _lightning()
    loader = torch.utils.data.DataLoader(tl.batches("cnn", 6), batch_size=None)
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    whole = Scheduled(LookSAM(2, 0.5))
    tl.trainer(max_epochs=2, **settings).fit(whole, train_dataloaders=loader)
    first = tl.trainer(max_epochs=1, **settings)
    first.fit(Scheduled(LookSAM(2, 0.5)), train_dataloaders=loader)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    entry = saved["optimizer_states"][0]["param_groups"][0]["gearsam"]["schedule"]
    assert entry["steps_done"] == 3 and entry["next_sam"] is False
    resumed = Scheduled(LookSAM(2, 0.5))
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    again = tl.trainer(max_epochs=2, **settings)
    again.fit(resumed, train_dataloaders=loader, ckpt_path=tmp_path / "epoch1.ckpt")
    assert again.global_step == 6
    assert torch.equal(flat(resumed.net), flat(whole.net))
    assert torch.equal(resumed.net.stem[1].running_var, whole.net.stem[1].running_var)

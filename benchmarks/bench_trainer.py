"""Trainer steps: the Hugging Face ``Trainer`` against :class:`SAMTrainer` (SAM and GEAR-SAM), and a Lightning fit
against the same module with :class:`SharpnessAwareMixin` (GEAR-SAM), on the same model.

A GPT-2 built from a config (4 layers, width 128, a 1000-token vocabulary; on CUDA width 768, GPT-2 small's) trains
on synthetic token sequences with AdamW, ``max_grad_norm=1.0`` and two micro-batches per step, each contender on its
fastest AdamW path: the plain trainers on torch's fused kernel (``optim="adamw_torch_fused"``, ``fused=True``), ours
on ``adamw_torch`` / ``torch.optim.AdamW``, whose step gearsam_fused fuses into SAM's restore (the row's
``base_step_mode`` says which path ran).

Only the steps are timed: a callback marks the end of every optimizer step (after a synchronisation on CUDA), and a
step's time is the time between two consecutive ends, so it holds the data loading, both passes, clipping, the
optimizer step and the trainer's own per-step work, but not the set-up before the first step, which is left out with
that step. A round is one fit of ``STEPS`` steps on a freshly built trainer; a row's ``step_ms`` is the median over the
steps of all its rounds, with quartiles. SAM doubles the forward and backward passes, while the data loading,
clipping, the optimizer step and the trainer's own work run once per step.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import DEVICE, synchronize
from report import quartiles, step_intervals

transformers = pytest.importorskip("transformers")
from gearsam_fused.integrations.transformers import SAMTrainer  # noqa: E402

CONTENDERS = {"Trainer": None, "SAMTrainer sam": "sam", "SAMTrainer gear-sam": "gear-sam"}
#: the AdamW of each: torch's fused kernel for the plain Trainer, and for ours the AdamW it fuses into the restore
OPTIM = {"Trainer": "adamw_torch_fused", "SAMTrainer sam": "adamw_torch", "SAMTrainer gear-sam": "adamw_torch"}
STEPS, QUICK_STEPS = 10, 2
SEQ = 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _setting(quick: bool) -> dict:
    if DEVICE == "cuda":
        return {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "batch": 8, "bf16": True}
    width = 64 if quick else 128
    return {"n_layer": 4, "n_embd": width, "n_head": 4, "vocab": 1000, "batch": 4 if quick else 8, "bf16": False}


def _gpt2(setting: dict):
    """The benchmarked GPT-2, the same weights every time."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=setting["n_layer"], n_embd=setting["n_embd"], n_head=setting["n_head"],
                                     vocab_size=setting["vocab"], n_positions=SEQ)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class StepEnds(transformers.TrainerCallback):
    """The time at the end of every optimizer step."""

    def __init__(self):
        self.marks: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.marks.append(time.perf_counter())


def _trainer(name: str, setting: dict, steps: int, out: str, clock: StepEnds | None = None):
    model = _gpt2(setting)
    args = transformers.TrainingArguments(
        out, max_steps=steps, per_device_train_batch_size=setting["batch"], gradient_accumulation_steps=2,
        max_grad_norm=1.0, learning_rate=1e-4, optim=OPTIM[name], bf16=setting["bf16"], save_strategy="no",
        report_to="none", disable_tqdm=True, logging_strategy="no", use_cpu=DEVICE == "cpu",
    )  # fmt: skip
    data = Tokens(2 * steps * setting["batch"], setting["vocab"])
    callbacks = [clock] if clock is not None else None
    if CONTENDERS[name] is None:
        return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    return SAMTrainer(model=model, args=args, train_dataset=data, sam=CONTENDERS[name], callbacks=callbacks)


def _step_fields(step_s: list[float], steps: int, setting: dict) -> dict:
    q1, median, q3 = quartiles(step_s)
    return dict(steps=steps, steps_timed=len(step_s), step_ms=1e3 * median, step_q1_ms=1e3 * q1, step_q3_ms=1e3 * q3,
                parameters=sum(p.numel() for p in _gpt2(setting).parameters()), micro_batches=2,
                batch=setting["batch"], seq=SEQ, bf16=setting["bf16"])  # fmt: skip


@pytest.mark.parametrize("contender", list(CONTENDERS))
def test_trainer_step(benchmark, record, quick, tmp_path, contender):
    setting = _setting(quick)
    steps = QUICK_STEPS if quick else STEPS
    _trainer(contender, setting, 2, str(tmp_path)).train()  # warm-up: allocator, kernels, lazy imports
    clocks, trainers = [], []

    def fresh():  # not timed: a new trainer per round, with its own clock
        clocks.append(StepEnds())
        trainers.append(_trainer(contender, setting, steps, str(tmp_path), clocks[-1]))
        return (trainers[-1],), {}

    benchmark.group = f"Trainer step, GPT-2 {setting['n_layer']}x{setting['n_embd']}, {DEVICE}"
    benchmark.pedantic(lambda trainer: trainer.train(), setup=fresh, rounds=2 if quick else 5, iterations=1)
    intervals = [d for clock in clocks for d in step_intervals(clock.marks)]
    fields = dict(contender=contender, optim=OPTIM[contender], **_step_fields(intervals, steps, setting))
    if CONTENDERS[contender] is not None:
        fields["base_step_mode"] = trainers[-1].sam.base_step_mode
    benchmark.extra_info.update(fields)
    record(**fields)


# ------------------------------------------------------------------------------ Lightning
LIGHTNING = ("LightningModule", "LightningModule + SharpnessAwareMixin gear-sam")


def _lightning_fit(name: str, setting: dict, steps: int, marks: list[float] | None = None):
    """The fit to time: ``steps`` steps of two micro-batches, AdamW (torch's fused kernel for the plain module;
    GEAR-SAM around the AdamW it fuses into the restore with the mixin), clipping at 1.0, on :func:`_gpt2`; the end of
    every optimizer step is appended to ``marks``. Returns the fit and the module."""
    import lightning.pytorch as L

    from gearsam_fused import GEARSAM
    from gearsam_fused.integrations.lightning import SharpnessAwareMixin

    sam = name != LIGHTNING[0]

    class Module(*((SharpnessAwareMixin,) if sam else ()), L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _gpt2(setting)

        def training_step(self, batch, batch_idx):
            return self.net(**batch).loss

        def configure_optimizers(self):
            if sam:
                return GEARSAM(self.net, torch.optim.AdamW, lr=1e-4)
            return torch.optim.AdamW(self.net.parameters(), lr=1e-4, fused=True)

    class StepEnds(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if marks is not None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # a step's last batch
                synchronize()
                marks.append(time.perf_counter())

    data = Tokens(2 * steps * setting["batch"], setting["vocab"])
    loader = torch.utils.data.DataLoader(data, batch_size=setting["batch"])
    fit = L.Trainer(max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator=DEVICE, devices=1, precision="bf16-mixed" if setting["bf16"] else "32-true",
                    callbacks=[StepEnds()])  # fmt: skip
    module = Module()
    return lambda: fit.fit(module, train_dataloaders=loader), fit


@pytest.mark.parametrize("contender", LIGHTNING)
def test_lightning_step(benchmark, record, quick, contender):
    pytest.importorskip("lightning")
    setting = _setting(quick)
    steps = QUICK_STEPS if quick else STEPS
    _lightning_fit(contender, setting, 2)[0]()  # warm-up
    marks, fits = [], []

    def fresh():  # not timed: a new trainer per round, with its own list of step ends
        marks.append([])
        fit, trainer = _lightning_fit(contender, setting, steps, marks[-1])
        fits.append(trainer)
        return (fit,), {}

    benchmark.group = f"Lightning step, GPT-2 {setting['n_layer']}x{setting['n_embd']}, {DEVICE}"
    benchmark.pedantic(lambda fit: fit(), setup=fresh, rounds=2 if quick else 5, iterations=1)
    intervals = [d for ends in marks for d in step_intervals(ends)]
    optimizer = fits[-1].optimizers[0]
    fields = dict(contender=contender, optim="torch.optim.AdamW" + ("" if contender != LIGHTNING[0] else ", fused=True"),
                  **_step_fields(intervals, steps, setting))  # fmt: skip
    if hasattr(optimizer, "base_step_mode"):
        fields["base_step_mode"] = optimizer.base_step_mode
    benchmark.extra_info.update(fields)
    record(**fields)

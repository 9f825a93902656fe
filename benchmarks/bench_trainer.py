"""Trainer steps: the Hugging Face ``Trainer`` against :class:`SAMTrainer` (SAM and GEAR-SAM), and a Lightning fit
against the same module with :class:`SharpnessAwareMixin` (GEAR-SAM), on the same model.

A GPT-2 built from a config (4 layers, width 128, a 1000-token vocabulary; on CUDA width 768, GPT-2 small's) trains
on synthetic token sequences with ``optim="adamw_torch"``, ``max_grad_norm=1.0`` and two micro-batches per step. A
round is one ``trainer.train()`` of ``STEPS`` optimizer steps on a freshly built Trainer (the Trainer's own set-up
inside ``train()`` is timed with them); a row's ``step_ms`` is its median over the steps. SAM doubles the forward and
backward passes, while the data loading, clipping, the optimizer step and the Trainer's own work run once per step.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE

transformers = pytest.importorskip("transformers")
from gearsam_fused.integrations.transformers import SAMTrainer  # noqa: E402

CONTENDERS = {"Trainer": None, "SAMTrainer sam": "sam", "SAMTrainer gear-sam": "gear-sam"}
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


def _trainer(name: str, setting: dict, steps: int, out: str):
    model = _gpt2(setting)
    args = transformers.TrainingArguments(
        out, max_steps=steps, per_device_train_batch_size=setting["batch"], gradient_accumulation_steps=2,
        max_grad_norm=1.0, learning_rate=1e-4, optim="adamw_torch", bf16=setting["bf16"], save_strategy="no",
        report_to="none", disable_tqdm=True, logging_strategy="no", use_cpu=DEVICE == "cpu",
    )  # fmt: skip
    data = Tokens(2 * steps * setting["batch"], setting["vocab"])
    if CONTENDERS[name] is None:
        return transformers.Trainer(model=model, args=args, train_dataset=data)
    return SAMTrainer(model=model, args=args, train_dataset=data, sam=CONTENDERS[name])


@pytest.mark.parametrize("contender", list(CONTENDERS))
def test_trainer_step(benchmark, record, quick, tmp_path, contender):
    setting = _setting(quick)
    steps = QUICK_STEPS if quick else STEPS
    _trainer(contender, setting, 2, str(tmp_path)).train()  # warm-up: allocator, kernels, lazy imports
    benchmark.group = f"Trainer step, GPT-2 {setting['n_layer']}x{setting['n_embd']}, {DEVICE}"
    benchmark.pedantic(
        lambda trainer: trainer.train(),
        setup=lambda: ((_trainer(contender, setting, steps, str(tmp_path)),), {}),
        rounds=2 if quick else 5,
        iterations=1,
    )
    parameters = sum(p.numel() for p in _gpt2(setting).parameters())
    fields = dict(contender=contender, steps=steps, step_ms=benchmark.stats.stats.median * 1e3 / steps,
                  parameters=parameters, micro_batches=2, batch=setting["batch"], seq=SEQ, bf16=setting["bf16"])  # fmt: skip
    benchmark.extra_info.update(fields)
    record(**fields)


# ------------------------------------------------------------------------------ Lightning
LIGHTNING = ("LightningModule", "LightningModule + SharpnessAwareMixin gear-sam")


def _lightning_fit(name: str, setting: dict, steps: int):
    """The fit to time: ``steps`` steps of two micro-batches, AdamW (GEAR-SAM around it with the mixin), clipping at
    1.0, on :func:`_gpt2`."""
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
            return torch.optim.AdamW(self.net.parameters(), lr=1e-4)

    data = Tokens(2 * steps * setting["batch"], setting["vocab"])
    loader = torch.utils.data.DataLoader(data, batch_size=setting["batch"])
    fit = L.Trainer(max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator=DEVICE, devices=1, precision="bf16-mixed" if setting["bf16"] else "32-true")  # fmt: skip
    module = Module()
    return lambda: fit.fit(module, train_dataloaders=loader)


@pytest.mark.parametrize("contender", LIGHTNING)
def test_lightning_step(benchmark, record, quick, contender):
    pytest.importorskip("lightning")
    setting = _setting(quick)
    steps = QUICK_STEPS if quick else STEPS
    _lightning_fit(contender, setting, 2)()  # warm-up
    benchmark.group = f"Lightning step, GPT-2 {setting['n_layer']}x{setting['n_embd']}, {DEVICE}"
    benchmark.pedantic(lambda fit: fit(), setup=lambda: ((_lightning_fit(contender, setting, steps),), {}),
                       rounds=2 if quick else 5, iterations=1)  # fmt: skip
    parameters = sum(p.numel() for p in _gpt2(setting).parameters())
    fields = dict(contender=contender, steps=steps, step_ms=benchmark.stats.stats.median * 1e3 / steps,
                  parameters=parameters, micro_batches=2, batch=setting["batch"], seq=SEQ, bf16=setting["bf16"])  # fmt: skip
    benchmark.extra_info.update(fields)
    record(**fields)

"""Hugging Face ``Trainer`` steps: the plain Trainer against :class:`SAMTrainer` (SAM and GEAR-SAM) on the same model.

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


def _trainer(name: str, setting: dict, steps: int, out: str):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=setting["n_layer"], n_embd=setting["n_embd"], n_head=setting["n_head"],
                                     vocab_size=setting["vocab"], n_positions=SEQ)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
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
    parameters = sum(p.numel() for p in _trainer(contender, setting, 1, str(tmp_path)).model.parameters())
    fields = dict(contender=contender, steps=steps, step_ms=benchmark.stats.stats.median * 1e3 / steps,
                  parameters=parameters, micro_batches=2, batch=setting["batch"], seq=SEQ, bf16=setting["bf16"])  # fmt: skip
    benchmark.extra_info.update(fields)
    record(**fields)

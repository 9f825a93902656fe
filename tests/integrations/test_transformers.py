"""Hugging Face ``Trainer`` with SAM, ASAM and GEAR-SAM (:class:`gearsam_fused.integrations.transformers.SAMTrainer`):
the Trainer's run equals the manual two-pass loop over the same micro-batches bit for bit, with and without gradient
accumulation and clipping, in float32 and with ``bf16=True`` (against the loop with both passes under autocast); a run resumed from a checkpoint equals the uninterrupted one, and a run switched to SAM from a plain
Trainer's checkpoint equals the manual loop continued from it; the blocks of the architectures it trains. One-pass
momentum SAM (MomentumSAM) in a plain Trainer with MomentumSAMCallback and in SAMTrainer: evaluation, checkpoints and
the model after training hold w, training runs at the look-ahead point as the hand-written loop does, a resumed run
equals the uninterrupted one. Tiny models built from configs, synthetic tokens, nothing downloaded."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.heavy  # a trainer's whole loop a case: the default tier runs one

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerState,
    TrainingArguments,
    get_scheduler,
)

from gearsam_fused import GEARSAM, SAM, Every, MomentumSAM, partition  # noqa: E402
from gearsam_fused.integrations.transformers import FLAVOURS, ONE_PASS, MomentumSAMCallback, SAMTrainer  # noqa: E402

from conftest import flat, rel_err  # noqa: E402
from doc_blocks import needs_block  # noqa: E402

SEQ, N_SEQ = 12, 24
#: What GEAR-SAM says when it takes over a plain optimizer's state dict (its EMA restarts at zero).
PLAIN_STATE_WARNING = r"without a 'gearsam' entry.*EMA of block energies starts at zero"


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (N_SEQ, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return N_SEQ

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recording(SAMTrainer):
    """Records every micro-batch of the first pass, with the token count the Trainer normalises its loss by."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)


def arguments(tmp_path, **overrides) -> TrainingArguments:
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=8,
              learning_rate=3e-3, weight_decay=0.01, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
              report_to=[], seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    return TrainingArguments(**{**kw, **overrides})


def manual_run(
    trainer: Recording,
    sam: str,
    steps: int,
    ga: int,
    clip: float,
    skip=frozenset(),
    start: Path | None = None,
    bf16=(False, False),
) -> nn.Module:
    """The two-pass loop by hand over the micro-batches the Trainer saw: the same optimizer, param groups, schedule
    and loss normalisation. The steps in ``skip`` are left out (no update, no schedule step). ``start``: a checkpoint
    of a plain Trainer to continue from (its weights, its base optimizer's state dict, its schedule and step); the
    micro-batches the Trainer saw are then those from that step on. ``bf16``: whether the first and the second pass
    run the model's forward under bfloat16 autocast, as ``bf16=True`` runs it."""
    model = gpt2() if start is None else GPT2LMHeadModel.from_pretrained(start)
    decay = set(trainer.get_decay_parameter_names(model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    cls = FLAVOURS[sam][0]
    extra = {"beta": 0.9} if cls is GEARSAM else {"adaptive": sam == "asam", "eta": 0.01 if sam == "asam" else 0.0}
    base, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)  # transformers 5: AdamW, fused=True
    opt = cls(groups, base, model=model, rho=0.05, **extra, **kwargs)
    schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    first = 0
    if start is not None:
        first = TrainerState.load_from_json(str(start / "trainer_state.json")).global_step
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*" + PLAIN_STATE_WARNING)  # GEAR-SAM's, checked in the Trainer
            opt.load_state_dict(torch.load(start / "optimizer.pt", weights_only=True))
        schedule.load_state_dict(torch.load(start / "scheduler.pt", weights_only=True))

    def backward(inputs, num_items, autocast: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if num_items is not None:  # the Trainer passes the window's token count to a model that accepts it
                loss = model(**inputs, num_items_in_batch=num_items).loss
            else:
                loss = model(**inputs).loss / ga
        loss.backward()

    for step in range(first, steps):
        if step in skip:
            continue
        window = trainer.seen[(step - first) * ga : (step - first + 1) * ga]
        for inputs, num_items in window:
            backward(inputs, num_items, bf16[0])
        opt.first_step(zero_grad=True)
        for inputs, num_items in window:
            backward(inputs, num_items, bf16[1])
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.second_step(zero_grad=True)
        schedule.step()
    return model


@pytest.mark.parametrize("sam", [name for name in FLAVOURS if name not in ONE_PASS])
@pytest.mark.parametrize("ga,clip", [(1, 0.0), (3, 0.0), (2, 0.05)], ids=["plain", "accumulation", "acc-clip"])
def test_trainer_equals_the_manual_two_pass_loop(tmp_path, sam, ga, clip):
    steps = 6
    model = gpt2()
    trainer = Recording(model=model, args=arguments(tmp_path, gradient_accumulation_steps=ga, max_steps=steps,
                                                    max_grad_norm=clip), train_dataset=Tokens(), sam=sam)  # fmt: skip
    trainer.train()
    assert len(trainer.seen) == steps * ga
    want = manual_run(trainer, sam, steps, ga, clip)
    assert torch.equal(flat(model), flat(want))
    assert rel_err(flat(model), flat(gpt2())) > 1e-3  # it trained


class OnePassInFloat32(Recording):
    """Runs the forward of one pass (``"first"`` or ``"second"``) without the Trainer's autocast, which wraps the
    model's forward: what the bf16 check must catch."""

    def __init__(self, *args, plain_pass: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain_pass = plain_pass

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        which = "second" if self.sam.perturbed else "first"
        if which != self.plain_pass:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        wrapped, model.forward = model.forward, model._original_forward  # the forward as the model defines it
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            model.forward = wrapped


@pytest.mark.parametrize("sam,ga,clip", [("gear-sam", 1, 0.0), ("sam", 2, 0.05)], ids=["gear-sam", "sam-acc-clip"])
def test_bf16_as_the_trainer_sets_it_up(tmp_path, sam, ga, clip):
    """bf16=True: the Trainer runs both passes under bfloat16 autocast, and equals the manual loop with both forward
    passes under autocast, bit for bit; the step works on the float32 weights."""
    steps = 4
    model = gpt2()
    trainer = Recording(model=model, args=arguments(tmp_path, max_steps=steps, bf16=True, gradient_accumulation_steps=ga,
                                                    max_grad_norm=clip), train_dataset=Tokens(), sam=sam)  # fmt: skip
    trainer.train()
    assert next(model.parameters()).dtype == torch.float32
    assert torch.equal(flat(model), flat(manual_run(trainer, sam, steps, ga, clip, bf16=(True, True))))
    assert rel_err(flat(model), flat(manual_run(trainer, sam, steps, ga, clip))) > 1e-3  # bfloat16 is not float32
    assert rel_err(flat(model), flat(gpt2())) > 1e-3


@pytest.mark.parametrize("plain_pass", ["first", "second"])
def test_the_bf16_check_catches_a_pass_run_without_autocast(tmp_path, plain_pass):
    """A run whose first or second pass runs in float32 is not the manual bf16 loop (it equals the manual loop with
    that pass in float32): the bit-for-bit comparison above fails for it."""
    model = gpt2()
    trainer = OnePassInFloat32(model=model, args=arguments(tmp_path, max_steps=4, bf16=True), train_dataset=Tokens(),
                               plain_pass=plain_pass)  # fmt: skip
    trainer.train()
    assert not torch.equal(flat(model), flat(manual_run(trainer, "gear-sam", 4, 1, 0.0, bf16=(True, True))))
    one = (plain_pass == "second", plain_pass == "first")
    assert torch.equal(flat(model), flat(manual_run(trainer, "gear-sam", 4, 1, 0.0, bf16=one)))


class Overflowing(Recording):
    """Multiplies the loss by inf in one pass (``"first"`` or ``"second"``) of one optimizer step."""

    def __init__(self, *args, overflow_at: tuple[int, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.overflow_at = overflow_at

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        which = "second" if self.sam.perturbed else "first"
        return loss * float("inf") if (self.state.global_step, which) == self.overflow_at else loss


@pytest.mark.parametrize("which", ["first", "second"])
def test_a_loss_scaler_skips_the_whole_step_after_an_overflow_in_either_pass(tmp_path, which):
    """fp16's loss scaling (a GradScaler in the Trainer's accelerator, as on a GPU): scaling by a power of two is
    exact, so the run equals the manual loop; the step whose first or second pass overflows is skipped whole (the
    weights, the GEAR EMA and the LR schedule as before it) and the scale is lowered once."""
    steps, skipped = 4, 2
    model = gpt2()
    trainer = Overflowing(model=model, args=arguments(tmp_path, max_steps=steps), train_dataset=Tokens(),
                          overflow_at=(skipped, which))  # fmt: skip
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    trainer.train()
    assert trainer.accelerator.scaler.get_scale() == 2.0**9
    assert not trainer.sam.perturbed
    want = manual_run(trainer, "gear-sam", steps, 1, 0.0, skip={skipped})
    assert torch.equal(flat(model), flat(want))


def test_logs_carry_rho_and_every_blocks_share(tmp_path):
    trainer = SAMTrainer(model=gpt2(), args=arguments(tmp_path, max_steps=3), train_dataset=Tokens())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        shares = [entry[f"sam/share/{name}"] for name in trainer.sam.block_names]
        assert entry["sam/rho"] == 0.05 and sum(shares) == pytest.approx(1.0, abs=1e-6)
        # a share of the step's time, so the marks are in order (its size depends on the machine: not checked here)
        assert 0 < entry["sam/overhead"] < 1
    assert trainer.sam.block_names == ["stem", "transformer.h.0", "transformer.h.1", "classifier"]


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    """Saved at step 3 of 6 (SAM state and GEAR EMA in the Trainer's optimizer checkpoint), resumed by a new Trainer
    on a model with other weights: the same weights as the uninterrupted run, bit for bit."""
    common = dict(max_steps=6, gradient_accumulation_steps=2, max_grad_norm=0.05, save_strategy="steps", save_steps=3)
    model = gpt2()
    SAMTrainer(model=model, args=arguments(tmp_path / "run", **common), train_dataset=Tokens()).train()
    torch.manual_seed(123)
    resumed = GPT2LMHeadModel(gpt2().config)
    trainer = SAMTrainer(model=resumed, args=arguments(tmp_path / "resumed", **common), train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert torch.equal(flat(resumed), flat(model))


@pytest.mark.parametrize("sam", ["sam", "gear-sam"])
def test_a_run_switched_to_sam_from_a_plain_trainers_checkpoint_continues_as_the_manual_loop(tmp_path, sam):
    """A plain Trainer (torch AdamW) saves at step 3 of 6; SAMTrainer resumes from that checkpoint, taking over the
    AdamW state, the schedule and the step. The rest of the run equals the manual two-pass loop continued from the
    same checkpoint, bit for bit; GEAR-SAM warns that its EMA starts at zero, SAM has nothing to warn of."""
    common = dict(max_steps=6, gradient_accumulation_steps=2, max_grad_norm=0.05, optim="adamw_torch",
                  save_strategy="steps", save_steps=3)  # fmt: skip
    plain = Trainer(model=gpt2(), args=arguments(tmp_path / "plain", **common), train_dataset=Tokens())
    plain.train()
    checkpoint = tmp_path / "plain" / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert type(plain.optimizer.optimizer) is torch.optim.AdamW and "gearsam" not in saved["param_groups"][0]

    torch.manual_seed(123)
    model = GPT2LMHeadModel(gpt2().config)  # other weights: everything must come from the checkpoint
    trainer = Recording(model=model, args=arguments(tmp_path / "sam", **common), train_dataset=Tokens(), sam=sam)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(checkpoint))
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert sum(bool(re.search(PLAIN_STATE_WARNING, m)) for m in said) == (sam == "gear-sam"), said
    assert trainer.state.global_step == 6 and len(trainer.seen) == 3 * 2
    # AdamW's state went on from the plain run's: 3 plain steps, then 3 SAM steps
    adam = trainer.sam.state
    assert len(adam) == len(list(model.parameters())) and all(s["step"].item() == 6 for s in adam.values())
    assert all(group["rho"] == 0.05 for group in trainer.sam.param_groups)
    want = manual_run(trainer, sam, 6, 2, 0.05, start=checkpoint)
    assert torch.equal(flat(model), flat(want))
    assert rel_err(flat(model), flat(GPT2LMHeadModel.from_pretrained(checkpoint))) > 1e-3  # it trained on


def test_a_wrapped_model_keeps_the_bare_models_blocks_and_a_given_optimizer_is_used(tmp_path):
    model = gpt2()
    opt = SAM(torch.compile(model), torch.optim.AdamW, lr=1e-3)
    trainer = SAMTrainer(model=model, args=arguments(tmp_path, max_steps=1), train_dataset=Tokens(),
                         optimizers=(opt, None))  # fmt: skip
    trainer.train()
    assert trainer.sam is opt and opt.block_names == ["stem", "transformer.h.0", "transformer.h.1", "classifier"]


def test_what_cannot_work_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="sam must be one of"):
        SAMTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=Tokens(), sam="lookahead")
    with pytest.raises(TypeError, match="needs a SAM or GEARSAM optimizer"):
        model = gpt2()
        SAMTrainer(model=model, args=arguments(tmp_path), train_dataset=Tokens(),
                   optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))  # fmt: skip
    with pytest.raises(ValueError, match="takes one gradient every step: a schedule"):
        SAMTrainer(
            model=gpt2(), args=arguments(tmp_path), train_dataset=Tokens(), sam="momentum-sam", schedule=Every(2)
        )
    model = gpt2()
    adamw = torch.optim.AdamW(model.parameters())
    plain = Trainer(model=model, args=arguments(tmp_path, max_steps=1), train_dataset=Tokens(),
                    optimizers=(adamw, None), callbacks=[MomentumSAMCallback()])  # fmt: skip
    with pytest.raises(TypeError, match="MomentumSAMCallback needs an optimizer with eval.. and train.., .*got AdamW"):
        plain.train()


# ------------------------------------------------------------------------------ a small CNN through the Trainer
class SmallCNN(nn.Module):
    """A Trainer-style model: keyword inputs, returns the loss first."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU())
        self.stage = nn.Sequential(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()))
        self.head = nn.Linear(8, 4)

    def forward(self, pixel_values, labels):
        logits = self.head(self.stage(self.stem(pixel_values)).mean((2, 3)))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Images(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(2)
        self.x, self.y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def test_a_cnn_with_batchnorm_equals_the_manual_loop_with_frozen_statistics(tmp_path):
    from gearsam_fused import frozen_bn_stats

    torch.manual_seed(0)
    model = SmallCNN()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Recording(model=model, args=arguments(tmp_path, max_steps=4, gradient_accumulation_steps=2,
                                                    max_grad_norm=1.0, optim="sgd", learning_rate=0.05),
                        train_dataset=Images())  # fmt: skip
    trainer.train()
    twin = SmallCNN()
    twin.load_state_dict(start)
    base, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, twin)
    decay = set(trainer.get_decay_parameter_names(twin))
    groups = [{"params": [p for n, p in twin.named_parameters() if n in decay], "weight_decay": 0.01},
              {"params": [p for n, p in twin.named_parameters() if n not in decay], "weight_decay": 0.0}]  # fmt: skip
    opt = GEARSAM(groups, base, model=twin, rho=0.05, beta=0.9, **kwargs)
    schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=4)
    for step in range(4):
        window = trainer.seen[2 * step : 2 * step + 2]
        for inputs, _ in window:
            (twin(**inputs)["loss"] / 2).backward()
        opt.first_step(zero_grad=True)
        with frozen_bn_stats(twin):
            for inputs, _ in window:
                (twin(**inputs)["loss"] / 2).backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        opt.second_step(zero_grad=True)
        schedule.step()
    assert torch.equal(flat(model), flat(twin))
    assert torch.equal(model.stem[1].running_mean, twin.stem[1].running_mean)
    assert trainer.sam.block_names == ["stem", "stage", "classifier"]


# ------------------------------------------------------------------------------ the blocks of HF architectures
def tiny(family: str) -> nn.Module:
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    if family == "gpt2":
        return gpt2()
    if family == "bert":
        return transformers.BertForSequenceClassification(
            transformers.BertConfig(vocab_size=64, max_position_embeddings=16, num_labels=3, **common)
        )
    if family == "roberta":
        return transformers.RobertaForMaskedLM(
            transformers.RobertaConfig(vocab_size=64, max_position_embeddings=20, **common)
        )
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, num_key_value_heads=1, **common))
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(image_size=16, patch_size=4, num_labels=3, **common)
    )


BLOCKS = {
    "gpt2": ("coarse", ["stem", "transformer.h.0", "transformer.h.1", "classifier"]),
    "bert": ("coarse", ["stem", "bert.encoder.layer.0", "bert.encoder.layer.1", "classifier"]),
    "roberta": ("coarse", ["stem", "roberta.encoder.layer.0", "roberta.encoder.layer.1", "classifier"]),
    "llama": ("coarse", ["stem", "model.layers.0", "model.layers.1", "classifier"]),
    "vit": ("fine", ["vit.embeddings", "vit.layers.0", "vit.layers.1", "classifier"]),
}


@pytest.mark.parametrize("family", list(BLOCKS))
def test_the_blocks_of_each_architecture_family(family):
    """Embeddings, each transformer layer, then the final norm with the head (ViT: "coarse" keeps its layers in one
    block, "fine" gives one per layer)."""
    strategy, names = BLOCKS[family]
    model = tiny(family)
    blocks = partition(model, strategy)
    assert [b.name for b in blocks] == names
    first, last = blocks[0].param_names, blocks[-1].param_names
    assert any("emb" in n or "wte" in n for n in first), first
    # the final norm and the head (GPT-2's head is tied to the embedding, so its last block is the final norm)
    assert any(k in n for n in last for k in ("norm", "ln_f", "head", "classifier")), last


def test_the_readme_example_runs(tmp_path, monkeypatch):
    block, where = needs_block("# needs: transformers")  # in the documentation's integrations page
    monkeypatch.chdir(tmp_path)  # it writes to "out"
    namespace = {"dataset": Tokens()}
    exec(compile(block, where, "exec"), namespace)
    trainer = namespace["trainer"]
    layers = [f"transformer.h.{i}" for i in range(4)]
    assert trainer.state.global_step == 20 and trainer.sam.block_names == ["stem", *layers, "classifier"]
    assert any("sam/share/stem" in entry for entry in trainer.state.log_history)


def test_importing_the_library_imports_no_trainer_framework():
    code = "import sys, gearsam_fused; print(sorted({'transformers', 'lightning', 'accelerate'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# ------------------------------------------------------------------------------ one-pass momentum SAM
class Watching(Trainer):
    """Records every micro-batch with its token count, the weights each training forward ran at, and the weights each
    evaluation saw (with the step it came after)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.trained_at, self.evaluated_at = [], [], []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = flat(model).clone()
        if model.training:
            self.trained_at.append(weights)
        else:
            self.evaluated_at.append((self.state.global_step, weights))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def momentum_sam(model: nn.Module, **kw) -> MomentumSAM:
    return MomentumSAM(model, torch.optim.AdamW, rho=0.5, lr=3e-3, weight_decay=0.01, **kw)


def momentum_loop(seen: list, steps: int) -> tuple[list, list]:
    """The one-call loop by hand over the Trainer's micro-batches (one per step), with the Trainer's linear schedule:
    the look-ahead point before each step and after the last, and after each step w from ``opt.eval()`` (then
    ``opt.train()`` again)."""
    model = gpt2()
    opt = momentum_sam(model)
    schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    lookahead, w = [], []
    for inputs, num_items in seen:
        lookahead.append(flat(model).clone())
        model(**inputs, num_items_in_batch=num_items).loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
        opt.eval()
        w.append(flat(model).clone())
        opt.train()
    return [*lookahead, flat(model).clone()], w


def test_momentum_sam_in_a_plain_trainer_evaluates_and_saves_w_and_trains_at_the_lookahead_point(tmp_path):
    """MomentumSAM given to a plain Trainer with MomentumSAMCallback; evaluation at steps 4 and 6 (the last), checkpoints
    at 3 and 6. Each evaluation sees w (the Trainer's own optimizer.eval()), the checkpoint of step 3, where nothing was
    evaluated, holds w (the callback), every training forward runs at the look-ahead point of the hand-written loop
    (so each move to w and back was exact), and after training the model holds w."""
    steps = 6
    model = gpt2()
    opt = momentum_sam(model)
    args = arguments(tmp_path, max_steps=steps, eval_strategy="steps", eval_steps=4, save_strategy="steps",
                     save_steps=3, per_device_eval_batch_size=N_SEQ, logging_steps=steps)  # fmt: skip
    trainer = Watching(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), optimizers=(opt, None),
                       callbacks=[MomentumSAMCallback()])  # fmt: skip
    trainer.train()
    lookahead, w = momentum_loop(trainer.seen, steps)

    assert len(trainer.trained_at) == steps
    assert all(torch.equal(a, b) for a, b in zip(trainer.trained_at, lookahead[:steps], strict=True))
    assert [step for step, _ in trainer.evaluated_at] == [4, 6]
    for step, weights in trainer.evaluated_at:
        assert torch.equal(weights, w[step - 1]) and not torch.equal(weights, lookahead[step])  # w, not w~
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "checkpoint-3")
    assert torch.equal(flat(saved), w[2]) and not torch.equal(flat(saved), lookahead[3])
    state = torch.load(tmp_path / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert state["param_groups"][0]["gearsam"]["training"] is False  # saved in eval mode, with the model's w
    assert not opt.training and torch.equal(flat(model), w[-1])


def test_momentum_sam_trainer_resumes_from_a_checkpoint_exactly(tmp_path):
    """SAMTrainer(sam="momentum-gear-sam") builds MomentumSAM from the TrainingArguments (GEAR-SAM's allocation) and
    adds the callback; saved at step 3 of 6, resumed by a new Trainer on a model with other weights: the weights after
    training are the uninterrupted run's w, bit for bit (the resumed run saves nothing: w comes from the end of
    training), and the logs carry rho and the blocks' shares."""
    common = dict(max_steps=6, gradient_accumulation_steps=2, max_grad_norm=0.05, optim="adamw_torch",
                  save_strategy="steps", save_steps=3)  # fmt: skip
    model = gpt2()
    whole = SAMTrainer(model=model, args=arguments(tmp_path / "run", **common), train_dataset=Tokens(),
                       sam="momentum-gear-sam", rho=0.5)  # fmt: skip
    whole.train()
    assert isinstance(whole.sam, MomentumSAM) and whole.sam.rule == "gear-sam" and not whole.sam.training
    logs = [entry for entry in whole.state.log_history if "loss" in entry]
    assert all(entry["sam/rho"] == 0.5 for entry in logs) and len(logs) == 6
    assert sum(logs[-1][f"sam/share/{name}"] for name in whole.sam.block_names) == pytest.approx(1.0, abs=1e-6)
    torch.manual_seed(123)
    resumed = GPT2LMHeadModel(gpt2().config)
    trainer = SAMTrainer(model=resumed, args=arguments(tmp_path / "resumed", **{**common, "save_strategy": "no"}),
                         train_dataset=Tokens(), sam="momentum-gear-sam", rho=0.5)  # fmt: skip
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert torch.equal(flat(resumed), flat(model)) and not trainer.sam.training
    assert rel_err(flat(model), flat(GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-3"))) > 1e-4

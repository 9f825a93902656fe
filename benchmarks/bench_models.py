"""A whole training step of real models built from their configurations (random weights), and what SAM adds to it.

Models (:data:`MODELS`), each at its real size on CUDA with bf16 autocast, and on CPU, or in quick mode anywhere, at a
tiny size in float32 on CPU (bf16 autocast still on CUDA) so that a smoke run takes seconds:

=====================  ===============================================  =============================================
model                  CUDA                                             tiny (CPU, quick mode)
=====================  ===============================================  =============================================
``ResNet-50``          ``torchvision.models.resnet50``, batch 128,      the same network, 10 classes, batch 2, 64x64
                       224x224, channels_last, SGD
``ViT-B/16``           ``timm`` ``vit_base_patch16_224``, batch 64,     2 layers, width 64, 2 heads, patch 8, 32x32,
                       224x224, AdamW                                   10 classes, batch 2
``GPT-2 small``        ``transformers.GPT2LMHeadModel(GPT2Config())``,  2 layers, width 64, 2 heads, a vocabulary of
                       batch 8 x 1024 tokens, AdamW                     1000, batch 2 x 32 tokens
``CIFAR ResNet-18``    ``gearsam_fused.models.resnet18``, width 64,     width 8, batch 8
                       batch 128, 32x32, channels_last, SGD
=====================  ===============================================  =============================================

A model whose package (torchvision, timm, transformers) is not installed is skipped, the skip saying which.

Rows per model (:data:`CONTENDERS`), all around the same base optimizer: the CNNs torch's SGD (momentum 0.9, weight
decay 5e-4), the transformers torch's AdamW (weight decay 0.01), each contender at its best:

* ``base optimizer``, ``base optimizer (fused)``  one forward+backward pass and the base optimizer's step, with
  ``foreach=True`` and with ``fused=True``: what SAM is compared against, the faster of the two in the same rounds
* ``per-tensor loop SAM``   :class:`contenders.PerTensorLoopSAM` around the base optimizer with ``fused=True``
* ``pytorch_optimizer``     ``pytorch_optimizer.SAM(..., foreach=True)`` (left out, its rows saying so, when it is not
  installed); its ``foreach`` reaches the base optimizer too, so its base optimizer runs ``foreach=True`` (torch
  refuses it together with ``fused=True``)
* ``compiled foreach SAM``  ``contenders.CompiledForeachSAM(params, base, rho=0.05, rule="sam", **base_kwargs)``: a
  ``torch.compile``-d foreach SAM perturbation with float32 norms, and a ``torch.compile``-d function holding its
  restore and the base optimizer's ``step()`` (built with ``foreach=True``); compiling happens in the warm-up, and the
  row records how long the calls that compiled took (``compile_s``)
* ``SAM``, ``GEAR-SAM``     gearsam_fused, ``backend="auto"``, ``base_step="auto"``: the base step runs fused into the
  restore (the row's ``base_step_mode`` says which path ran, ``base_step_reason`` why when it was not fused)

One test per model builds every row's model (the same seed: the same weights), three more copies for the parts below,
warms each up, then times them in turn (``conftest.step_in_turn``): a round steps every row and every part once,
each timed alone, the order turned by one place each round. The parts of a round: one forward+backward pass (on a
copy of its own, its gradients left to accumulate), and one ``step()`` of the base optimizer with ``foreach=True``
and one with ``fused=True`` (each on a copy of its own, its gradients computed once). From each round of a SAM row
(:func:`report.sam_parts`, its SGD step being this round's forward+backward plus the faster base step of the run)

    beyond 2 x (forward+backward) = SAM step - 2 x (forward+backward)
    SAM tax                       = SAM step - 2 x (forward+backward) - base step

``beyond`` is everything in a SAM step that is not one of its two passes: the gradient norm, perturbation and restore,
the base update and two ``zero_grad``. The tax is what SAM itself adds: ``beyond`` minus the base optimizer's own
step. A row records the median and quartiles of both in ms (``beyond_ms``, ``tax_ms``), the tax's median share of
the step in % (``tax_pct``), the step over the same round's forward+backward plus base step (``over_plain``), which
base step that was (``base_step_path``), and, as every row, its time in each round (``round_ms``) and its ratios to
the other rows of the same rounds, medians of per-round ratios with quartiles and range (``rows.interleaved_fields``):
``vs`` (the per-tensor loop's, pytorch_optimizer's and the compiled foreach SAM's time over this row's) and ``over``
(this row's time over the faster ``base optimizer`` row's).

Memory (CUDA only; ``None`` on CPU, where torch has no allocator statistics to read): ``peak_mib`` is the allocator's
peak during one step of the row after its warm-up, ``held_mib`` what stays allocated after it (model, gradients,
optimizer state, SAM's buffers), both above what was allocated before its model was built (the rows are built and
warmed up one after the other, before the parts' copies).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.models import resnet18

import contenders
from conftest import DEVICE, step_in_turn, synchronize, warm_up
from report import MODELS_IN_TURN_NOTE, MODELS_NOTE, model_table, quartiles, sam_parts
from rows import faster_path, interleaved_fields

RHO = 0.05
BASE, BASE_FUSED = "base optimizer", "base optimizer (fused)"
LOOP, PEER, COMPILED = "per-tensor loop SAM", "pytorch_optimizer", contenders.COMPILED
SAM_ROWS = [LOOP, PEER, COMPILED, "SAM", "GEAR-SAM"]
CONTENDERS = [BASE, BASE_FUSED, *SAM_ROWS]
#: the parts each round also times: one forward+backward pass, one base step with each flag
FORWARD_BACKWARD = "forward+backward"
BASE_STEP_PARTS = {"foreach=True": "base step (foreach)", "fused=True": "base step (fused)"}
#: what every row is compared with in the same rounds: label -> the rows it stands for (the faster one taken)
REFERENCES = {LOOP: (LOOP,), PEER: (PEER,), COMPILED: (COMPILED,)}
OVER = {BASE: (BASE, BASE_FUSED)}
MIB = 2**20


@dataclass(frozen=True)
class Model:
    """A model of the benchmark: its name, the package it needs (None: this repository's), its base optimizer, and
    ``build(tiny) -> (model, loss, setting)``, ``loss(module)`` computing the loss of the fixed batch through
    ``module`` and ``setting`` describing the size for the row."""

    name: str
    package: str | None
    base: str  # "SGD" or "AdamW"
    build: Callable[[bool], tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor], dict]]


def _images(batch: int, size: int, classes: int):
    x = torch.randn(batch, 3, size, size, device=DEVICE)
    y = torch.randint(0, classes, (batch,), device=DEVICE)
    if DEVICE == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    return lambda module: F.cross_entropy(module(x), y)


def _resnet50(tiny: bool):
    import torchvision

    batch, size, classes = (2, 64, 10) if tiny else (128, 224, 1000)
    model = torchvision.models.resnet50(weights=None, num_classes=classes)
    return model, _images(batch, size, classes), {"batch": batch, "image": size, "classes": classes}


def _vit_b16(tiny: bool):
    import timm

    shape = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10) if tiny else {}
    model = timm.create_model("vit_base_patch16_224", pretrained=False, **shape)  # pretrained=False: no download
    batch, size, classes = (2, 32, 10) if tiny else (64, 224, 1000)
    return model, _images(batch, size, classes), {"batch": batch, "image": size, "depth": 2 if tiny else 12,
                                                  "width": 64 if tiny else 768}  # fmt: skip


def _gpt2_small(tiny: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=32) if tiny else {}
    config = GPT2Config(**shape)  # the defaults are GPT-2 small: 12 layers, width 768, 50257 tokens, 1024 positions
    model = GPT2LMHeadModel(config)
    batch, length = (2, 32) if tiny else (8, 1024)
    ids = torch.randint(0, config.vocab_size, (batch, length), device=DEVICE)
    setting = {"batch": batch, "tokens": length, "layers": config.n_layer, "width": config.n_embd}
    return model, lambda module: module(input_ids=ids, labels=ids).loss, setting


def _cifar_resnet18(tiny: bool):
    width, batch = (8, 8) if tiny else (64, 128)
    model = resnet18(num_classes=10, width=width)
    return model, _images(batch, 32, 10), {"batch": batch, "image": 32, "width": width}


MODELS = {
    "resnet50": Model("ResNet-50", "torchvision", "SGD", _resnet50),
    "vit_b16": Model("ViT-B/16", "timm", "AdamW", _vit_b16),
    "gpt2_small": Model("GPT-2 small", "transformers", "AdamW", _gpt2_small),
    "cifar_resnet18": Model("CIFAR ResNet-18", None, "SGD", _cifar_resnet18),
}
CHANNELS_LAST = {"ResNet-50", "CIFAR ResNet-18"}


def base_optimizer(model: Model, contender: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The base optimizer's class and arguments for ``contender``: ``fused=True`` for the ``(fused)`` base optimizer
    row and the per-tensor loop (torch's fastest step, on CPU and CUDA), ``foreach=True`` for the other base optimizer
    row, ours and the peer (whose ``foreach`` reaches its base optimizer; torch refuses both flags together); the
    compiled contender adds ``foreach=True`` itself."""
    flag = {"fused": True} if contender in (BASE_FUSED, LOOP) else {"foreach": True}
    if model.base == "SGD":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, **flag}
    return torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01, **flag}


def _not_available(model: Model) -> str:
    """Why this model cannot run here ("" when it can)."""
    if model.package is not None:
        try:
            importlib.import_module(model.package)
        except ImportError:
            return f"{model.package} is not installed: {model.name} is skipped"
    return ""


def _problem(model: Model, quick: bool):
    tiny = quick or DEVICE != "cuda"
    torch.manual_seed(0)
    module, loss, setting = model.build(tiny)
    module = module.to(DEVICE).train()
    channels_last = DEVICE == "cuda" and model.name in CHANNELS_LAST
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    autocast = DEVICE == "cuda"  # bf16 autocast on CUDA; float32 on CPU
    setting = {"model": model.name, **setting, "tiny": tiny, "channels_last": channels_last,
               "autocast": "torch.bfloat16" if autocast else None}  # fmt: skip

    def forward_backward(target=module):
        with torch.autocast(DEVICE, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            value = loss(target)
        value.backward()

    return module, forward_backward, setting


def _contender_step(name: str, model: Model, module, forward_backward):
    """The step to time for row ``name``, with ``.optimizer`` (None for the base optimizer's row)."""
    base_cls, base_kwargs = base_optimizer(model, name)
    if name in (BASE, BASE_FUSED):
        opt = base_cls(module.parameters(), **base_kwargs)

        def step():
            opt.zero_grad(set_to_none=False)
            forward_backward()
            opt.step()

        step.optimizer = None
        return step
    if name == LOOP:
        opt = contenders.PerTensorLoopSAM(module.parameters(), lambda params: base_cls(params, **base_kwargs), rho=RHO)
        holder = module  # the loop keeps no gradient buffers: the model's own gradients are zeroed
    elif name == PEER:
        import pytorch_optimizer as peer

        opt = holder = peer.SAM(module.parameters(), base_cls, rho=RHO, **base_kwargs)  # foreach=True: its SAM too
    elif name == COMPILED:  # it builds its base optimizer with foreach=True itself; dynamo reset by the caller
        kwargs = {k: v for k, v in base_kwargs.items() if k not in ("foreach", "fused")}
        opt = contenders.CompiledForeachSAM(module.parameters(), base_cls, rho=RHO, rule="sam", reset=False, **kwargs)
        holder = module
    else:
        opt = holder = (SAM if name == "SAM" else GEARSAM)(module, base_cls, rho=RHO, **base_kwargs)

    return contenders.two_pass_step(opt, holder, forward_backward)


def _allocated() -> int:
    gc.collect()
    synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _synchronised(step):
    def synchronised():
        step()
        synchronize()

    return synchronised


@pytest.mark.parametrize("key", list(MODELS))
def test_model_step(record_rounds, quick, leave_out, key):
    model = MODELS[key]
    reason = _not_available(model)
    if reason:
        pytest.skip(reason)
    missing = {**contenders.not_installed(), **leave_out}
    names = [name for name in CONTENDERS if name not in missing]
    for note in contenders.not_installed().values():
        warnings.warn(note, stacklevel=1)
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # no graph of an earlier model is reused or counted
    steps, optimizers, settings, memory, extra = {}, {}, {}, {}, {name: {} for name in names}
    for name in names:  # each row's model, built, warmed up and (CUDA) its memory read before the next is built
        start_bytes = _allocated() if DEVICE == "cuda" else 0
        module, forward_backward, setting = _problem(model, quick)
        step = _contender_step(name, model, module, forward_backward)
        steps[name], optimizers[name], settings[name] = _synchronised(step), step.optimizer, setting
        if quick:  # a smoke run: one step warms up, two for the compiled contender, which compiles again on its second
            warm_up(steps[name], min_steps=2 if name == COMPILED else 1, min_seconds=0.0)
        else:
            warm_up(steps[name])
        memory[name] = {"peak_mib": None, "held_mib": None}
        if DEVICE == "cuda":  # one step of this row alone
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
            steps[name]()
            memory[name] = {"peak_mib": (torch.cuda.max_memory_allocated() - start_bytes) / MIB,
                            "held_mib": (torch.cuda.memory_allocated() - start_bytes) / MIB}  # fmt: skip
        kwargs = base_optimizer(model, name)[1]
        flags = "fused=True" if kwargs.get("fused") else "foreach=True" + (", compiled" if name == COMPILED else "")
        extra[name] = {"base": model.base, "base_kwargs": repr(kwargs), "base_flags": flags}
        if hasattr(step.optimizer, "compile_s"):  # the compiled contender: the warm-up's calls that compiled
            extra[name]["compile_s"] = step.optimizer.compile_s
        if hasattr(step.optimizer, "base_step_mode"):  # ours: whether the base step ran fused into the restore
            extra[name]["base_step_mode"] = step.optimizer.base_step_mode
            extra[name]["base_step_reason"] = step.optimizer.base_step_reason
    # the parts of each round, each on a copy of its own: one forward+backward pass, one base step with each flag
    fb_module, fb_pass, _ = _problem(model, quick)
    parts = {FORWARD_BACKWARD: _synchronised(lambda: fb_pass(fb_module))}
    for flag, part in BASE_STEP_PARTS.items():
        reference, ref_pass, _ = _problem(model, quick)
        cls, kwargs = base_optimizer(model, BASE_FUSED if flag == "fused=True" else BASE)
        reference_step = cls(reference.parameters(), **kwargs)
        ref_pass(reference)  # its gradients, computed once
        parts[part] = _synchronised(reference_step.step)
    for part in parts.values():
        warm_up(part, min_steps=1 if quick else 3, min_seconds=0.0)
    rounds = 3 if quick else (20 if DEVICE == "cuda" else 10)
    seconds, _ = step_in_turn({**steps, **parts}, rounds)
    for name in names:
        if "compile_s" in extra[name]:  # the compiled contender compiles in the warm-up, never in the rounds
            assert optimizers[name].compile_s == extra[name]["compile_s"], f"{name} compiled again while it was timed"
    ms = {name: [1e3 * t for t in seconds[name]] for name in names}
    ratios = interleaved_fields(ms, REFERENCES, OVER)
    fb = seconds[FORWARD_BACKWARD]
    path = faster_path({flag: seconds[part] for flag, part in BASE_STEP_PARTS.items()}, tuple(BASE_STEP_PARTS))
    base = seconds[BASE_STEP_PARTS[path]]
    for name in names:
        fields = dict(extra[name])
        if name in SAM_ROWS:
            parts_fields = sam_parts(seconds[name], fb, [f + b for f, b in zip(fb, base)])
            parts_fields.pop("sgd_ms")
            fields.update({k.replace("over_sgd", "over_plain"): v for k, v in parts_fields.items()})
            fields.update(base_step_ms=1e3 * quartiles(base)[1], base_step_path=path)
        record_rounds(seconds[name], contender=name, **settings[name], **fields, **ratios[name], **memory[name],
                      stepped_in_turn=names, left_out=missing)  # fmt: skip


def table(rows: list[dict]) -> str:
    """The rows of one run of this benchmark as Markdown, one table per model (``report.model_table``)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: CONTENDERS.index(r["contender"]))
        first = mine[0]
        size = ", ".join(
            f"{k} {first[k]}" for k in ("batch", "image", "tokens", "layers", "depth", "width") if k in first
        )
        out += [f"### {model} ({size}{', tiny' if first['tiny'] else ''}), {first['device']}, base {first['base']}",
                "", *model_table(mine), ""]  # fmt: skip
    return "\n".join(out + ([MODELS_IN_TURN_NOTE if any("vs" in r for r in rows) else MODELS_NOTE] if rows else []))


def main(argv: list[str]) -> int:
    """``python benchmarks/bench_models.py RESULTS.jsonl [OUT.md]``: print the tables of the newest run of this
    benchmark in RESULTS.jsonl, and write them to OUT.md when given."""
    if len(argv) not in (1, 2):
        print("usage: python benchmarks/bench_models.py RESULTS.jsonl [OUT.md]", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if r.get("benchmark") == "bench_models"]
    if not rows:
        print(f"no rows of bench_models in {argv[0]}", file=sys.stderr)
        return 1
    run = rows[-1]
    where = run["gpu"] or f"CPU {run['cpu']} ({run['cpu_count']} cores)"
    heading = f"## Training steps of real models: run {run['run']}, {run['date']}, commit {run['commit']}, {where}"
    text = "\n".join([heading, "", table([r for r in rows if r["run"] == run["run"]])])
    print(text)
    if len(argv) == 2:
        with open(argv[1], "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

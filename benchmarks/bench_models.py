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
decay 5e-4, ``foreach=True``), the transformers torch's AdamW (weight decay 0.01; ``fused=True`` on CUDA,
``foreach=True`` on CPU):

* ``base optimizer``        one forward+backward pass and the base optimizer's step: what SAM is compared against
* ``per-tensor loop SAM``   :class:`contenders.PerTensorLoopSAM` around the base optimizer
* ``pytorch_optimizer``     ``pytorch_optimizer.SAM(..., foreach=True)`` (skipped with a note when it is not installed);
  its ``foreach`` reaches the base optimizer too, so its AdamW runs ``foreach=True`` (torch refuses it together with
  ``fused=True``)
* ``compiled foreach SAM``  ``contenders.CompiledForeachSAM(params, base, rho=0.05, rule="sam", **base_kwargs)``: a
  ``torch.compile``-d foreach SAM step around the compiled ``step()`` of its base optimizer, which it builds with
  ``foreach=True``; compiling happens in the warm-up, and the row records how long the calls that compiled took
  (``compile_s``)
* ``SAM``, ``GEAR-SAM``     gearsam_fused, ``backend="auto"``, ``base_step="auto"``: the base step runs fused into the
  restore where it can (the transformers' AdamW without ``fused=True``, which the fused step does not take; the
  row's ``base_step_mode`` says which path ran, ``base_step_reason`` why when it was not fused)

Every round of a SAM row times, back to back on the same batch, one forward+backward pass (on the contender's own
model), one ``step()`` of the base optimizer as the ``base optimizer`` row runs it (on a copy of the model, its
gradients computed once; AdamW with ``fused=True`` on CUDA, torch's fastest) and then the SAM step
(``zero_grad``, forward+backward, ``first_step``, ``zero_grad``, forward+backward, ``second_step``), and from each
round (:func:`report.sam_parts`, its SGD step being this round's forward+backward plus base step)

    beyond 2 x (forward+backward) = SAM step - 2 x (forward+backward)
    SAM tax                       = SAM step - 2 x (forward+backward) - base step

``beyond`` is everything in a SAM step that is not one of its two passes: the gradient norm, perturbation and restore,
the base update and two ``zero_grad``. The tax is what SAM itself adds: ``beyond`` minus the base optimizer's own
step. A row records the median and quartiles of both in ms (``beyond_ms``, ``tax_ms``), the tax's median share of
the step in % (``tax_pct``), and the step over the same round's forward+backward plus base step (``over_plain``).

Memory (CUDA only; ``None`` on CPU, where torch has no allocator statistics to read): ``peak_mib`` is the allocator's
peak during one step of the row after its warm-up, ``held_mib`` what stays allocated after it (model, gradients,
optimizer state, SAM's buffers), both above what was allocated when the row started, before its model was built.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from gearsam_fused import GEARSAM, SAM
from gearsam_fused.models import resnet18

import contenders
from conftest import DEVICE, synchronize, warm_up
from report import quartiles, sam_parts

RHO = 0.05
BASE = "base optimizer"
COMPILED = "compiled foreach SAM"
SAM_ROWS = ["per-tensor loop SAM", "pytorch_optimizer", COMPILED, "SAM", "GEAR-SAM"]
CONTENDERS = [BASE, *SAM_ROWS]
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
    """The base optimizer's class and arguments for ``contender``: SGD with ``foreach=True``; AdamW with ``fused=True``
    on CUDA (``foreach=True`` on CPU), except for ours, the peer and the compiled contender, which take it with
    ``foreach=True`` (the compiled contender adds that flag itself)."""
    if model.base == "SGD":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "foreach": True}
    fused = DEVICE == "cuda" and contender not in ("SAM", "GEAR-SAM", "pytorch_optimizer", COMPILED)
    return torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.01, **({"fused": True} if fused else {"foreach": True})}


def _not_available(model: Model, contender: str) -> str:
    """Why this row cannot run here ("" when it can)."""
    if model.package is not None:
        try:
            importlib.import_module(model.package)
        except ImportError:
            return f"{model.package} is not installed: {model.name} is skipped"
    missing = contenders.not_installed()
    if contender in missing:
        return missing[contender]
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
    if name == BASE:
        opt = base_cls(module.parameters(), **base_kwargs)

        def step():
            opt.zero_grad(set_to_none=False)
            forward_backward()
            opt.step()

        step.optimizer = None
        return step
    if name == "per-tensor loop SAM":
        opt = contenders.PerTensorLoopSAM(module.parameters(), lambda params: base_cls(params, **base_kwargs), rho=RHO)
        holder = module  # the loop keeps no gradient buffers: the model's own gradients are zeroed
    elif name == "pytorch_optimizer":
        import pytorch_optimizer as peer

        opt = holder = peer.SAM(module.parameters(), base_cls, rho=RHO, **base_kwargs)  # foreach=True: its SAM too
    elif name == COMPILED:  # it builds its base optimizer with foreach=True itself
        kwargs = {k: v for k, v in base_kwargs.items() if k not in ("foreach", "fused")}
        opt = contenders.CompiledForeachSAM(module.parameters(), base_cls, rho=RHO, rule="sam", **kwargs)
        holder = module
    else:
        opt = holder = (SAM if name == "SAM" else GEARSAM)(module, base_cls, rho=RHO, **base_kwargs)

    return contenders.two_pass_step(opt, holder, forward_backward)


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


def _allocated() -> int:
    gc.collect()
    synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("name", CONTENDERS)
@pytest.mark.parametrize("key", list(MODELS))
def test_model_step(benchmark, record, quick, key, name):
    model = MODELS[key]
    reason = _not_available(model, name)
    if reason:
        pytest.skip(reason)
    start_bytes = _allocated() if DEVICE == "cuda" else 0
    module, forward_backward, setting = _problem(model, quick)
    step = _contender_step(name, model, module, forward_backward)

    def synchronised_step():
        step()
        synchronize()

    if quick:  # a smoke run: one step warms up, two for the compiled contender, which compiles again on its second
        warm_up(synchronised_step, min_steps=2 if name == COMPILED else 1, min_seconds=0.0)
    else:
        warm_up(synchronised_step)
    memory = {"peak_mib": None, "held_mib": None}
    if DEVICE == "cuda":  # one step of this row alone, before the parts below allocate their copy of the model
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        synchronised_step()
        memory = {"peak_mib": (torch.cuda.max_memory_allocated() - start_bytes) / MIB,
                  "held_mib": (torch.cuda.memory_allocated() - start_bytes) / MIB}  # fmt: skip
    base_cls, base_kwargs = base_optimizer(model, BASE)
    extra = {"base": model.base, "base_kwargs": repr(base_optimizer(model, name)[1])}
    parts = {"forward+backward": [], "base step": []}
    setup = None
    if name in SAM_ROWS:
        reference = copy.deepcopy(module)  # the base step of each round updates a copy, leaving the contender's alone
        reference_step = base_cls(reference.parameters(), **base_kwargs)
        forward_backward(reference)  # its gradients, computed once
        warm_up(reference_step.step, min_steps=1 if quick else 3, min_seconds=0.0)

        def setup():  # not timed by the benchmark: the parts of this round, just before its SAM step
            parts["forward+backward"].append(_timed(forward_backward))
            parts["base step"].append(_timed(reference_step.step))
            return (), {}

    benchmark.group = f"model step, {model.name}{' (tiny)' if setting['tiny'] else ''}, {DEVICE}"
    rounds = 3 if quick else (20 if DEVICE == "cuda" else 10)
    benchmark.pedantic(synchronised_step, setup=setup, rounds=rounds, iterations=1)
    if name in SAM_ROWS:
        fb, base = parts["forward+backward"], parts["base step"]
        fields = sam_parts(benchmark.stats.stats.data, fb, [f + b for f, b in zip(fb, base)])
        fields.pop("sgd_ms")
        fields["base_step_ms"] = 1e3 * quartiles(base)[1]
        extra.update({k.replace("over_sgd", "over_plain"): v for k, v in fields.items()})
        if hasattr(step.optimizer, "compile_s"):  # the compiled contender: the warm-up's calls that compiled
            extra["compile_s"] = step.optimizer.compile_s
        if hasattr(step.optimizer, "base_step_mode"):  # ours: whether the base step ran fused into the restore
            extra["base_step_mode"] = step.optimizer.base_step_mode
            extra["base_step_reason"] = step.optimizer.base_step_reason
    fields = dict(contender=name, **setting, **extra, **memory)
    benchmark.extra_info.update(fields)
    record(**fields)
    if name == COMPILED and hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # the compiled graphs and what they hold go with the row


def table(rows: list[dict]) -> str:
    """The rows of one run of this benchmark as Markdown, one table per model."""

    def ms(row, key):
        value = row.get(key)
        if value is None:
            return ""
        spread = (row.get(f"{key[:-3]}_q1_ms"), row.get(f"{key[:-3]}_q3_ms"))
        return f"{value:.2f}" + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if None not in spread else "")

    def number(value, form="{:.1f}"):
        return "" if value is None else form.format(value)

    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: CONTENDERS.index(r["contender"]))
        first = mine[0]
        size = ", ".join(
            f"{k} {first[k]}" for k in ("batch", "image", "tokens", "layers", "depth", "width") if k in first
        )
        out += [f"### {model} ({size}{', tiny' if first['tiny'] else ''}), {first['device']}, base {first['base']}",
                "", "| contender | step ms (IQR) | fwd+bwd ms | base step ms | beyond 2 passes ms (IQR) | "
                "SAM tax ms (IQR) | tax % | / plain | peak MiB | held MiB | base step |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in mine:
            median = f"{r['median_ms']:.2f} ({r['q1_ms']:.2f}–{r['q3_ms']:.2f})"
            out.append(
                f"| {r['contender']} | {median} | {number(r.get('forward_backward_ms'), '{:.2f}')} | "
                f"{number(r.get('base_step_ms'), '{:.2f}')} | {ms(r, 'beyond_ms')} | {ms(r, 'tax_ms')} | "
                f"{number(r.get('tax_pct'))} | {number(r.get('over_plain'), '{:.2f}x')} | "
                f"{number(r.get('peak_mib'), '{:.0f}')} | {number(r.get('held_mib'), '{:.0f}')} | "
                f"{r.get('base_step_mode', '')} |"
            )
        out.append("")
    return "\n".join(out)


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

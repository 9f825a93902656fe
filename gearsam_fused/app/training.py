"""The training loop behind ``gearsam demo`` and ``gearsam train``: several optimizers under the same seeds, a run
directory with ``config.json``, ``metrics.jsonl`` (see :mod:`.metrics`), ``summary.md`` and checkpoints. The plots
are drawn by the command afterwards, from ``metrics.jsonl`` alone: the loop never imports matplotlib.

Nothing in a step reads a value back from the device: the running loss and accuracy are summed on the device and
read once per epoch, block telemetry is read every ``telemetry_every`` steps, and time inside the optimizer is
measured with CUDA events on a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import OPTIMIZERS as SHARPNESS_AWARE
from gearsam_fused import BlockTelemetry, frozen_bn_stats
from gearsam_fused.allocation import GEAR_RULE
from gearsam_fused.backends import resolve_backend_name
from gearsam_fused.checks import check_real
from gearsam_fused.models import MODELS
from gearsam_fused.partition import STRATEGIES

from .data import DATASETS, Dataset, add_symmetric_noise, crop_and_flip, load_dataset
from .machine import describe_machine
from .metrics import MetricsLog

#: The baseline without SAM: the base optimizer alone.
SGD = "sgd"
#: The optimizers a run can train, by the names of ``--optimizers`` and the metrics rows: the baseline, then the
#: library's sharpness-aware optimizers by their rule.
OPTIMIZERS = (SGD, *SHARPNESS_AWARE)
SCHEDULES = ("constant", "cosine")
AMP_MODES = ("none", "bf16")


@dataclass
class RunConfig:
    """Everything a run depends on; saved as ``config.json`` and read back by ``--resume``."""

    command: str = "train"
    dataset: str = "synthetic"
    data_dir: str | None = None
    synthetic_size: int = 2048
    model: str = "resnet18"
    model_args: dict = field(default_factory=dict)
    optimizers: list[str] = field(default_factory=lambda: [GEAR_RULE])
    seeds: list[int] = field(default_factory=lambda: [0])
    epochs: int = 1
    batch_size: int = 128
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "constant"
    rho: float = 0.05
    beta: float = 0.9
    adaptive: bool = False
    partition: str = "coarse"
    backend: str = "auto"
    label_noise: float = 0.0
    device: str = "cpu"
    amp: str = "none"
    channels_last: bool = False
    telemetry_every: int = 25
    checkpoint_every: int = 0
    threads: int | None = None

    def validate(self) -> RunConfig:
        """``self``, once every setting is known good (the model's factory found, the device and backend usable);
        else a ValueError saying what is wrong. Nothing is built or written."""
        choices = {"dataset": DATASETS, "schedule": SCHEDULES, "amp": AMP_MODES, "partition": STRATEGIES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        unknown = [o for o in self.optimizers if o not in OPTIMIZERS]
        if unknown or not self.optimizers:
            raise ValueError(f"unknown optimizer(s) {unknown}; expected a non-empty subset of {OPTIMIZERS}")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        positive = ("epochs", "batch_size", "telemetry_every", "synthetic_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: never), got {self.checkpoint_every}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        check_real("rho", self.rho, low=0.0)
        load_factory(self.model)
        device = resolve_device(self.device)
        if self.channels_last and device.type == "cpu":
            # torch's CPU channels_last convolutions can corrupt the heap (stride-2 1x1 convolutions abort the process)
            raise ValueError("--channels-last is for CUDA devices; drop it on CPU")
        resolve_backend_name(self.backend, {device})
        return self

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """The settings saved in the ``config.json`` at ``path``; unknown settings are a ValueError."""
        fields = json.loads(Path(path).read_text())
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path} has unknown settings {sorted(unknown)}")
        return cls(**fields)


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` (cpu, cuda or cuda:N), or a ValueError when this machine cannot run on it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"invalid device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested, but this torch sees no CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: only cpu and cuda are supported")
    return device


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """An in-repo model name or ``package.module:factory``, imported as under ``python -m``: the current directory
    comes first on the import path (the ``gearsam`` script alone would not put it there)."""
    if spec in MODELS:
        return MODELS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}; use one of {sorted(MODELS)} or package.module:factory")
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from None


def call_factory(spec: str, **kwargs) -> nn.Module:
    """``spec``'s model built with ``kwargs``; a call that fails on its arguments is a ValueError naming them."""
    try:
        model = load_factory(spec)(**kwargs)
    except TypeError as exc:
        raise ValueError(f"cannot build {spec!r} with {kwargs}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def build_model(cfg: RunConfig, data: Dataset) -> nn.Module:
    """``cfg.model`` built with ``cfg.model_args`` and, where not given there, the dataset's ``num_classes`` and
    ``in_channels``. Every in-repo factory takes both; a user's factory gets them only where its signature takes
    them, and ``in_channels`` only for images that are not RGB."""
    args = dict(cfg.model_args)
    in_repo = cfg.model in MODELS
    if in_repo or data.in_channels != 3:
        args.setdefault("in_channels", data.in_channels)
    args.setdefault("num_classes", data.num_classes)
    if not in_repo:
        params = inspect.signature(load_factory(cfg.model)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        args = {k: v for k, v in args.items() if k in cfg.model_args or k in params or takes_any}
    return call_factory(cfg.model, **args)


def check_model(cfg: RunConfig, data: Dataset) -> None:
    """Build the model once on the meta device (no memory, no compute), so bad ``model_args`` fail before a run
    directory is written."""
    try:
        with torch.device("meta"):
            build_model(cfg, data)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"cannot build {cfg.model!r} with {cfg.model_args}: {exc}") from None


def make_optimizer(name: str, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The optimizer ``name`` of :data:`OPTIMIZERS` over ``model``: SGD with the run's momentum and weight decay, alone
    or as the base optimizer of the library's sharpness-aware optimizer of that rule."""
    base = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == SGD:
        return torch.optim.SGD(model.parameters(), **base)
    if name not in SHARPNESS_AWARE:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")
    sharpness_aware = SHARPNESS_AWARE[name]
    hyper = dict(rho=cfg.rho, adaptive=cfg.adaptive, backend=cfg.backend, **base)
    if "beta" in inspect.signature(sharpness_aware).parameters:  # an EMA-based rule (GEAR-SAM); SAM refuses a beta
        hyper["beta"] = cfg.beta
    return sharpness_aware(model, torch.optim.SGD, partition=cfg.partition, **hyper)


class Stopwatch:
    """Sums the durations of ``start()``/``stop()`` sections. On CUDA the sections are timed with events, read only
    by :meth:`seconds`, so timing a step never waits for the device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._done = 0.0
        self._events: list[tuple] = []
        self._started = None

    def start(self) -> None:
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end))
        else:
            self._done += time.perf_counter() - self._started

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._done += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self._done


class Progress:
    """A one-line progress bar on a terminal; elsewhere (CI logs, nohup) one line per status, i.e. per epoch, so
    logs show a long run advancing without filling up with redraws."""

    def __init__(self, label: str, total: int, stream=None, width: int = 24):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label, self.total, self.width = label, total, width
        self.done, self.status = 0, ""
        self._start = self._shown = time.perf_counter()

    def update(self, steps: int = 1, status: str | None = None) -> None:
        self.done += steps
        if status is not None:
            self.status = status
        now = time.perf_counter()
        if not self.enabled and status is not None:
            self.stream.write(f"{self.label}: {status} ({now - self._start:.1f}s)\n")
            self.stream.flush()
        if self.enabled and (now - self._shown > 0.1 or self.done >= self.total or status is not None):
            self._shown = now
            filled = self.width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(
                f"\r{self.label} [{bar}] {self.done}/{self.total} {now - self._start:5.1f}s {self.status}"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class Experiment:
    """What the runs of one :func:`run_experiment` share."""

    cfg: RunConfig
    data: Dataset
    device: torch.device
    run_dir: Path
    metrics: MetricsLog
    resume: bool = False  # continue each run from its checkpoint in the run directory, where it has one
    stream: TextIO | None = None  # where progress goes; None: stderr


@dataclass
class TrainingRun:
    """One optimizer under one seed: what its steps, epochs and checkpoints read and advance."""

    cfg: RunConfig
    name: str  # one of OPTIMIZERS
    seed: int
    device: torch.device
    train: tuple[torch.Tensor, torch.Tensor]  # images and labels on the device, label noise applied
    test: tuple[torch.Tensor, torch.Tensor]
    augment: bool
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    # the cosine schedule's parameters (see cosine_factor); the scheduler reads this very dict at every step, so a
    # resumed run updates it in place
    cosine: dict
    steps_per_epoch: int
    metrics: MetricsLog
    checkpoint: Path
    in_optimizer: Stopwatch  # first_step + second_step
    in_base_step: Stopwatch  # the base optimizer's step inside second_step
    epoch: int = 0  # epochs done
    step: int = 0  # steps done
    seconds: float = 0.0  # training time so far, without evaluation
    # of it, in first_step + second_step minus the base optimizer's step (with a fused base step, minus the fused
    # restore and update, around which the base optimizer's step hooks run)
    sam_seconds: float = 0.0
    telemetry: BlockTelemetry | None = None  # SAM/GEAR-SAM runs only
    progress: Progress | None = None

    @property
    def tag(self) -> dict:
        """The fields that say whose a metrics row is."""
        return {"optimizer": self.name, "seed": self.seed}

    @property
    def sharpness_aware(self) -> bool:
        """Whether the run steps a SAM/GEAR-SAM optimizer (two passes a step) rather than plain SGD."""
        return self.name in SHARPNESS_AWARE


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: RunConfig, batch: int = 1024):
    """Mean loss and accuracy as device tensors (no synchronisation)."""
    model.eval()
    loss = torch.zeros((), device=images.device)
    correct = torch.zeros((), dtype=torch.int64, device=images.device)
    for start in range(0, len(labels), batch):
        logits, batch_loss = _forward(model, images[start : start + batch], labels[start : start + batch], cfg)
        loss += batch_loss.float() * len(logits)
        correct += (logits.argmax(1) == labels[start : start + batch]).sum()
    model.train()
    return loss / len(labels), correct / len(labels)


def _forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: RunConfig):
    """``model``'s logits for ``x`` and their mean cross-entropy against ``y``, under the run's layout and autocast."""
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
        logits = model(x)
        return logits, F.cross_entropy(logits, y)


def run_experiment(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, log=print, stream: TextIO | None = None
) -> list[dict]:
    """Train every optimizer in ``cfg.optimizers`` for every seed; returns the ``result`` rows. With ``resume``,
    runs continue from their last checkpoint in ``run_dir`` (finished runs are evaluated again, not retrained).
    ``log`` gets the lines of the report, ``stream`` the progress (default stderr). Plots are the caller's to draw
    from the run directory's ``metrics.jsonl``."""
    cfg.validate()
    device = resolve_device(cfg.device)
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.synthetic_size)
    check_model(cfg, data)
    run_dir = Path(run_dir)
    if resume:
        _check_extension(cfg, run_dir)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    metrics = _open_run_dir(cfg, run_dir, resume)
    experiment = Experiment(cfg, data, device, run_dir, metrics, resume=resume, stream=stream)
    log(
        f"{data.name}: {len(data.train[1])} train / {len(data.test[1])} test images, model {cfg.model}, "
        f"{cfg.epochs} epochs, seeds {list(cfg.seeds)}, rho={cfg.rho}, label noise={cfg.label_noise:.0%}, "
        f"device {device}, run directory {run_dir}"
    )
    results = []
    for seed in cfg.seeds:
        for name in cfg.optimizers:
            result = _train_one(experiment, name, seed)
            log(
                f"  {name:<9} seed {seed}: test acc {100 * result['test_acc']:6.2f}%  "
                f"({result['seconds']:.1f}s, {result['sam_seconds']:.2f}s in SAM machinery)"
            )
            results.append(result)
    table = summarize(results, cfg.optimizers)
    _write_summary(experiment, table)
    log("")
    log(table)
    return results


def _open_run_dir(cfg: RunConfig, run_dir: Path, resume: bool) -> MetricsLog:
    """Create ``run_dir`` with the run's ``config.json``; returns its metrics log, emptied unless resuming."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    if not resume:
        metrics.path.write_text("")
    return metrics


def _write_summary(experiment: Experiment, table: str) -> None:
    """``summary.md``: the comparison table, with the machine, date, torch version and commit that produced it."""
    cfg = experiment.cfg
    machine = describe_machine(experiment.device)
    where = f"{machine['date']}, {machine['cpu']} ({machine['cpu_count']} cores)" + (
        f", {machine['gpu']}" if machine["gpu"] else ""
    )
    (experiment.run_dir / "summary.md").write_text(
        f"# gearsam {cfg.command}: {experiment.data.name}, {cfg.epochs} epochs, seeds {list(cfg.seeds)}\n\n"
        f"Measured {where}; torch {machine['torch']}, commit {machine['commit']}.\n\n```\n{table}\n```\n"
    )


def _check_extension(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse more epochs for a finished cosine run: its lr has reached 0, and every added step would stay there."""
    if cfg.schedule != "cosine" or cfg.epochs <= RunConfig.load(run_dir / "config.json").epochs:
        return
    log = MetricsLog(run_dir / "metrics.jsonl")
    finished = [(r["optimizer"], r["seed"]) for r in log.rows() if r["kind"] == "result"]
    if any((run_dir / "checkpoints" / f"{name}-seed{seed}.pt").exists() for name, seed in finished):
        raise ValueError(f"the cosine schedule of {run_dir} has ended at lr 0, so more --epochs would not train; "
                         "start a new run")  # fmt: skip


def cosine_factor(step: int, start: int, phase: float, total: int) -> float:
    """The cosine schedule's lr factor at ``step``: half a cosine whose phase runs linearly from ``phase`` at step
    ``start`` to 1 (lr 0) at step ``total``; a fresh run has ``start = phase = 0``."""
    return 0.5 * (1 + math.cos(math.pi * (phase + (1 - phase) * (step - start) / (total - start))))


def stretch_cosine(cosine: dict, step: int, total: int) -> dict:
    """The cosine of a run resumed at ``step`` with ``total`` steps in all: unchanged for the same total (so resuming
    is exact); otherwise it continues from the phase reached, its rest stretched (or squeezed) to end at ``total``,
    so the lr never jumps."""
    if cosine["total"] == total or step >= total:
        return cosine
    phase = cosine["phase"] + (1 - cosine["phase"]) * (step - cosine["start"]) / (cosine["total"] - cosine["start"])
    return {"start": step, "phase": phase, "total": total}


def _train_one(experiment: Experiment, name: str, seed: int) -> dict:
    """Train ``name`` under ``seed`` up to ``cfg.epochs`` (from its checkpoint when resuming); returns its ``result``
    row."""
    run = _new_run(experiment, name, seed)
    if experiment.resume:
        _restore_checkpoint(run)
        run.metrics.forget_after(name, seed, run.step)
    _start_instruments(run, experiment.stream)
    cfg = run.cfg
    while run.epoch < cfg.epochs:
        _train_epoch(run)
        if cfg.checkpoint_every and (run.epoch % cfg.checkpoint_every == 0 or run.epoch == cfg.epochs):
            _save_checkpoint(run)
    run.progress.close()
    return _write_result(run)


def _new_run(experiment: Experiment, name: str, seed: int) -> TrainingRun:
    """The run of ``name`` under ``seed`` before its first step: the data on the device (label noise drawn from the
    seed), the model initialised from the seed, the optimizer and the lr schedule."""
    cfg, data, device = experiment.cfg, experiment.data, experiment.device
    x_train, y_train = data.train
    if cfg.label_noise:
        y_train = add_symmetric_noise(y_train, cfg.label_noise, data.num_classes, seed)
    train = (x_train.to(device), y_train.to(device))
    test = tuple(t.to(device) for t in data.test)
    torch.manual_seed(seed)
    model = build_model(cfg, data).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(name, model, cfg)
    steps_per_epoch = math.ceil(len(y_train) / cfg.batch_size)
    cosine = {"start": 0, "phase": 0.0, "total": steps_per_epoch * cfg.epochs}
    factor = (lambda s: cosine_factor(s, **cosine)) if cfg.schedule == "cosine" else (lambda s: 1.0)
    return TrainingRun(
        cfg=cfg, name=name, seed=seed, device=device, train=train, test=test, augment=data.augment, model=model,
        optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, factor), cosine=cosine,
        steps_per_epoch=steps_per_epoch, metrics=experiment.metrics,
        checkpoint=experiment.run_dir / "checkpoints" / f"{name}-seed{seed}.pt", in_optimizer=Stopwatch(device),
        in_base_step=Stopwatch(device),
    )  # fmt: skip


def _restore_checkpoint(run: TrainingRun) -> None:
    """Continue ``run`` from its checkpoint, where it has one: weights, optimizer and scheduler state, counters, and
    the cosine schedule stretched to the run's (possibly new) length."""
    if not run.checkpoint.exists():
        return
    saved = torch.load(run.checkpoint, map_location=run.device, weights_only=False)
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.epoch, run.step, run.seconds, run.sam_seconds = (saved[k] for k in ("epoch", "step", "seconds", "sam_seconds"))
    # checkpoints from before the cosine was saved ran the schedule they were started with
    started_with = {"start": 0, "phase": 0.0, "total": run.steps_per_epoch * saved["config"]["epochs"]}
    run.cosine.update(stretch_cosine(saved.get("cosine", started_with), run.step, run.cosine["total"]))


def _start_instruments(run: TrainingRun, stream: TextIO | None) -> None:
    """The progress bar over the steps left and, for SAM/GEAR-SAM, the block telemetry (into the metrics log) and
    the hooks that time the base optimizer's step, so that ``sam_seconds`` leaves it out."""
    if run.sharpness_aware:
        sink = lambda records: run.metrics.write([{"kind": "blocks", **run.tag, **r} for r in records])  # noqa: E731
        run.telemetry = BlockTelemetry(run.optimizer, every=run.cfg.telemetry_every, sink=sink, start=run.step)
        run.optimizer.base_optimizer.register_step_pre_hook(lambda *_: run.in_base_step.start())
        run.optimizer.base_optimizer.register_step_post_hook(lambda *_: run.in_base_step.stop())
    left = run.steps_per_epoch * (run.cfg.epochs - run.epoch)
    run.progress = Progress(f"{run.name} seed {run.seed}", left, stream)


def _train_epoch(run: TrainingRun) -> None:
    """One pass over the training set, in an order drawn from the seed and the epoch alone, then the test set;
    writes the epoch's metrics row."""
    epoch_start = time.perf_counter()
    # an epoch's batches (order and augmentation) depend on nothing else, so a resumed run draws the same ones
    order_gen = torch.Generator().manual_seed(run.seed * 1_000_003 + run.epoch)
    loss_sum = torch.zeros((), device=run.device)
    sharpness_sum = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    images = len(run.train[1])
    for idx in torch.randperm(images, generator=order_gen).split(run.cfg.batch_size):
        batch_loss, batch_correct, batch_sharpness = _train_batch(run, idx.to(run.device), order_gen)
        loss_sum += batch_loss
        sharpness_sum += batch_sharpness
        correct += batch_correct
    if run.telemetry is not None:
        run.telemetry.flush()
    train_loss, train_acc = (loss_sum / images).item(), (correct / images).item()
    train_sharpness = (sharpness_sum / images).item() if run.sharpness_aware else None
    run.seconds += time.perf_counter() - epoch_start
    test_loss, test_acc = (t.item() for t in evaluate(run.model, *run.test, run.cfg))
    run.epoch += 1
    run.sam_seconds = run.in_optimizer.seconds() - run.in_base_step.seconds()
    run.metrics.write([{
        "kind": "epoch", **run.tag, "epoch": run.epoch, "step": run.step, "lr": run.scheduler.get_last_lr()[0],
        "train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss, "test_acc": test_acc,
        "train_sharpness": train_sharpness, "seconds": run.seconds, "sam_seconds": run.sam_seconds,
    }])  # fmt: skip
    run.progress.update(0, f"epoch {run.epoch}/{run.cfg.epochs} loss {train_loss:.3f} test acc {100 * test_acc:.1f}%")


def _train_batch(run: TrainingRun, idx: torch.Tensor, order_gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One optimizer step on the training images ``idx`` (cropped and flipped from ``order_gen`` where the dataset
    asks for it); returns the batch's summed loss, its number of correct predictions and its summed realized sharpness
    L(w + eps) - L(w) (0 for SGD), as device tensors."""
    xb, yb = run.train[0][idx], run.train[1][idx]
    if run.augment:
        xb = crop_and_flip(xb, order_gen)
    logits, loss = _forward(run.model, xb, yb, run.cfg)
    loss.backward()
    batch_loss, batch_correct = loss.detach().float() * len(idx), (logits.argmax(1) == yb).sum()
    batch_sharpness = torch.zeros((), device=run.device)
    if run.sharpness_aware:
        batch_sharpness = (_sam_step(run, xb, yb, loss).float() - loss.detach().float()) * len(idx)
    else:
        run.optimizer.step()
        run.optimizer.zero_grad()
    run.scheduler.step()
    run.step += 1
    run.progress.update()
    return batch_loss, batch_correct, batch_sharpness


def _sam_step(run: TrainingRun, xb: torch.Tensor, yb: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """The rest of a SAM/GEAR-SAM step once the batch's gradients (of ``loss``) are in: perturb, forward and backward
    again at the perturbed weights, then restore and update; returns the loss at the perturbed weights, detached.
    Only ``first_step`` and ``second_step`` are timed."""
    opt = run.optimizer
    run.in_optimizer.start()
    opt.first_step()
    run.in_optimizer.stop()
    # zeroing in place keeps the gradients as views of a fused backend's flat buffer: no copies
    opt.zero_grad(set_to_none=False)
    with frozen_bn_stats(run.model):  # BatchNorm statistics come from the first pass only
        perturbed = _forward(run.model, xb, yb, run.cfg)[1]
        perturbed.backward()
    run.in_optimizer.start()
    opt.second_step()
    run.in_optimizer.stop()
    run.telemetry.record(loss, perturbed)  # the step's statistics stay readable until the next first_step
    opt.zero_grad(set_to_none=False)
    return perturbed.detach()


def _save_checkpoint(run: TrainingRun) -> None:
    """Write what a resumed run needs to continue exactly: weights, optimizer and scheduler state, counters, the
    cosine schedule and the settings."""
    state = {
        "epoch": run.epoch, "step": run.step, "seconds": run.seconds, "sam_seconds": run.sam_seconds,
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(), "cosine": dict(run.cosine), "config": dataclasses.asdict(run.cfg),
    }  # fmt: skip
    run.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    partial = run.checkpoint.with_suffix(".tmp")
    torch.save(state, partial)
    partial.replace(run.checkpoint)  # a crash while saving never leaves a truncated checkpoint behind


def _write_result(run: TrainingRun) -> dict:
    """Evaluate the trained model on the test set and write the run's ``result`` row; returns it."""
    test_loss, test_acc = (t.item() for t in evaluate(run.model, *run.test, run.cfg))
    result = {
        "kind": "result", **run.tag, "epochs": run.epoch, "step": run.step, "test_loss": test_loss,
        "test_acc": test_acc, "seconds": run.seconds, "sam_seconds": run.sam_seconds,
    }  # fmt: skip
    run.metrics.write([result])
    return result


def summarize(results: list[dict], optimizers) -> str:
    """The comparison table: test accuracy (mean ± std over seeds), training time and time in SAM's machinery."""
    header = f"{'optimizer':<10}  {'test acc (%)':>16}  {'time / run (s)':>14}  {'SAM machinery (s)':>17}"
    lines = [header, "-" * len(header)]
    for name in optimizers:
        runs = [r for r in results if r["optimizer"] == name]
        accs = [100.0 * r["test_acc"] for r in runs]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        machinery = statistics.mean(r["sam_seconds"] for r in runs)
        shown = "-" if name == SGD else f"{machinery:.2f}"
        seconds = statistics.mean(r["seconds"] for r in runs)
        lines.append(f"{name:<10}  {statistics.mean(accs):>8.2f} ± {spread:<5.2f}  {seconds:>14.2f}  {shown:>17}")
    return "\n".join(lines)

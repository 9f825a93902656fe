"""The training loop behind ``gearsam demo`` and ``gearsam train``: several optimizers under the same seeds, a run
directory with ``config.json``, ``metrics.jsonl``, ``summary.md``, plots and checkpoints.

Nothing in a step reads a value back from the device: the running loss and accuracy are summed on the device and
read once per epoch, block telemetry is read every ``telemetry_every`` steps, and time inside the optimizer is
measured with CUDA events on a GPU.

``metrics.jsonl`` holds one JSON object per line, each with ``kind``, ``optimizer`` and ``seed``:

- ``epoch``: ``epoch`` (1-based), ``step`` (steps done), ``lr``, ``train_loss``, ``train_acc``, ``test_loss``,
  ``test_acc``, ``seconds`` (training time so far), ``sam_seconds`` (of it, inside ``first_step``/``second_step``
  but outside the base optimizer's step; 0 for SGD);
- ``blocks``: one per SAM/GEAR-SAM step, the :class:`~gearsam_fused.telemetry.BlockTelemetry` record: ``step``,
  ``rho``, ``blocks`` (names), and per block ``energy``, ``ema`` (allocation score), ``radius`` and ``share``;
- ``result``: once per finished run: ``epochs``, ``step``, ``test_loss``, ``test_acc``, ``seconds``, ``sam_seconds``.
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

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_real
from .backends import resolve_backend_name
from .bn import frozen_bn_stats
from .data import DATASETS, Dataset, add_symmetric_noise, crop_and_flip, load_dataset
from .machine import describe_machine
from .models import MODELS, ResNet
from .optim import GEARSAM, SAM
from .telemetry import BlockTelemetry

OPTIMIZERS = ("sgd", "sam", "gear-sam")
SCHEDULES = ("constant", "cosine")
AMP_MODES = ("none", "bf16")
METRIC_KINDS = ("epoch", "blocks", "result")


@dataclass
class RunConfig:
    """Everything a run depends on; saved as ``config.json`` and read back by ``--resume``."""

    command: str = "train"
    dataset: str = "synthetic"
    data_dir: str | None = None
    synthetic_size: int = 2048
    model: str = "resnet18"
    model_args: dict = field(default_factory=dict)
    optimizers: list[str] = field(default_factory=lambda: ["gear-sam"])
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
        choices = {"dataset": DATASETS, "schedule": SCHEDULES, "amp": AMP_MODES}
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
        if self.model != "digits_resnet":
            load_factory(self.model)
        device = resolve_device(self.device)
        if self.channels_last and device.type == "cpu":
            # torch's CPU channels_last convolutions can corrupt the heap (stride-2 1x1 convolutions abort the process)
            raise ValueError("--channels-last is for CUDA devices; drop it on CPU")
        resolve_backend_name(self.backend, {device})
        return self

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        fields = json.loads(Path(path).read_text())
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path} has unknown settings {sorted(unknown)}")
        return cls(**fields)


def resolve_device(name: str) -> torch.device:
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
    args = dict(cfg.model_args)
    if data.in_channels != 3:
        args.setdefault("in_channels", data.in_channels)
    if cfg.model == "digits_resnet":  # the demo's network: three stages, sized for 8x8 inputs
        return ResNet(blocks=(1, 1, 1), width=args.pop("width", 16), num_classes=data.num_classes, **args)
    args.setdefault("num_classes", data.num_classes)
    if cfg.model not in MODELS:  # a user's factory gets the dataset's shape only where it asks for it
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


def make_optimizer(name: str, model: nn.Module, cfg: RunConfig):
    base = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), **base)
    common = dict(rho=cfg.rho, adaptive=cfg.adaptive, backend=cfg.backend, **base)
    if name == "sam":
        return SAM(model, torch.optim.SGD, partition=cfg.partition, **common)
    if name == "gear-sam":
        return GEARSAM(model, torch.optim.SGD, partition=cfg.partition, beta=cfg.beta, **common)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


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
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {now - self._start:5.1f}s {self.status}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


class MetricsLog:
    """``metrics.jsonl``: appended line by line, so a run that dies keeps everything up to its last step."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def write(self, rows: list[dict]) -> None:
        with self.path.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        return read_metrics(self.path) if self.path.exists() else []

    def forget_after(self, optimizer: str, seed: int, step: int) -> None:
        """Drop a run's rows past ``step`` and its result: what a resumed run will write again."""
        keep = [
            r for r in self.rows()
            if not (r["optimizer"] == optimizer and r["seed"] == seed and (r["kind"] == "result" or r["step"] > step))
        ]  # fmt: skip
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number} is not JSON: {exc}") from None
    return rows


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
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
        logits = model(x)
        return logits, F.cross_entropy(logits, y)


def run_experiment(cfg: RunConfig, run_dir: Path, *, resume: bool = False, log=print, stream=None) -> list[dict]:
    """Train every optimizer in ``cfg.optimizers`` for every seed; returns the ``result`` rows. With ``resume``,
    runs continue from their last checkpoint in ``run_dir`` (finished runs are evaluated again, not retrained)."""
    cfg.validate()
    device = resolve_device(cfg.device)
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.synthetic_size)
    check_model(cfg, data)
    run_dir = Path(run_dir)
    if resume:
        _check_extension(cfg, run_dir)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    if not resume:
        metrics.path.write_text("")
    log(
        f"{data.name}: {len(data.train[1])} train / {len(data.test[1])} test images, model {cfg.model}, "
        f"{cfg.epochs} epochs, seeds {list(cfg.seeds)}, rho={cfg.rho}, label noise={cfg.label_noise:.0%}, "
        f"device {device}, run directory {run_dir}"
    )
    results = []
    for seed in cfg.seeds:
        for name in cfg.optimizers:
            result = _train_one(cfg, name, seed, data, device, metrics, run_dir, resume, stream)
            log(
                f"  {name:<9} seed {seed}: test acc {100 * result['test_acc']:6.2f}%  "
                f"({result['seconds']:.1f}s, {result['sam_seconds']:.2f}s in SAM machinery)"
            )
            results.append(result)
    table = summarize(results, cfg.optimizers)
    machine = describe_machine(device)
    where = f"{machine['date']}, {machine['cpu']} ({machine['cpu_count']} cores)" + (
        f", {machine['gpu']}" if machine["gpu"] else ""
    )
    (run_dir / "summary.md").write_text(
        f"# gearsam {cfg.command}: {data.name}, {cfg.epochs} epochs, seeds {list(cfg.seeds)}\n\n"
        f"Measured {where}; torch {machine['torch']}, commit {machine['commit']}.\n\n```\n{table}\n```\n"
    )
    log("")
    log(table)
    try:
        from .plots import render
    except ImportError as exc:
        log(f"\nno plots: {exc} (pip install matplotlib)")
    else:
        for path in render(run_dir):
            log(f"wrote {path}")
    return results


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


def _train_one(cfg, name, seed, data, device, metrics, run_dir, resume, stream) -> dict:
    x_train, y_train = data.train
    if cfg.label_noise:
        y_train = add_symmetric_noise(y_train, cfg.label_noise, data.num_classes, seed)
    x_train, y_train = x_train.to(device), y_train.to(device)
    x_test, y_test = (t.to(device) for t in data.test)
    torch.manual_seed(seed)
    model = build_model(cfg, data).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = make_optimizer(name, model, cfg)
    steps_per_epoch = math.ceil(len(y_train) / cfg.batch_size)
    cosine = {"start": 0, "phase": 0.0, "total": steps_per_epoch * cfg.epochs}
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, (lambda s: cosine_factor(s, **cosine)) if cfg.schedule == "cosine" else (lambda s: 1.0)
    )
    checkpoint = run_dir / "checkpoints" / f"{name}-seed{seed}.pt"
    epoch = step = 0
    seconds = sam_seconds = 0.0
    if resume:
        if checkpoint.exists():
            saved = torch.load(checkpoint, map_location=device, weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            epoch, step, seconds, sam_seconds = saved["epoch"], saved["step"], saved["seconds"], saved["sam_seconds"]
            fresh = {"start": 0, "phase": 0.0, "total": steps_per_epoch * saved["config"]["epochs"]}
            cosine.update(stretch_cosine(saved.get("cosine", fresh), step, cosine["total"]))
        metrics.forget_after(name, seed, step)

    sam_like = name != "sgd"
    tag = {"optimizer": name, "seed": seed}
    telemetry = None
    in_optimizer = Stopwatch(device)  # first_step + second_step
    in_base_step = Stopwatch(device)  # the base optimizer's step inside second_step
    if sam_like:
        sink = lambda records: metrics.write([{"kind": "blocks", **tag, **r} for r in records])  # noqa: E731
        telemetry = BlockTelemetry(opt, every=cfg.telemetry_every, sink=sink, start=step)
        opt.base_optimizer.register_step_pre_hook(lambda *_: in_base_step.start())
        opt.base_optimizer.register_step_post_hook(lambda *_: in_base_step.stop())

    progress = Progress(f"{name} seed {seed}", steps_per_epoch * (cfg.epochs - epoch), stream)
    while epoch < cfg.epochs:
        epoch_start = time.perf_counter()
        order_gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)  # an epoch's batches depend on nothing else
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        for idx in torch.randperm(len(y_train), generator=order_gen).split(cfg.batch_size):
            idx = idx.to(device)
            xb, yb = x_train[idx], y_train[idx]
            if data.augment:
                xb = crop_and_flip(xb, order_gen)
            logits, loss = _forward(model, xb, yb, cfg)
            loss.backward()
            loss_sum += loss.detach().float() * len(idx)
            correct += (logits.argmax(1) == yb).sum()
            if sam_like:
                # zeroing in place keeps the gradients as views of a fused backend's flat buffer: no copies
                in_optimizer.start()
                opt.first_step()
                in_optimizer.stop()
                telemetry.record()
                opt.zero_grad(set_to_none=False)
                with frozen_bn_stats(model):  # BatchNorm statistics come from the first pass only
                    _forward(model, xb, yb, cfg)[1].backward()
                in_optimizer.start()
                opt.second_step()
                in_optimizer.stop()
                opt.zero_grad(set_to_none=False)
            else:
                opt.step()
                opt.zero_grad()
            scheduler.step()
            step += 1
            progress.update()
        if telemetry is not None:
            telemetry.flush()
        train_loss, train_acc = (loss_sum / len(y_train)).item(), (correct / len(y_train)).item()
        seconds += time.perf_counter() - epoch_start
        test_loss, test_acc = (t.item() for t in evaluate(model, x_test, y_test, cfg))
        epoch += 1
        sam_seconds = in_optimizer.seconds() - in_base_step.seconds()
        metrics.write([{
            "kind": "epoch", **tag, "epoch": epoch, "step": step, "lr": scheduler.get_last_lr()[0],
            "train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss, "test_acc": test_acc,
            "seconds": seconds, "sam_seconds": sam_seconds,
        }])  # fmt: skip
        progress.update(0, f"epoch {epoch}/{cfg.epochs} loss {train_loss:.3f} test acc {100 * test_acc:.1f}%")
        if cfg.checkpoint_every and (epoch % cfg.checkpoint_every == 0 or epoch == cfg.epochs):
            _save_checkpoint(checkpoint, {
                "epoch": epoch, "step": step, "seconds": seconds, "sam_seconds": sam_seconds,
                "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
                "cosine": dict(cosine), "config": dataclasses.asdict(cfg),
            })  # fmt: skip
    progress.close()
    test_loss, test_acc = (t.item() for t in evaluate(model, x_test, y_test, cfg))
    result = {
        "kind": "result", **tag, "epochs": epoch, "step": step, "test_loss": test_loss, "test_acc": test_acc,
        "seconds": seconds, "sam_seconds": sam_seconds,
    }  # fmt: skip
    metrics.write([result])
    return result


def _save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save(state, partial)
    partial.replace(path)  # a crash while saving never leaves a truncated checkpoint behind


def summarize(results: list[dict], optimizers) -> str:
    """The comparison table: test accuracy (mean ± std over seeds), training time and time in SAM's machinery."""
    header = f"{'optimizer':<10}  {'test acc (%)':>16}  {'time / run (s)':>14}  {'SAM machinery (s)':>17}"
    lines = [header, "-" * len(header)]
    for name in optimizers:
        runs = [r for r in results if r["optimizer"] == name]
        accs = [100.0 * r["test_acc"] for r in runs]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        machinery = statistics.mean(r["sam_seconds"] for r in runs)
        shown = "-" if name == "sgd" else f"{machinery:.2f}"
        seconds = statistics.mean(r["seconds"] for r in runs)
        lines.append(f"{name:<10}  {statistics.mean(accs):>8.2f} ± {spread:<5.2f}  {seconds:>14.2f}  {shown:>17}")
    return "\n".join(lines)

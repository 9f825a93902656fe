"""The main job: SGD, SAM and GEAR-SAM side by side on a real dataset that ships offline.

scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes) train a small CIFAR-style ResNet in
seconds on a CPU; every optimizer sees the same seeds, split, initial weights and batch order.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .models import ResNet
from .optim import GEARSAM, SAM

OPTIMIZERS = ("sgd", "sam", "gear-sam")


@dataclass
class DemoConfig:
    epochs: int = 15
    seeds: tuple[int, ...] = (0, 1, 2)
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    rho: float = 0.05
    beta: float = 0.9
    label_noise: float = 0.0
    optimizers: tuple[str, ...] = OPTIMIZERS
    threads: int | None = None


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """Standardised (N, 1, 8, 8) float32 images and int64 labels, split once by ``seed``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the demo needs scikit-learn for its bundled digits dataset: pip install scikit-learn") from exc
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])


def add_symmetric_noise(y: torch.Tensor, rate: float, num_classes: int, seed: int) -> torch.Tensor:
    """Replace a ``rate`` fraction of labels by a uniformly drawn *different* class."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"label noise rate must lie in [0, 1), got {rate}")
    g = torch.Generator().manual_seed(seed)
    flip = torch.rand(len(y), generator=g) < rate
    offset = torch.randint(1, num_classes, (len(y),), generator=g)
    return torch.where(flip, (y + offset) % num_classes, y)


def demo_model(num_classes: int = 10) -> nn.Module:
    """A three-stage ResNet for 8x8 inputs (stem, layer1..3, classifier: five coarse blocks)."""
    return ResNet(blocks=(1, 1, 1), width=16, num_classes=num_classes, in_channels=1)


def make_optimizer(name: str, model: nn.Module, cfg: DemoConfig):
    base = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), **base)
    if name == "sam":
        return SAM(model, torch.optim.SGD, rho=cfg.rho, **base)
    if name == "gear-sam":
        return GEARSAM(model, torch.optim.SGD, rho=cfg.rho, beta=cfg.beta, **base)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def train_one(name: str, seed: int, cfg: DemoConfig, train, test) -> dict:
    x_train, y_train = train
    y_train = add_symmetric_noise(y_train, cfg.label_noise, 10, seed) if cfg.label_noise else y_train
    torch.manual_seed(seed)
    model = demo_model()
    opt = make_optimizer(name, model, cfg)
    order_gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(cfg.epochs):
        for idx in torch.randperm(len(y_train), generator=order_gen).split(cfg.batch_size):
            xb, yb = x_train[idx], y_train[idx]
            F.cross_entropy(model(xb), yb).backward()
            if name == "sgd":
                opt.step()
            else:
                opt.first_step(zero_grad=True)
                F.cross_entropy(model(xb), yb).backward()
                opt.second_step()
            opt.zero_grad()
    seconds = time.perf_counter() - start
    return {"optimizer": name, "seed": seed, "test_acc": accuracy(model, *test), "seconds": seconds}


def summarize(results: list[dict], optimizers) -> str:
    lines = [f"{'optimizer':<10}  {'test acc (%)':>16}  {'time / run (s)':>14}", "-" * 44]
    for name in optimizers:
        accs = [100.0 * r["test_acc"] for r in results if r["optimizer"] == name]
        secs = [r["seconds"] for r in results if r["optimizer"] == name]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(f"{name:<10}  {statistics.mean(accs):>8.2f} ± {spread:<5.2f}  {statistics.mean(secs):>14.2f}")
    return "\n".join(lines)


def run_demo(cfg: DemoConfig, log=print) -> list[dict]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    unknown = [o for o in cfg.optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; expected a subset of {OPTIMIZERS}")
    train, test = load_digits_split()
    log(
        f"digits: {len(train[1])} train / {len(test[1])} test images, {cfg.epochs} epochs, seeds {list(cfg.seeds)}, "
        f"rho={cfg.rho}, label noise={cfg.label_noise:.0%}"
    )
    results = []
    for seed in cfg.seeds:
        for name in cfg.optimizers:
            r = train_one(name, seed, cfg, train, test)
            log(f"  {name:<9} seed {seed}: test acc {100 * r['test_acc']:6.2f}%  ({r['seconds']:.1f}s)")
            results.append(r)
    log("")
    log(summarize(results, cfg.optimizers))
    return results

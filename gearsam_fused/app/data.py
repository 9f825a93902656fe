"""Datasets of the command line, as whole tensors: scikit-learn's bundled digits, CIFAR-10/100 read from the official
python archives in ``--data-dir``, and synthetic images (class patterns under noise) for quick runs. Batches are index slices, so an epoch
costs no data-loader processes and is reproducible from its seed alone."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DATASETS = ("digits", "cifar10", "cifar100", "synthetic")

# Per-channel statistics of the CIFAR training sets (the values everyone normalises with).
_CIFAR_MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "cifar100": (0.5071, 0.4865, 0.4409)}
_CIFAR_STD = {"cifar10": (0.2470, 0.2435, 0.2616), "cifar100": (0.2673, 0.2564, 0.2762)}
_CIFAR_LAYOUT = {  # folder, training files, test file, label key
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels"),
    "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels"),
}


@dataclass
class Dataset:
    """Normalised float32 images ``[N, C, H, W]`` and int64 labels; ``augment`` asks for CIFAR's crop and flip."""

    name: str
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    num_classes: int
    augment: bool = False

    @property
    def in_channels(self) -> int:
        return self.train[0].shape[1]


def load_dataset(name: str, data_dir: str | None = None, synthetic_size: int = 2048, seed: int = 0) -> Dataset:
    """One of :data:`DATASETS`; CIFAR needs ``data_dir`` holding the unpacked python version of the archive."""
    if name == "digits":
        train, test = load_digits_split(seed)
        return Dataset("digits", train, test, 10)
    if name in _CIFAR_LAYOUT:
        return load_cifar(name, data_dir)
    if name == "synthetic":
        return synthetic_images(synthetic_size, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 digits (1,797 images) as standardised ``(N, 1, 8, 8)`` images, split once by ``seed``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the digits dataset comes with scikit-learn: pip install scikit-learn") from exc
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])


def load_cifar(name: str, data_dir: str | None) -> Dataset:
    """CIFAR-10/100 from the python-pickle archive (``cifar-10-batches-py/`` or ``cifar-100-python/`` in
    ``data_dir``), the same files torchvision downloads; torchvision itself is not needed."""
    folder, train_files, test_file, label_key = _CIFAR_LAYOUT[name]
    if data_dir is None:
        raise ValueError(f"--dataset {name} needs --data-dir DIR containing {folder}/ (or use --dataset synthetic)")
    root = Path(data_dir) / folder
    missing = [f for f in [*train_files, test_file] if not (root / f).is_file()]
    if missing:
        raise ValueError(
            f"{name} not found: {root} lacks {missing}. Unpack the python version of the dataset "
            f"(https://www.cs.toronto.edu/~kriz/cifar.html) into {data_dir}, or use --dataset synthetic"
        )
    mean = torch.tensor(_CIFAR_MEAN[name]).view(1, 3, 1, 1)
    std = torch.tensor(_CIFAR_STD[name]).view(1, 3, 1, 1)

    def read(files):
        images, labels = [], []
        for f in files:
            with open(root / f, "rb") as fh:
                batch = pickle.load(fh, encoding="bytes")
            images.append(torch.as_tensor(batch[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32))
            labels.append(torch.as_tensor(batch[label_key], dtype=torch.int64))
        x = torch.cat(images).float().div_(255.0)
        return (x - mean) / std, torch.cat(labels)

    return Dataset(name, read(train_files), read([test_file]), 100 if name == "cifar100" else 10, augment=True)


def synthetic_images(n: int, num_classes: int = 10, shape=(3, 32, 32), seed: int = 0) -> Dataset:
    """Images of ``num_classes`` classes, each a smooth random pattern of its own (a 4x4 grid of colours, upsampled)
    under Gaussian noise: free to make, and learnable in an epoch or two, so curves move. No crop and flip: they
    would move a pattern away from what makes its class, and a test image is never shifted."""
    if n < 2:
        raise ValueError(f"synthetic dataset size must be at least 2, got {n}")
    g = torch.Generator().manual_seed(seed)
    channels, height, width = shape
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    patterns = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    y = torch.randint(0, num_classes, (n + n // 4,), generator=g)
    x = 2.0 * patterns[y] + torch.randn(len(y), *shape, generator=g)
    return Dataset("synthetic", (x[:n], y[:n]), (x[n:], y[n:]), num_classes)


def add_symmetric_noise(y: torch.Tensor, rate: float, num_classes: int, seed: int) -> torch.Tensor:
    """Replace a ``rate`` fraction of labels by a uniformly drawn *different* class."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"label noise rate must lie in [0, 1), got {rate}")
    g = torch.Generator().manual_seed(seed)
    flip = torch.rand(len(y), generator=g) < rate
    offset = torch.randint(1, num_classes, (len(y),), generator=g)
    return torch.where(flip, (y + offset) % num_classes, y)


def crop_and_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """CIFAR augmentation on a batch: a random ``H x W`` crop of the zero-padded image, then a horizontal flip with
    probability 1/2. Offsets are drawn on the CPU from ``generator`` so the result does not depend on the device."""
    n, c, h, w = x.shape
    offsets = torch.randint(0, 2 * pad + 1, (2, n), generator=generator).to(x.device)
    flips = (torch.rand(n, generator=generator) < 0.5).to(x.device)
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    padded = F.pad(x, (pad, pad, pad, pad))
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]

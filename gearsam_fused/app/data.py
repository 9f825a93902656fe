"""Datasets of the command line, as whole tensors: scikit-learn's bundled digits, CIFAR-10/100 read from the official
python archives in ``--data-dir``, an image folder in ``--data-dir`` (``train/CLASS/*.jpg``, ``test/CLASS/*.jpg``,
read with Pillow and kept as bytes), and synthetic images (class patterns under noise) for quick runs. Batches are
index slices, so an epoch costs no data-loader processes and is reproducible from its seed alone. A run may keep some
classes only (``--classes``, relabelled in the order given) and, per seed, a few training images per class
(``--train-per-class``)."""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

DATASETS = ("digits", "cifar10", "cifar100", "synthetic", "imagefolder")
#: The files an image folder's classes hold (the extension, in any case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".gif", ".tif", ".tiff", ".webp")
#: The ImageNet statistics torchvision's pretrained weights expect their inputs normalised with.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

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


def load_dataset(
    name: str, data_dir: str | None = None, synthetic_size: int = 2048, seed: int = 0, image_size: int = 224
) -> Dataset:
    """One of :data:`DATASETS`; CIFAR needs ``data_dir`` holding the unpacked python version of the archive, an image
    folder ``data_dir`` holding ``train/`` and ``test/`` (see :func:`load_image_folder`, which ``image_size`` is
    for)."""
    if name == "digits":
        train, test = load_digits_split(seed)
        return Dataset("digits", train, test, 10)
    if name in _CIFAR_LAYOUT:
        return load_cifar(name, data_dir)
    if name == "synthetic":
        return synthetic_images(synthetic_size, seed=seed)
    if name == "imagefolder":
        return load_image_folder(data_dir, image_size)
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
    ``data_dir``), the same files torchvision downloads; torchvision itself is not needed. The official files are
    pickles, read as they are: unpickling runs whatever a file says, so ``data_dir`` must be trusted (``--data-dir``
    says so)."""
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


def keep_classes(data: Dataset, classes: list[int] | None) -> Dataset:
    """``data`` with the images of ``classes`` only (all of them for None), class ``classes[i]`` relabelled ``i``; a
    ValueError for a class the dataset does not have."""
    if classes is None:
        return data
    unknown = [c for c in classes if not 0 <= c < data.num_classes]
    if unknown:
        raise ValueError(f"--classes {' '.join(map(str, classes))}: {data.name} has classes 0 to "
                         f"{data.num_classes - 1}, not {unknown}")  # fmt: skip
    relabel = torch.full((data.num_classes,), -1, dtype=torch.int64)
    relabel[torch.tensor(classes)] = torch.arange(len(classes))

    def keep(split):
        x, y = split
        kept = relabel[y] >= 0
        return x[kept], relabel[y[kept]]

    return replace(data, train=keep(data.train), test=keep(data.test), num_classes=len(classes))


def per_class(labels: torch.Tensor, count: int, num_classes: int, seed: int) -> torch.Tensor:
    """The indices of ``count`` training images per class (all of a class that has fewer), drawn from ``seed``, in
    the order drawn: for one seed, the images of a smaller count are among those of a larger one."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    return torch.cat([order[labels[order] == c][:count] for c in range(num_classes)])


def as_float(images: torch.Tensor) -> torch.Tensor:
    """The network's input: float images as they are; bytes (an image folder's, kept so: a quarter of the memory)
    scaled to [0, 1] and normalised with the ImageNet mean and std, as torchvision's pretrained weights expect."""
    if images.dtype != torch.uint8:
        return images
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float().div_(255.0) - mean) / std


@functools.lru_cache(maxsize=1)  # a study reads the folder once, not once per run directory
def _read_image_folder(root: Path, image_size: int, files: tuple) -> Dataset:
    """The image folder at ``root``; ``files`` (each file's path, size and time of change) is only the cache's key:
    a folder changed on disk is read again."""
    classes = _class_folders(root / "train")
    test_classes = _class_folders(root / "test")
    if test_classes != classes:
        only_train, only_test = sorted(set(classes) - set(test_classes)), sorted(set(test_classes) - set(classes))
        raise ValueError(f"--data-dir {root}: train/ and test/ must hold the same class folders; only in train/: "
                         f"{only_train[:5]}, only in test/: {only_test[:5]}")  # fmt: skip
    return Dataset(
        f"imagefolder {root.name}", _read_split(root / "train", classes, image_size),
        _read_split(root / "test", classes, image_size), len(classes),
    )  # fmt: skip


def load_image_folder(data_dir: str | None, image_size: int = 224) -> Dataset:
    """The images of ``data_dir/train/CLASS/`` and ``data_dir/test/CLASS/`` (torchvision's ImageFolder layout: one
    folder per class, the same classes in both, numbered in sorted order), read with Pillow as RGB, the shorter side
    resized to ``image_size * 256 / 224`` and the centre ``image_size`` square cropped (torchvision's evaluation
    transform for its ImageNet weights), kept as bytes (:func:`as_float` normalises them per batch). No
    augmentation. A ValueError naming what is missing or unreadable."""
    if data_dir is None:
        raise ValueError("--dataset imagefolder needs --data-dir DIR holding train/CLASS/*.jpg and test/CLASS/*.jpg")
    root = Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"--data-dir {root} is not a directory; expected one holding train/CLASS/*.jpg and "
                         "test/CLASS/*.jpg")  # fmt: skip
    root = root.resolve()
    files = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(root.rglob("*")) if f.is_file())
    return _read_image_folder(root, image_size, files)


def _class_folders(split: Path) -> list[str]:
    """The class folders of ``split`` (``train/`` or ``test/``), sorted; a ValueError when it has none."""
    if not split.is_dir():
        raise ValueError(f"--data-dir {split.parent}: no {split.name}/ folder; expected train/CLASS/*.jpg and "
                         "test/CLASS/*.jpg (one folder per class)")  # fmt: skip
    classes = sorted(p.name for p in split.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"--data-dir {split.parent}: {split} holds no class folders; expected {split.name}/CLASS/"
                         "*.jpg, one folder per class")  # fmt: skip
    return classes


def _read_split(split: Path, classes: list[str], image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One split's images as ``uint8 [N, 3, S, S]`` and their labels (the index of their class in ``classes``)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--dataset imagefolder reads images with Pillow: pip install pillow") from exc
    files = [(label, f) for label, name in enumerate(classes) for f in sorted((split / name).iterdir())
             if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]  # fmt: skip
    empty = sorted(set(classes) - {classes[label] for label, _ in files})
    if empty:
        raise ValueError(f"--data-dir {split.parent}: {len(empty)} class folder(s) of {split.name}/ hold no image "
                         f"({', '.join(empty[:5])}); an image is a file ending in {', '.join(IMAGE_SUFFIXES)}")  # fmt: skip
    images = torch.empty(len(files), 3, image_size, image_size, dtype=torch.uint8)
    for i, (_, path) in enumerate(files):
        try:
            with Image.open(path) as opened:
                image = center_crop(opened.convert("RGB"), image_size)
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"cannot read {path} as an image: {exc}") from None
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        images[i] = pixels.view(image_size, image_size, 3).permute(2, 0, 1)
    return images, torch.tensor([label for label, _ in files], dtype=torch.int64)


def center_crop(image, size: int):
    """A Pillow RGB image as torchvision's evaluation transform for its ImageNet weights makes it: the shorter side
    resized (bilinear, antialiased) to ``size * 256 / 224`` (256 for 224), then the centre ``size`` square."""
    from PIL import Image

    short = round(size * 256 / 224)
    width, height = image.size
    if width <= height:
        width, height = short, int(short * height / width)
    else:
        width, height = int(short * width / height), short
    image = image.resize((width, height), Image.Resampling.BILINEAR)
    left, top = int(round((width - size) / 2.0)), int(round((height - size) / 2.0))
    return image.crop((left, top, left + size, top + size))

"""The training loop behind ``gearsam demo`` and ``gearsam train``: several optimizers under the same seeds, a run
directory with ``config.json``, ``metrics.jsonl`` (see :mod:`.metrics`), ``summary.md`` and checkpoints. The plots
are drawn by the command afterwards, from ``metrics.jsonl`` alone: the loop never imports matplotlib.

Nothing in a step reads a value back from the device: the running loss and accuracy are summed on the device and
read once per epoch, block telemetry is read every ``telemetry_every`` steps, and time inside the optimizer is
measured with CUDA events on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import os
import pickle
import re
import shutil
import statistics
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import nn

from gearsam_fused import (
    GEARSAM,
    GSAM,
    OPTIMIZERS,
    SAM,
    WSAM,
    Adaptive,
    BlockTelemetry,
    Every,
    FriendlySAM,
    LookSAM,
    MomentumSAM,
    Random,
    Schedule,
    SurrogateGap,
    __version__,
    frozen_bn_stats,
    timing,
)
from gearsam_fused.models import MODELS
from gearsam_fused.partition import STRATEGIES
from gearsam_fused.partition import partition as blocks_of

from ..machine import describe_machine
from .data import DATASETS, Dataset, add_symmetric_noise, as_float, crop_and_flip, keep_classes, load_dataset, per_class
from .metrics import MetricsLog
from .weights import check_weights, load_backbone, read_weights, weights_path

#: The baseline without SAM: the base optimizer alone.
SGD = "sgd"
#: SAM's and GEAR-SAM's rules: their names on the command line and in the metrics rows (the library's one name for
#: each).
SAM_RULE, GEAR_RULE = SAM.rule, GEARSAM.rule
#: The SAM family by the names of ``--optimizers``: each name's library class and the keywords that set its part, at
#: its authors' defaults (fixed: no option changes them).
#:
#: - ``gsam``: GSAM (Zhuang et al.), SAM's perturbation with the surrogate-gap descent, alpha 0.4;
#: - ``wsam``: WSAM (Yue et al.), SAM's perturbation with the weighted-sharpness descent, gamma 0.9, decoupled;
#: - ``friendly-sam``: F-SAM (Li et al.), SAM with the friendly ascent direction, sigma 1.0, lambda 0.9;
#: - ``gear-gsam``: GEAR-SAM's block-wise allocation with GSAM's descent, alpha 0.4 (inner products per block).
#:
#: Under a ``--second-pass`` schedule their skipped steps are the base step with the first gradient; ``looksam`` is
#: refused with them, and ``adaptive`` with F-SAM's ascent (see ``RunConfig._check_second_pass``).
FAMILY = {
    "gsam": (GSAM, {"alpha": 0.4}),
    "wsam": (WSAM, {"gamma": 0.9, "decouple": True}),
    "friendly-sam": (FriendlySAM, {"sigma": 1.0, "lmbda": 0.9}),
    "gear-gsam": (GEARSAM, {"descent": SurrogateGap(alpha=0.4)}),  # a part holds no state: one serves every run
}
#: Every sharpness-aware optimizer a run can train, by name: the library's by their rule, with their own step
#: (no part), then the family.
BUILDS = {**{rule: (cls, {}) for rule, cls in OPTIMIZERS.items()}, **FAMILY}
#: One-pass momentum SAM (:class:`~gearsam_fused.MomentumSAM`) by name, with its allocation: SAM's global radius or
#: GEAR-SAM's block-wise one. ``NAME:RHO`` trains it at look-ahead radius RHO, ``NAME`` at ``--momentum-rho``.
ONE_PASS = {"momentum-sam": "sam", "momentum-gear-sam": "gear"}
#: The paper's comparison, which the demo trains: the baseline, then the library's sharpness-aware optimizers by
#: their rule.
PAPER = (SGD, *OPTIMIZERS)
#: The optimizers a run can train, by the names of ``--optimizers`` and the metrics rows: the demo's, the family,
#: then one-pass momentum SAM.
OPTIMIZER_NAMES = (*PAPER, *FAMILY, *ONE_PASS)


def one_pass(name: str) -> tuple[str, float | None] | None:
    """``(allocation, rho)`` of a one-pass name (``momentum-sam`` or ``momentum-sam:RHO``; rho None without one), None
    for any other name; a ValueError for a one-pass name whose radius is not a number >= 0."""
    base, colon, rho = name.partition(":")
    if base not in ONE_PASS:
        return None
    if not colon:
        return ONE_PASS[base], None
    try:
        value = float(rho)
    except ValueError:
        value = float("nan")
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"optimizer {name!r}: write {base}:RHO with RHO a number >= 0, the look-ahead radius")
    return ONE_PASS[base], value


def known_optimizer(name: str) -> bool:
    """Whether ``name`` is one of :data:`OPTIMIZER_NAMES` or a one-pass name with its radius."""
    return name in OPTIMIZER_NAMES or one_pass(name) is not None


SCHEDULES = ("constant", "cosine")
#: Every step of a sharpness-aware optimizer takes the second forward and backward: ``--second-pass``'s default.
ALWAYS = "always"
#: The forms of ``--second-pass``: which steps take the second pass (see gearsam_fused.schedules).
SECOND_PASS_FORMS = "always, every:K, looksam:K, looksam:K:ALPHA, random:P or adaptive, adaptive:C"
AMP_MODES = ("none", "bf16")
#: The range of each real setting, as :func:`check_real`'s bounds; each must also be finite.
REAL_RANGES = {
    "lr": {"low": 0.0, "low_inclusive": False},  # at lr 0 the weights never move
    "momentum": {"low": 0.0, "high": 1.0},
    "weight_decay": {"low": 0.0},
    "rho": {"low": 0.0},
    "momentum_rho": {"low": 0.0},
    "beta": {"low": 0.0, "high": 1.0},
    "label_noise": {"low": 0.0, "high": 1.0},  # the share of training labels replaced by another class
}
#: The least value of each integer setting (``threads`` may also be None: torch's choice).
INT_MINIMA = {"epochs": 1, "batch_size": 1, "telemetry_every": 1, "synthetic_size": 1, "checkpoint_every": 0,
              "threads": 1, "image_size": 1}  # fmt: skip
#: ``--train-per-class``'s value for the whole training split.
ALL = "all"

# What --resume may change in a run or study: how long and where it runs, never what it computes.
RESUMABLE = {"epochs", "threads", "device", "checkpoint_every", "telemetry_every"}


class SettingWarning(UserWarning):
    """A setting that runs, but likely not as meant; the command line prints it as ``gearsam: warning: ...``."""


def plural(count: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``, ``2 batches``."""
    sibilant = noun.endswith(("s", "sh", "ch", "x")) and not noun.endswith("epoch")  # epoch: a hard ch
    return f"{count} {noun}{('es' if sibilant else 's') * (count != 1)}"


def option(name: str) -> str:
    """The command-line option of setting ``name``: ``label_noise`` -> ``--label-noise``."""
    return "--" + name.replace("_", "-")


def check_at_least(name: str, value, low: int) -> int:
    """``value`` if it is an integer of at least ``low``; else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")
    return value


def check_real(
    name: str, value, *, low: float, low_inclusive: bool = True, high: float | None = None, high_inclusive: bool = False
) -> float:
    """``float(value)`` if it is a finite real in ``[low, high)`` (``(`` when not ``low_inclusive``, ``]`` when
    ``high_inclusive``); else a ValueError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    value = float(value)
    too_low = value < low if low_inclusive else value <= low
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        upper = "inf)" if high is None else f"{high}" + ("]" if high_inclusive else ")")
        raise ValueError(f"{name} must lie in {'[' if low_inclusive else '('}{low}, {upper}, got {value!r}")
    return value


def check_backend(name: str, device: torch.device) -> None:
    """A ValueError, in the library's words, unless the library can step parameters on ``device`` with backend
    ``name``. The library checks a backend as it builds an optimizer and has no public check of its own, so this
    builds one over a single parameter on ``device`` and drops it."""
    probe = nn.Parameter(torch.zeros(1, device=device))
    try:
        with warnings.catch_warnings():  # whatever the library says of a one-parameter model is not the run's
            warnings.simplefilter("ignore")
            SAM([probe], torch.optim.SGD, lr=1.0, backend=name)
    except TypeError as exc:  # a backend that is not a string, from a hand-edited config.json
        raise ValueError(str(exc)) from None


def second_pass_schedule(spec: str, seed: int = 0, name: str = "--second-pass") -> Schedule | None:
    """The schedule that ``spec`` (one of :data:`SECOND_PASS_FORMS`) names: None for ``always``, else
    ``Every(K)``, ``LookSAM(K, ALPHA)`` (ALPHA 0.7 unless given), ``Random(P, seed)`` or ``Adaptive(C)`` (C 0 unless
    given). A ValueError naming ``name`` and ``spec`` for anything else."""
    if not isinstance(spec, str):
        raise ValueError(f"{name} must be one of {SECOND_PASS_FORMS}, got {spec!r}")
    kind, *args = spec.strip().lower().split(":")

    def bad(why: str) -> ValueError:
        return ValueError(f"{name} {spec}: {why}; expected one of {SECOND_PASS_FORMS}")

    arity = {ALWAYS: (0, 0), "every": (1, 1), "looksam": (1, 2), "random": (1, 1), "adaptive": (0, 1)}
    if kind not in arity:
        raise bad(f"unknown schedule {kind!r}")
    forms = [f for f in SECOND_PASS_FORMS.replace(" or ", ", ").split(", ") if f.split(":")[0] == kind and ":" in f]
    if not arity[kind][0] <= len(args) <= arity[kind][1]:
        raise bad(f"write {kind} as {' or '.join(forms)}" if forms else f"{kind} takes no value")
    if kind == ALWAYS:
        return None
    if kind in ("every", "looksam"):
        try:
            k = int(args[0])
        except ValueError:
            raise bad(f"K must be an integer of at least 1 (a second pass every K steps), got {args[0]!r}") from None
        if k < 1:
            raise bad(f"K must be an integer of at least 1 (a second pass every K steps), got {k}")
    reals = []
    for text in args[1:] if kind == "looksam" else args if kind != "every" else ():
        try:
            reals.append(float(text))
        except ValueError:
            raise bad(f"{text!r} is not a number") from None
    try:
        if kind == "every":
            return Every(k)
        if kind == "looksam":
            return LookSAM(k, *reals)
        if kind == "random":
            if not 0.0 <= reals[0] <= 1.0:
                raise ValueError(f"P must lie in [0, 1], got {args[0]}")
            return Random(reals[0], seed)
        return Adaptive(*reals)
    except (ValueError, TypeError) as exc:  # the library's range checks (alpha >= 0, c finite)
        raise bad(str(exc)) from None


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
    second_pass: str = ALWAYS  # which steps take the second pass: one of SECOND_PASS_FORMS
    rho: float = 0.05
    momentum_rho: float = 1.0  # one-pass momentum SAM's look-ahead radius (a name's own :RHO takes precedence)
    beta: float = 0.9
    adaptive: bool = False
    partition: str = "coarse"
    backend: str = "auto"
    label_noise: float = 0.0
    # transfer learning (see gearsam_fused.app.weights): the classes kept, relabelled in the order given (None: all);
    # the training images per class, drawn from the seed (ALL: the whole split); the state dict the network starts
    # from, its classifier replaced ({seed} in the path: one file per seed; a relative path is read from the run
    # directory); the side of an image folder's square images
    classes: list[int] | None = None
    train_per_class: int | str = ALL
    weights: str | None = None
    image_size: int = 224
    # the radius of the sharpness-aware optimizers named here, in place of rho (the paper's transfer learning: SAM at
    # 0.05, GEAR-SAM at 0.2)
    optimizer_rho: dict = field(default_factory=dict)
    device: str = "cpu"
    amp: str = "none"
    channels_last: bool = False
    telemetry_every: int = 25
    checkpoint_every: int = 0
    threads: int | None = None

    def validate(self, spell: Callable[[str], str] = option) -> RunConfig:
        """``self``, once every setting is known good (in its range, the model's factory found, the device and
        backend usable); else a ValueError naming the setting, as ``spell`` writes it (its option), and its value.
        Nothing is built or written."""
        self._check_choices(spell)
        for name, low in INT_MINIMA.items():
            if not (name == "threads" and self.threads is None):
                check_at_least(spell(name), getattr(self, name), low)
        for name, bounds in REAL_RANGES.items():
            check_real(spell(name), getattr(self, name), **bounds)
        self._check_second_pass(spell)
        self._check_transfer(spell)
        load_factory(self.model)
        device = resolve_device(self.device)
        if self.channels_last and device.type == "cpu":
            # torch's CPU channels_last convolutions can corrupt the heap (stride-2 1x1 convolutions abort the process)
            raise ValueError("--channels-last is for CUDA devices; drop it on CPU")
        check_backend(self.backend, device)
        return self

    def _check_choices(self, spell: Callable[[str], str]) -> None:
        """The settings that name one (or several) of a fixed set."""
        choices = {"dataset": DATASETS, "schedule": SCHEDULES, "amp": AMP_MODES, "partition": STRATEGIES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{spell(name)} must be one of {allowed}, got {getattr(self, name)!r}")
        unknown = [o for o in self.optimizers if not known_optimizer(o)]
        if unknown or not self.optimizers:
            raise ValueError(
                f"{spell('optimizers')}: unknown {unknown}; expected a non-empty subset of {OPTIMIZER_NAMES} (the "
                "one-pass ones also as NAME:RHO)"
            )
        twice = sorted({o for o in self.optimizers if self.optimizers.count(o) > 1})
        if twice:
            raise ValueError(f"{spell('optimizers')} names {twice} more than once")
        if not self.seeds:
            raise ValueError(f"{spell('seeds')} must name at least one seed")
        twice = sorted({seed for seed in self.seeds if self.seeds.count(seed) > 1})
        if twice:  # a seed trained twice gives the same run twice, and a spread of 0 that means nothing
            raise ValueError(f"{spell('seeds')} names {twice} more than once; each seed is one run")

    def _check_second_pass(self, spell: Callable[[str], str]) -> None:
        """The second-pass schedule: a form of :data:`SECOND_PASS_FORMS`, for the sharpness-aware optimizers only
        (LookSAM's correction for SAM/GEAR-SAM only)."""
        schedule = second_pass_schedule(self.second_pass, name=spell("second_pass"))
        if schedule is None:
            return
        family = [o for o in self.optimizers if o in FAMILY]
        if family and schedule.corrects:  # said here, before anything trains, in the command's words
            raise ValueError(f"{spell('second_pass')} {self.second_pass} cannot correct the skipped steps of "
                             f"{', '.join(family)}: LookSAM's correction keeps the first gradient in the buffer their "
                             "descent keeps it in (and an ascent replaces it); drop them from "
                             f"{spell('optimizers')} or use every:K, random:P or adaptive")  # fmt: skip
        ascending = [o for o in family if "ascent" in FAMILY[o][1] or FAMILY[o][0] is FriendlySAM]
        if ascending and schedule.reads_energy:
            raise ValueError(f"{spell('second_pass')} {self.second_pass} cannot schedule {', '.join(ascending)}: it "
                             "decides from the first gradient's energy, which F-SAM's ascent replaces on its SAM "
                             f"steps; drop them from {spell('optimizers')} or use every:K or random:P")  # fmt: skip
        plain = [o for o in self.optimizers if o not in BUILDS]
        if plain:
            raise ValueError(f"{spell('second_pass')} {self.second_pass} schedules the second pass of the "
                             f"two-pass sharpness-aware optimizers; {', '.join(plain)} has none: drop it from "
                             f"{spell('optimizers')} (or train it in a run of its own)")  # fmt: skip
        if schedule.corrects and self.adaptive:
            raise ValueError(f"{spell('second_pass')} {self.second_pass}: LookSAM's correction is defined for plain "
                             f"gradients, not ASAM's; drop {spell('adaptive')} or use every:K")  # fmt: skip

    def _check_transfer(self, spell: Callable[[str], str]) -> None:
        """The settings of transfer learning: classes, training images per class, weights, and the radii per
        optimizer."""
        if self.classes is not None:
            if not self.classes or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.classes):
                raise ValueError(f"{spell('classes')} must name classes by their numbers (0, 1, ...), got "
                                 f"{self.classes!r}")  # fmt: skip
            twice = sorted({c for c in self.classes if self.classes.count(c) > 1})
            if twice:
                raise ValueError(f"{spell('classes')} names {twice} more than once")
        if self.train_per_class != ALL:
            try:
                check_at_least(spell("train_per_class"), self.train_per_class, 1)
            except ValueError:
                raise ValueError(f"{spell('train_per_class')} must be {ALL!r} or an integer of at least 1 (training "
                                 f"images per class), got {self.train_per_class!r}") from None  # fmt: skip
        if self.weights is not None and (not isinstance(self.weights, str) or not self.weights):
            raise ValueError(f"{spell('weights')} must be a file path, got {self.weights!r}")
        if not isinstance(self.optimizer_rho, dict):
            raise ValueError(f"{spell('optimizer_rho')} must map optimizer names to radii, got {self.optimizer_rho!r}")
        for name, rho in self.optimizer_rho.items():
            if name not in BUILDS:
                raise ValueError(f"{spell('optimizer_rho')} {name}={rho}: {name} is not a two-pass sharpness-aware "
                                 f"optimizer; expected one of {tuple(BUILDS)}")  # fmt: skip
            check_real(f"{spell('optimizer_rho')} {name}", rho, **REAL_RANGES["rho"])

    def rho_of(self, name: str) -> float:
        """The radius optimizer ``name`` trains at: its own in ``optimizer_rho``, else ``rho``."""
        return self.optimizer_rho.get(name, self.rho)

    def radii(self) -> str:
        """``rho`` as the reports write it, with the radii of ``optimizer_rho``: ``0.05 (gear-sam 0.2)``."""
        own = ", ".join(f"{name} {rho}" for name, rho in self.optimizer_rho.items() if name in self.optimizers)
        return f"{self.rho}" + (f" ({own})" if own else "")

    def describe(self, name: str) -> str:
        """Optimizer ``name`` as run summaries show it: with its second-pass schedule where it has one."""
        return name if name not in BUILDS or self.second_pass == ALWAYS else f"{name} {self.second_pass}"

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
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        dotted = module_name.removesuffix(".py").lstrip("./").replace("/", ".").replace("\\", ".")
        raise ValueError(f"model {spec!r}: expected package.module:factory, an importable module, not a file path; "
                         f"for ./{dotted.replace('.', '/')}.py run from its folder with {dotted}:{attr}")  # fmt: skip
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from None
    except Exception as exc:  # the module's own code failed as it was imported
        raise ValueError(f"cannot load {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}") from None


def call_factory(spec: str, **kwargs) -> nn.Module:
    """``spec``'s model built with ``kwargs``; whatever the factory raises (arguments its signature does not take,
    or its own code failing) is a ValueError naming the factory, the arguments and the exception."""
    factory = load_factory(spec)
    try:
        model = factory(**kwargs)
    except Exception as exc:  # a user's factory may raise anything: a bad setting, not a crash of the command
        raise ValueError(f"cannot build {spec!r} with {kwargs}: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def load_run_data(cfg: RunConfig) -> Dataset:
    """The dataset of a run: ``cfg.dataset`` (an image folder at ``cfg.image_size``) with ``cfg.classes`` only. The
    training images per class (``cfg.train_per_class``) are drawn per seed, as each run starts."""
    data = load_dataset(cfg.dataset, cfg.data_dir, cfg.synthetic_size, image_size=cfg.image_size)
    return keep_classes(data, cfg.classes)


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


def check_model(cfg: RunConfig, data: Dataset) -> nn.Module:
    """Build the model once on the meta device (no memory, no compute), so bad ``model_args`` fail before a run
    directory is written; returns that model."""
    try:
        with torch.device("meta"):
            return build_model(cfg, data)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"cannot build {cfg.model!r} with {cfg.model_args}: {exc}") from None


def check_run_weights(cfg: RunConfig, model: nn.Module, run_dir: Path | None = None) -> None:
    """A ValueError unless each seed's ``cfg.weights`` file is a state dict of ``model`` (built with the run's
    settings, on the meta device) but its classifier: read and checked before anything is written or trained."""
    if cfg.weights is None:
        return
    for path in dict.fromkeys(weights_path(cfg.weights, seed, run_dir) for seed in cfg.seeds):
        check_weights(model, read_weights(path), path, cfg.model)


def warn_single_block(cfg: RunConfig, model: nn.Module) -> None:
    """A SettingWarning, in the command's words, when ``cfg.partition`` puts all of ``model`` in one block, which
    makes GEAR-SAM plain SAM (the library's own warning, in its API's words, is silenced in :func:`make_optimizer`)."""
    block_wise = [o for o in cfg.optimizers if o == GEAR_RULE or (one_pass(o) or ("",))[0] == "gear"]
    if not block_wise or cfg.partition == "global":
        return
    blocks = blocks_of(model, cfg.partition)
    if len(blocks) == 1:
        message = (
            f"--partition {cfg.partition} gives {cfg.model} a single block ({blocks[0].name!r}), so GEAR-SAM is plain "
            f"SAM here; choose a finer --partition (`gearsam partition {cfg.model}` shows each strategy's blocks)"
        )
        warnings.warn(SettingWarning(message), stacklevel=2)


def check_out(path: Path, *, overwrite: bool, hint: str = "") -> bool:
    """Whether ``path``, about to receive a new run or study, holds files that must be cleared first (only with
    ``overwrite``). A ValueError, touching nothing, when it holds files and ``overwrite`` is off (old checkpoints and
    metrics would mix with the new run's), when it is a file, and when it holds something gearsam did not write."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file, not a directory")
    if not path.exists() or not any(path.iterdir()):
        return False
    if not overwrite:
        raise ValueError(
            f"--out {path} is not empty: pass --overwrite to clear it first{hint}, or choose another --out"
        )
    if not _written_by_gearsam(path):
        raise ValueError(f"--overwrite clears only a run or study directory, and {path} is neither (no config.json, "
                         "no study.json, no SETTING=VALUE runs); clear it yourself or choose another --out")  # fmt: skip
    return True


def _written_by_gearsam(path: Path) -> bool:
    """A run directory (``config.json`` is written first) or a study's (``study.json``, or runs named ``SETTING=VALUE``
    before it is written)."""
    if (path / "config.json").is_file() or (path / "study.json").is_file():
        return True
    return any("=" in child.name and (child / "config.json").is_file() for child in path.iterdir())


def clear_dir(path: Path) -> None:
    """Remove what ``path`` holds, keeping the directory itself."""
    for child in Path(path).iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def make_optimizer(name: str, model: nn.Module, cfg: RunConfig, seed: int = 0) -> torch.optim.Optimizer:
    """The optimizer ``name`` of :data:`OPTIMIZER_NAMES` over ``model``: SGD with the run's momentum and weight decay, alone
    or as the base optimizer of the library's sharpness-aware optimizer of that name (:data:`BUILDS`), under the
    run's second-pass schedule (``random:P`` draws its steps from ``seed``)."""
    base = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == SGD:
        return torch.optim.SGD(model.parameters(), **base)
    if one_pass(name) is not None:
        allocation, rho = one_pass(name)
        cls, hyper = MomentumSAM, dict(rho=cfg.momentum_rho if rho is None else rho, allocation=allocation)
        hyper.update(beta=cfg.beta, adaptive=cfg.adaptive, backend=cfg.backend, **base)
    elif name in BUILDS:
        cls, part = BUILDS[name]
        hyper = dict(rho=cfg.rho_of(name), adaptive=cfg.adaptive, backend=cfg.backend, **part, **base)
        hyper["schedule"] = second_pass_schedule(cfg.second_pass, seed)
        if "beta" in inspect.signature(cls).parameters:  # an EMA-based rule (GEAR-SAM); SAM refuses a beta
            hyper["beta"] = cfg.beta
    else:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZER_NAMES}")
    with warnings.catch_warnings():
        # the single-block warning speaks of the library's partition= argument; warn_single_block has said it in
        # the command's words, once for the whole run
        warnings.filterwarnings("ignore", message=".*pass partition=", category=UserWarning)
        return cls(model, torch.optim.SGD, partition=cfg.partition, **hyper)


class Stopwatch:
    """Sums the durations of ``start()``/``stop()`` sections. On CUDA the sections are timed with events, read only
    by :meth:`seconds`, so timing a step never waits for the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._done = 0.0
        self._sections: list[tuple[timing.Mark, timing.Mark]] = []
        self._started: timing.Mark | None = None

    def start(self) -> None:
        self._started = timing.mark(self.device)

    def stop(self) -> None:
        self._sections.append((self._started, timing.mark(self.device)))

    def seconds(self) -> float:
        self._done += sum(timing.seconds(a, b) for a, b in self._sections)
        self._sections.clear()
        return self._done


class Progress:
    """A run's progress: a tqdm bar on a terminal; elsewhere (CI logs, nohup, a notebook's output), or where tqdm is
    not installed, one line per status, i.e. per epoch, so logs show a long run advancing without filling up with
    redraws."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self._start = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional (pip install tqdm): without it, the lines below
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=label, file=self.stream, unit="step", dynamic_ncols=True)

    def update(self, steps: int = 1, status: str | None = None) -> None:
        """``steps`` more steps done; ``status``, when given, is the run's news (the epoch just ended)."""
        if self.bar is not None:
            if steps:
                self.bar.update(steps)
            if status is not None:
                self.bar.set_postfix_str(status)
        elif status is not None:
            self.stream.write(f"{self.label}: {status} ({time.perf_counter() - self._start:.1f}s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
    name: str  # one of OPTIMIZER_NAMES
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
    cpu_seconds: float = 0.0  # the process's CPU time in training so far (all its threads), without evaluation
    sam_steps: int = 0  # steps so far that took the second pass (every SAM/GEAR-SAM step under --second-pass always)
    # of each step recorded by the telemetry but not yet written, oldest first: whether it took the second pass, and
    # how many of the run's steps had up to it
    decisions: list[tuple[bool, int]] = field(default_factory=list)
    telemetry: BlockTelemetry | None = None  # SAM/GEAR-SAM runs only
    progress: Progress | None = None

    @property
    def tag(self) -> dict:
        """The fields that say whose a metrics row is."""
        return {"optimizer": self.name, "seed": self.seed}

    @property
    def sharpness_aware(self) -> bool:
        """Whether the run steps a SAM/GEAR-SAM optimizer or one of the family (two passes a step) rather than plain
        SGD."""
        return self.name in BUILDS

    @property
    def one_pass(self) -> bool:
        """Whether the run steps one-pass momentum SAM, whose parameters hold the look-ahead point between steps."""
        return one_pass(self.name) is not None


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, cfg: RunConfig, batch: int | None = None):
    """Mean loss and accuracy (%) as device tensors (no synchronisation), ``batch`` images at a time (default: 1024
    images up to 64x64 pixels, 128 larger ones, whose activations would fill a GPU's memory)."""
    batch = batch or (1024 if images[0].numel() <= 3 * 64 * 64 else 128)
    model.eval()
    loss = torch.zeros((), device=images.device)
    correct = torch.zeros((), dtype=torch.int64, device=images.device)
    for start in range(0, len(labels), batch):
        logits, batch_loss = _forward(model, images[start : start + batch], labels[start : start + batch], cfg)
        loss += batch_loss.float() * len(logits)
        correct += (logits.argmax(1) == labels[start : start + batch]).sum()
    model.train()
    return loss / len(labels), 100.0 * correct / len(labels)


def _forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: RunConfig):
    """``model``'s logits for ``x`` and their mean cross-entropy against ``y``, under the run's layout and autocast
    (an image folder's bytes normalised first: see :func:`~.data.as_float`)."""
    x = as_float(x)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
        logits = model(x)
        return logits, F.cross_entropy(logits, y)


def run_experiment(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    log=print,
    stream: TextIO | None = None,
) -> list[dict]:
    """Train every optimizer in ``cfg.optimizers`` for every seed; returns the ``result`` rows. With ``resume``,
    runs continue from their last checkpoint in ``run_dir`` (finished runs are evaluated again, not retrained);
    otherwise ``run_dir`` must be empty, or is cleared with ``overwrite`` once every setting is known good.
    ``log`` gets the lines of the report, ``stream`` the progress (default stderr). Plots are the caller's to draw
    from the run directory's ``metrics.jsonl``."""
    run_dir = Path(run_dir)
    data, stale = _check_run(cfg, run_dir, resume, overwrite)
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    else:  # results depend on the thread count (the order of float sums): config.json records the one used
        cfg = dataclasses.replace(cfg, threads=torch.get_num_threads())
    if stale:
        clear_dir(run_dir)
    metrics = _open_run_dir(cfg, run_dir, resume)
    experiment = Experiment(cfg, data, device, run_dir, metrics, resume=resume, stream=stream)
    subset = "" if cfg.train_per_class == ALL else f" ({cfg.train_per_class} per class for each seed)"
    start = "" if cfg.weights is None else f", from --weights {cfg.weights} (classifier replaced)"
    log(
        f"{data.name}: {len(data.train[1])} train{subset} / {len(data.test[1])} test images, model {cfg.model}"
        f"{start}, {plural(cfg.epochs, 'epoch')}, seeds {list(cfg.seeds)}, rho={cfg.radii()}, "
        f"label noise={cfg.label_noise:.0%}, device {device}, run directory {run_dir}"
        + ("" if cfg.second_pass == ALWAYS else f"; second pass: {cfg.second_pass}")
    )
    results = []
    for seed in cfg.seeds:
        for name in cfg.optimizers:
            result = _train_one(experiment, name, seed)
            passes = f", second pass on {_share(result)} of the steps" if cfg.describe(name) != name else ""
            log(
                f"  {cfg.describe(name):<9} seed {seed}: test acc {result['test_acc']:6.2f}%  "
                f"({result['seconds']:.1f}s, {result['sam_seconds']:.2f}s in SAM machinery{passes})"
            )
            results.append(result)
    table = summarize(results, cfg.optimizers, cfg)
    _write_summary(experiment, table)
    log("")
    log(table)
    return results


def _check_run(cfg: RunConfig, run_dir: Path, resume: bool, overwrite: bool) -> tuple[Dataset, bool]:
    """Every check before a run writes anything: the settings, the run directory, the data and the model; returns
    the data and whether ``run_dir`` holds an old run to clear."""
    cfg.validate()
    resumable = cfg.command == "train" and (run_dir / "config.json").is_file()
    hint = f", --resume {run_dir} to continue its runs" if resumable else ""
    stale = not resume and check_out(run_dir, overwrite=overwrite, hint=hint)
    data = load_run_data(cfg)
    model = check_model(cfg, data)
    check_run_weights(cfg, model, run_dir)
    warn_single_block(cfg, model)
    if resume:
        _check_extension(cfg, run_dir)
        for name in cfg.optimizers:  # a checkpoint refused now, before a run resumes and writes
            for seed in cfg.seeds:
                if checkpoint_path(run_dir, name, seed).exists():
                    read_checkpoint(checkpoint_path(run_dir, name, seed))
    return data, stale


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
    # outside a source checkout there is no commit: the installed version says what ran
    code = f"commit {machine['commit']}" if machine["commit"] else f"gearsam_fused {__version__}"
    (experiment.run_dir / "summary.md").write_text(
        f"# gearsam {cfg.command}: {experiment.data.name}, {plural(cfg.epochs, 'epoch')}, seeds {list(cfg.seeds)}\n\n"
        f"Measured {where}; torch {machine['torch']}, {code}, {plural(cfg.threads, 'thread')}.\n\n```\n{table}\n```\n"
    )


def _check_extension(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse more epochs for a finished cosine run: its lr has reached 0, and every added step would stay there."""
    if cfg.schedule != "cosine" or cfg.epochs <= RunConfig.load(run_dir / "config.json").epochs:
        return
    log = MetricsLog(run_dir / "metrics.jsonl")
    finished = [(r["optimizer"], r["seed"]) for r in log.rows() if r["kind"] == "result"]
    if any(checkpoint_path(run_dir, name, seed).exists() for name, seed in finished):
        raise ValueError(f"the cosine schedule of {run_dir} has ended at lr 0, so more --epochs would not train; "
                         "start a new run")  # fmt: skip


def checkpoint_path(run_dir: Path, name: str, seed: int) -> Path:
    """Where the run of optimizer ``name`` under ``seed`` keeps its checkpoint (no colon in a file name:
    ``momentum-sam:1`` is ``momentum-sam-rho1``)."""
    return Path(run_dir) / "checkpoints" / f"{name.replace(':', '-rho')}-seed{seed}.pt"


#: What a checkpoint holds (:func:`_save_checkpoint`); ``--resume`` reads all of it, the Hessian probe the model.
CHECKPOINT_KEYS = ("epoch", "step", "seconds", "sam_seconds", "cpu_seconds", "sam_steps", "model", "optimizer",
                   "scheduler", "cosine", "config")  # fmt: skip
#: The types a checkpoint is made of, besides tensors: what ``torch.load(weights_only=True)`` builds without calling
#: anything the file names.
PLAIN_TYPES = (dict, OrderedDict, list, tuple, str, int, float, bool, type(None))


def read_checkpoint(path: Path, map_location="cpu", keys=CHECKPOINT_KEYS) -> dict:
    """The checkpoint at ``path``, read with ``torch.load(weights_only=True)``: tensors and plain containers only, so
    nothing in the file runs. A file that needs more (a pickle that names a function or class to call, which could
    run any code) is refused with a ValueError, never loaded the unsafe way; so is a file torch cannot read or one
    that lacks ``keys``."""
    try:
        saved = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        what = (
            f"Its pickle asks to call {named[1]}, so loading it would execute code from the file"
            if named
            else "It holds more than tensors and plain containers, so loading it could execute code from the file"
        )
        raise ValueError(
            f"refusing {path}: it is not a checkpoint gearsam wrote. {what}; gearsam reads checkpoints with "
            "torch.load(weights_only=True) only. Resume or probe a run directory that gearsam wrote"
        ) from exc
    except (RuntimeError, EOFError, KeyError) as exc:  # not torch's format, truncated, or not a pickle at all
        reason = f": {str(exc).splitlines()[0]}" if str(exc) else " (the file ends early)"
        raise ValueError(f"cannot read {path} as a gearsam checkpoint: {type(exc).__name__}{reason}") from exc
    missing = [k for k in keys if k not in saved] if isinstance(saved, dict) else list(keys)
    if missing:
        raise ValueError(f"{path} is not a checkpoint gearsam wrote: it lacks {missing}")
    return saved


def check_plain(value, where: str = "checkpoint") -> None:
    """A TypeError naming the first entry of ``value`` (``where``) that is neither a tensor nor of
    :data:`PLAIN_TYPES`: a checkpoint holding it could not be read back by :func:`read_checkpoint`."""
    if type(value) in (torch.Tensor, nn.Parameter):
        return
    if type(value) not in PLAIN_TYPES:
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a checkpoint holds tensors and plain "
            "containers (dict, list, tuple, str, int, float, bool, None) only, which torch.load(weights_only=True) "
            "reads; convert it where the checkpoint is saved"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")


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
    """Train ``name`` under ``seed`` up to ``cfg.epochs`` (from its checkpoint when resuming; a run that already
    finished all of them is kept as it is); returns its ``result`` row."""
    if experiment.resume:
        done = [r for r in experiment.metrics.rows() if r["kind"] == "result" and (r["optimizer"], r["seed"]) ==
                (name, seed) and r["epochs"] == experiment.cfg.epochs]  # fmt: skip
        if done:
            return done[-1]
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
    if cfg.train_per_class != ALL:
        kept = per_class(y_train, cfg.train_per_class, data.num_classes, seed)
        x_train, y_train = x_train[kept], y_train[kept]
    if cfg.label_noise:
        y_train = add_symmetric_noise(y_train, cfg.label_noise, data.num_classes, seed)
    train = (x_train.to(device), y_train.to(device))
    test = tuple(t.to(device) for t in data.test)
    torch.manual_seed(seed)
    model = build_model(cfg, data)
    if cfg.weights is not None:  # every tensor but the classifier's, which keeps its fresh weights from the seed
        load_backbone(model, read_weights(weights_path(cfg.weights, seed, experiment.run_dir)))
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(name, model, cfg, seed)
    steps_per_epoch = math.ceil(len(y_train) / cfg.batch_size)
    cosine = {"start": 0, "phase": 0.0, "total": steps_per_epoch * cfg.epochs}
    factor = (lambda s: cosine_factor(s, **cosine)) if cfg.schedule == "cosine" else (lambda s: 1.0)
    return TrainingRun(
        cfg=cfg, name=name, seed=seed, device=device, train=train, test=test, augment=data.augment, model=model,
        optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, factor), cosine=cosine,
        steps_per_epoch=steps_per_epoch, metrics=experiment.metrics,
        checkpoint=checkpoint_path(experiment.run_dir, name, seed), in_optimizer=Stopwatch(device),
        in_base_step=Stopwatch(device),
    )  # fmt: skip


def _restore_checkpoint(run: TrainingRun) -> None:
    """Continue ``run`` from its checkpoint, where it has one: weights, optimizer and scheduler state, counters, and
    the cosine schedule stretched to the run's (possibly new) length."""
    if not run.checkpoint.exists():
        return
    saved = read_checkpoint(run.checkpoint, map_location=run.device)
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    if run.one_pass:
        run.optimizer.train()  # saved in eval mode: back to the look-ahead point
    run.scheduler.load_state_dict(saved["scheduler"])
    run.epoch, run.step, run.seconds, run.sam_seconds = (saved[k] for k in ("epoch", "step", "seconds", "sam_seconds"))
    run.sam_steps, run.cpu_seconds = saved["sam_steps"], saved["cpu_seconds"]
    run.cosine.update(stretch_cosine(saved["cosine"], run.step, run.cosine["total"]))


def _start_instruments(run: TrainingRun, stream: TextIO | None) -> None:
    """The progress bar over the steps left and, for SAM/GEAR-SAM, the block telemetry (into the metrics log) and
    the hooks that time the base optimizer's step, so that ``sam_seconds`` leaves it out."""
    if run.sharpness_aware or run.one_pass:

        def sink(records: list[dict]) -> None:
            # whether each step took the second pass, and the share of the run's steps so far that did: counted from
            # the run's first step, where the telemetry's own share counts from its creation (the resumption)
            taken, run.decisions[:] = run.decisions[: len(records)], run.decisions[len(records) :]
            run.metrics.write([{"kind": "blocks", **run.tag, **r, "sam_step": sam, "sam_fraction": done / r["step"]}
                               for (sam, done), r in zip(taken, records)])  # fmt: skip

        run.telemetry = BlockTelemetry(run.optimizer, every=run.cfg.telemetry_every, sink=sink, start=run.step)
        run.optimizer.base_optimizer.register_step_pre_hook(lambda *_: run.in_base_step.start())
        run.optimizer.base_optimizer.register_step_post_hook(lambda *_: run.in_base_step.stop())
    left = run.steps_per_epoch * (run.cfg.epochs - run.epoch)
    run.progress = Progress(f"{run.name} seed {run.seed}", left, stream)


def _train_epoch(run: TrainingRun) -> None:
    """One pass over the training set, in an order drawn from the seed and the epoch alone, then the test set;
    writes the epoch's metrics row."""
    epoch_start, cpu_start, sam_steps_before = time.perf_counter(), time.process_time(), run.sam_steps
    # an epoch's batches (order and augmentation) depend on nothing else, so a resumed run draws the same ones
    order_gen = torch.Generator().manual_seed(run.seed * 1_000_003 + run.epoch)
    loss_sum = torch.zeros((), device=run.device)
    sharpness_sum = torch.zeros((), device=run.device)
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    images = len(run.train[1])
    perturbed_images = 0  # the images of the steps that took the second pass: the realized sharpness is theirs
    batches = torch.randperm(images, generator=order_gen).split(run.cfg.batch_size)
    for idx in batches:
        batch_loss, batch_correct, batch_sharpness = _train_batch(run, idx.to(run.device), order_gen)
        loss_sum += batch_loss
        if batch_sharpness is not None:
            sharpness_sum += batch_sharpness
            perturbed_images += len(idx)
        correct += batch_correct
    if run.telemetry is not None:
        run.telemetry.flush()
    train_loss, train_acc = (loss_sum / images).item(), (100.0 * correct / images).item()
    # None for SGD, and for an epoch whose schedule skipped every second pass
    train_sharpness = (sharpness_sum / perturbed_images).item() if perturbed_images else None
    epoch_seconds = time.perf_counter() - epoch_start
    run.seconds += epoch_seconds
    run.cpu_seconds += time.process_time() - cpu_start
    with _at_w(run):
        test_loss, test_acc = (t.item() for t in evaluate(run.model, *run.test, run.cfg))
    run.epoch += 1
    run.sam_seconds = run.in_optimizer.seconds() - run.in_base_step.seconds()
    run.metrics.write([{
        "kind": "epoch", **run.tag, "epoch": run.epoch, "step": run.step, "lr": run.scheduler.get_last_lr()[0],
        "train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss, "test_acc": test_acc,
        "train_sharpness": train_sharpness, "seconds": run.seconds, "sam_seconds": run.sam_seconds,
        "epoch_seconds": epoch_seconds, "cpu_seconds": run.cpu_seconds, "sam_steps": run.sam_steps,
        "sam_fraction": (run.sam_steps - sam_steps_before) / len(batches),
    }])  # fmt: skip
    run.progress.update(0, f"epoch {run.epoch}/{run.cfg.epochs} loss {train_loss:.3f} test acc {test_acc:.1f}%")


def _train_batch(run: TrainingRun, idx: torch.Tensor, order_gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One optimizer step on the training images ``idx`` (cropped and flipped from ``order_gen`` where the dataset
    asks for it); returns the batch's summed loss, its number of correct predictions and its summed realized sharpness
    L(w + eps) - L(w), as device tensors (the sharpness None for SGD and for a step that skipped the second pass)."""
    xb, yb = run.train[0][idx], run.train[1][idx]
    if run.augment:
        xb = crop_and_flip(xb, order_gen)
    logits, loss = _forward(run.model, xb, yb, run.cfg)
    loss.backward()
    batch_loss, batch_correct = loss.detach().float() * len(idx), (logits.argmax(1) == yb).sum()
    batch_sharpness = None
    if run.sharpness_aware:
        perturbed = _sam_step(run, xb, yb, loss)
        if perturbed is not None:
            batch_sharpness = (perturbed.float() - loss.detach().float()) * len(idx)
    elif run.one_pass:
        _one_pass_step(run)
    else:
        run.optimizer.step()
        run.optimizer.zero_grad()
    run.scheduler.step()
    run.step += 1
    run.progress.update()
    return batch_loss, batch_correct, batch_sharpness


def _sam_step(run: TrainingRun, xb: torch.Tensor, yb: torch.Tensor, loss: torch.Tensor) -> torch.Tensor | None:
    """The rest of a SAM/GEAR-SAM step once the batch's gradients (of ``loss``) are in: perturb, forward and backward
    again at the perturbed weights, then restore and update; returns the loss at the perturbed weights, detached. On
    a step the second-pass schedule skips, ``first_step`` has made the update with the first gradient: no second pass,
    and None. Only ``first_step`` and ``second_step`` are timed."""
    opt = run.optimizer
    run.in_optimizer.start()
    second_pass = opt.first_step()
    run.in_optimizer.stop()
    run.sam_steps += second_pass
    run.decisions.append((second_pass, run.sam_steps))
    if not second_pass:
        run.telemetry.record()  # the step's energies and radii (0: nothing perturbed), without losses
        opt.zero_grad(set_to_none=False)
        return None
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


def _one_pass_step(run: TrainingRun) -> None:
    """A one-pass momentum SAM step with the batch's gradient, taken at the look-ahead point: no second pass (the
    telemetry records the look-ahead's energies and radii)."""
    run.in_optimizer.start()
    run.optimizer.step()
    run.in_optimizer.stop()
    run.decisions.append((False, run.sam_steps))
    run.telemetry.record()
    run.optimizer.zero_grad(set_to_none=False)


@contextlib.contextmanager
def _at_w(run: TrainingRun):
    """The model at its weights ``w`` for what is inside (evaluation, a checkpoint): a one-pass run's parameters hold
    the look-ahead point between steps, which is put back after."""
    if not run.one_pass:
        yield
        return
    run.optimizer.eval()
    try:
        yield
    finally:
        run.optimizer.train()


def _save_checkpoint(run: TrainingRun) -> None:
    """Write what a resumed run needs to continue exactly: weights, optimizer and scheduler state, counters, the
    cosine schedule and the settings (:data:`CHECKPOINT_KEYS`), as tensors and plain containers only (no random
    state: an epoch's batches are drawn from the seed and the epoch, a ``random:P`` schedule's generator state is a
    tensor in the optimizer's state dict)."""
    run.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    partial = run.checkpoint.with_suffix(".tmp")
    # a one-pass run saves w and its optimizer's eval-mode state, which train() resumes from; saved inside, since the
    # model's state dict holds the parameters themselves, not copies
    with _at_w(run):
        state = {
            "epoch": run.epoch, "step": run.step, "seconds": run.seconds, "sam_seconds": run.sam_seconds,
            "cpu_seconds": run.cpu_seconds, "sam_steps": run.sam_steps, "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "cosine": dict(run.cosine), "config": dataclasses.asdict(run.cfg),
        }  # fmt: skip
        check_plain(state)  # read back with weights_only=True: nothing in a checkpoint runs when it is loaded
        torch.save(state, partial)
    partial.replace(run.checkpoint)  # a crash while saving never leaves a truncated checkpoint behind


def _write_result(run: TrainingRun) -> dict:
    """Evaluate the trained model on the test set and write the run's ``result`` row; returns it."""
    with _at_w(run):
        test_loss, test_acc = (t.item() for t in evaluate(run.model, *run.test, run.cfg))
    result = {
        "kind": "result", **run.tag, "epochs": run.epoch, "step": run.step, "test_loss": test_loss,
        "test_acc": test_acc, "seconds": run.seconds, "sam_seconds": run.sam_seconds, "cpu_seconds": run.cpu_seconds,
        "sam_steps": run.sam_steps,
    }  # fmt: skip
    run.metrics.write([result])
    return result


def _share(result: dict) -> str:
    """The share of a run's steps that took the second pass, in %."""
    return f"{100.0 * result.get('sam_steps', 0) / max(result['step'], 1):.0f}%"


def summarize(results: list[dict], optimizers, cfg: RunConfig | None = None) -> str:
    """The comparison table: test accuracy (mean ± std over seeds), training time and time in SAM's machinery; under
    a second-pass schedule (``cfg.second_pass``), the optimizers named with it and the share of their steps that took
    the second pass."""
    scheduled = cfg is not None and cfg.second_pass != ALWAYS
    names = {name: cfg.describe(name) if cfg is not None else name for name in optimizers}
    width = max(10, *map(len, names.values()))
    header = f"{'optimizer':<{width}}  {'test acc (%)':>16}  {'time / run (s)':>14}  {'SAM machinery (s)':>17}"
    header += f"  {'second passes':>13}" if scheduled else ""
    lines = [header, "-" * len(header)]
    for name in optimizers:
        runs = [r for r in results if r["optimizer"] == name]
        accs = [r["test_acc"] for r in runs]
        spread = f"{statistics.stdev(accs):.2f}" if len(accs) > 1 else "n/a"  # one seed has no spread
        machinery = statistics.mean(r["sam_seconds"] for r in runs)
        shown = "-" if name == SGD else f"{machinery:.2f}"
        seconds = statistics.mean(r["seconds"] for r in runs)
        line = f"{names[name]:<{width}}  {statistics.mean(accs):>8.2f} ± {spread:<5}  {seconds:>14.2f}  {shown:>17}"
        if scheduled:
            passes = sum(r.get("sam_steps", 0) for r in runs) / max(sum(r["step"] for r in runs), 1)
            line += f"  {100.0 * passes:>12.0f}%"
        lines.append(line)
    return "\n".join(lines)

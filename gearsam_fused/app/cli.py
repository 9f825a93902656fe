"""Command line ``gearsam`` (also ``python -m gearsam_fused``): demo, train, reproduce, hessian, partition, plot,
bench."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import itertools
import json
import subprocess
import sys
import warnings
from pathlib import Path

from gearsam_fused import __version__, available_backends
from gearsam_fused.models import MODELS
from gearsam_fused.partition import STRATEGIES, format_partition, partition

from .data import DATASETS
from .demo import demo_run_config, is_demo_run, render_demo, run_demo
from .probe import ProbeSettings, probe_run
from .studies import STUDIES, rebuild_study, run_study, study_config
from .training import (
    ALL,
    AMP_MODES,
    OPTIMIZER_NAMES,
    RESUMABLE,
    SCHEDULES,
    SECOND_PASS_FORMS,
    RunConfig,
    SettingWarning,
    call_factory,
    check_at_least,
    known_optimizer,
    option,
    run_experiment,
)

# The benchmark suite's runner, in a source checkout's benchmarks/ folder: the suite is not part of the package.
RUNNER = "run.py"
# The probe's counts (ProbeSettings fields) by the options that set them; each must be at least 1.
PROBE_OPTIONS = {"k": "k", "batches": "probe_batches", "batch_size": "probe_batch_size", "max_iter": "max_iter",
                 "trace_samples": "trace_samples"}  # fmt: skip


def _model_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with a Python name as KEY, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a bare word such as act=silu


def _optimizer_rho(text: str) -> tuple[str, float]:
    """``--optimizer-rho``'s values: ``NAME=RHO``."""
    name, sep, value = text.partition("=")
    try:
        return (name, float(value)) if sep and name else _no_rho(text)
    except ValueError:
        return _no_rho(text)


def _no_rho(text: str):
    raise argparse.ArgumentTypeError(
        f"expected NAME=RHO (an optimizer and its radius, e.g. gear-sam=0.2), got {text!r}"
    )


def _per_class(text: str):
    """``--train-per-class``'s value: ``all`` or a whole number (checked with the other settings)."""
    if text == ALL:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {ALL} or a whole number, got {text!r}") from None


def _optimizer_name(text: str) -> str:
    """``--optimizers``' values: a name of :data:`OPTIMIZER_NAMES`, or a one-pass name with its radius."""
    try:
        if known_optimizer(text):
            return text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    raise argparse.ArgumentTypeError(f"unknown optimizer {text!r}; choose from {', '.join(OPTIMIZER_NAMES)}")


def _adder(parser: argparse.ArgumentParser, defaults: RunConfig):
    """``parser.add_argument`` that ends the help with the command's default. Options keep None as their own
    default, so that only the options given override the defaults (or a resumed run's settings)."""

    def add(flag: str, help: str = "", **kwargs) -> None:
        value = getattr(defaults, flag[2:].replace("-", "_"), None)
        if isinstance(value, bool):
            value = "on" if value else "off"
        elif isinstance(value, list):
            value = " ".join(map(str, value))
        elif isinstance(value, dict):
            value = " ".join(f"{k}={v}" for k, v in value.items()) or None
        parser.add_argument(flag, help=help + ("" if value is None else f" (default: {value})"), **kwargs)

    return add


def _training_options(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    """Options shared by demo and train."""
    add = _adder(parser, defaults)
    add("--optimizers", nargs="+", type=_optimizer_name, metavar="NAME", help=f"which of "
        f"{', '.join(OPTIMIZER_NAMES)} to train; gsam, wsam and friendly-sam are GSAM, WSAM and F-SAM at their "
        "authors' defaults, gear-gsam GEAR-SAM with GSAM's descent; momentum-sam and momentum-gear-sam one-pass "
        "momentum SAM with SAM's or GEAR-SAM's allocation, at --momentum-rho or as NAME:RHO")  # fmt: skip
    add("--seeds", type=int, nargs="+", help="one run per optimizer and seed")
    resumable = "; with --resume, the run's new total (see --resume)" if defaults.command == "train" else ""
    add("--epochs", type=int, help="epochs of each run" + resumable)
    add("--batch-size", type=int, help="images per step")
    add("--lr", type=float, help="base learning rate (SGD with momentum 0.9)")
    add("--rho", type=float, help="global SAM radius, >= 0")
    add("--momentum-rho", type=float, help="one-pass momentum SAM's look-ahead radius along the momentum, >= 0")
    add("--beta", type=float, help="GEAR-SAM's EMA factor")
    add("--partition", choices=STRATEGIES, help="GEAR-SAM's blocks")
    # no choices=: an unknown backend gets the library's own error, which lists them all
    add("--backend", help=f"auto, or one this installation can run: {', '.join(available_backends())}")
    add("--label-noise", type=float, help="symmetric label noise rate on the training set, e.g. 0.2")
    add("--telemetry-every", type=int, help="read block statistics from the device every N steps")
    chosen = "" if defaults.threads else " (default: torch's choice)"  # the demo's default is its own: see demo.DEMO
    add("--threads", type=int, help=f"CPU threads for torch{chosen}")
    add("--out", type=Path, help="run directory (default: runs/COMMAND-TIMESTAMP); refused if it holds files")
    parser.add_argument("--overwrite", action="store_true",
                        help="clear --out first when it holds an earlier run or study, instead of refusing it")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gearsam",
        description="SAM and GEAR-SAM for PyTorch. Start with `gearsam demo`: SGD, SAM and GEAR-SAM on the digits with "
        "40% of the training labels flipped, in about half a minute on a CPU, with a table, a reading and plots.",
    )
    parser.add_argument("--version", action="version", version=f"gearsam_fused {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train SGD, SAM and GEAR-SAM on scikit-learn's digits with noisy labels and compare",
        description="SGD, SAM and GEAR-SAM on scikit-learn's digits with 40% of the training labels flipped, a cosine "
        "learning rate and the same seeds: prints each one's test accuracy, its difference to SGD's and the "
        "training's CPU time, then a one-line reading of the run; writes a run directory with curves.png (accuracy "
        "panels zoomed to the run, final values labelled) and block_shares.png.",
    )
    _training_options(demo, demo_run_config())

    train = sub.add_parser("train", help="train a model on the digits, CIFAR-10/100 or synthetic data")
    _training_options(train, RunConfig())
    _model_options(train, RunConfig())
    _adder(train, RunConfig())(
        "--resume", type=Path, metavar="RUN_DIR",
        help="continue the runs of RUN_DIR from their checkpoints; a larger --epochs extends them, and a cosine "
        "schedule then goes on from the lr reached down to 0 at the new last step, never jumping back up (a "
        "finished cosine run, already at lr 0, cannot be extended)")  # fmt: skip

    _study_commands(sub)

    part = sub.add_parser("partition", help="print the block table of a model for each strategy")
    part.add_argument("model", help=f"an in-repo model ({', '.join(sorted(MODELS))}) or package.module:factory")
    part.add_argument("--model-arg", type=_model_arg, action="append", default=[], metavar="KEY=VALUE",
                      help="keyword for the model factory, as in train; e.g. num_classes=10 for the head a 10-class "
                      "dataset trains (the factory's own default otherwise: 1000 for tv_resnet18, resnet50, vit_b16 "
                      "and efficientnet_b0)")  # fmt: skip
    part.add_argument("--strategy", nargs="+", default=["coarse", "fine"], choices=STRATEGIES,
                      help="one table per strategy (default: coarse fine)")  # fmt: skip

    plot = sub.add_parser("plot", help="render the plots of a run directory, or rebuild a study's tables and figure")
    plot.add_argument("run_dir", type=Path, metavar="DIR",
                      help="a run directory (curves.png, block_shares.png) or a study directory (study.md, "
                      "study.json and study.png, rebuilt from its runs, finished or not)")  # fmt: skip

    bench = sub.add_parser("bench", help="run the benchmark suite (quick mode unless --full)")
    bench.add_argument("--full", action="store_true", help="the full suite (CPU: about 15 minutes on 2 cores) "
                       "instead of the quick one")  # fmt: skip
    bench.add_argument("--results", help="JSONL file to append the rows to (default benchmarks/results/runs.jsonl)")
    bench.add_argument("--benchmarks", type=Path, metavar="DIR",
                       help="the benchmarks/ folder of a source checkout (default: the one of the checkout holding "
                       "the current directory); the benchmarks are not part of the installed package")  # fmt: skip
    return parser


def _study_commands(sub) -> None:
    """``reproduce`` and ``hessian``: the paper's studies and the Hessian probe."""
    reproduce = sub.add_parser("reproduce", help="one of the paper's studies: a grid of runs, a table, a figure")
    reproduce.add_argument(
        "study",
        choices=list(STUDIES),
        help="; ".join(f"{k}: {s.about}" for k, s in STUDIES.items())
        + ". Defaults: the clean-label digits settings the demo starts from (15 epochs, rho 0.05), with --schedule "
        "cosine and five seeds; partition, rho, beta, efficiency and family train on 40%% noisy labels, hessian on "
        "three seeds. transfer: the paper's fine-tuning (30 epochs, lr 0.01, SAM rho 0.05, GEAR-SAM rho 0.2, weight "
        "decay 1e-4, 1e-5 for efficientnet_b0) of digits 5-9 in batches of 32 from a source network it pretrains on "
        "digits 0-4; or, with --model resnet50|efficientnet_b0 --weights PATH --data-dir DIR, of your image folder "
        "in batches of 128 from your weights",
    )
    _training_options(reproduce, study_config())
    _model_options(reproduce, study_config())
    reproduce.add_argument(
        "--values", nargs="+", type=_literal, help="the grid of the varied setting (default: the paper's)"
    )
    reproduce.add_argument("--resume", type=Path, metavar="STUDY_DIR",
                           help="continue the study in STUDY_DIR: finished runs are kept, unfinished ones go on from "
                           "their checkpoints (saved every epoch by default); only --epochs, --threads, --device, "
                           "--checkpoint-every and --telemetry-every may change")  # fmt: skip
    _probe_options(reproduce)
    hessian = sub.add_parser("hessian", help="the Hessian spectrum of a run directory's trained models")
    hessian.add_argument("run_dir", type=Path, help="a run trained with --checkpoint-every")
    _probe_options(hessian)


def _probe_options(parser: argparse.ArgumentParser) -> None:
    """The Hessian probe's budget (see ``gearsam_fused.app.probe.ProbeSettings``)."""
    defaults = ProbeSettings()
    parser.add_argument("--k", type=int, default=None, help=f"top eigenvalues (default: {defaults.k})")
    parser.add_argument("--probe-batches", type=int, default=None,
                        help=f"test batches the Hessian averages over (default: {defaults.batches})")  # fmt: skip
    parser.add_argument("--probe-batch-size", type=int, default=None,
                        help=f"images per probe batch (default: {defaults.batch_size})")  # fmt: skip
    parser.add_argument("--max-iter", type=int, default=None,
                        help=f"Hessian-vector products per eigenvalue, at most (default: {defaults.max_iter})")  # fmt: skip
    parser.add_argument("--trace-samples", type=int, default=None,
                        help=f"Hutchinson samples of the trace (default: {defaults.trace_samples})")  # fmt: skip


def _probe_settings(args: argparse.Namespace) -> ProbeSettings:
    """The probe's budget from the options, each checked before anything is trained or probed."""
    defaults = ProbeSettings()
    given = {key: getattr(args, dest) for key, dest in PROBE_OPTIONS.items()}
    return ProbeSettings(**{key: check_at_least(option(PROBE_OPTIONS[key]), getattr(defaults, key) if value is None
                                                else value, 1) for key, value in given.items()})  # fmt: skip


def _literal(text: str):
    """A grid value: a number where it reads as one, else the word (a partition strategy)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _model_options(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    """Options of train and reproduce beyond demo's: the model, the data, the device and the schedule."""
    add = _adder(parser, defaults)
    add("--model", help="in-repo model name (see `gearsam partition`) or package.module:factory; a factory taking "
        "num_classes (or in_channels) gets the dataset's")  # fmt: skip
    add(
        "--model-arg",
        type=_model_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword for the model factory, e.g. width=16 or 'blocks=(1,1)'; repeatable",
    )
    add("--dataset", choices=DATASETS, help="training data: scikit-learn's digits (8x8, 1 channel), CIFAR (needs "
        "--data-dir), synthetic (class patterns under noise, 3x32x32) or imagefolder (--data-dir holding "
        "train/CLASS/*.jpg and test/CLASS/*.jpg, read with Pillow)")  # fmt: skip
    add("--data-dir", help="folder holding cifar-10-batches-py/ or cifar-100-python/ (a trusted one: CIFAR's files "
        "are pickles, which can run code when read), or an image folder's train/ and test/")  # fmt: skip
    add("--synthetic-size", type=int, help="training images of --dataset synthetic")
    add("--momentum", type=float, help="SGD momentum")
    add("--weight-decay", type=float, help="SGD weight decay")
    add("--schedule", choices=SCHEDULES, help="learning rate schedule over all steps")
    add("--second-pass", metavar="SPEC", help=f"which steps of the sharpness-aware optimizers take the second forward "
        f"and backward: {SECOND_PASS_FORMS} (LookSAM's ALPHA 0.7 and AE-SAM's C 0 unless given; random draws from "
        "the seed); the other steps update with the first gradient alone. Not for sgd; looksam for sam and gear-sam "
        "only")  # fmt: skip
    add("--adaptive", action="store_const", const=True, help="ASAM scaling |w| + eta")
    add("--device", help="cpu, cuda or cuda:N")
    add("--amp", choices=AMP_MODES, help="bf16: forward and loss under bfloat16 autocast")
    add("--channels-last", action="store_const", const=True, help="channels_last model and inputs; CUDA only")
    add("--checkpoint-every", type=int, help="save a checkpoint every N epochs and at the end; 0: never")
    add("--weights", metavar="PATH", help="a state dict file the network starts from (torchvision's ImageNet weights "
        "of resnet50 or efficientnet_b0, say; nothing is downloaded), read with torch.load(weights_only=True): every "
        "tensor but the classifier's (the last linear layer, replaced for the dataset's classes and initialised from "
        "the seed); every layer is trained")  # fmt: skip
    add("--classes", type=int, nargs="+", metavar="C", help="train and test on these classes of the dataset only "
        "(numbered from 0; an image folder's in sorted order), relabelled in the order given")  # fmt: skip
    add("--train-per-class", type=_per_class, metavar="K", help=f"K training images per class, drawn from each "
        f"seed (all of a class that has fewer), or {ALL}")  # fmt: skip
    add("--image-size", type=int, metavar="SIZE", help="--dataset imagefolder: the side of the square images (shorter side resized "
        "to SIZE*256/224, centre crop)")  # fmt: skip
    add("--optimizer-rho", type=_optimizer_rho, action="append", metavar="NAME=RHO",
        help="the radius of optimizer NAME in place of --rho, e.g. gear-sam=0.2; repeatable")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the ``gearsam`` command with ``argv`` (default: the process's arguments); returns its exit status: 0, 2
    for bad settings (after printing ``gearsam: error: ...``), or the benchmark runner's."""
    if hasattr(sys.stdout, "reconfigure"):  # a replaced stdout (a notebook's, a test's capture) may not have it
        sys.stdout.reconfigure(line_buffering=True)  # a log file or CI sees each line as it is printed, not at the end
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.showwarning = _showing_setting_warnings(warnings.showwarning)
        try:
            return _run(args)
        except ValueError as exc:
            print(f"gearsam: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"\ngearsam: interrupted; {_interrupted(args)}", file=sys.stderr)
            return 130


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupted command kept, and the command that continues it."""
    where = getattr(args, "out_dir", None)
    if where is None or not where.is_dir():
        return "nothing was written"
    if args.command == "reproduce":
        return (f"{where} keeps the finished runs and the checkpoints; continue with: "
                f"gearsam reproduce {args.study} --resume {where}")  # fmt: skip
    if args.command == "train":
        return (f"{where} keeps the metrics so far and any checkpoints (--checkpoint-every); continue with: "
                f"gearsam train --resume {where}")  # fmt: skip
    if args.command == "demo":
        return f"{where} keeps the metrics so far; a demo run has no checkpoints: run it again to finish it"
    return "nothing was written"


def _showing_setting_warnings(show):
    """``warnings.showwarning`` that prints a SettingWarning as the command's own message (no source location: it is
    about the settings, not the code) and leaves every other warning to ``show``."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SettingWarning):
            print(f"gearsam: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def _config(args: argparse.Namespace) -> tuple[RunConfig, Path, bool]:
    """The run's settings: the command's defaults, then (or a resumed run's config.json, then) the options given."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if getattr(args, f.name, None) is not None
    }
    if getattr(args, "model_arg", None):
        given["model_args"] = dict(args.model_arg)
    if "optimizer_rho" in given:
        given["optimizer_rho"] = dict(given["optimizer_rho"])
    if "weights" in given:  # the file the user named, wherever the run directory is
        given["weights"] = str(Path(given["weights"]).expanduser().resolve())
    resume = getattr(args, "resume", None)
    if args.command == "reproduce":
        return _study_config(args, given)
    if resume is not None:
        if args.out is not None or args.overwrite:
            raise ValueError("--resume continues in RUN_DIR itself, keeping what it holds; drop --out and --overwrite")
        if not (resume / "config.json").is_file():
            raise ValueError(f"cannot resume {resume}: it has no config.json")
        cfg = RunConfig.load(resume / "config.json")
        changed = sorted(k for k, v in given.items() if k not in RESUMABLE and getattr(cfg, k) != v)
        if changed:
            raise ValueError(f"--resume cannot change {changed}; only {sorted(RESUMABLE)}")
        return dataclasses.replace(cfg, **given), resume, True
    cfg = RunConfig(**given) if args.command == "train" else demo_run_config(**given)
    _check_optimizer_rho(given, cfg.optimizers)
    return cfg, args.out, False


def _check_optimizer_rho(given: dict, optimizers) -> None:
    """Refuse a radius given for an optimizer the run does not train: it would be dropped."""
    idle = [f"{name}={rho}" for name, rho in given.get("optimizer_rho", {}).items() if name not in optimizers]
    if idle:
        raise ValueError(f"--optimizer-rho {' '.join(idle)}: not trained here (--optimizers {' '.join(optimizers)})")


def _study_config(args: argparse.Namespace, given: dict) -> tuple[RunConfig, Path | None, bool]:
    """A study's settings: its defaults then the options given, or those its ``study.json`` recorded when resuming
    (then only how long and where it runs may change). Options the study would not use are refused."""
    if args.resume is None:
        _check_study_options(args, given)
        cfg = study_config(args.study, **given)
        _check_optimizer_rho(given, cfg.optimizers)
        return cfg, args.out, False
    if args.out is not None or args.overwrite:
        raise ValueError("--resume continues in STUDY_DIR itself, keeping what it holds; drop --out and --overwrite")
    if not (args.resume / "study.json").is_file():
        raise ValueError(f"cannot resume {args.resume}: it has no study.json")
    saved = json.loads((args.resume / "study.json").read_text())
    if saved.get("study") != args.study or "settings" not in saved:
        raise ValueError(f"cannot resume {args.resume} as the {args.study} study: it holds {saved.get('study')!r}")
    cfg = RunConfig(**saved["settings"])
    changed = sorted(k for k, v in given.items() if k not in RESUMABLE and getattr(cfg, k) != v)
    if args.values and list(args.values) != saved["values"]:
        changed.append("values")
    if changed:
        raise ValueError(f"--resume cannot change {changed}; only {sorted(RESUMABLE)}")
    args.values = saved["values"]
    for key, dest in PROBE_OPTIONS.items():  # the probe's budget as recorded, unless given again
        if getattr(args, dest) is None:
            setattr(args, dest, saved["probe"][key])
    return dataclasses.replace(cfg, **given), args.resume, True


def _check_study_options(args: argparse.Namespace, given: dict) -> None:
    """Refuse the options a study would drop: the setting it varies (its grid is --values), optimizers it does not
    train, and the probe's budget outside the Hessian study."""
    study = STUDIES[args.study]
    if study.setting in given and args.study != "hessian":
        raise ValueError(f"{option(study.setting)} {given[study.setting]}: the {args.study} study varies "
                         f"{study.setting} itself; set its grid with --values")  # fmt: skip
    foreign = [o for o in given.get("optimizers", []) if o not in study.optimizers]
    if foreign:
        raise ValueError(f"--optimizers {' '.join(given['optimizers'])}: the {args.study} study trains "
                         f"{', '.join(study.optimizers)} only")  # fmt: skip
    probing = [option(dest) for dest in PROBE_OPTIONS.values() if getattr(args, dest) is not None]
    if probing and args.study != "hessian":
        raise ValueError(f"{', '.join(probing)}: the probe's options apply to the hessian study only")


def fresh_run_dir(base: Path) -> Path:
    """A new, empty directory named ``base``, or ``base-2``, ``base-3``, ... when that name is taken. ``mkdir`` without
    ``exist_ok`` is atomic: two runs started in the same second never share (or reuse) a directory."""
    for number in itertools.count(1):
        path = base if number == 1 else base.with_name(f"{base.name}-{number}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _out_dir(args: argparse.Namespace, given: Path | None):
    """``given``, or a fresh ``runs/COMMAND-TIMESTAMP``; a fresh one that a refused or failed command leaves empty is
    removed again, so a bad setting leaves no run directory behind."""
    if given is not None:
        args.out_dir = given
        yield given
        return
    what = f"{args.command}-{args.study}" if args.command == "reproduce" else args.command
    path = args.out_dir = fresh_run_dir(Path("runs") / f"{what}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    try:
        yield path
    finally:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def _run(args: argparse.Namespace) -> int:
    """Carry out the parsed command; returns its exit status."""
    if args.command in ("demo", "train"):
        cfg, out, resume = _config(args)
        with _out_dir(args, out) as run_dir:
            if args.command == "demo":
                run_demo(cfg, run_dir, overwrite=args.overwrite)
            else:
                run_experiment(cfg, run_dir, resume=resume, overwrite=args.overwrite)
        _plot_run(run_dir)
    elif args.command == "reproduce":
        cfg, out, resume = _config(args)
        probe = _probe_settings(args)
        with _out_dir(args, out) as study_dir:
            run_study(args.study, cfg, study_dir, values=args.values, probe=probe, overwrite=args.overwrite,
                      resume=resume)  # fmt: skip
        print((study_dir / "study.md").read_text())
        _plot(study_dir, "render_study")
    elif args.command == "hessian":
        probe_run(args.run_dir, _probe_settings(args))
        print((args.run_dir / "hessian.md").read_text())
        _plot(args.run_dir, "render_hessian")
    elif args.command == "partition":
        model = call_factory(args.model, **dict(args.model_arg))
        shown = " ".join([args.model, *(f"{k}={v!r}" for k, v in args.model_arg)])
        for strategy in args.strategy:
            print(f"[{shown}: {strategy}]")
            print(format_partition(partition(model, strategy)))
            print()
    elif args.command == "plot":
        if (args.run_dir / "study.json").is_file():  # a study: its tables are rebuilt from its runs, then drawn
            rebuild_study(args.run_dir)
            print(f"wrote {args.run_dir / 'study.md'}\nwrote {args.run_dir / 'study.json'}")
            _plot(args.run_dir, "render_study")
        else:
            _plot_run(args.run_dir)
    elif args.command == "bench":
        runner = benchmark_runner(args.benchmarks)
        extra = ([] if args.full else ["--quick"]) + (["--results", args.results] if args.results else [])
        return subprocess.run([sys.executable, str(runner), *extra]).returncode
    return 0


def benchmark_runner(folder: Path | None, start: Path | None = None) -> Path:
    """The runner of the benchmark suite in ``folder`` (``--benchmarks``), else in the benchmarks/ folder of the
    source checkout holding ``start`` (default: the current directory): the nearest folder, ``start`` or one above
    it, with both ``benchmarks/run.py`` and the package's sources ``gearsam_fused/``. A ValueError saying what is
    missing and how to get it when there is none: an installed package has no benchmarks."""
    if folder is not None:
        runner = folder / RUNNER
        if not runner.is_file():
            raise ValueError(f"--benchmarks {folder}: {runner} does not exist; pass the benchmarks/ folder of a "
                             "source checkout of gearsam_fused")  # fmt: skip
        return runner.resolve()
    start = (start or Path.cwd()).resolve()
    for root in (start, *start.parents):
        runner = root / "benchmarks" / RUNNER
        if runner.is_file() and (root / "gearsam_fused").is_dir():
            return runner
    raise ValueError(f"gearsam bench runs the benchmark suite of a source checkout (benchmarks/{RUNNER}), which the "
                     f"installed package does not include, and neither {start} nor a folder above it is such a "
                     "checkout; run it from within a clone of the gearsam_fused repository, or pass "
                     "--benchmarks DIR (its benchmarks/ folder)")  # fmt: skip


def _plot_run(run_dir: Path) -> None:
    """Render the plots of a run, or say why there are none: the run itself never needs matplotlib. A demo run's
    accuracy panels are zoomed to its range (``demo.render_demo``)."""
    _plot(run_dir, render_demo if is_demo_run(run_dir) else "render")


def _plot(folder: Path, renderer) -> None:
    """Draw ``folder``'s plots with ``plots.<renderer>`` (or ``renderer`` itself, a function) and name them, or say
    why there are none."""
    try:
        from . import plots
    except ImportError as exc:
        print(f"\nno plots: {exc} (pip install matplotlib)")
        return
    written = renderer(folder) if callable(renderer) else getattr(plots, renderer)(folder)
    for path in written if isinstance(written, list) else [written]:
        print(f"wrote {path}")

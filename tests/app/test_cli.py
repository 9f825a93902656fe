"""The command line, run as a user runs it, on tiny settings, checking what it writes: mostly in this process, and in
a process of its own where the process is what is tested (the import path, an interrupt, the installed script)."""

import contextlib
import io
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gearsam_fused.app.cli import main
from gearsam_fused.app.data import add_symmetric_noise, crop_and_flip, load_digits_split
from gearsam_fused.app.plots import block_shares_figure, curves_figure
from gearsam_fused.app.training import (
    Progress,
    RunConfig,
    cosine_factor,
    read_checkpoint,
    run_experiment,
    stretch_cosine,
)

EPOCH_FIELDS = {"kind", "optimizer", "seed", "epoch", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "train_sharpness",
                "seconds", "sam_seconds", "epoch_seconds", "cpu_seconds", "sam_steps", "sam_fraction"}  # fmt: skip
RESULT_FIELDS = {"kind", "optimizer", "seed", "epochs", "step", "test_loss", "test_acc", "seconds", "sam_seconds",
                 "cpu_seconds", "sam_steps"}  # fmt: skip
# the only fields that differ between two runs of the same settings
TIMES = {"seconds", "sam_seconds", "epoch_seconds", "cpu_seconds"}
# A small CIFAR-style network: trains in well under a second per epoch on 64 synthetic images.
TINY_TRAIN = ["--model-arg", "width=4", "--model-arg", "blocks=(1,1)", "--synthetic-size", "64", "--batch-size", "16",
              "--threads", "1"]  # fmt: skip
# A user's models module, for package.module:factory.
MYMODELS = """
from torch import nn

def tiny(num_classes, width=4):
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

def fixed():
    return tiny(10)
"""


def gearsam(*args, cwd=None, script=False) -> subprocess.CompletedProcess:
    """``gearsam ARGS``, with its exit code, stdout and stderr. In this process (the command starts in seconds, not
    after a fresh interpreter imports torch), leaving the process as it found it; ``script``: in a process of its own,
    as the installed ``gearsam`` script runs, without the current directory on the import path."""
    argv = list(map(str, args))
    if script:
        command = [sys.executable, "-P", "-m", "gearsam_fused", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)
    out, err = io.StringIO(), io.StringIO()
    with in_this_process(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's --help, --version and usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["gearsam", *argv], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def in_this_process(cwd):
    """Runs the body in ``cwd`` and puts back what a command changes for the rest of its process: the working
    directory, the import path and the user's modules imported from it, torch's thread count and random state (the
    thread count here too: a module's fixture runs a command before any test's own fixtures see the count)."""
    start, import_path, modules = os.getcwd(), list(sys.path), set(sys.modules)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    os.chdir(cwd or start)
    try:
        yield
    finally:
        os.chdir(start)
        sys.path[:] = import_path
        if cwd is not None:  # a user's modules imported from there: another test's folder may hold others so named
            here = str(Path(cwd).resolve())
            for name in set(sys.modules) - modules:
                if (getattr(sys.modules[name], "__file__", None) or "").startswith(here):
                    del sys.modules[name]
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def failed(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"gearsam: error: {message}" in result.stderr and "Traceback" not in result.stderr, result.stderr


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def table_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("optimizer"))
    rows = {}
    for line in lines[header + 2 :]:
        if not line.strip() or line.startswith("wrote"):
            break
        rows[line.split()[0]] = line.split()[1:]
    return rows


def assert_real_plot(path) -> None:
    """A PNG that decodes, has a plot's size and is not blank: many colours, spread over the image."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100
    drawn = (pixels < 250).any(axis=2)  # anything that is not white background
    assert 0.05 < drawn.mean() < 0.95
    assert drawn[: len(drawn) // 2].any() and drawn[len(drawn) // 2 :].any()


def test_plot_rejects_a_directory_without_metrics(tmp_path):
    failed(gearsam("plot", tmp_path), f"{tmp_path} is not a run directory: it has no metrics.jsonl")


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without timings, in a canonical order (resuming interleaves the runs differently)."""
    stripped = [{k: v for k, v in r.items() if k not in TIMES} for r in rows]
    return sorted(stripped, key=lambda r: (r["optimizer"], r["seed"], r["kind"], r["step"]))


def test_train_resumes_from_checkpoints_exactly(tmp_path):
    args = [*TINY_TRAIN, "--optimizers", "sgd", "gear-sam", "--checkpoint-every", "1", "--telemetry-every", "3"]
    ok(gearsam("train", *args, "--epochs", 2, "--out", tmp_path / "straight"))
    ok(gearsam("train", *args, "--epochs", 1, "--out", tmp_path / "resumed"))
    out = ok(gearsam("train", "--resume", tmp_path / "resumed", "--epochs", 2, "--threads", 1))
    assert f"run directory {tmp_path / 'resumed'}" in out
    for name in ("sgd", "gear-sam"):
        saved = read_checkpoint(tmp_path / "resumed" / "checkpoints" / f"{name}-seed0.pt")
        assert saved["epoch"] == 2 and saved["step"] == 8
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert len(resumed) == len(straight) == 2 * 2 + 2 + 8  # epoch rows, results, GEAR-SAM's per-step records
    assert comparable(resumed) == comparable(straight)  # bitwise: same losses, accuracies, energies, radii


def test_train_resume_refuses_to_change_what_it_computes(tmp_path):
    ok(gearsam("train", *TINY_TRAIN, "--optimizers", "sgd", "--checkpoint-every", "1", "--out", tmp_path))
    failed(gearsam("train", "--resume", tmp_path, "--lr", "0.3"), "--resume cannot change ['lr']")
    failed(
        gearsam("train", "--resume", tmp_path / "nothing"),
        f"cannot resume {tmp_path / 'nothing'}: it has no config.json",
    )


def test_train_bf16_autocast_channels_last_and_cosine_schedule(tmp_path):
    args = ["--optimizers", "sam", "--amp", "bf16", "--schedule", "cosine", "--epochs", 2]
    if torch.cuda.is_available():
        args += ["--device", "cuda", "--channels-last"]
    ok(gearsam("train", *TINY_TRAIN, *args, "--out", tmp_path))
    epochs = [r for r in metrics(tmp_path) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert epochs[0]["lr"] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi / 2)))  # half way down the cosine
    assert epochs[1]["lr"] == pytest.approx(0.0, abs=1e-12) and all(math.isfinite(r["train_loss"]) for r in epochs)


def test_train_refuses_channels_last_on_cpu(tmp_path):
    # torch's CPU channels_last convolutions abort this very run with "free(): invalid next size"
    failed(gearsam("train", *TINY_TRAIN, "--channels-last", "--out", tmp_path / "r"),
           "--channels-last is for CUDA devices; drop it on CPU")  # fmt: skip
    assert not (tmp_path / "r").exists()


class RunCrashed(Exception):
    pass


class CrashingLog:
    """A log stream (not a terminal) that raises at the run's tenth epoch line: a run that dies part way, at the
    same point every time. The line comes after that epoch's metrics and before its checkpoint."""

    def __init__(self, epochs: int):
        self.epochs, self.lines = epochs, 0

    def write(self, text: str) -> None:
        self.lines += text.count("\n")
        if self.lines >= self.epochs:
            raise RunCrashed

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_train_resumed_with_more_epochs_continues_the_cosine_down(tmp_path):
    cfg = RunConfig(model_args={"width": 4, "blocks": (1, 1)}, synthetic_size=64, batch_size=16,
                    optimizers=["sgd"], schedule="cosine", checkpoint_every=1, epochs=20)  # fmt: skip
    with pytest.raises(RunCrashed):
        run_experiment(cfg, tmp_path, log=lambda *_: None, stream=CrashingLog(10))
    stopped = read_checkpoint(tmp_path / "checkpoints" / "sgd-seed0.pt")["epoch"]
    # late enough that the old schedule, stretched over 30 epochs from step 0, would put the lr back up
    assert stopped == 9
    ok(gearsam("train", "--resume", tmp_path, "--epochs", 30, "--threads", 1))
    lrs = [r["lr"] for r in sorted((r for r in metrics(tmp_path) if r["kind"] == "epoch"), key=lambda r: r["epoch"])]
    assert len(lrs) == 30 and lrs[stopped - 1] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * stopped / 20)))
    assert all(later < earlier for earlier, later in zip(lrs, lrs[1:-1])) and lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert lrs[stopped] > 0.1 * 0.5 * (1 + math.cos(math.pi * (stopped + 1) / 20))  # stretched over the added epochs


def test_cosine_schedule_stretches_without_jumps():
    fresh = {"start": 0, "phase": 0.0, "total": 40}
    assert stretch_cosine(fresh, 10, 40) is fresh  # the same total: exactly the schedule the run started with
    longer, shorter = stretch_cosine(fresh, 10, 100), stretch_cosine(fresh, 10, 20)
    for cosine, total in ((longer, 100), (shorter, 20)):
        assert cosine_factor(10, **cosine) == pytest.approx(cosine_factor(10, **fresh))
        factors = [cosine_factor(s, **cosine) for s in range(10, total + 1)]
        assert all(b < a for a, b in zip(factors, factors[1:])) and factors[-1] == pytest.approx(0.0, abs=1e-12)


def test_train_refuses_to_extend_a_finished_cosine(tmp_path):
    args = [*TINY_TRAIN, "--optimizers", "sgd", "--schedule", "cosine", "--checkpoint-every", "1", "--epochs", 1]
    ok(gearsam("train", *args, "--out", tmp_path))
    before = (tmp_path / "metrics.jsonl").read_text()
    failed(gearsam("train", "--resume", tmp_path, "--epochs", 2),
           f"the cosine schedule of {tmp_path} has ended at lr 0, so more --epochs would not train")  # fmt: skip
    assert RunConfig.load(tmp_path / "config.json").epochs == 1 and (tmp_path / "metrics.jsonl").read_text() == before


def write_fake_cifar(root, name: str, per_file: int) -> None:
    """The python archive's layout and pickle format, with random pixels."""
    layout = {"cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels"),
              "cifar100": ("cifar-100-python", ["train", "test"], b"fine_labels")}  # fmt: skip
    folder, files, label_key = layout[name]
    rng = np.random.default_rng(0)
    (root / folder).mkdir()
    for f in files:
        batch = {b"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
                 label_key: rng.integers(0, 100 if name == "cifar100" else 10, per_file).tolist()}  # fmt: skip
        with open(root / folder / f, "wb") as fh:
            pickle.dump(batch, fh)


@pytest.mark.parametrize("name, train_images", [("cifar10", 5 * 12), ("cifar100", 12)])
def test_train_reads_the_cifar_archives(tmp_path, name, train_images):
    write_fake_cifar(tmp_path, name, per_file=12)
    out = ok(gearsam("train", *TINY_TRAIN, "--dataset", name, "--data-dir", tmp_path, "--optimizers", "gear-sam",
                     "--out", tmp_path / "run"))  # fmt: skip
    assert out.startswith(f"{name}: {train_images} train / 12 test images")
    (epoch,) = [r for r in metrics(tmp_path / "run") if r["kind"] == "epoch"]
    assert epoch["step"] == math.ceil(train_images / 16)


def test_train_says_what_is_missing(tmp_path):
    failed(
        gearsam("train", "--dataset", "cifar10"),
        "--dataset cifar10 needs --data-dir DIR containing cifar-10-batches-py/",
    )
    failed(gearsam("train", "--dataset", "cifar100", "--data-dir", tmp_path), "cifar100 not found:")
    failed(gearsam("train", "--model", "resnet1000", "--out", tmp_path / "r"), "unknown model 'resnet1000'")
    bad = gearsam("train", "--model-arg", "width")
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
    if not torch.cuda.is_available():
        failed(gearsam("train", "--device", "cuda"), "device 'cuda' requested, but this torch sees no CUDA GPU")
    assert not (tmp_path / "r").exists()  # nothing is written before the settings and the data are known good


def test_train_validates_settings_before_writing_anything(tmp_path):
    run = tmp_path / "r"
    tiny = [*TINY_TRAIN, "--out", run]
    failed(gearsam("train", *tiny, "--model-arg", "depth=3"), "cannot build 'resnet18' with {'width': 4, 'blocks'")
    failed(gearsam("train", *tiny, "--model-arg", "width=abc"), "cannot build 'resnet18' with {'width': 'abc'")
    failed(gearsam("train", *tiny, "--rho", "-0.1"), "--rho must lie in [0.0, inf), got -0.1")
    failed(gearsam("train", *tiny, "--rho", "nan"), "--rho must be a finite real number, got nan")
    failed(gearsam("train", *tiny, "--backend", "fastest"), "unknown backend 'fastest'; expected 'auto' or one of")
    bad = gearsam("train", *tiny, "--rho", "big")
    assert bad.returncode == 2 and "argument --rho: invalid float value: 'big'" in bad.stderr
    assert not run.exists()


def test_demo_rejects_bad_settings():
    bad = gearsam("demo", "--optimizers", "adamw")
    assert bad.returncode == 2 and "unknown optimizer 'adamw'; choose from sgd, sam, gear-sam" in bad.stderr
    failed(gearsam("demo", "--epochs", "0"), "--epochs must be at least 1, got 0")


# Small enough that a command given good settings would finish in seconds (as it did before settings were checked).
SMALL = {"train": ["--model-arg", "width=4", "--model-arg", "blocks=(1,1)", "--synthetic-size", "64", "--batch-size",
                   "16", "--optimizers", "sgd", "gear-sam"],
         "demo": ["--epochs", "1", "--seeds", "0", "--batch-size", "256"],
         "reproduce": ["--epochs", "1", "--seeds", "0", "--batch-size", "256", "--optimizers", "sgd"],
         "hessian": []}  # fmt: skip


def refused(capsys, argv: list, message: str) -> str:
    """Run ``gearsam ARGV`` in this process (a refusal happens before anything is trained); asserts exit code 2 and
    ``gearsam: error: MESSAGE``. Returns stderr."""
    import_path = list(sys.path)
    try:
        assert main([str(a) for a in argv]) == 2
    finally:
        sys.path[:] = import_path  # as a process of its own, the command puts the current directory first
    err = capsys.readouterr().err
    assert f"gearsam: error: {message}" in err, err
    return err


BAD_SETTINGS = [
    ("train", ["--beta", "1.5"], "--beta must lie in [0.0, 1.0), got 1.5"),
    ("train", ["--lr", "-1"], "--lr must lie in (0.0, inf), got -1.0"),
    ("train", ["--momentum", "-1"], "--momentum must lie in [0.0, 1.0), got -1.0"),
    ("train", ["--label-noise", "1.5"], "--label-noise must lie in [0.0, 1.0), got 1.5"),
    ("train", ["--label-noise", "-0.5"], "--label-noise must lie in [0.0, 1.0), got -0.5"),
    ("train", ["--lr", "nan"], "--lr must be a finite real number, got nan"),
    ("train", ["--lr", "inf"], "--lr must be a finite real number, got inf"),
    ("train", ["--weight-decay", "nan"], "--weight-decay must be a finite real number, got nan"),
    ("demo", ["--beta", "nan"], "--beta must be a finite real number, got nan"),
    ("demo", ["--label-noise", "1.5"], "--label-noise must lie in [0.0, 1.0), got 1.5"),
    ("demo", ["--rho", "inf"], "--rho must be a finite real number, got inf"),
    ("reproduce", ["label-noise", "--momentum", "inf"], "--momentum must be a finite real number, got inf"),
    # a bad value late in the grid fails the study before its first run, not after it
    ("reproduce", ["label-noise", "--values", "0.0", "1.5"], "label_noise must lie in [0.0, 1.0), got 1.5, in --values"),
    ("reproduce", ["label-noise", "--values", "0.0", "nan"],
     "label_noise must be a finite real number, got 'nan', in --values"),
    ("reproduce", ["hessian", "--k", "0"], "--k must be at least 1, got 0"),  # the probe comes after the training
    ("hessian", ["no-such-run", "--probe-batch-size", "0"], "--probe-batch-size must be at least 1, got 0"),
    ("hessian", ["no-such-run", "--max-iter", "-1"], "--max-iter must be at least 1, got -1"),
]  # fmt: skip


@pytest.mark.parametrize("command, args, message", BAD_SETTINGS)
def test_every_setting_is_checked_before_anything_is_written(capsys, tmp_path, command, args, message):
    out = [] if command == "hessian" else ["--out", tmp_path / "out"]
    refused(capsys, [command, *args, *SMALL[command], *out], message)
    assert list(tmp_path.iterdir()) == []


def old_run(folder) -> dict:
    """A run directory as an earlier run left it (its config, metrics and a checkpoint); returns its files' contents."""
    (folder / "checkpoints").mkdir(parents=True)
    files = {
        "config.json": '{"seeds": [7]}\n',
        "metrics.jsonl": '{"kind": "result"}\n',
        "checkpoints/sam-seed7.pt": "old",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def contents(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["demo", "train", "reproduce"])
def test_an_existing_run_directory_is_refused_and_left_untouched(capsys, tmp_path, command):
    files = old_run(tmp_path)
    study = ["label-noise", "--values", "0.0"] if command == "reproduce" else []
    err = refused(capsys, [command, *study, *SMALL[command], "--out", tmp_path],
                  f"--out {tmp_path} is not empty: pass --overwrite to clear it first")  # fmt: skip
    assert (f"--resume {tmp_path}" in err) == (command == "train")  # a run, which train alone can continue
    assert contents(tmp_path) == files


def test_overwrite_touches_nothing_until_the_settings_are_good(capsys, tmp_path):
    run = tmp_path / "run"
    files = old_run(run)
    refused(capsys, ["train", *SMALL["train"], "--lr", "nan", "--out", run, "--overwrite"], "--lr must be a finite")
    refused(capsys, ["train", "--model-arg", "depth=3", "--out", run, "--overwrite"], "cannot build 'resnet18'")
    refused(capsys, ["train", "--resume", run, "--overwrite"], "--resume continues in RUN_DIR itself")
    assert contents(run) == files
    mine = tmp_path / "mine"  # not a run: --overwrite would delete someone's files
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    refused(capsys, ["demo", *SMALL["demo"], "--out", mine, "--overwrite"],
            f"--overwrite clears only a run or study directory, and {mine} is neither")  # fmt: skip
    assert contents(mine) == {"notes.txt": "keep"}


def test_overwrite_replaces_the_old_run_entirely(tmp_path):
    old_run(tmp_path)
    ok(gearsam("train", *TINY_TRAIN, "--optimizers", "sgd", "--out", tmp_path, "--overwrite"))
    assert not (tmp_path / "checkpoints").exists()  # no stale checkpoint left for a later --resume to pick up
    assert {(r["optimizer"], r["seed"]) for r in metrics(tmp_path)} == {("sgd", 0)}
    assert RunConfig.load(tmp_path / "config.json").seeds == [0]


def test_overwrite_replaces_an_old_study_entirely(tmp_path):
    old_run(tmp_path / "label_noise=0.5")
    ok(gearsam("reproduce", "label-noise", "--values", 0.0, *SMALL["reproduce"], "--threads", 1, "--out", tmp_path,
               "--overwrite"))  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["label_noise=0.0"]
    assert [r["value"] for r in json.loads((tmp_path / "study.json").read_text())["accuracy"]] == [0.0]


# A model with a single layer of parameters: one block under every partition.
ONE_LAYER = """
from torch import nn

def linear(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
"""
# A user's models module whose factory raises, and one whose import fails.
RAISING_MODELS = """
def boom(num_classes=10):
    raise KeyError("weights")
"""


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """The current directory (first on the import path) holds ``raising_models`` and ``broken_models``."""
    (tmp_path / "raising_models.py").write_text(RAISING_MODELS)
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)
    yield tmp_path
    sys.modules.pop("raising_models", None)


def test_a_factory_that_raises_is_a_clean_error_everywhere(capsys, user_modules):
    raised = "KeyError: 'weights'"
    err = refused(capsys, ["partition", "raising_models:boom"], "cannot build 'raising_models:boom' with {}")
    assert raised in err
    for command, small in (("train", ["--synthetic-size", 64]), ("reproduce", ["label-noise", *SMALL["reproduce"]])):
        err = refused(capsys, [command, *small, "--model", "raising_models:boom", "--out", "out"],
                      "cannot build 'raising_models:boom' with {'num_classes': 10}")  # fmt: skip
        assert raised in err and not (user_modules / "out").exists()
    run = user_modules / "run"  # a run whose model's factory fails when the probe rebuilds it
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"model": {}}, run / "checkpoints" / "sgd-seed0.pt")  # read before the probe builds the model
    (run / "config.json").write_text(json.dumps({"model": "raising_models:boom", "optimizers": ["sgd"]}))
    assert raised in refused(capsys, ["hessian", run], "cannot build 'raising_models:boom'")
    refused(capsys, ["partition", "broken_models:tiny"],
            "cannot load 'broken_models:tiny': importing broken_models raised RuntimeError: needs a GPU")  # fmt: skip


def test_a_single_block_is_reported_in_the_commands_words(tmp_path):
    (tmp_path / "onelayer.py").write_text(ONE_LAYER)
    args = ["--model", "onelayer:linear", "--synthetic-size", 32, "--batch-size", 16, "--threads", 1, "--seeds", 0, 1,
            "--optimizers", "gear-sam", "--out", "run"]  # fmt: skip
    run = gearsam("train", *args, cwd=tmp_path)
    ok(run)
    assert "partition=" not in run.stderr and "UserWarning" not in run.stderr  # the library's own words
    warning = "gearsam: warning: --partition coarse gives onelayer:linear a single block ("
    assert run.stderr.count(warning) == 1, run.stderr  # once for the run, not once per seed
    assert "so GEAR-SAM is plain SAM here; choose a finer --partition" in run.stderr


def test_partition_prints_block_tables():
    out = ok(gearsam("partition", "resnet18", "--strategy", "coarse"))
    lines = out.splitlines()
    assert lines[1].split() == ["block", "tensors", "params", "%"]
    assert [line.split()[0] for line in lines[2:8]] == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
    assert lines[8].split() == ["total", "62", "11,173,962", "100.00"]
    by_path = ok(gearsam("partition", "gearsam_fused.models:pyramidnet110", "--strategy", "coarse", "fine"))
    assert (
        "[gearsam_fused.models:pyramidnet110: coarse]" in by_path
        and "[gearsam_fused.models:pyramidnet110: fine]" in by_path
    )
    failed(gearsam("partition", "nonexistent_model"), "unknown model 'nonexistent_model'")
    failed(gearsam("partition", "torch.nn:NoSuchLayer"), "cannot load 'torch.nn:NoSuchLayer'")


def test_partition_imports_from_the_current_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    out = ok(gearsam("partition", "mymodels:fixed", "--strategy", "coarse", cwd=tmp_path, script=True))
    assert out.startswith("[mymodels:fixed: coarse]")
    failed(gearsam("partition", "mymodels:tiny", cwd=tmp_path, script=True),
           "cannot build 'mymodels:tiny' with {}: TypeError: tiny() missing 1 required positional argument")  # fmt: skip


def test_train_takes_a_model_by_path(tmp_path):
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    args = ["--model", "mymodels:tiny", "--model-arg", "width=3", "--synthetic-size", "64", "--batch-size", "16",
            "--optimizers", "sgd", "gear-sam", "--out", "run"]  # fmt: skip
    out = ok(gearsam("train", *args, cwd=tmp_path, script=True))
    assert "model mymodels:tiny" in out and RunConfig.load(tmp_path / "run" / "config.json").model == "mymodels:tiny"
    assert {r["optimizer"] for r in metrics(tmp_path / "run") if r["kind"] == "result"} == {"sgd", "gear-sam"}
    failed(gearsam("train", "--model", "mymodels:fixed", "--model-arg", "width=3", "--out", "r2", cwd=tmp_path),
           "cannot build 'mymodels:fixed' with {'width': 3}")  # fmt: skip
    assert not (tmp_path / "r2").exists()


def test_help_shows_the_defaults():
    train = ok(gearsam("train", "--help"))
    for default in ("(default: resnet18)", "(default: 0.05)", "(default: 128)", "(default: off)", "(default: 0)"):
        assert default in " ".join(train.split()), default
    demo = " ".join(ok(gearsam("demo", "--help")).split())
    for default in ("--epochs EPOCHS epochs of each run (default: 10)", "(default: sgd sam gear-sam)",
                    "--label-noise LABEL_NOISE symmetric label noise rate on the training set, e.g. 0.2 (default: 0.4)",
                    "--threads THREADS CPU threads for torch (default: 1)"):  # fmt: skip
        assert default in demo, default
    assert "(default: coarse fine)" in " ".join(ok(gearsam("partition", "--help")).split())
    assert "default: None" not in train + demo


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_a_line_per_epoch_elsewhere():
    screen = Terminal()
    bar = Progress("sam seed 0", total=4, stream=screen)
    for _ in range(4):
        bar.update()
    bar.update(0, "epoch 1/1")
    bar.close()
    last = screen.getvalue().rstrip("\n").split("\r")[-1]  # the bar as last drawn
    assert last.startswith("sam seed 0: 100%") and " 4/4 " in last and "epoch 1/1" in last, last
    log = io.StringIO()
    bar = Progress("sgd seed 0", total=4, stream=log)
    bar.update(4)
    assert log.getvalue() == ""
    bar.update(0, "epoch 1/1")
    bar.close()
    assert log.getvalue().startswith("sgd seed 0: epoch 1/1 (") and log.getvalue().count("\n") == 1


def test_without_tqdm_a_terminal_gets_a_line_per_epoch(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if it were not installed: importing it fails
    screen = Terminal()
    bar = Progress("sam seed 0", total=4, stream=screen)
    bar.update(4)
    bar.update(0, "epoch 1/1")
    bar.close()
    assert screen.getvalue().startswith("sam seed 0: epoch 1/1 (") and screen.getvalue().count("\n") == 1


# A model whose real build (not the settings check on the meta device) waits for a file "go": the run is known to be
# still going until the test writes it.
GATED_MODEL = """
import pathlib, time
import torch
from torch import nn

def gated(num_classes):
    if torch.empty(0).device.type != "meta":
        while not pathlib.Path("go").exists():
            time.sleep(0.01)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))
"""


def test_train_logs_each_epoch_as_it_ends(tmp_path):
    (tmp_path / "gatedmodels.py").write_text(GATED_MODEL)
    command = [sys.executable, "-m", "gearsam_fused", "train", "--synthetic-size", "64", "--batch-size", "16",
               "--threads", "1", "--optimizers", "sgd", "--epochs", "3", "--model", "gatedmodels:gated",
               "--out", str(tmp_path / "run")]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path) as run:
        first = run.stdout.readline()  # a pipe, as under nohup or CI: lines come as printed, not at exit
        still_running = run.poll() is None  # it cannot have ended: it waits for "go"
        (tmp_path / "go").write_text("")
        stderr = run.stderr.read()
    assert run.returncode == 0, stderr
    assert first.startswith("synthetic: 64 train") and still_running
    lines = [line for line in stderr.splitlines() if line.startswith("sgd seed 0: epoch")]
    assert [line.split()[4] for line in lines] == ["1/3", "2/3", "3/3"] and "test acc" in lines[0]


def epoch_row(epoch: int, **values) -> dict:
    row = {"kind": "epoch", "optimizer": "sgd", "seed": 0, "epoch": epoch, "step": 4 * epoch, "lr": 0.1, "seconds": 1,
           "sam_seconds": 0, "train_loss": 2.0, "test_loss": 2.1, "train_acc": 25.0, "test_acc": 20.0}  # fmt: skip
    return {**row, **values}


def test_curves_show_accuracy_in_percent_and_one_epoch_readably():
    fig = curves_figure([epoch_row(1), epoch_row(1, seed=1, train_acc=35.0)])
    train_loss, test_loss, train_acc, test_acc = fig.axes
    assert list(train_acc.lines[0].get_ydata()) == pytest.approx([30.0]) and train_acc.get_ylim() == (0, 100)
    assert "%" in train_acc.get_title() and test_acc.get_ylim() == (0, 100)
    assert train_loss.get_ylim()[0] == 0 and train_loss.get_ylim()[1] > 2.0
    left, right = test_acc.get_xlim()
    assert left <= 0 and right >= 2  # not 0.95 to 1.05
    assert all(float(t).is_integer() for t in test_acc.get_xticks())
    assert train_acc.lines[0].get_marker() == "o" and train_acc.lines[0].get_markersize() >= 5


def test_curves_add_the_realized_sharpness_of_sharpness_aware_runs():
    rows = [epoch_row(e, optimizer=name, train_sharpness=None if name == "sgd" else 0.01 * e)
            for name in ("sgd", "gear-sam") for e in (1, 2)]  # fmt: skip
    fig = curves_figure(rows)
    assert len(fig.axes) == 5
    (sharpness,) = [ax for ax in fig.axes if "sharpness" in ax.get_title()]
    assert [line.get_label() for line in sharpness.lines] == ["GEAR-SAM"]  # SGD has none
    assert list(sharpness.lines[0].get_ydata()) == pytest.approx([0.01, 0.02])


def test_block_shares_of_a_short_run_tick_whole_steps():
    blocks = {"kind": "blocks", "optimizer": "gear-sam", "seed": 0, "blocks": ["a", "b"], "share": [0.3, 0.7]}
    fig = block_shares_figure([{**blocks, "step": step} for step in (1, 2, 3)])
    ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_digits_split_and_label_noise():
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    assert x_train.shape[1:] == (1, 8, 8) and len(y_train) + len(y_test) == 1797
    noisy = add_symmetric_noise(y_train, 0.2, 10, seed=0)
    flipped = (noisy != y_train).float().mean().item()
    assert 0.15 < flipped < 0.25 and int(noisy.max()) <= 9
    assert torch.equal(add_symmetric_noise(y_train, 0.0, 10, seed=0), y_train)


def test_crop_and_flip_moves_whole_images():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    out = crop_and_flip(x, torch.Generator().manual_seed(0), pad=2)
    assert out.shape == x.shape
    for image, source in zip(out, x):
        # every output pixel is zero padding or an input pixel of the same channel
        for channel, plane in enumerate(image):
            assert set(plane.flatten().tolist()) <= set(source[channel].flatten().tolist()) | {0.0}
    same = crop_and_flip(x, torch.Generator().manual_seed(0), pad=2)
    assert torch.equal(out, same)


def test_the_library_never_imports_the_application():
    """Every module of the library imports without pulling in gearsam_fused.app (the command line's package)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "def load(package):\n"
        "    for m in pkgutil.iter_modules(importlib.import_module(package).__path__):\n"
        "        if m.name not in ('app', '__main__', 'triton_kernels'):\n"
        "            name = f'{package}.{m.name}'\n"
        "            load(name) if m.ispkg else importlib.import_module(name)\n"
        "load('gearsam_fused')\n"
        "print(len([m for m in sys.modules if m.startswith('gearsam_fused.')]))\n"
        "print(sorted(m for m in sys.modules if m.startswith('gearsam_fused.app')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    imported, app = done.stdout.split("\n")[:2]
    assert int(imported) >= 20 and app == "[]"  # the optimizer, helpers, backends and models, and no app


def test_every_curve_panel_colours_an_optimizer_as_the_legend_does():
    rows = [
        {"optimizer": name, "seed": 0, "epoch": epoch, "train_loss": 1.0, "test_loss": 1.2, "train_acc": 50.0,
         "test_acc": 40.0, "train_sharpness": None if name == "sgd" else 0.01 * epoch}
        for name in ("sgd", "sam", "gear-sam") for epoch in (1, 2)
    ]  # fmt: skip
    fig = curves_figure(rows)
    legend = {text.get_text(): handle.get_color() for text, handle in
              zip(fig.axes[0].get_legend().get_texts(), fig.axes[0].get_legend().legend_handles)}  # fmt: skip
    assert set(legend) == {"SGD", "SAM", "GEAR-SAM"} and len(set(legend.values())) == 3
    sharpness = next(ax for ax in fig.axes if ax.get_title().startswith("realized sharpness"))
    assert [line.get_label() for line in sharpness.get_lines()] == ["SAM", "GEAR-SAM"]  # SGD has none
    for ax in fig.axes:
        for line in ax.get_lines():
            assert line.get_color() == legend[line.get_label()], (ax.get_title(), line.get_label())
    fig.canvas.draw()  # tick labels exist once drawn
    assert [t.get_text() for t in sharpness.get_xticklabels() if t.get_visible() and t.get_text()]
    assert sharpness.get_xlabel() == "epoch"


def test_default_run_directories_are_new_even_within_one_second(tmp_path, monkeypatch, capsys):
    import datetime

    from gearsam_fused.app import cli

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(cli.datetime, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    args = ["demo", "--optimizers", "sgd", "--epochs", "1", "--seeds", "0", "--batch-size", "512", "--threads", "1"]
    assert main([*args, "--lr", "-1"]) == 2
    assert not any((tmp_path / "runs").iterdir())  # a refused run leaves no directory behind
    threads = torch.get_num_threads()
    try:
        assert main(args) == 0 and main(args) == 0
    finally:
        torch.set_num_threads(threads)  # --threads sets this process's count
    first, second = tmp_path / "runs" / "demo-20260102-030405", tmp_path / "runs" / "demo-20260102-030405-2"
    for run_dir in (first, second):
        assert [r["kind"] for r in metrics(run_dir)] == ["epoch", "result"]  # one run each, nothing interleaved
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [first.name, second.name]


def test_synthetic_data_is_learnable(tmp_path):
    """The synthetic default trains well above chance (10%) in three short epochs, for SGD and GEAR-SAM alike."""
    args = ["--model-arg", "width=4", "--model-arg", "blocks=(1,1)", "--synthetic-size", "1024", "--batch-size", "32",
            "--threads", "1", "--epochs", "3", "--optimizers", "sgd", "gear-sam"]  # fmt: skip
    rows = table_rows(ok(gearsam("train", *args, "--out", tmp_path)))
    assert {name: float(cells[0]) > 60.0 for name, cells in rows.items()} == {"sgd": True, "gear-sam": True}, rows
    results = {r["optimizer"]: r["test_acc"] for r in metrics(tmp_path) if r["kind"] == "result"}
    assert results == pytest.approx({name: float(cells[0]) for name, cells in rows.items()}, abs=0.01)  # 100% both


def test_train_offers_the_digits(tmp_path):
    out = ok(gearsam("train", "--dataset", "digits", "--model-arg", "width=4", "--model-arg", "blocks=(1,1)",
                     "--optimizers", "sgd", "--batch-size", "256", "--threads", "1", "--out", tmp_path))  # fmt: skip
    assert out.startswith("digits: 1438 train / 359 test images")
    assert RunConfig.load(tmp_path / "config.json").dataset == "digits"
    for command in ("demo", "train", "reproduce"):
        helped = ok(gearsam(command, *(["label-noise"] if command == "reproduce" else []), "--help"))
        assert "{digits,cifar10,cifar100,synthetic,imagefolder}" in helped or command == "demo"


def test_partition_shows_the_trained_head_and_names_the_models(tmp_path):
    out = ok(gearsam("partition", "tv_resnet18", "--model-arg", "num_classes=10", "--strategy", "coarse"))
    assert "[tv_resnet18 num_classes=10: coarse]" in out
    assert " 5,130 " in out  # 512 * 10 + 10: the 10-class head, not ImageNet's 1000
    helped = ok(gearsam("partition", "--help"))
    assert all(name in helped for name in ("digits_resnet", "resnet18", "tv_resnet18", "wrn28_10"))
    failed(gearsam("partition", "./mymodels.py:tiny", cwd=tmp_path),
           "model './mymodels.py:tiny': expected package.module:factory, an importable module, not a file path; for "
           "./mymodels.py run from its folder with mymodels:tiny")  # fmt: skip


@pytest.mark.parametrize(("args", "message"), [
    (("demo", "--seeds", 0, 0), "--seeds names [0] more than once; each seed is one run"),
    (("reproduce", "partition", "--values", "coarse", "--optimizers", "sgd"),
     "--optimizers sgd: the partition study trains gear-sam only"),
    (("reproduce", "label-noise", "--values", 0.0, "--label-noise", 0.2),
     "--label-noise 0.2: the label-noise study varies label_noise itself; set its grid with --values"),
    (("reproduce", "rho", "--values", 0.1, "--rho", 0.1), "--rho 0.1: the rho study varies rho itself"),
    (("reproduce", "beta", "--values", 0.9, "--k", 3), "--k: the probe's options apply to the hessian study only"),
    (("reproduce", "beta", "--resume", "nowhere"), "cannot resume nowhere: it has no study.json"),
])  # fmt: skip
def test_options_a_command_would_not_use_are_refused(tmp_path, args, message):
    small = ("--epochs", 1, "--batch-size", 512, "--threads", 1)  # were an option accepted, the run would be short
    failed(gearsam(*args, *small, cwd=tmp_path), message)
    assert not any(tmp_path.rglob("*.json"))


def test_top_level_help_version_and_plot_help():
    from gearsam_fused import __version__

    assert ok(gearsam("--version")).strip() == f"gearsam_fused {__version__}"
    assert "Start with `gearsam demo`" in ok(gearsam("--help"))
    helped = ok(gearsam("plot", "--help"))
    assert "a run directory (curves.png, block_shares.png) or a study directory" in " ".join(helped.split())


# This checkout, whose benchmarks/ a `gearsam bench` run within it finds.
CHECKOUT = Path(__file__).resolve().parents[2]


def test_bench_runs_the_checkouts_benchmark_runner_quick_unless_full(tmp_path, monkeypatch):
    """What ``gearsam bench`` runs within a checkout (the runner itself: tests/benchmarks/test_bench_suite.py) and
    that it passes the runner's exit status on."""
    from gearsam_fused.app import cli

    ran = []
    monkeypatch.setattr(
        cli.subprocess, "run", lambda command: ran.append(command) or subprocess.CompletedProcess(command, 3)
    )
    assert gearsam("bench", "--results", tmp_path / "runs.jsonl", cwd=CHECKOUT / "docs").returncode == 3
    assert gearsam("bench", "--full", cwd=CHECKOUT).returncode == 3
    runner = str(CHECKOUT / "benchmarks" / "run.py")
    assert ran == [
        [sys.executable, runner, "--quick", "--results", str(tmp_path / "runs.jsonl")],
        [sys.executable, runner],
    ]


def fake_checkout(root: Path) -> Path:
    """A folder laid out as a source checkout as far as ``gearsam bench`` looks: the package's sources beside
    benchmarks/run.py; returns the runner."""
    (root / "gearsam_fused").mkdir(parents=True)
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "run.py").write_text("")
    return root / "benchmarks" / "run.py"


def test_bench_finds_the_checkout_above_the_current_directory_or_takes_benchmarks_dir(tmp_path, monkeypatch):
    from gearsam_fused.app import cli

    ran = []
    monkeypatch.setattr(
        cli.subprocess, "run", lambda command: ran.append(command[1]) or subprocess.CompletedProcess(command, 0)
    )
    runner = fake_checkout(tmp_path / "checkout")
    (tmp_path / "checkout" / "docs" / "deep").mkdir(parents=True)
    ok(gearsam("bench", cwd=tmp_path / "checkout" / "docs" / "deep"))
    other = fake_checkout(tmp_path / "other")
    ok(gearsam("bench", "--benchmarks", other.parent, cwd=tmp_path / "checkout"))  # the option wins
    assert ran == [str(runner), str(other)]


def test_bench_outside_a_checkout_says_what_is_missing_and_how_to_get_it(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.py").write_text("")  # someone else's benchmarks: no gearsam_fused/ beside them
    outside = gearsam("bench", cwd=tmp_path)
    failed(outside, "gearsam bench runs the benchmark suite of a source checkout (benchmarks/run.py), which the "
           f"installed package does not include, and neither {tmp_path.resolve()} nor a folder above it")  # fmt: skip
    assert "--benchmarks DIR" in outside.stderr
    failed(gearsam("bench", "--benchmarks", tmp_path, cwd=tmp_path),
           f"--benchmarks {tmp_path}: {tmp_path / 'run.py'} does not exist")  # fmt: skip


def test_exports_record_threads_units_and_version_and_one_seed_has_no_spread(tmp_path, monkeypatch):
    from gearsam_fused import __version__
    from gearsam_fused.app import training

    machine = training.describe_machine
    monkeypatch.setattr(training, "describe_machine", lambda device: {**machine(device), "commit": None})
    cfg = RunConfig(model_args={"width": 4, "blocks": (1, 1)}, synthetic_size=64, batch_size=32, optimizers=["sgd"])
    lines = []
    run_experiment(cfg, tmp_path, log=lines.append, stream=io.StringIO())
    assert json.loads((tmp_path / "config.json").read_text())["threads"] == torch.get_num_threads()
    summary = (tmp_path / "summary.md").read_text()
    assert "1 epoch," in summary and f"gearsam_fused {__version__}" in summary and "commit None" not in summary
    assert "± n/a" in summary and "± 0.00" not in summary  # one seed: no spread to show
    (result,) = [r for r in metrics(tmp_path) if r["kind"] == "result"]
    assert f"test acc {result['test_acc']:6.2f}%" in lines[1]  # metrics.jsonl holds % as the log prints it
    assert "1 epoch," in lines[0]

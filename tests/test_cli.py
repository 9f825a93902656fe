"""The command line, run as a user runs it: in a subprocess."""

import subprocess
import sys

import torch

from gearsam_fused.demo import add_symmetric_noise, load_digits_split


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gearsam_fused", *args], capture_output=True, text=True, timeout=300)


def test_demo_prints_a_comparison_table():
    result = run("demo", "--epochs", "1", "--seeds", "0", "1", "--threads", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("optimizer"))
    rows = [line.split() for line in lines[header + 2 : header + 5]]
    assert [r[0] for r in rows] == ["sgd", "sam", "gear-sam"]
    for r in rows:
        accuracy, spread = float(r[1]), float(r[3])
        assert 50.0 < accuracy <= 100.0 and spread >= 0.0  # one epoch on digits already beats chance (10%) by far
        assert float(r[4]) > 0.0


def test_demo_rejects_unknown_optimizer():
    result = run("demo", "--epochs", "1", "--seeds", "0", "--optimizers", "adamw")
    assert result.returncode == 2 and "gearsam: error: unknown optimizer(s) ['adamw']" in result.stderr
    assert "Traceback" not in result.stderr


def test_partition_command_prints_block_tables():
    result = run("partition", "resnet18", "--strategy", "coarse")
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()[2:8]]
    assert names == ["stem", "layer1", "layer2", "layer3", "layer4", "classifier"]
    bad = run("partition", "nonexistent_model")
    assert bad.returncode != 0 and "unknown model 'nonexistent_model'" in bad.stderr


def test_digits_split_and_label_noise():
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    assert x_train.shape[1:] == (1, 8, 8) and len(y_train) + len(y_test) == 1797
    noisy = add_symmetric_noise(y_train, 0.2, 10, seed=0)
    flipped = (noisy != y_train).float().mean().item()
    assert 0.15 < flipped < 0.25 and int(noisy.max()) <= 9
    assert torch.equal(add_symmetric_noise(y_train, 0.0, 10, seed=0), y_train)

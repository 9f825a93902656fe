"""``benchmarks/bench_models.py`` in quick mode on CPU, the tiny configuration of every model (a smoke test: no timing
is asserted): the rows it writes for the models whose package is installed here, the skips, with their reasons, of
those whose package is not, its tables, and the SAM tax's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MODELS = {"resnet50": ("ResNet-50", "torchvision"), "vit_b16": ("ViT-B/16", "timm"),
          "gpt2_small": ("GPT-2 small", "transformers"), "cifar_resnet18": ("CIFAR ResNet-18", None)}  # fmt: skip
CONTENDERS = ["base optimizer", "base optimizer (fused)", "per-tensor loop SAM", "pytorch_optimizer",
              "compiled foreach SAM", "SAM", "GEAR-SAM"]  # fmt: skip
BASE_ROWS = ("base optimizer", "base optimizer (fused)")
LEAVE_OUT = "--leave-out=compiled foreach SAM"
PEER_NOTE = "pytorch_optimizer is not installed: its contender is skipped"
ROW_FIELDS = {"run", "date", "commit", "device", "quick", "median_ms", "q1_ms", "q3_ms", "rounds", "contender",
              "model", "batch", "tiny", "channels_last", "autocast", "base", "base_kwargs", "base_flags", "peak_mib",
              "held_mib", "round_ms", "vs", "vs_path", "over", "over_path", "stepped_in_turn", "left_out"}  # fmt: skip
SAM_FIELDS = {"forward_backward_ms", "base_step_ms", "base_step_path", "beyond_ms", "beyond_q1_ms", "beyond_q3_ms",
              "tax_ms", "tax_q1_ms", "tax_q3_ms", "tax_pct", "step_ms", "over_plain", "over_plain_q1",
              "over_plain_q3"}  # fmt: skip


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


def _bench(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "bench_models.py", "--quick",
         f"--benchmark-storage=file://{tmp_path}/storage", "-W", "ignore::DeprecationWarning", *args],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip


def _skips(stdout: str) -> list[str]:
    """The reasons of ``-rs``, one per skipped test."""
    return [reason for count, reason in re.findall(r"^SKIPPED \[(\d+)\] bench_models\.py:\d+: (.*)$", stdout, re.M)
            for _ in range(int(count))]  # fmt: skip


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run of the module and its rows, without the compiled contender (``--leave-out``): compiling takes
    10-30 s per model on CPU (its rows were run by hand; on CUDA the suite's ``models`` phase runs them)."""
    tmp_path = tmp_path_factory.mktemp("bench_models")
    results = tmp_path / "rows.jsonl"
    done = _bench(tmp_path, f"--results={results}", LEAVE_OUT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    return done, rows, results


def test_rows_of_the_installed_models_carry_their_fields(quick_run):
    _, rows, _ = quick_run
    assert len({r["run"] for r in rows}) == 1 and all(r["quick"] and r["tiny"] for r in rows)
    peer = _installed("pytorch_optimizer")
    for key, (model, package) in MODELS.items():
        mine = {r["contender"]: r for r in rows if r["model"] == model}
        if not _installed(package):
            assert not mine
            continue
        expected = {c for c in CONTENDERS if c != "compiled foreach SAM" and (c != "pytorch_optimizer" or peer)}
        assert set(mine) == expected, (model, set(mine))
        # every row and part stepped in turn within the same rounds, the compiled contender left out, saying so
        assert len({r["test"] for r in mine.values()}) == 1
        for name, row in mine.items():
            assert ROW_FIELDS <= row.keys(), (model, name, ROW_FIELDS - row.keys())
            assert row["benchmark"] == "bench_models" and row["median_ms"] > 0 and row["rounds"] == 3
            assert row["device"] == "cpu" and row["autocast"] is None and row["channels_last"] is False
            assert row["peak_mib"] is None and row["held_mib"] is None  # CUDA's allocator only
            assert row["base"] == ("AdamW" if key in ("vit_b16", "gpt2_small") else "SGD")
            assert set(row["stepped_in_turn"]) == set(mine) and len(row["round_ms"]) == 3
            assert row["left_out"]["compiled foreach SAM"] == "left out by --leave-out"
            # each at its best: torch's fused step for the base row (fused) and the per-tensor loop
            fused = name in ("base optimizer (fused)", "per-tensor loop SAM")
            assert row["base_flags"] == ("fused=True" if fused else "foreach=True"), (model, name)
            assert set(row["vs"]) == ({"per-tensor loop SAM", "pytorch_optimizer"} if peer else {"per-tensor loop SAM"})
            assert row["over_path"]["base optimizer"] in BASE_ROWS
            for stats in (*row["vs"].values(), *row["over"].values()):
                assert stats["low"] <= stats["q1"] <= stats["median"] <= stats["q3"] <= stats["high"]
            if name in BASE_ROWS:
                assert not SAM_FIELDS & row.keys()
                continue
            assert SAM_FIELDS <= row.keys(), (model, name, SAM_FIELDS - row.keys())
            assert "sgd_ms" not in row and "over_sgd" not in row
            assert row["forward_backward_ms"] > 0 and row["base_step_ms"] > 0 and row["over_plain"] > 0
            assert row["beyond_q1_ms"] <= row["beyond_ms"] <= row["beyond_q3_ms"]
            assert row["tax_q1_ms"] <= row["tax_ms"] <= row["tax_q3_ms"]
            assert row["base_step_path"] in ("foreach=True", "fused=True")
            if name in ("SAM", "GEAR-SAM"):  # ours fuse the base step into the restore, SGD's and AdamW's alike
                assert row["base_step_mode"] == "fused" and row["base_step_reason"] == ""


def test_models_whose_package_is_missing_are_skipped_saying_which(quick_run):
    done, _, _ = quick_run
    skips = _skips(done.stdout)
    for model, package in MODELS.values():
        note = f"{package} is not installed: {model} is skipped"
        assert skips.count(note) == (0 if _installed(package) else 1), (note, skips)  # one test per model
    if not _installed("pytorch_optimizer"):
        assert PEER_NOTE in done.stdout


def test_the_tables_render_the_newest_run(quick_run, tmp_path):
    _, rows, results = quick_run
    out = tmp_path / "models.md"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_models.py"), str(results), str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.strip() == done.stdout.strip()
    assert text.startswith(f"## Training steps of real models: run {rows[0]['run']}, ")
    for model in {r["model"] for r in rows}:
        assert f"### {model} (" in text
    assert "| SAM | " in text and "| GEAR-SAM | " in text and "| fused |" in text and "| fused=True |" in text
    assert "vs per-tensor loop SAM [IQR]" in text and "stepped in turn within each round" in text


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
def test_without_pytorch_optimizer_its_rows_are_left_out_with_the_note(tmp_path):
    (tmp_path / "pytorch_optimizer.py").write_text('raise ImportError("not installed, for this test")\n')
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    results = tmp_path / "rows.jsonl"
    done = _bench(tmp_path, f"--results={results}", "-k", "cifar_resnet18", LEAVE_OUT,
                  env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert {r["contender"] for r in rows} == set(CONTENDERS) - {"pytorch_optimizer", "compiled foreach SAM"}
    assert all(r["left_out"]["pytorch_optimizer"] == PEER_NOTE and "pytorch_optimizer" not in r["vs"] for r in rows)
    assert PEER_NOTE in done.stdout  # its warning, in the run's output


def test_the_sam_tax_is_the_step_less_two_passes_and_the_base_step():
    spec = importlib.util.spec_from_file_location("bench_models_test_report", BENCHMARKS / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    step, passes, base = [0.100, 0.120, 0.110], [0.040, 0.045, 0.042], [0.005, 0.006, 0.004]
    # bench_models hands sam_parts one forward+backward pass plus the base step where bench_train_step has SGD's step
    fields = report.sam_parts(step, passes, [f + b for f, b in zip(passes, base)])
    assert fields["tax_ms"] == pytest.approx(1e3 * sorted(s - 2 * f - b for s, f, b in zip(step, passes, base))[1])
    assert fields["beyond_ms"] == pytest.approx(1e3 * sorted(s - 2 * f for s, f in zip(step, passes))[1])

"""The benchmark suite's quick mode, run by ``gearsam bench``, goes end to end (a smoke test: no timing is asserted)
and writes rows that carry what the report and the README rely on."""

import json
import subprocess
import sys

MACHINE_FIELDS = {"run", "date", "commit", "cpu", "cpu_count", "gpu", "torch", "triton", "platform", "device", "quick"}
TIMING_FIELDS = {"median_ms", "q1_ms", "q3_ms", "min_ms", "rounds"}
SAM_STEP_FIELDS = {
    "set",
    "rule",
    "contender",
    "parameters",
    "tensors",
    "bytes_counted",
    "gbps",
    "copy_gbps",
    "pct_copy",
    "held_bytes",
}

# the whole step's rows: per base optimizer instead of per rule, and no memory column
WHOLE_STEP_FIELDS = (SAM_STEP_FIELDS - {"rule", "held_bytes"}) | {"base"}
BYTES_PER_PARAM = {"SGD": 40, "AdamW": 48}  # a fused step's floor: energy 4 + perturb 16 + restore-and-update 20 or 28


def test_quick_run_appends_rows_and_prints_the_report(tmp_path):
    results = tmp_path / "runs.jsonl"
    results.write_text("")  # an existing file is appended to, not replaced
    done = subprocess.run(
        [sys.executable, "-m", "gearsam_fused", "bench", "--results", str(results)],  # `gearsam bench`: quick mode
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len({r["run"] for r in rows}) == 1 and all(r["quick"] for r in rows)
    steps = [r for r in rows if r["benchmark"] == "bench_sam_step"]
    trains = [r for r in rows if r["benchmark"] == "bench_train_step"]
    wholes = [r for r in rows if r["benchmark"] == "bench_whole_step"]
    for row in steps:
        assert MACHINE_FIELDS | TIMING_FIELDS | SAM_STEP_FIELDS <= row.keys(), row.keys()
        assert row["median_ms"] > 0 and row["gbps"] > 0 and row["held_bytes"] > 0
    assert {r["set"].split(" (")[0] for r in steps} == {
        "ResNet-18", "WRN-28-1", "ViT-B/16 shapes", "GPT-2-medium shapes", "2048 small tensors",
    }  # fmt: skip
    contenders = {(r["contender"], r["rule"]) for r in steps}
    assert {
        ("per-tensor loop", "sam"),
        ("pytorch_optimizer", "sam"),
        ("torch", "sam"),
        ("torch", "gear-sam"),
    } <= contenders
    assert {r["contender"] for r in trains} == {
        "forward+backward", "base step", "SGD", "per-tensor loop SAM", "pytorch_optimizer", "SAM", "GEAR-SAM",
    }  # fmt: skip
    assert all(r["parameters"] >= 2048 and r["tensors"] >= 62 for r in steps)
    # the whole step: quick mode's sets, both base optimizers, and for each set and base every contender
    for row in wholes:
        assert MACHINE_FIELDS | TIMING_FIELDS | WHOLE_STEP_FIELDS <= row.keys(), row.keys()
        assert row["median_ms"] > 0 and row["gbps"] > 0
        assert row["bytes_counted"] == BYTES_PER_PARAM[row["base"]] * row["parameters"]
    assert {r["set"].split(" (")[0] for r in wholes} == {"ResNet-18", "2048 small tensors", "2000 tensors x 512"}
    expected = {
        "per-tensor loop", "pytorch_optimizer", "torch", "torch, base per tensor", "bare base step",
    }  # fmt: skip
    for key in {(r["set"], r["base"]) for r in wholes}:
        assert expected <= {r["contender"] for r in wholes if (r["set"], r["base"]) == key}, key
    assert {r["base"] for r in wholes} == {"SGD", "AdamW"}
    # our rows say which path the base step took, and it is the one their name says
    ours = [r for r in wholes if r["contender"].split(", ")[0] in ("torch", "cpp", "triton")]
    assert ours and all(
        r["base_step_mode"] == ("per-tensor" if r["contender"].endswith(", base per tensor") else "fused") for r in ours
    )
    assert (
        "**SAM step, ResNet-18" in done.stdout and "SAM tax" in done.stdout and "vs per-tensor loop SAM" in done.stdout
    )
    assert "**Whole step, SGD, ResNet-18" in done.stdout and "**Whole step, AdamW, 2000 tensors x 512" in done.stdout
    assert "/ bare base step" in done.stdout
    # the Hugging Face Trainer's step, plain and with SAMTrainer
    trainers = [r for r in rows if r["benchmark"] == "bench_trainer"]
    assert {r["contender"] for r in trainers} == {
        "Trainer", "SAMTrainer sam", "SAMTrainer gear-sam", "LightningModule",
        "LightningModule + SharpnessAwareMixin gear-sam",
    }  # fmt: skip
    assert all(r["step_ms"] > 0 and r["steps"] == 2 for r in trainers)
    assert "**Hugging Face Trainer step" in done.stdout and "/ Trainer |" in done.stdout
    assert "**Lightning step" in done.stdout and "/ LightningModule |" in done.stdout

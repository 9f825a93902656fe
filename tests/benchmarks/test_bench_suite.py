"""The benchmark suite's quick mode, run by ``gearsam bench``, goes end to end (a smoke test: no timing is asserted)
and writes rows that carry what the report and the README rely on (the default tier runs one benchmark of it, the full
tier all); the report's arithmetic on made-up rows."""

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    """A module of benchmarks/ under a name of its own (its folder is not a package, and "conftest" is taken). The
    folder goes on the import path, as when pytest runs the benchmarks: their modules import one another by name."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_test_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("report")
rows_module = _load("rows")

MACHINE_FIELDS = {
    "run", "date", "commit", "cpu", "cpu_count", "gpu", "torch", "triton", "platform", "huge_pages", "device", "quick",
}  # fmt: skip
TIMING_FIELDS = {"median_ms", "q1_ms", "q3_ms", "min_ms", "rounds"}
SAM_STEP_FIELDS = {
    "set",
    "rule",
    "contender",
    "parameters",
    "tensors",
    "bytes_counted",
    "gbps",
    "floor_gbps",
    "floor_kind",
    "pct_floor",
    "held_bytes",
}

# the whole step's rows: per base optimizer instead of per rule, and no memory column
WHOLE_STEP_FIELDS = (SAM_STEP_FIELDS - {"rule", "held_bytes"}) | {"base"}
BYTES_PER_PARAM = {"SGD": 36, "AdamW": 44}  # a fused step's floor: energy 4 + perturb 12 + restore-and-update 20 or 28


def quick_run(tmp_path, command: list[str], pytest_args: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    """Runs ``command`` (a quick run writing to ``tmp_path``'s results file, running pytest with ``pytest_args``);
    returns its rows and its stdout."""
    results = tmp_path / "runs.jsonl"
    results.write_text("")  # an existing file is appended to, not replaced
    done = subprocess.run(
        [*command, "--results", str(results), *(["--", *pytest_args] if pytest_args else [])],
        capture_output=True, text=True, timeout=1800,  # about two minutes alone; far more on a loaded machine
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows and len({r["run"] for r in rows}) == 1 and all(r["quick"] for r in rows)
    return rows, done.stdout


def test_a_quick_run_of_the_sam_and_momentum_step_benchmarks_appends_its_rows_and_prints_its_report(tmp_path):
    """The harness end to end on the SAM step's and MomentumSAM's step benchmarks; the default tier's representative
    of the quick run below."""
    selected = "bench_sam_step or bench_momentum_step"
    rows, stdout = quick_run(tmp_path, [sys.executable, str(BENCHMARKS / "run.py"), "--quick"], ("-k", selected))
    assert {r["benchmark"] for r in rows} == {"bench_sam_step", "bench_momentum_step"}
    check_sam_steps(rows, stdout)
    check_family(rows, stdout, {"bench_sam_step": {None: 16}})
    check_momentum_steps(rows, stdout)


@pytest.mark.full  # the whole quick run; the default tier keeps the SAM step's run above
def test_quick_run_appends_rows_and_prints_the_report(tmp_path):
    rows, stdout = quick_run(
        tmp_path, [sys.executable, "-m", "gearsam_fused", "bench", "--benchmarks", str(BENCHMARKS)]
    )
    check_sam_steps(rows, stdout)
    check_train_steps(rows, stdout)
    check_momentum_train_step(rows, stdout)
    check_whole_steps(rows, stdout)
    check_skipped_steps(rows, stdout)
    check_momentum_steps(rows, stdout)
    check_family(rows, stdout, {"bench_sam_step": {None: 16}, "bench_whole_step": {"SGD": 36}})  # quick: SGD only
    check_trainers(rows, stdout)


def check_sam_steps(rows: list[dict], stdout: str) -> None:
    steps = [r for r in rows if r["benchmark"] == "bench_sam_step" and "variant" not in r]
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
        ("pytorch_optimizer, per tensor", "sam"),
        ("torch", "sam"),
        ("torch", "gear-sam"),
    } <= contenders
    assert all(r["parameters"] >= 2048 and r["tensors"] >= 62 for r in steps)
    check_stepped_in_turn(steps, ("set",), {"per-tensor loop": "per-tensor loop"})
    # GEAR-SAM's rows, which no peer has, against the SAM steps of the same rounds
    gear = [r for r in steps if r["rule"] == "gear-sam"]
    assert gear and all(set(r["vs"]) == {"per-tensor loop", "pytorch_optimizer"} for r in gear)
    assert "**SAM step, ResNet-18" in stdout and "vs per-tensor loop SAM [IQR]" in stdout
    assert "stepped in turn within each round" in stdout


def check_stepped_in_turn(rows: list[dict], keys: tuple[str, ...], references: dict[str, str]) -> None:
    """Rows of contenders stepped in turn: the rows of one group (``keys``) share their test and rounds, each keeps its
    time in each round, and each ratio to a reference of the same rounds is the median of the per-round ratios
    (``references``: label -> the contender it must be, where there is one path)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    for key, group in groups.items():
        assert len({r["test"] for r in group}) == 1 and len({r["rounds"] for r in group}) == 1, key
        times = {r["contender"] if r.get("rule", "sam") == "sam" else f"{r['contender']}, {r['rule']}": r["round_ms"]
                 for r in group}  # fmt: skip
        assert set(group[0]["stepped_in_turn"]) == set(times), key
        for row in group:
            assert len(row["round_ms"]) == row["rounds"] and all(t > 0 for t in row["round_ms"]) and "load_1min" in row
            assert row["median_ms"] == pytest.approx(report.quartiles(row["round_ms"])[1], rel=1e-3)
            for label, stats in row["vs"].items():
                path = row["vs_path"][label]
                assert path == references.get(label, path) and path in times
                ratios = sorted(a / b for a, b in zip(times[path], row["round_ms"]))
                assert stats["low"] == pytest.approx(ratios[0]) and stats["high"] == pytest.approx(ratios[-1])
                assert stats["q1"] <= stats["median"] <= stats["q3"]
                assert stats["median"] == pytest.approx(report.quartiles(ratios)[1])


def check_train_steps(rows: list[dict], stdout: str) -> None:
    trains = [r for r in rows if r["benchmark"] == "bench_train_step"]
    schedule_rows = {f"{rule} {schedule}" for rule in ("SAM", "GEAR-SAM")
                     for schedule in ("every-5", "LookSAM-5", "every-2", "adaptive")}  # fmt: skip
    assert {r["contender"] for r in trains} == {
        "forward+backward", "base step", "SGD", "per-tensor loop SAM", "pytorch_optimizer", "SAM", "GEAR-SAM",
        "compiled foreach SAM", "compiled foreach GEAR-SAM", "MomentumSAM",
    } | schedule_rows  # fmt: skip
    check_momentum_train_step(rows, stdout)
    # every SAM row of the training step carries its parts, measured in its own rounds; ours say how SGD stepped
    sam_rows = [r for r in trains if r["contender"] in ("per-tensor loop SAM", "pytorch_optimizer", "SAM", "GEAR-SAM")]
    # the schedules' rows: whole cycles (one second pass in k steps under Every and LookSAM), numbers per step
    cycles = {r["contender"]: r for r in trains if r["contender"] in schedule_rows}
    assert all(cycles[f"{rule} every-5"]["sam_fraction"] == 0.2 for rule in ("SAM", "GEAR-SAM"))
    assert all(cycles[f"{rule} LookSAM-5"]["sam_fraction"] == 0.2 for rule in ("SAM", "GEAR-SAM"))
    for row in cycles.values():
        assert row["step_q1_ms"] <= row["step_ms"] <= row["step_q3_ms"] and row["over_sgd"] > 0
        assert row["base_step_mode"] == "fused"
    sam_rows += list(cycles.values())
    for row in sam_rows:
        assert {
            "forward_backward_ms",
            "sgd_ms",
            "beyond_ms",
            "beyond_q1_ms",
            "beyond_q3_ms",
            "tax_ms",
            "tax_pct",
        } <= row.keys()
        assert row["beyond_q1_ms"] <= row["beyond_ms"] <= row["beyond_q3_ms"]
    assert {r["base_step_mode"] for r in sam_rows if r["contender"] in ("SAM", "GEAR-SAM")} == {"fused"}
    assert "SAM tax" in stdout and "vs per-tensor loop SAM" in stdout


def check_momentum_train_step(rows: list[dict], stdout: str) -> None:
    # MomentumSAM's training step: one pass, the SGD step fused; each round also timed an SGD step and a full SAM step
    (row,) = [r for r in rows if r["benchmark"] == "bench_train_step" and r["contender"] == "MomentumSAM"]
    assert row["one_pass"] is True and row["base_step_mode"] == "fused"
    assert all(row[f"{n}_q1"] <= row[n] <= row[f"{n}_q3"] for n in ("over_sgd", "sam_over_sgd", "over_paired_sam"))
    assert all(row[f"{n}_q1_ms"] <= row[f"{n}_ms"] <= row[f"{n}_q3_ms"] for n in ("beyond", "tax"))
    assert row["over_sgd"] > 0 and row["sam_over_sgd"] > 0 and row["paired_sam_ms"] > 0 and row["sgd_ms"] > 0
    assert "none (one pass per step)" in stdout and "full SAM / SGD step, same rounds" in stdout


def check_momentum_steps(rows: list[dict], stdout: str) -> None:
    # MomentumSAM's step against our fused base step, a skipped SAM step and torch's foreach step, stepped in turn
    # within each round, on ResNet-18's shapes and 2048 small tensors with both base optimizers
    steps = [r for r in rows if r["benchmark"] == "bench_momentum_step"]
    groups = {(r["set"].split(" (")[0], r["base"]) for r in steps}
    assert groups == {(s, b) for s in ("ResNet-18", "2048 small tensors") for b in ("SGD", "AdamW")}
    ours = "cpp" if any(r["contender"].startswith("cpp, ") for r in steps) else "torch"  # quick: one backend
    # bytes beyond the update: the look-ahead's 16, and on torch the momentum's energy pass (the kernel backends' update
    # sums it as it writes the momentum); the skipped step's energy pass
    summed = ours in ("cpp", "triton")
    kinds = {"MomentumSAM": 16 if summed else 20, "fused base step": 0, "SAM skipped step": 4}
    for key in groups:
        these = [r for r in steps if (r["set"].split(" (")[0], r["base"]) == key]
        assert {r["contender"] for r in these} == {f"{ours}, {kind}" for kind in kinds} | {"bare base step"}, key
        assert len({r["rounds"] for r in these}) == 1 and len({r["test"] for r in these}) == 1  # the same rounds
    update = {"SGD": 20, "AdamW": 28}
    for row in steps:
        assert MACHINE_FIELDS | TIMING_FIELDS <= row.keys(), row.keys()
        kind = row["contender"].removeprefix(f"{ours}, ")
        counted = update[row["base"]] + kinds.get(kind, 0)
        assert row["bytes_counted"] == counted * row["parameters"] and row["median_ms"] > 0 and row["gbps"] > 0
        assert row["yardstick"] == f"{ours}, fused base step" and row["pct_floor"] > 0
        for name in ("over_base", "over_bare"):
            assert row[f"{name}_q1"] <= row[name] <= row[f"{name}_q3"], name
        assert (row["contender"] == row["yardstick"]) == (row["over_base"] == 1.0)
        if kind == "MomentumSAM":  # over the time its bytes take at the fused base step's rate of the same round
            assert row["over_allowed"] == pytest.approx(row["over_base"] * update[row["base"]] / counted)
            assert row["over_allowed_skipped_q1"] <= row["over_allowed_skipped"] <= row["over_allowed_skipped_q3"]
        assert ("over_allowed" in row) == (kind == "MomentumSAM")
        read_only = kind == "SAM skipped step" or (kind == "MomentumSAM" and not summed)
        assert ("pct_traffic_floor" in row) == read_only
        assert row.get("base_step_mode") == (None if row["contender"] == "bare base step" else "fused")
    assert "**MomentumSAM step, AdamW, 2048 small tensors" in stdout
    assert "/ its bytes at the fused base step's rate" in stdout


def check_whole_steps(rows: list[dict], stdout: str) -> None:
    wholes = [r for r in rows if r["benchmark"] == "bench_whole_step" and "variant" not in r]
    for row in wholes:
        assert MACHINE_FIELDS | TIMING_FIELDS | WHOLE_STEP_FIELDS <= row.keys(), row.keys()
        assert row["median_ms"] > 0 and row["gbps"] > 0
        bare = row["contender"].startswith("bare base step")
        own = {"SGD": 20, "AdamW": 28} if bare else BYTES_PER_PARAM
        assert row["bytes_counted"] == own[row["base"]] * row["parameters"]
        # each contender at its best: torch's optimizer fused where a contender steps it per tensor and torch allows
        flags = {"pytorch_optimizer": "foreach=True", "bare base step": "foreach=True", "compiled foreach SAM":
                 "foreach=True, compiled", "cpp": "fused into the restore", "cpp, compiled": "fused into the restore",
                 "torch": "fused into the restore"}  # fmt: skip
        assert row["base_flags"] == flags.get(row["contender"], "fused=True"), row["contender"]
    assert {r["set"].split(" (")[0] for r in wholes} == {"ResNet-18", "2048 small tensors", "2000 tensors x 512"}
    expected = {
        "per-tensor loop", "pytorch_optimizer", "pytorch_optimizer, per tensor", "torch", "torch, base per tensor",
        "bare base step", "bare base step (fused)",
    }  # fmt: skip
    for key in {(r["set"], r["base"]) for r in wholes}:
        these = [r for r in wholes if (r["set"], r["base"]) == key]
        assert expected <= {r["contender"] for r in these}, key
        # the compiled contenders left out of the quick run's other sets, the rows saying so
        if not key[0].startswith("ResNet-18"):
            assert "compiled foreach SAM" in these[0]["left_out"] and "cpp, compiled" in these[0]["left_out"]
    check_stepped_in_turn(wholes, ("set", "base"), {"per-tensor loop": "per-tensor loop"})
    for row in wholes:  # torch's own step: the faster of its two paths in the same rounds
        assert set(row["over"]) == {"torch's base step"}
        assert row["over_path"]["torch's base step"] in ("bare base step", "bare base step (fused)")
    # the compiled contender on ResNet-18 only in quick mode, within the float32 tolerance of our step
    compiled = [r for r in wholes if r["contender"] == "compiled foreach SAM"]
    assert {(r["set"].split(" (")[0], r["base"]) for r in compiled} == {("ResNet-18", "SGD"), ("ResNet-18", "AdamW")}
    assert all(r["max_rel_diff"] <= 1e-6 and r["compile_s"] > 0 for r in compiled)
    # our fused step under torch.compile(fullgraph=True), next to the eager row: cpp where it is built (triton only on
    # CUDA), ResNet-18 only in quick mode; it took the fused path and its compile time is recorded
    ours_compiled = [r for r in wholes if r["contender"].endswith(", compiled")]
    if any(r["contender"] == "cpp" for r in wholes):
        assert {(r["contender"], r["set"].split(" (")[0], r["base"]) for r in ours_compiled} == {
            ("cpp, compiled", "ResNet-18", "SGD"), ("cpp, compiled", "ResNet-18", "AdamW"),
        }  # fmt: skip
    assert all(r["compile_s"] > 0 and r["base_step_mode"] == "fused" for r in ours_compiled)
    assert not any(r["contender"].endswith(", CUDA graph") for r in wholes if r["device"] == "cpu")
    assert {r["base"] for r in wholes} == {"SGD", "AdamW"}
    # our rows say which path the base step took, and it is the one their name says
    ours = [r for r in wholes if r["contender"].split(", ")[0] in ("torch", "cpp", "triton")]
    assert ours and all(
        r["base_step_mode"] == ("per-tensor" if r["contender"].endswith(", base per tensor") else "fused") for r in ours
    )
    assert "**Whole step, SGD, ResNet-18" in stdout and "**Whole step, AdamW, 2000 tensors x 512" in stdout
    assert "/ torch's base step [IQR]" in stdout and "torch's base step = its faster path in these rounds" in stdout


def check_skipped_steps(rows: list[dict], stdout: str) -> None:
    # a step the schedule skips, against the bare base step, on ResNet-18's shapes with both base optimizers
    skipped = [r for r in rows if r["benchmark"] == "bench_skipped_step"]
    assert {r["base"] for r in skipped} == {"SGD", "AdamW"}
    assert {r["set"].split(" (")[0] for r in skipped} == {"ResNet-18"}
    assert {f"torch, {rule} {schedule}, skipped step" for rule in ("SAM", "GEAR-SAM")
            for schedule in ("every-k", "LookSAM")} | {"bare base step"} <= {r["contender"] for r in skipped}  # fmt: skip
    update = {"SGD": 20, "AdamW": 28}
    for row in skipped:
        floor = update[row["base"]] + (0 if row["contender"] == "bare base step" else 4)
        floor += 4 if " LookSAM" in row["contender"] else 0
        assert row["bytes_counted"] == floor * row["parameters"] and row["gbps"] > 0
        assert row["over_paired_bare_q1"] <= row["over_paired_bare"] <= row["over_paired_bare_q3"]
    assert all(r["base_step_mode"] == "fused" for r in skipped if r["contender"] != "bare base step")
    assert "**Skipped step, AdamW, ResNet-18" in stdout and "same round" in stdout


def check_family(rows: list[dict], stdout: str, benchmarks: dict[str, dict]) -> None:
    """The SAM family's rows of ``benchmarks`` (each mapped to its bases and their floors in bytes per parameter)."""
    family = [r for r in rows if "variant" in r]
    # the SAM family on ResNet-18's shapes: each variant ours (one backend) and the peer's (its foreach path) where it
    # has it, in both benchmarks, counted at SAM's bytes plus the variant's passes
    ours_backend = "cpp" if any(r["contender"] == "cpp" for r in rows if "variant" not in r) else "torch"
    expected = {(v, c) for v in ("SAM", "GSAM", "WSAM", "F-SAM", "GEAR-SAM", "GEAR-SAM + GSAM")
                for c in (ours_backend, "pytorch_optimizer") if c == ours_backend or "GEAR" not in v}  # fmt: skip
    extra = {"SAM": 0, "GSAM": 24, "WSAM": 32, "F-SAM": 12, "GEAR-SAM": 0, "GEAR-SAM + GSAM": 24}
    # a whole step's fused base update takes GSAM's mix and WSAM's sharpness step: g read, not passes of their own
    folded = {"GSAM": 8, "GEAR-SAM + GSAM": 8, "WSAM": 24}
    for benchmark, bases in benchmarks.items():
        for base, floor in bases.items():
            these = [r for r in family if r["benchmark"] == benchmark and r.get("base") == base]
            assert {(r["variant"], r["contender"]) for r in these} == expected, (benchmark, base)
            for row in these:
                assert row["set"].startswith("ResNet-18") and row["median_ms"] > 0
                saved = folded.get(row["variant"], 0) if benchmark == "bench_whole_step" else 0
                assert row["bytes_counted"] == (floor + extra[row["variant"]] - saved) * row["parameters"]
                if benchmark == "bench_whole_step" and row["contender"] == ours_backend:
                    assert row["base_step_mode"] == "fused"
            for variant in {r["variant"] for r in these}:
                check_family_in_turn([r for r in these if r["variant"] == variant])
    assert {r.get("base") for r in family} == {base for bases in benchmarks.values() for base in bases}
    assert "**SAM family, SAM step, ResNet-18" in stdout and "/ own SAM [IQR]" in stdout
    assert "each variant's contenders stepped in turn with their yardsticks" in stdout
    assert ("**SAM family, whole step, SGD" in stdout) == ("bench_whole_step" in benchmarks)


def check_family_in_turn(group: list[dict]) -> None:
    """One variant's rows: one test, their rounds shared with the yardsticks their ratios name (our plain variant on
    the same backend, the peer's variant under SAM's radius for a GEAR-SAM variant); each ratio the median of its
    per-round ratios, recomputed here where its reference has a row."""
    assert len({r["test"] for r in group}) == 1 and len({r["rounds"] for r in group}) == 1
    times = {r["contender"]: r["round_ms"] for r in group}
    for row in group:
        variant, mine = row["variant"], row["round_ms"]
        assert len(mine) == row["rounds"] and set(times) <= set(row["stepped_in_turn"]) and "load_1min" in row
        own = row["contender"] if row["plain_variant"] == variant else f"{row['plain_variant']}: {row['contender']}"
        peer = "pytorch_optimizer" if row["peer_variant"] == variant else f"{row['peer_variant']}: pytorch_optimizer"
        assert row["over_path"] == {"own SAM": own} and row["vs_path"] == {"pytorch_optimizer": peer}
        assert {own, peer} <= set(row["stepped_in_turn"])
        for stats, path, per_round in ((row["over"]["own SAM"], own, lambda a, b: a / b),
                                       (row["vs"]["pytorch_optimizer"], peer, lambda a, b: b / a)):  # fmt: skip
            assert stats["low"] <= stats["q1"] <= stats["median"] <= stats["q3"] <= stats["high"]
            if path in times:
                ratios = [per_round(a, b) for a, b in zip(mine, times[path])]
                assert stats["median"] == pytest.approx(report.quartiles(ratios)[1])


def check_trainers(rows: list[dict], stdout: str) -> None:
    # the Hugging Face Trainer's step, plain and with SAMTrainer
    trainers = [r for r in rows if r["benchmark"] == "bench_trainer"]
    assert {r["contender"] for r in trainers} == {
        "Trainer", "SAMTrainer sam", "SAMTrainer gear-sam", "LightningModule",
        "LightningModule + SharpnessAwareMixin gear-sam",
    }  # fmt: skip
    assert all(r["step_ms"] > 0 and r["steps"] == 2 for r in trainers)
    # the steps alone (the set-up before each round's first step left out), each trainer on its fastest AdamW
    assert all(r["steps_timed"] > 0 and r["step_q1_ms"] <= r["step_ms"] <= r["step_q3_ms"] for r in trainers)
    optims = {r["contender"]: r["optim"] for r in trainers}
    assert optims["Trainer"] == "adamw_torch_fused" and optims["SAMTrainer sam"] == "adamw_torch"
    assert {r["base_step_mode"] for r in trainers if r["contender"] not in ("Trainer", "LightningModule")} == {"fused"}
    assert "**Hugging Face Trainer step" in stdout and "/ Trainer |" in stdout
    assert "**Lightning step" in stdout and "/ LightningModule |" in stdout


# ------------------------------------------------------------------------------ the report's arithmetic


def test_quartiles_and_step_intervals():
    assert report.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 3.0, 4.0)
    assert report.quartiles([7.0]) == (7.0, 7.0, 7.0)
    assert report.step_intervals([1.0, 1.5, 3.5, 4.0]) == [0.5, 2.0, 0.5]
    assert report.step_intervals([1.0]) == []


def test_sam_parts_are_computed_per_round():
    # seconds per round: SAM step, one forward+backward pass, one SGD step (its pass and its update), back to back
    step, passes, sgd = [0.070, 0.062, 0.100], [0.030, 0.028, 0.040], [0.031, 0.029, 0.041]
    parts = report.sam_parts(step, passes, sgd)
    # beyond = step - 2 x pass: 10, 6, 20 ms; tax = step - SGD step - pass: 9, 5, 19 ms
    assert parts["beyond_ms"] == pytest.approx(10.0) and parts["tax_ms"] == pytest.approx(9.0)
    assert (parts["beyond_q1_ms"], parts["beyond_q3_ms"]) == pytest.approx((8.0, 15.0))
    assert (parts["tax_q1_ms"], parts["tax_q3_ms"]) == pytest.approx((7.0, 14.0))
    assert parts["forward_backward_ms"] == pytest.approx(30.0) and parts["sgd_ms"] == pytest.approx(31.0)
    assert parts["tax_pct"] == pytest.approx(100 * 9 / 70)  # the median of 12.9%, 8.1% and 19%
    with pytest.raises(ValueError, match="per round"):
        report.sam_parts(step, passes[:2], sgd)


def _row(benchmark: str, contender: str, median_ms: float, **fields) -> dict:
    return {"benchmark": benchmark, "contender": contender, "median_ms": median_ms, "q1_ms": median_ms - 1,
            "q3_ms": median_ms + 1, **fields}  # fmt: skip


def test_the_whole_step_table_compares_with_the_peers_faster_path():
    common = {"set": "ResNet-18", "base": "SGD", "parameters": 10, "tensors": 2, "bytes_counted": 400, "device": "cpu",
              "floor_gbps": 40.0, "floor_kind": "update", "gbps": 10.0, "pct_floor": 25.0}  # fmt: skip
    rows = [_row("bench_whole_step", name, ms, **common) for name, ms in
            (("per-tensor loop", 8.0), ("pytorch_optimizer", 20.0), ("pytorch_optimizer, per tensor", 30.0),
             ("compiled foreach SAM", 6.0), ("cpp", 5.0), ("bare base step", 4.0))]  # fmt: skip
    text = "\n".join(report.whole_step_tables(rows))
    assert "its faster path here, `pytorch_optimizer`" in text and "memory floor 40 GB/s (update)" in text
    assert (
        "| cpp | 5.000 | 2.000 | 1.60x | 4.00x | 1.20x | 1.25x | 10.0 | 25 | - |" in text
    )  # 8/5, 20/5 (not 30/5), 6/5; 5/4
    text = "\n".join(report.whole_step_tables([r for r in rows if r["contender"] != "pytorch_optimizer"]))
    assert "faster path" not in text and "| cpp | 5.000 | 2.000 | 1.60x | 6.00x | 1.20x | 1.25x |" in text


def test_the_whole_step_table_shows_compile_and_capture_times():
    common = {"set": "ResNet-18", "base": "AdamW", "parameters": 10, "tensors": 2, "bytes_counted": 480,
              "device": "cuda", "floor_gbps": 40.0, "floor_kind": "update", "gbps": 10.0, "pct_floor": 25.0}  # fmt: skip
    rows = [_row("bench_whole_step", "triton", 5.0, **common),
            _row("bench_whole_step", "triton, compiled", 4.0, compile_s=12.4, **common),
            _row("bench_whole_step", "triton, CUDA graph", 2.4, capture_s=0.31, **common),
            _row("bench_whole_step", "bare base step", 4.0, **common)]  # fmt: skip
    text = "\n".join(report.whole_step_tables(rows))
    assert "| triton | 5.000 | 2.000 | - | - | - | 1.25x | 10.0 | 25 | - | - | - |" in text
    assert "| triton, compiled | 4.000 | 2.000 | - | - | - | 1.00x | 10.0 | 25 | - | 12 | - |" in text
    assert "| triton, CUDA graph | 2.400 | 2.000 | - | - | - | 0.60x | 10.0 | 25 | - | 0.3 | - |" in text
    assert "`BACKEND, CUDA graph`" in text and "`BACKEND, compiled`" in text


def test_the_whole_step_lists_our_compiled_and_captured_rows_next_to_the_eager_ones(monkeypatch):
    """Names and order of the whole step's contenders on CUDA (where every backend may be built) and on CPU."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the benchmark imports its neighbours by name
    neighbours = ("contenders", "param_sets", "conftest")  # "conftest": the tests' own, put back after
    saved = {name: sys.modules.pop(name, None) for name in neighbours}
    try:
        whole = _load("bench_whole_step")
        usable = {"cuda": ["per-tensor loop", "torch", "triton", "cpp"], "cpu": ["per-tensor loop", "torch", "cpp"]}
        monkeypatch.setattr(whole.contenders, "available", lambda device: usable[device])
        assert whole.whole_step_contenders("cuda") == [
            "per-tensor loop", "compiled foreach SAM", "compiled foreach SAM, reduce-overhead",
            "torch", "torch, base per tensor",
            "cpp", "cpp, base per tensor", "cpp, compiled", "cpp, CUDA graph",
            "triton", "triton, base per tensor", "triton, compiled", "triton, CUDA graph",
            "bare base step", "bare base step (fused)",
        ]  # fmt: skip
        assert whole.whole_step_contenders("cpu") == [
            "per-tensor loop", "compiled foreach SAM", "torch", "torch, base per tensor", "cpp",
            "cpp, base per tensor", "cpp, compiled", "bare base step", "bare base step (fused)",
        ]  # fmt: skip
        assert whole.GRAPH_SET_KEYS == ["resnet18", "small_tensors"]
        # what each contender leaves out: compiling outside quick mode's set and --compile-sets, capturing outside
        # the CUDA-graph sets
        assert whole.left_out("cpp, compiled", "small_tensors", True, None).startswith("quick mode compiles")
        assert whole.left_out("cpp, compiled", "resnet18", True, None) is None
        assert whole.left_out("compiled foreach SAM", "small_tensors", False, None) is None
        assert "--compile-sets" in whole.left_out("compiled foreach SAM", "small_tensors", False, ["resnet18"])
        assert whole.left_out("compiled foreach SAM, reduce-overhead", "vit_b16", False, None).startswith("captured")
        assert whole.left_out("cpp, CUDA graph", "resnet18", False, None) is None
        assert whole.left_out("cpp", "small_tensors", True, ["resnet18"]) is None
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module


def test_ratios_of_contenders_stepped_in_turn_are_medians_of_per_round_ratios():
    """Each contender's ratio to a reference of the same rounds: the median, quartiles and range of the per-round
    ratios, not the ratio of the medians; a reference with two paths stands for the one with the lower median."""
    round_ms = {
        "ours": [1.0, 2.0, 1.0, 4.0, 1.0],
        "loop": [3.0, 4.0, 3.0, 40.0, 5.0],  # per round over ours: 3, 2, 3, 10, 5
        "peer foreach": [9.0, 9.0, 9.0, 9.0, 9.0],
        "peer per tensor": [2.0, 30.0, 2.0, 30.0, 2.0],  # median 2, below the foreach path's 9
    }
    stats = rows_module.ratio_stats(round_ms["loop"], round_ms["ours"])
    assert stats == {"median": 3.0, "q1": 3.0, "q3": 5.0, "low": 2.0, "high": 10.0}
    assert stats["median"] != statistics.median(round_ms["loop"]) / statistics.median(round_ms["ours"])  # 4 / 1
    assert rows_module.faster_path(round_ms, ("peer foreach", "peer per tensor")) == "peer per tensor"
    assert rows_module.faster_path(round_ms, ("absent",)) is None
    fields = rows_module.interleaved_fields(
        round_ms, {"loop": ("loop",), "peer": ("peer foreach", "peer per tensor"), "gone": ("absent",)},
        {"slowest": ("peer foreach",)},
    )  # fmt: skip
    ours = fields["ours"]
    assert set(ours["vs"]) == {"loop", "peer"} and ours["vs_path"] == {"loop": "loop", "peer": "peer per tensor"}
    assert ours["vs"]["peer"]["median"] == 2.0 and ours["vs"]["peer"]["high"] == 15.0  # 30 / 2 in round 2
    assert ours["over"]["slowest"]["median"] == pytest.approx(1 / 9) and ours["over_path"] == {
        "slowest": "peer foreach"
    }
    assert fields["loop"]["vs"]["loop"] == {"median": 1.0, "q1": 1.0, "q3": 1.0, "low": 1.0, "high": 1.0}
    with pytest.raises(ValueError):
        rows_module.ratio_stats([1.0, 2.0], [1.0])


def test_contenders_step_in_turn_the_order_turned_each_round(monkeypatch):
    """Every step once per round, each timed alone, the order turned by one place each round, the floor measured once
    before each round and once after the last."""
    conftest = _load("conftest")
    order: list[str] = []
    steps = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}

    class Floor:
        def __init__(self):
            self.measured = 0

        def interleaved(self):
            def measure():
                self.measured += 1
                order.append("floor")

            return measure

        def around_rounds(self):
            self.measured += 1
            return ["sample"] * self.measured

    floor = Floor()
    seconds, samples = conftest.step_in_turn(steps, 4, floor)
    assert order == ["floor", "a", "b", "c", "floor", "b", "c", "a", "floor", "c", "a", "b", "floor", "a", "b", "c"]
    assert {name: len(s) for name, s in seconds.items()} == {"a": 4, "b": 4, "c": 4} and len(samples) == 5
    assert conftest.step_in_turn(steps, 2)[1] is None


def test_contenders_that_would_not_fit_in_memory_together_are_left_out_in_order_saying_so():
    conftest = _load("conftest")
    buffers = {"a": 4, "b": 3, "c": 5}
    gib = 2**30
    # 12 buffers of 1 GiB plus 2 shared: 14 GiB; 60% of 20 GiB is 12: "c" goes first, then fits (9 GiB)
    kept, notes = conftest.fit_in_memory(list(buffers), buffers.get, gib, ("c", "b"), 20 * gib, fixed_buffers=2)
    assert kept == ["a", "b"] and list(notes) == ["c"]
    assert "14.0 GiB, more than 60% of the 20.0 GiB available" in notes["c"]
    assert conftest.fit_in_memory(list(buffers), buffers.get, gib, ("c",), 40 * gib) == (list(buffers), {})
    with pytest.raises(pytest.skip.Exception, match="even without"):
        conftest.fit_in_memory(list(buffers), buffers.get, gib, ("c",), 5 * gib)


def test_the_tables_of_contenders_stepped_in_turn_give_the_ratios_of_the_same_rounds():
    common = {"set": "ResNet-18", "parameters": 10, "tensors": 2, "device": "cpu", "floor_gbps": 40.0,
              "floor_kind": "update", "gbps": 10.0, "pct_floor": 25.0, "rounds": 15, "left_out": {}}  # fmt: skip
    vs = {"per-tensor loop": {"median": 2.5, "q1": 2.25, "q3": 2.75, "low": 2.0, "high": 3.0},
          "pytorch_optimizer": {"median": 0.98, "q1": 0.9, "q3": 1.04, "low": 0.8, "high": 1.2},
          "compiled foreach SAM": {"median": 3.0, "q1": 2.9, "q3": 3.1, "low": 2.8, "high": 3.2}}  # fmt: skip
    paths = {"vs_path": {"per-tensor loop": "per-tensor loop", "pytorch_optimizer": "pytorch_optimizer, per tensor",
                         "compiled foreach SAM": "compiled foreach SAM"}}  # fmt: skip
    over = {"over": {"torch's base step": {"median": 1.5, "q1": 1.4, "q3": 1.6, "low": 1.3, "high": 1.7}},
            "over_path": {"torch's base step": "bare base step (fused)"}}  # fmt: skip
    whole = [_row("bench_whole_step", "cpp", 5.0, base="SGD", bytes_counted=360, base_flags="fused into the restore",
                  vs=vs, **paths, **over, left_out={"cpp, compiled": "this run compiled for ['resnet18'] only"},
                  **{k: v for k, v in common.items() if k != "left_out"})]  # fmt: skip
    text = "\n".join(report.whole_step_tables(whole))
    assert ("| cpp | fused into the restore | 5.000 | 2.000 | 2.50x [2.25, 2.75] | 0.98x [0.90, 1.04] | "
            "3.00x [2.90, 3.10] | 1.50x [1.40, 1.60] | 10.0 | 25 | - | - | - |") in text  # fmt: skip
    assert "15 rounds, the contenders stepped in turn within each" in text
    assert "pytorch_optimizer = its faster path in these rounds, `pytorch_optimizer, per tensor`" in text
    assert "torch's base step = its faster path in these rounds, `bare base step (fused)`" in text
    assert "not run here: `cpp, compiled`" in text and "straddle 1.00x is inside the noise" in text
    sam = [_row("bench_sam_step", "cpp", 5.0, rule="gear-sam", bytes_counted=160, held_bytes=2**20, vs=vs, **paths,
                **common)]  # fmt: skip
    text = "\n".join(report.sam_step_tables(sam))
    assert (
        "**GEAR-SAM step, ResNet-18**" in text
        and "| cpp | 5.000 | 2.000 | 2.50x [2.25, 2.75] | 0.98x [0.90, 1.04] |" in text
    )
    assert "compared with their SAM steps of the same rounds" in text


def test_rows_of_runs_before_the_floor_are_recounted():
    """Runs that measured a copy (counted at 8 bytes per element, moving 12 on a CPU) and counted the bare base step
    at the SAM step's bytes: the floor is the copy's moved bytes, the bare step its own 20 bytes per parameter."""
    old = {"benchmark": "bench_whole_step", "base": "SGD", "parameters": 10, "bytes_counted": 400, "device": "cpu",
           "copy_gbps": 30.0, "gbps": 40.0}  # fmt: skip
    assert report.floor_gbps(old) == 45.0 and report.pct_floor({**old, "contender": "cpp"}) == pytest.approx(88.9, 0.01)
    assert report.counted_gbps({**old, "contender": "bare base step"}) == 20.0
    assert report.floor_gbps({**old, "device": "cuda"}) == 30.0


def test_the_sam_step_table_compares_with_the_peers_faster_path():
    common = {"set": "ResNet-18", "rule": "sam", "parameters": 11_000_000, "tensors": 62, "floor_gbps": 30.0,
              "floor_kind": "update", "gbps": 10.0, "pct_floor": 33.0, "held_bytes": 2**20,
              "bytes_counted": 16 * 11_000_000}  # fmt: skip
    rows = [_row("bench_sam_step", name, ms, **common) for name, ms in
            (("per-tensor loop", 8.0), ("pytorch_optimizer", 30.0), ("pytorch_optimizer, per tensor", 20.0),
             ("cpp", 5.0))]  # fmt: skip
    assert report.best_peer({r["contender"]: r["median_ms"] for r in rows}) == ("pytorch_optimizer, per tensor", 20.0)
    text = "\n".join(report.sam_step_tables(rows))
    assert "its faster path here, `pytorch_optimizer, per tensor`" in text
    assert "62 tensors; 16 bytes counted per parameter;" in text
    assert "| cpp | 5.000 | 2.000 | 1.60x | 4.00x |" in text  # 8/5 and 20/5, not 30/5
    # a run with the peer's one path: compared with it, and no path named
    text = "\n".join(report.sam_step_tables(rows[:2] + rows[3:]))
    assert "faster path" not in text and "| cpp | 5.000 | 2.000 | 1.60x | 6.00x |" in text
    assert report.best_peer({"cpp": 5.0}) == (None, None)


def test_the_train_step_table_shows_the_parts_of_each_round():
    setting = {"width": 16, "batch": 32, "autocast": "None", "channels_last": False}
    parts = report.sam_parts([0.070, 0.062, 0.100], [0.030, 0.028, 0.040], [0.031, 0.029, 0.041])
    rows = [_row("bench_train_step", "forward+backward", 30.0, **setting),
            _row("bench_train_step", "SAM", 70.0, base_step_mode="fused", **parts, **setting),
            _row("bench_train_step", "pytorch_optimizer", 71.0, **parts, **setting)]  # fmt: skip
    text = "\n".join(report.train_step_table(rows))
    assert "| SAM | 70.00 | 2.00 | 10.00 [8.00, 15.00] | 9.00 [7.00, 14.00] | 12.9 | fused into the restore |" in text
    assert (
        "| pytorch_optimizer | 71.00 | 2.00 | 10.00 [8.00, 15.00] | 9.00 [7.00, 14.00] | 12.9 | SGD `step()` |" in text
    )
    # rows written before the parts were timed per round: the tax from the part rows' medians, as then
    old = [_row("bench_train_step", "forward+backward", 30.0, **setting),
           _row("bench_train_step", "base step", 1.0, **setting), _row("bench_train_step", "SAM", 65.0, **setting)]  # fmt: skip
    text = "\n".join(report.train_step_table(old))
    assert "| SAM | 65.00 | 2.00 | 4.00 | 6.2 |" in text and "from medians of the same run" in text


def test_sam_parts_of_a_schedules_rounds_are_per_step():
    # two rounds of 5 steps with one second pass each: per step, round / 5; beyond and tax per step
    step, passes, sgd = [0.40, 0.50], [0.030, 0.030], [0.050, 0.060]
    parts = report.sam_parts(step, passes, sgd, steps=[5, 5], second_passes=[1, 1])
    assert parts["step_ms"] == pytest.approx(90.0)  # the median of 80 and 100
    assert parts["beyond_ms"] == pytest.approx(((400 - 6 * 30) / 5 + (500 - 6 * 30) / 5) / 2)
    assert parts["tax_ms"] == pytest.approx(((400 - 250 - 30) / 5 + (500 - 300 - 30) / 5) / 2)
    assert parts["over_sgd"] == pytest.approx((80 / 50 + 100 / 60) / 2)
    # without a schedule, one step and one second pass per round, as before
    assert report.sam_parts(step, passes, sgd)["tax_ms"] == pytest.approx(((400 - 80) + (500 - 90)) / 2)


def test_the_skipped_step_table_compares_with_the_bare_base_step():
    common = {"set": "ResNet-18", "base": "AdamW", "parameters": 10, "tensors": 2, "floor_gbps": 30.0,
              "floor_kind": "update", "gbps": 10.0, "pct_floor": 33.0}  # fmt: skip
    rows = [_row("bench_skipped_step", "cpp, SAM every-k, skipped step", 5.0, bytes_counted=320, over_paired_bare=1.1,
                 over_paired_bare_q1=1.0, over_paired_bare_q3=1.2, **common),
            _row("bench_skipped_step", "bare base step", 4.0, bytes_counted=280, **common)]  # fmt: skip
    text = "\n".join(report.skipped_step_tables(rows))
    assert "**Skipped step, AdamW, ResNet-18**" in text
    assert "| cpp, SAM every-k, skipped step | 32 | 5.000 | 2.000 | 1.25x | 1.10x [1.00, 1.20] |" in text
    assert "| bare base step | 28 | 4.000 | 2.000 | 1.00x | - |" in text


def _ratios(name: str, median: float, q1: float | None = None, q3: float | None = None) -> dict[str, float]:
    """A per-round ratio's fields: its median and quartiles (the median itself where not given)."""
    return {name: median, f"{name}_q1": median if q1 is None else q1, f"{name}_q3": median if q3 is None else q3}


def test_the_momentum_step_table_gives_the_ratios_of_the_same_rounds():
    common = {"set": "ResNet-18", "base": "SGD", "parameters": 10, "tensors": 2, "device": "cpu", "floor_gbps": 40.0,
              "floor_kind": "update", "gbps": 10.0, "pct_floor": 25.0, "rounds": 40}  # fmt: skip
    rows = [
        _row("bench_momentum_step", "cpp, MomentumSAM", 5.0, bytes_counted=400, **_ratios("over_base", 2.2, 2.1, 2.3),
             **_ratios("over_allowed", 1.1, 1.05, 1.15), **_ratios("over_allowed_skipped", 0.9, 0.85, 0.95),
             **_ratios("over_bare", 0.5, 0.45, 0.55), pct_traffic_floor=31.0, read_only_bytes=40, **common),
        _row("bench_momentum_step", "cpp, fused base step", 2.0, bytes_counted=200, **_ratios("over_base", 1.0),
             **_ratios("over_bare", 0.25), **common),
        _row("bench_momentum_step", "bare base step", 8.0, bytes_counted=200, **_ratios("over_base", 4.0),
             **_ratios("over_bare", 1.0), **common),
    ]  # fmt: skip
    text = "\n".join(report.momentum_step_tables(rows))
    assert "**MomentumSAM step, SGD, ResNet-18** (0.0M parameters in 2 tensors; 40 rounds, the contenders" in text
    assert (
        "| cpp, MomentumSAM | 40 | 5.000 | 2.000 | 10.0 | 2.20x [2.10, 2.30] | 1.10x [1.05, 1.15] | 0.90x [0.85, 0.95] "
        "| 0.50x [0.45, 0.55] | 25 | 31 |" in text
    )
    assert (
        "| cpp, fused base step | 20 | 2.000 | 2.000 | 10.0 | 1.00x [1.00, 1.00] | - | - | 0.25x [0.25, 0.25] |" in text
    )
    assert (
        "| bare base step | 20 | 8.000 | 2.000 | 10.0 | 4.00x [4.00, 4.00] | - | - | 1.00x [1.00, 1.00] | 25 | - |"
        in text
    )
    assert report.momentum_step_tables([r for r in rows if r["benchmark"] != "bench_momentum_step"]) == []


def test_the_train_step_table_shows_a_one_pass_row_beside_sgd_and_full_sam():
    setting = {"width": 16, "batch": 32, "autocast": "None", "channels_last": False}
    # one step and no second pass per round: beyond = step - pass (3, 3, 5 ms), tax = step - SGD step (2, 1, 2 ms)
    parts = report.sam_parts([0.033, 0.031, 0.035], [0.030, 0.028, 0.030], [0.031, 0.030, 0.033], steps=[1] * 3,
                             second_passes=[0] * 3)  # fmt: skip
    assert parts["beyond_ms"] == pytest.approx(3.0) and parts["tax_ms"] == pytest.approx(2.0)
    row = _row("bench_train_step", "MomentumSAM", 33.0, base_step_mode="fused", one_pass=True, paired_sam_ms=62.0,
               **_ratios("sam_over_sgd", 1.9, 1.8, 2.0), **_ratios("over_paired_sam", 0.55, 0.5, 0.6), **parts,
               **setting)  # fmt: skip
    text = "\n".join(report.train_step_table([row]))
    assert "| MomentumSAM | 33.00 | 2.00 | 3.00 [3.00, 4.00] |" in text and "| none (one pass per step) |" in text
    over_sgd = f"{parts['over_sgd']:.2f}x [{parts['over_sgd_q1']:.2f}, {parts['over_sgd_q3']:.2f}]"
    assert f"| MomentumSAM | 33.00 | {over_sgd} | 1.90x [1.80, 2.00] | 0.55x [0.50, 0.60] | 31.00 | 62.00 |" in text


def test_the_trainer_table_shows_the_steps_alone():
    common = {"parameters": 930_000, "micro_batches": 2, "batch": 8, "seq": 64, "bf16": False, "steps": 10,
              "steps_timed": 45, "test": "test_trainer_step[x]"}  # fmt: skip
    rows = [_row("bench_trainer", "Trainer", 0, step_ms=100.0, step_q1_ms=95.0, step_q3_ms=110.0,
                 optim="adamw_torch_fused", **common),
            _row("bench_trainer", "SAMTrainer sam", 0, step_ms=190.0, step_q1_ms=185.0, step_q3_ms=200.0,
                 optim="adamw_torch", base_step_mode="fused", **common)]  # fmt: skip
    text = "\n".join(report.trainer_tables(rows))
    assert "| Trainer | adamw_torch_fused | 100.0 | 15.0 | 1.00x |" in text
    assert "| SAMTrainer sam | adamw_torch, fused into the restore | 190.0 | 15.0 | 1.90x |" in text
    assert "45 steps timed" in text


def test_the_peer_runs_on_the_path_its_name_says():
    pytest.importorskip("pytorch_optimizer")
    import torch

    contenders = _load("contenders")
    model = torch.nn.Linear(3, 2)
    assert contenders.PEER_PATHS == {"pytorch_optimizer": True, "pytorch_optimizer, per tensor": False}
    for name, foreach in contenders.PEER_PATHS.items():
        assert name in contenders.available("cpu") and name in contenders.SAM_ONLY
        opt = contenders.make(name, "sam", model, None)
        assert all(group["foreach"] is foreach for group in opt.param_groups)


def test_the_family_table_compares_each_variant_with_the_peers_and_its_own_sam():
    """Rows of runs that timed each family row in a test of its own: the ratios of the rows' medians, rendered as
    those runs' reports have them."""
    common = {"set": "ResNet-18", "base": "SGD", "parameters": 10, "tensors": 2, "device": "cpu", "floor_gbps": 40.0,
              "floor_kind": "update", "gbps": 10.0, "pct_floor": 25.0}  # fmt: skip
    family = {"SAM": ("sam", "SAM", "SAM", 400), "GSAM": ("sam", "GSAM", "SAM", 760),
              "GEAR-SAM": ("gear-sam", "SAM", "GEAR-SAM", 400),
              "GEAR-SAM + GSAM": ("gear-sam", "GSAM", "GEAR-SAM", 760)}  # fmt: skip
    rows = [_row("bench_whole_step", contender, ms, variant=variant, rule=family[variant][0],
                 peer_variant=family[variant][1], plain_variant=family[variant][2], bytes_counted=family[variant][3],
                 **common)
            for variant, contender, ms in (
                ("SAM", "cpp", 5.0), ("SAM", "pytorch_optimizer", 20.0), ("SAM", "pytorch_optimizer, per tensor", 30.0),
                ("GSAM", "cpp", 6.0), ("GSAM", "pytorch_optimizer", 36.0), ("GSAM", "pytorch_optimizer, per tensor", 24.0),
                ("GEAR-SAM", "cpp", 5.5), ("GEAR-SAM + GSAM", "cpp", 6.6))]  # fmt: skip
    text = "\n".join(report.family_tables(rows))
    assert "**SAM family, whole step, SGD, ResNet-18**" in text
    assert "faster path here: SAM `pytorch_optimizer`, GSAM `pytorch_optimizer, per tensor`" in text
    assert "| GSAM | cpp | 76 | 6.000 | 2.000 | 4.00x | 1.20x |" in text  # 24/6 (not 36/6); 6/5
    assert "| GSAM | pytorch_optimizer | 76 | 36.000 | 2.000 | 0.67x | 1.80x |" in text  # its own SAM: 36/20
    assert "| GEAR-SAM + GSAM | cpp | 76 | 6.600 | 2.000 | 3.64x | 1.20x |" in text  # 24/6.6; over GEAR-SAM, 6.6/5.5
    # the whole step's same-round column: the pairing where the run has it, "-" where not
    paired = [dict(r) for r in rows]
    paired[3].update(over_paired_plain=1.25, over_paired_plain_q1=1.125, over_paired_plain_q3=1.5)  # GSAM, cpp
    text = "\n".join(report.family_tables(paired))
    assert "| GSAM | cpp | 76 | 6.000 | 2.000 | 4.00x | 1.20x | 1.25x [1.12, 1.50] | 10.0 | 25 | - |" in text
    assert "| SAM | cpp | 40 | 5.000 | 2.000 | 4.00x | 1.00x | - | 10.0 | 25 | - |" in text
    # the family's rows stay out of the whole-step table, and a SAM-step family table shows the memory held
    assert report.whole_step_tables(rows) == []
    sam_step = [{**r, "benchmark": "bench_sam_step", "held_bytes": 2**21} for r in rows]
    sam_step[3].update(over_paired_plain=1.25, over_paired_plain_q1=1.125, over_paired_plain_q3=1.5)  # GSAM, cpp
    text = "\n".join(report.family_tables(sam_step))
    assert "| SAM | cpp | 40 | 5.000 | 2.000 | 4.00x | 1.00x | - | 10.0 | 25 | - | 2.0 |" in text
    assert "| GSAM | cpp | 76 | 6.000 | 2.000 | 4.00x | 1.20x | 1.25x [1.12, 1.50] | 10.0 |" in text


def test_the_family_table_of_contenders_stepped_in_turn_gives_the_ratios_of_the_same_rounds():
    """One variant's rows stepped in turn with their yardsticks (our SAM on the same backend, the peer's SAM for a
    GEAR-SAM variant): "vs pytorch_optimizer" and "/ own SAM" are medians of per-round ratios (rows.family_fields),
    which here differ from the ratios of the medians."""
    round_ms = {
        "cpp": [1.0, 2.0, 1.0, 4.0, 0.5],  # median 1
        "SAM: cpp": [1.0, 1.0, 0.5, 2.0, 0.25],  # median 1; cpp over it per round: 1, 2, 2, 2, 2
        "pytorch_optimizer": [9.0] * 5,
        "pytorch_optimizer, per tensor": [3.0, 30.0, 3.0, 30.0, 3.0],  # median 3: the faster path
        "SAM: pytorch_optimizer": [6.0] * 5,
        "SAM: pytorch_optimizer, per tensor": [2.0] * 5,
    }  # fmt: skip
    peer = ("pytorch_optimizer", "pytorch_optimizer, per tensor")
    own = {"cpp": "SAM: cpp", **{path: f"SAM: {path}" for path in peer}}
    fields = rows_module.family_fields(round_ms, own, peer)
    # over cpp per round: 3, 15, 3, 7.5, 6 -> median 6, quartiles 3 and 7.5; the ratio of the medians is 3
    assert fields["cpp"]["vs"]["pytorch_optimizer"] == {"median": 6.0, "q1": 3.0, "q3": 7.5, "low": 3.0, "high": 15.0}
    assert fields["cpp"]["vs_path"] == {"pytorch_optimizer": "pytorch_optimizer, per tensor"}
    assert fields["cpp"]["over"]["own SAM"]["median"] == 2.0 and fields["cpp"]["over_path"] == {"own SAM": "SAM: cpp"}
    # the peer has no GEAR-SAM: its GSAM, stepped in the same rounds as a yardstick (here the same times)
    gear_peer = tuple(f"GSAM: {path}" for path in peer)
    gear = rows_module.family_fields({"cpp": round_ms["cpp"], "GEAR-SAM: cpp": round_ms["SAM: cpp"],
                                      **{f"GSAM: {path}": round_ms[path] for path in peer}},
                                     {"cpp": "GEAR-SAM: cpp"}, gear_peer)  # fmt: skip
    common = {"set": "ResNet-18", "base": "SGD", "parameters": 10, "tensors": 2, "device": "cpu", "floor_gbps": 40.0,
              "floor_kind": "update", "floor_row_kind": "update", "gbps": 10.0, "pct_floor": 25.0, "rounds": 5,
              "left_out": {"torch": "quick mode"}, "stepped_in_turn": list(round_ms)}  # fmt: skip
    rows = [_row("bench_whole_step", name, statistics.median(round_ms[name]), variant="GSAM", rule="sam",
                 peer_variant="GSAM", plain_variant="SAM", bytes_counted=760, round_ms=round_ms[name], **fields[name],
                 **common)
            for name in own]  # fmt: skip
    rows.append(_row("bench_whole_step", "cpp", 1.0, variant="GEAR-SAM + GSAM", rule="gear-sam", peer_variant="GSAM",
                     plain_variant="GEAR-SAM", bytes_counted=760, **gear["cpp"], **common))  # fmt: skip
    text = "\n".join(report.family_tables(rows))
    assert "| GSAM | cpp | 76 | 1.000 | 2.000 | 6.00x [3.00, 7.50] | 2.00x [2.00, 2.00] | 10.0 | 25 | - |" in text
    assert "| GSAM | pytorch_optimizer | 76 | 9.000 | 2.000 | 0.33x [0.33, 3.33] | 1.50x [1.50, 1.50] |" in text
    assert "| GEAR-SAM + GSAM | cpp | 76 | 1.000 | 2.000 | 6.00x [3.00, 7.50] | 2.00x [2.00, 2.00] |" in text
    assert "**SAM family, whole step, SGD, ResNet-18** (0.0M parameters in 2 tensors; 5 rounds" in text
    assert ("pytorch_optimizer = its faster path in those rounds: GSAM `pytorch_optimizer, per tensor`, "
            "GEAR-SAM + GSAM `GSAM: pytorch_optimizer, per tensor`") in text  # fmt: skip
    assert "not run here: `torch` (quick mode)" in text and "straddle 1.00x is inside the noise" in text
    assert "/ own SAM, same round" not in text and "Runs up to" not in text  # the runs before: not rendered


def test_each_variants_rounds_step_its_rows_and_the_yardsticks_they_are_compared_with(monkeypatch):
    contenders = _load("contenders")
    usable = ["per-tensor loop", "pytorch_optimizer", "pytorch_optimizer, per tensor", "torch", "cpp"]
    monkeypatch.setattr(contenders, "available", lambda device: usable)
    monkeypatch.setattr(contenders, "not_installed", dict)
    peer = ("pytorch_optimizer", "pytorch_optimizer, per tensor")
    plan = contenders.family_steps("SAM", "cpu", False, {})
    assert plan.rows == ["torch", "cpp", *peer] and plan.own == {c: c for c in plan.rows} and plan.peer == peer
    assert plan.steps == {c: ("SAM", c) for c in plan.rows} and plan.left_out == {}
    plan = contenders.family_steps("GSAM", "cpu", False, {"torch": "left out by --leave-out"})
    assert plan.own == {"cpp": "SAM: cpp", **{path: f"SAM: {path}" for path in peer}} and plan.peer == peer
    assert set(plan.steps) == {"cpp", "SAM: cpp", *peer, *(f"SAM: {path}" for path in peer)}
    assert plan.steps["SAM: cpp"] == ("SAM", "cpp") and plan.left_out == {"torch": "left out by --leave-out"}
    plan = contenders.family_steps("GEAR-SAM + GSAM", "cpu", False, {})
    assert plan.own == {"torch": "GEAR-SAM: torch", "cpp": "GEAR-SAM: cpp"}
    assert plan.peer == ("GSAM: pytorch_optimizer", "GSAM: pytorch_optimizer, per tensor")
    assert list(plan.steps) == ["torch", "GEAR-SAM: torch", "cpp", "GEAR-SAM: cpp", *plan.peer]
    # quick mode: one of our backends and the peer's foreach path, the whole step with SGD only
    plan = contenders.family_steps("GEAR-SAM", "cpu", True, {}, "SGD")
    assert plan.own == {"cpp": "cpp"} and plan.peer == ("SAM: pytorch_optimizer",) and list(plan.left_out) == ["torch"]
    assert contenders.family_steps("GSAM", "cpu", True, {}, "AdamW").rows == []


def test_the_peers_family_runs_on_the_path_its_name_says():
    pytest.importorskip("pytorch_optimizer")
    import torch

    contenders = _load("contenders")
    model = torch.nn.Linear(3, 2)
    for variant in ("SAM", "GSAM", "WSAM", "F-SAM"):
        for name, foreach in contenders.PEER_PATHS.items():
            assert name in contenders.variant_contenders("cpu")
            assert contenders.family_skip(variant, name, "cpu", quick=False) is None
            opt = contenders.make_variant(variant, name, model, None, lr=0.01)
            assert all(group["foreach"] is foreach for group in opt.param_groups), (variant, name)
    assert contenders.family_skip("GEAR-SAM + GSAM", "pytorch_optimizer", "cpu", quick=False) is not None


def test_a_row_above_the_floor_of_its_own_rounds_fails_where_no_cache_holds_it(monkeypatch):
    """The floor's fields: the rate of the row's median round; its % of the floor the median over its rounds of each
    round's rate over the mean of the floor measured just before and just after it; a row of 50M parameters or more
    above the best of those measurements is a benchmark bug, a smaller one may be in the caches."""
    conftest = _load("conftest")
    floor = conftest.MemoryFloor(2**16)
    # buffers this small stay in the caches, where our kernels do not stream: only STREAM's three kinds and the read
    assert floor.kind == "the fastest over the row's rounds of copy, triad, update, read"
    assert set(floor.start_gbps) == {"copy", "triad", "update", "read"} and all(
        v > 0 for v in floor.start_gbps.values()
    )
    measure = floor.interleaved()
    for _ in range(3):
        assert measure() is None  # pedantic's setup: nothing to pass on
    assert len(floor.samples) == 3 and all(0 < s.read <= s.fastest for s in floor.samples)

    def samples(*fastest):  # the read kind's rate does not enter pct_floor
        return [conftest.FloorSample({"copy": f, "read": 1.0}) for f in fastest]

    after = iter(samples(12.0, 12.0, 12.0, 12.0))  # the measurement after a row's last round, one per row below
    monkeypatch.setattr(floor, "_sample", lambda: next(after))
    # 3 rounds of 1e9 bytes at 10, 12 and 11 GB/s; the floor around them 10.5, 11 and 11.5
    floor.samples = samples(10.0, 11.0, 11.0)
    fields = floor.fields(10**9, [1 / 10, 1 / 12, 1 / 11], 60_000_000, "row")
    assert fields["gbps"] == pytest.approx(11.0) and fields["floor_gbps"] == 11.0 and fields["floor_best_gbps"] == 12.0
    assert fields["floor_row_kind"] == "copy" and fields["floor_highest_gbps"] == 11.0
    ratios = sorted([10 / 10.5, 12 / 11, 11 / 11.5])
    assert fields["pct_floor"] == pytest.approx(100 * ratios[1])
    quartiles = (50 * (ratios[0] + ratios[1]), 50 * (ratios[1] + ratios[2]))
    assert (fields["pct_floor_q1"], fields["pct_floor_q3"]) == pytest.approx(quartiles)
    assert "pct_traffic_floor" not in fields  # no read-only bytes said: no traffic floor
    assert floor.samples == []  # each row starts its own measurements
    floor.samples = samples(10.0, 12.0, 11.0)
    with pytest.raises(AssertionError, match="above the memory floor"):
        floor.fields(10**9, [1 / 12.5] * 3, 60_000_000, "row")
    floor.samples = samples(10.0, 10.0, 12.0)  # below the best measurement, above the floor around most of its rounds
    with pytest.raises(AssertionError, match=r"104\.5% of the floor around its rounds"):
        floor.fields(10**9, [1 / 11.5] * 3, 60_000_000, "row")
    floor.samples = samples(10.0, 12.0, 11.0)
    assert floor.fields(10**9, [1 / 12.5] * 3, 1_000_000, "row")["gbps"] == pytest.approx(12.5)
    floor.samples = samples(10.0, 12.0)
    with pytest.raises(ValueError, match="3 rounds timed but 2 floor measurements"):
        floor.fields(10**9, [1 / 12.5] * 3, 1_000_000, "row")


def test_rows_stepped_in_the_same_rounds_share_the_floor_measured_around_them(monkeypatch):
    """Contenders stepped in turn within each round: one floor measurement before each round and one after the last
    serve every row, each round's rate over the mean of the measurements around it; no row measures the floor again."""
    conftest = _load("conftest")
    floor = conftest.MemoryFloor(2**16)

    def samples(*fastest):
        return [conftest.FloorSample({"copy": f, "read": 1.0}) for f in fastest]

    after = iter(samples(12.0))  # one measurement after the last round, taken once
    monkeypatch.setattr(floor, "_sample", lambda: next(after))
    floor.samples = samples(10.0, 11.0, 11.0)
    shared = floor.around_rounds()
    assert [s.rates["copy"] for s in shared] == [10.0, 11.0, 11.0, 12.0] and floor.samples == []
    for rate in (10.0, 12.0):  # around the rounds 10.5, 11 and 11.5: the median ratio is rate / 11
        fields = floor.fields(10**9, [1 / rate] * 3, 1_000_000, "row", read_only=10**8, samples=shared)
        assert fields["pct_floor"] == pytest.approx(100 * rate / 11.0) and fields["floor_gbps"] == 11.0
    with pytest.raises(ValueError, match="3 rounds timed but 3 floor measurements around them"):
        floor.fields(10**9, [0.1] * 3, 1_000_000, "row", samples=shared[:3])


def test_the_traffic_floor_takes_the_read_only_bytes_at_the_read_rate(monkeypatch):
    """A row with read-only passes: its traffic floor is the rate of its bytes with the read-only ones at the read
    kind's rate and the rest at the fastest kind's, each the mean of the measurements around the round."""
    conftest = _load("conftest")
    floor = conftest.MemoryFloor(2**16)

    def sample(copy, read):
        return conftest.FloorSample({"copy": copy, "read": read})

    monkeypatch.setattr(floor, "_sample", lambda: sample(60.0, 60.0))  # after the last round
    floor.samples = [sample(60.0, 40.0), sample(60.0, 20.0)]
    # 4e9 bytes, 1e9 of them read-only; round 1 around (60, 30): the traffic floor 4 / (1/30 + 3/60) = 48 GB/s;
    # round 2 around (60, 40): 4 / (1/40 + 3/60) = 53.33 GB/s; both rounds at 40 GB/s, the median their mean
    fields = floor.fields(4 * 10**9, [0.1, 0.1], 1_000_000, "row", read_only=10**9)
    assert fields["read_only_bytes"] == 10**9
    assert fields["pct_traffic_floor"] == pytest.approx(100 * (40 / 48 + 40 / (4 / (1 / 40 + 3 / 60))) / 2)
    assert fields["pct_floor"] == pytest.approx(100 * 40 / 60)  # the fastest kind's floor: as without read_only
    for bad in (-1, 4 * 10**9 + 1):
        floor.samples = [sample(60.0, 40.0)] * 2
        with pytest.raises(ValueError, match="read-only bytes"):
            floor.fields(4 * 10**9, [0.1, 0.1], 1_000_000, "row", read_only=bad)


def test_the_floor_of_a_row_is_the_kind_fastest_over_its_rounds_not_the_highest_of_each_moment(monkeypatch):
    """Two kinds as fast as each other, whose single measurements take turns at being the higher: the row's floor is
    one of them, each round over that kind's rate around it, not the higher measurement of each moment (which would
    be the high end of their noise); the traffic floor prices the rest of the bytes at the same kind."""
    conftest = _load("conftest")
    floor = conftest.MemoryFloor(2**16)

    def sample(copy, update):
        return conftest.FloorSample({"copy": copy, "update": update, "read": 5.0})

    monkeypatch.setattr(floor, "_sample", lambda: sample(12.0, 10.0))  # after the last round
    floor.samples = [sample(10.0, 12.0), sample(12.0, 10.5), sample(10.0, 12.5)]
    # medians with the one after the last round: copy 11, update 11.25 -> update, around the rounds 11.25, 11.5 and
    # 11.25; the higher kind of each moment would have put the floor at 12, 12.25 and 12.25
    fields = floor.fields(10**9, [1 / 10] * 3, 60_000_000, "row", read_only=10**8)
    assert fields["floor_row_kind"] == "update" and fields["floor_gbps"] == 11.25
    assert fields["floor_highest_gbps"] == 12.0 and fields["floor_best_gbps"] == 12.5
    assert fields["pct_floor"] == pytest.approx(100 * 10 / 11.25)
    traffic = [1 / (0.1 / 5.0 + 0.9 / f) for f in (11.25, 11.5, 11.25)]
    assert fields["pct_traffic_floor"] == pytest.approx(100 * 10 / traffic[0])  # the median round's


def test_every_table_row_has_as_many_cells_as_its_header():
    """The rendered tables stay Markdown tables: header, separator and every row with the same number of cells,
    with the traffic floor's column filled where a row has it and '-' where it does not."""
    common = {"set": "ResNet-18", "parameters": 10, "tensors": 2, "device": "cpu", "floor_gbps": 40.0,
              "floor_kind": "update", "gbps": 10.0, "pct_floor": 25.0, "held_bytes": 2**20}  # fmt: skip
    traffic = {"pct_traffic_floor": 31.0, "read_only_bytes": 40}
    rows = [
        _row("bench_sam_step", "cpp", 5.0, rule="sam", bytes_counted=280, **common, **traffic),
        _row("bench_sam_step", "per-tensor loop", 8.0, rule="sam", bytes_counted=280, **common),
        _row("bench_whole_step", "cpp", 5.0, base="SGD", bytes_counted=400, **common, **traffic),
        _row("bench_whole_step", "bare base step", 4.0, base="SGD", bytes_counted=200, **common),
        _row("bench_skipped_step", "cpp, SAM every-k, skipped step", 5.0, base="SGD", bytes_counted=240, **common,
             **traffic),
        _row("bench_whole_step", "cpp", 5.0, base="SGD", bytes_counted=400, variant="GSAM", peer_variant="GSAM",
             plain_variant="SAM", **common, **traffic),
        _row("bench_sam_step", "cpp", 5.0, rule="sam", bytes_counted=280, variant="GSAM", peer_variant="GSAM",
             plain_variant="SAM", **common),
        _row("bench_momentum_step", "cpp, MomentumSAM", 5.0, base="SGD", bytes_counted=400, rounds=3,
             **_ratios("over_base", 2.0), **_ratios("over_allowed", 1.0), **common, **traffic),
        _row("bench_momentum_step", "bare base step", 4.0, base="SGD", bytes_counted=200, rounds=3, **common),
    ]  # fmt: skip
    in_turn = {"rounds": 3, "vs": {"per-tensor loop": {"median": 2.0, "q1": 1.9, "q3": 2.1, "low": 1.8, "high": 2.2}},
               "vs_path": {"per-tensor loop": "per-tensor loop"}, "left_out": {}}  # fmt: skip
    rows += [
        _row("bench_sam_step", "cpp", 5.0, rule="sam", bytes_counted=160, **in_turn,
             **{**common, "set": "WRN-28-10"}, **traffic),
        _row("bench_whole_step", "cpp", 5.0, base="AdamW", bytes_counted=440, base_flags="fused into the restore",
             over={}, over_path={}, **in_turn, **common, **traffic),
        _row("bench_sam_step", "cpp", 5.0, rule="sam", bytes_counted=400, variant="WSAM", peer_variant="WSAM",
             plain_variant="SAM", over={}, over_path={}, **in_turn, **{**common, "set": "WRN-28-10"}, **traffic),
    ]  # fmt: skip
    tables = [report.sam_step_tables, report.whole_step_tables, report.skipped_step_tables, report.family_tables,
              report.momentum_step_tables]  # fmt: skip
    for render in tables:
        text = "\n".join(render(rows))
        blocks = [[line for line in block.splitlines() if line.startswith("|")] for block in text.split("\n\n")]
        tables_here = [lines for lines in blocks if lines]
        assert tables_here, render.__name__
        for lines in tables_here:
            assert len(lines) >= 3 and len({line.count("|") for line in lines}) == 1, (render.__name__, lines)
        cells = []
        for lines in tables_here:
            column = lines[0].split("|").index(" % of traffic floor ")
            cells += [line.split("|")[column].strip() for line in lines[2:]]
        assert "31" in cells, (render.__name__, cells)
    text = "\n".join(report.whole_step_tables(rows))
    assert "| bare base step | 4.000 | 2.000 | - | - | - | 1.00x | 10.0 | 25 | - | - | - |" in text


def test_a_paired_row_keeps_its_rounds_ratio_to_the_floor():
    """Rows whose rounds were each compared with the floor around them report that median ratio, not the median
    rate over the median floor; the bare base step's, recounted at its own bytes, in the same proportion."""
    paired = {"benchmark": "bench_whole_step", "base": "SGD", "parameters": 10, "bytes_counted": 400, "device": "cpu",
              "gbps": 40.0, "floor_gbps": 50.0, "pct_floor": 90.0, "floor_paired": "each round"}  # fmt: skip
    assert report.pct_floor({**paired, "contender": "cpp"}) == 90.0
    assert report.pct_floor({**paired, "contender": "bare base step"}) == pytest.approx(45.0)
    unpaired = {key: value for key, value in paired.items() if key != "floor_paired"}
    assert report.pct_floor({**unpaired, "contender": "cpp"}) == pytest.approx(80.0)


def test_a_report_gives_the_floor_kinds_measured_at_the_start_fastest_first():
    rows = [{"contender": "cpp"}, {"contender": "torch", "floor_start_gbps": {"read": 30.0, "update": 50.25}}]
    assert report.floor_start_line(rows) == [
        "The memory floor's kinds at the start of the run, GB/s by the bytes each moves: update 50.2, read 30.0.",
        "",
    ]
    assert report.floor_start_line([{"contender": "cpp"}]) == []


def test_a_report_gives_what_the_floor_kinds_allow_a_step_of_its_passes():
    """Each pass's bytes at its own kind's rate: a whole SGD step's 4 at 40, 12 at 60 and 20 at 100 GB/s take 0.1 + 0.2
    + 0.2 ns a parameter, 36 bytes in 0.5 ns, 72 GB/s, 72.0% of the fastest kind (100); a SAM step's 16 bytes (the
    restore an exchange of memory) 0.3 ns, 53.3%. Only for a step whose eager ``cpp`` row counted those passes' bytes:
    a run whose perturbation copied w to the backup (40 bytes) gets no line."""
    start = {"read": 40.0, "streamed update": 60.0, "streamed AdamW step": 100.0, "copy": 90.0}

    def row(base, per_param, contender="cpp", benchmark="bench_whole_step"):
        return {"benchmark": benchmark, "base": base, "contender": contender, "parameters": 1000,
                "bytes_counted": per_param * 1000, "floor_start_gbps": start}  # fmt: skip

    line = report.pass_bound_line([row("SGD", 36), row("SGD", 20, "bare base step")])
    assert line[0].endswith("of the fastest kind: whole step SGD 72.0%.")
    adamw = 44 / (4 / 40 + 12 / 60 + 28 / 100) / 100 * 100
    rows = [row(None, 16, benchmark="bench_sam_step"), row("SGD", 36), row("AdamW", 44)]
    assert report.pass_bound_line(rows)[0].endswith(
        f"SAM step 53.3%, whole step SGD 72.0%, whole step AdamW {adamw:.1f}%."
    )
    assert report.pass_bound_line([row("SGD", 40), row(None, 24, benchmark="bench_sam_step")]) == []
    assert report.pass_bound_line([{**row("SGD", 36), "floor_start_gbps": {"read": 40.0, "copy": 90.0}}]) == []


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
def test_the_stream_threshold_benchmark_compares_two_thresholds_on_the_same_weights(tmp_path):
    """``bench_stream_threshold.py --quick --against 0``: the kernels' own threshold (the set's buffers are under a
    core's private cache) against streaming every output, each in its own process; the script fails where the two
    give different weights, and writes one row per base optimizer with both times and their ratio. No time is
    looked at."""
    from gearsam_fused.backends.cpp_backend import cpp_stream_threshold_bytes

    threshold = cpp_stream_threshold_bytes()
    if threshold is None or threshold < 0:
        pytest.skip("the C++ extension is not built, or this CPU has no non-temporal stores")
    if threshold < 400_000:
        pytest.skip("the quick set's buffers are past this machine's threshold: both settings would stream")
    out = tmp_path / "table.md"
    script = BENCHMARKS / "bench_stream_threshold.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--against", "0", "--report", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 0.1M |")]
    assert [row.split(" | ")[1] for row in rows] == ["SGD", "AdamW"]
    assert all(len(row.strip("|").split("|")) == 5 and row.endswith("x |") for row in rows), rows


@pytest.mark.full  # a build or a benchmark run beyond the representative one the default tier keeps
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_the_host_checks_benchmark_compares_the_trusted_state_with_the_checked_one_and_another_checkout(
    tmp_path, backend
):
    """``bench_host_checks.py --quick --backend B --against .``: the whole step of backend B with the state trusted,
    checked every step, and stepped by worker processes importing this checkout and another (this one again),
    alternated; the script fails where the copies leave different weights, and writes one row per base optimizer with
    four times and two ratios, naming the backend. No time is looked at."""
    from gearsam_fused.backends import available_backends

    if backend not in available_backends():
        pytest.skip(f"the {backend} backend cannot run here")
    out, rows_file = tmp_path / "table.md", tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_host_checks.py"), "--quick", "--backend", backend, "--against",
         str(BENCHMARKS.parent), "--report", str(out), "--rows", str(rows_file)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2048 small tensors")]
    assert [row.split(" | ")[2] for row in rows] == ["SGD", "AdamW"]
    assert all(len(row.strip("|").split("|")) == 9 and " | 2048 | " in row for row in rows), rows
    data = json.loads(rows_file.read_text())
    ratios = ["checked every step / trusted", "other checkout / this checkout, own process"]
    assert [list(row["ratio"]) for row in data] == [ratios] * 2
    assert {row["backend"] for row in data} == {backend} and f"of the `{backend}` backend" in out.read_text()

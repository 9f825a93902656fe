"""``benchmarks/gpu_suite.sh`` and its summary writer on a machine without a GPU: argument handling, the dry run,
the records and summary of runs split over several invocations, and the benchmark suite without pytorch_optimizer."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conftest  # tests/conftest.py: the --part option

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_suite.sh"
PHASES = ["info", "build", "tests", "sanitize", "bench", "models", "train"]
NOTE = "pytorch_optimizer is not installed: its contender is skipped"
KNOBS = {"PHASE_TIMEOUT", "WORKERS", "TEST_TIMEOUT", "PYTEST_ARGS", "SANITIZE_TOOLS", "SANITIZE_BIG", "BENCH_ARGS",
         "MODELS_ARGS", "SANITIZER", "TORCH_CUDA_ARCH_LIST"}  # fmt: skip
#: the runs of at most 10 minutes each that the README splits the suite into, with the default limits
SPLIT = [["info", "build", "tests"], ["sanitize", "train"], ["bench"], ["models"]]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_suite_test_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


summary = _load("suite_summary")


def suite(*args: str, cwd: Path = ROOT, timeout: int = 60, **env: str) -> subprocess.CompletedProcess:
    """Runs gpu_suite.sh with ``args``, the suite's knobs taken from ``env`` only; returns the finished process."""
    base = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("TIMEOUT_")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, "PYTHON": sys.executable, **env},
        check=False,
    )


def listed_phases(stdout: str) -> list[tuple[str, bool]]:
    """(phase, selected) for each ``== PHASE`` line of a dry run, in printed order."""
    return [
        (m[1], m[2] != ": not selected")
        for m in re.finditer(r"^== (\w+)(: not selected| \(limit)", stdout, re.MULTILINE)
    ]


# argument handling


@pytest.mark.parametrize("only", ["tests,bogus", "bogus", ",tests"])
def test_an_unknown_phase_exits_2_naming_it_before_anything_runs(tmp_path, only):
    out = tmp_path / "results"
    done = suite(str(out), "--only", only)
    assert done.returncode == 2
    bad = next(name for name in only.split(",") if name not in PHASES)
    assert f"unknown phase '{bad}'" in done.stderr
    assert "valid phases: " + " ".join(PHASES) in done.stderr
    assert done.stdout == "" and not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only"], "--only needs a list of phases"),
        (["--only="], "--only needs at least one phase"),
        (["--frobnicate"], "unknown option '--frobnicate'"),
        (["a", "b"], "one RESULTS_DIR only, got 'a' and 'b'"),
        (["tests"], "'tests' is a phase: use --only tests"),  # the old interface took phases as arguments
    ],
)
def test_usage_errors_exit_2(args, message):
    done = suite(*args, "--dry-run")
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""


def test_help_prints_the_usage_and_the_phases():
    done = suite("--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: benchmarks/gpu_suite.sh [RESULTS_DIR] [--only PHASE[,PHASE...]] [--dry-run]")
    block = done.stdout.split("in this order:\n")[1].split("\nThen")[0]
    assert re.findall(r"^  (\w+) ", block, re.MULTILINE) == PHASES


def test_the_dry_run_lists_every_phase_in_order_with_its_commands(tmp_path):
    out = tmp_path / "results"
    done = suite(str(out), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert listed_phases(done.stdout) == [(phase, True) for phase in PHASES]
    text = done.stdout
    for fragment in [
        "suite_summary.py environment",
        "GEARSAM_BUILD_CUDA=1",
        "pip install --no-build-isolation --no-deps --no-index --use-pep517 -e .",
        "_C.built_with_cuda()",
        "-m pytest --full -m 'not cuda' tests/kernels/test_cpp_ops.py tests/kernels/test_cpp_extension.py -k 'not hopper'",
        "-m pytest --full -m cuda tests -v",
        "--timeout=300",
        f"--junitxml={out}/cuda-tests.xml",
        "--tool memcheck --error-exitcode 99",
        "--tool racecheck --error-exitcode 99",
        "benchmarks/kernels_once.py",
        f"benchmarks/run.py --results {out}/bench-runs.jsonl --report {out}/bench.md",
        f"-m pytest -q -rs -p no:cacheprovider benchmarks/bench_models.py --results={out}/models-runs.jsonl",
        f"benchmarks/bench_models.py {out}/models-runs.jsonl {out}/models.md",
        "gearsam_fused train --device cuda",
        f"suite_summary.py summary {out} --phases {','.join(PHASES)}",
    ]:
        assert fragment in text, fragment
    assert text.index("--tool memcheck") < text.index("--tool racecheck")
    # the quick CPU side first
    assert text.index("tests/kernels/test_cpp_ops.py") < text.index("-m pytest --full -m cuda")
    assert text.index("benchmarks/bench_models.py --results") < text.index(f"bench_models.py {out}/models-runs.jsonl")
    assert not out.exists()  # nothing ran


@pytest.mark.parametrize(
    "args, picked",
    [
        (["--only", "bench,tests"], ["tests", "bench"]),
        (["--only=train", "--only", "info"], ["info", "train"]),
        (["--only", "sanitize,sanitize"], ["sanitize"]),
    ],
)
def test_only_picks_phases_and_keeps_the_suite_order(args, picked):
    done = suite(*args, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert listed_phases(done.stdout) == [(phase, phase in picked) for phase in PHASES]


def test_the_dry_run_takes_its_knobs_from_the_environment():
    done = suite("--dry-run", "--only", "tests,sanitize", SANITIZE_TOOLS="initcheck", SANITIZE_BIG="1", WORKERS="0",
                 TIMEOUT_TESTS="77")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "== tests (limit 77 s)" in done.stdout and " -n " not in done.stdout
    assert "--tool initcheck" in done.stdout and "kernels_once.py --big" in done.stdout
    assert "memcheck" not in done.stdout


def test_extra_arguments_keep_their_quoted_words_whole():
    """A -k expression with spaces reaches pytest as one word (it used to split into three: "-k", "resnet50" and
    "or ..." as paths)."""
    done = suite("--dry-run", "--only", "tests,bench,models", PYTEST_ARGS="-k 'mix or exchange' -x",
                 BENCH_ARGS="--quick", MODELS_ARGS='--quick -k "resnet50 or gpt2_small"')  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--junitxml=" in done.stdout and "cuda-tests.xml -k 'mix or exchange' -x " in done.stdout
    assert "bench.md --quick " in done.stdout
    assert "DeprecationWarning --quick -k 'resnet50 or gpt2_small' " in done.stdout


def test_an_unmatched_quote_in_extra_arguments_exits_2_naming_the_knob():
    done = suite("--dry-run", "--only", "tests", PYTEST_ARGS="-k 'mix")
    assert done.returncode == 2 and "cannot split PYTEST_ARGS into words" in done.stderr, done.stderr
    assert "pytest -m cuda" not in done.stdout


def test_the_default_limits_fit_the_split_runs_into_10_minutes_each():
    done = suite("--dry-run")
    limits = {m[1]: int(m[2]) for m in re.finditer(r"^== (\w+) \(limit (\d+) s\)", done.stdout, re.MULTILINE)}
    assert sorted(limits) == sorted(PHASES) and sorted(p for run in SPLIT for p in run) == sorted(PHASES)
    for run in SPLIT:
        assert sum(limits[p] for p in run) <= 600, (run, limits)
    # the cuda tests (2047 when counted) at the pace of the last GPU run recorded (549 in 150 s), in the README's two
    # parts
    assert limits["tests"] >= 150 * 2047 / 549 / 2


def _collect(*args: str) -> subprocess.CompletedProcess:
    """pytest's collection of this file with ``args``, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/benchmarks/test_gpu_suite.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip


def _collected(*args: str) -> list[str]:
    done = _collect(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.full  # the wiring in a real collection; the default tier keeps the selection's own tests below
def test_the_parts_of_a_selection_run_each_of_its_tests_once():
    """``--part K/N`` (what the README's split runs pass in PYTEST_ARGS): N parts of the selected tests that hold each
    of them once, their sizes within one of each other."""
    whole = _collected("-k", "not junit")
    parts = [_collected("-k", "not junit", "--part", f"{k}/3") for k in (1, 2, 3)]
    assert sorted(test for part in parts for test in part) == sorted(whole)
    assert all(abs(len(part) - len(whole) / 3) < 1 for part in parts), [len(part) for part in parts]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_the_parts_hold_every_selected_test_once_in_turn(n):
    """The selection of ``--part K/N`` on 10 tests: every N-th from the K-th, what it drops reported as deselected."""

    class Config:
        def __init__(self, k):
            self.part, self.dropped = f"{k}/{n}", []
            self.hook = type("Hook", (), {"pytest_deselected": lambda _, items: self.dropped.extend(items)})()

        def getoption(self, name):
            assert name == "--part"
            return self.part

    parts = []
    for k in range(1, n + 1):
        items, config = list(range(10)), Config(k)
        conftest.pytest_collection_modifyitems(config, items)
        assert sorted(items + config.dropped) == list(range(10)) and items == list(range(k - 1, 10, n))
        parts.append(items)
    assert sorted(sum(parts, [])) == list(range(10))


@pytest.mark.parametrize("part", ["0/2", "3/2", "1", "a/b", "1/0", "1/-2"])
def test_a_part_out_of_range_is_refused_naming_it(part):
    with pytest.raises(pytest.UsageError) as refused:
        conftest.parse_part(part)
    assert str(refused.value) == f"--part must be K/N with 1 <= K <= N (whole numbers), got {part!r}"


def test_the_command_line_refuses_a_bad_part_naming_it():
    done = _collect("--part", "3/2")
    assert done.returncode != 0 and "--part must be K/N with 1 <= K <= N (whole numbers), got '3/2'" in done.stderr


@pytest.mark.full  # the script's phase run on CPU; the dry runs above and below test the script's logic
def test_the_models_phase_runs_the_model_benchmark_and_writes_its_tables(tmp_path):
    # quick mode on CPU, one model without the compiled contender (a quoted argument): the phase's two commands from
    # the repository root, as on a GPU machine
    done = suite(str(tmp_path), "--only", "models", MODELS_ARGS="--quick -k cifar_resnet18 '--leave-out=compiled foreach SAM'",
                 timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "models-runs.jsonl").read_text().splitlines()]
    assert {(r["benchmark"], r["model"]) for r in rows} == {("bench_models", "CIFAR ResNet-18")}
    assert {"SAM", "GEAR-SAM", "base optimizer (fused)"} <= {r["contender"] for r in rows}
    assert "compiled foreach SAM" not in {r["contender"] for r in rows}
    tables = (tmp_path / "models.md").read_text()
    assert "### CIFAR ResNet-18 (" in tables and "| SAM | " in tables
    log = (tmp_path / "models.log").read_text()
    assert "1 passed" in log and "== models tables" in log
    assert table((tmp_path / "summary.md").read_text())["models"][0] == "ok"


def test_results_dir_is_the_first_positional_argument_else_a_dated_default(tmp_path):
    days = {datetime.date.today().isoformat()}
    done = suite("--dry-run", "--only", "bench")
    days.add(datetime.date.today().isoformat())  # the test may straddle midnight
    first = done.stdout.splitlines()[0]
    assert any(first.endswith(f"results would go to {ROOT}/benchmarks/results/gpu-{day}") for day in days), first
    relative = suite("here/out/", "--dry-run", "--only", "bench", cwd=tmp_path)  # the caller's directory, not the root
    assert relative.stdout.splitlines()[0].endswith(f"results would go to {tmp_path}/here/out")
    assert f"--results {tmp_path}/here/out/bench-runs.jsonl" in relative.stdout


# the summary writer

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="7">
<testcase classname="tests.test_amp" name="test_a[torch-cuda]" file="tests/test_amp.py" time="0.1"/>
<testcase classname="tests.test_amp" name="test_b[triton-cuda]" file="tests/test_amp.py" time="0.1"/>
<testcase classname="tests.test_kernels" name="test_c" time="0.1"/>
<testcase classname="tests.test_kernels" name="test_d[cpp-cuda]" file="tests/test_kernels.py">
  <failure message="assert 1 == 2">assert 1 == 2</failure></testcase>
<testcase classname="tests.test_kernels" name="test_e" file="tests/test_kernels.py">
  <skipped type="pytest.skip" message="needs a CUDA GPU">skipped</skipped></testcase>
<testcase classname="tests.test_kernels" name="test_f" file="tests/test_kernels.py">
  <skipped type="pytest.xfail" message="known">xfail</skipped></testcase>
<testcase classname="tests.test_optim" name="test_g" file="tests/test_optim.py">
  <error message="failed on setup with RuntimeError">RuntimeError</error></testcase>
</testsuite></testsuites>
"""
HEADER = "run\tphase\tstep\tstatus\tseconds\tlog\tnote\n"


def records(run: str, *phases: tuple[str, list[tuple[str, str, int, str, str]], int | None]) -> str:
    """phases.tsv lines for one run: per phase its steps (name, status, seconds, log, note) and its wall time (None:
    the run stopped inside the phase, so no ``finished`` line)."""
    lines = []
    for phase, steps, seconds in phases:
        lines.append(f"{run}\t{phase}\t-\tstarted\t0\t\t")
        lines += [f"{run}\t{phase}\t{name}\t{status}\t{s}\t{log}\t{note}" for name, status, s, log, note in steps]
        if seconds is not None:
            lines.append(f"{run}\t{phase}\t-\tfinished\t{seconds}\t\t")
    return "\n".join(lines) + "\n"


def table(text: str) -> dict[str, list[str]]:
    """phase -> its cells (status, seconds, run, notes) in the summary's table."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows if cells[0].strip() in PHASES}


def test_junit_counts(tmp_path):
    path = tmp_path / "cuda-tests.xml"
    path.write_text(JUNIT)
    assert summary.junit_counts(path) == {"passed": 3, "failed": 1, "skipped": 2, "errors": 1}
    assert summary.unsuccessful_tests(path) == [
        "tests/test_kernels.py::test_d[cpp-cuda]",
        "tests/test_optim.py::test_g",
    ]
    assert summary.junit_counts(tmp_path / "missing.xml") is None
    (tmp_path / "cut.xml").write_text(JUNIT[:300])  # a run stopped while writing
    assert summary.junit_counts(tmp_path / "cut.xml") is None


def test_phase_statuses_and_test_counts_in_the_summary(tmp_path):
    (tmp_path / "cuda-tests.xml").write_text(JUNIT)
    (tmp_path / "build.log").write_text("")
    (tmp_path / "phases.tsv").write_text(
        HEADER
        + records(
            "R1",
            ("info", [("environment", "ok", 2, "environment.txt", "")], 2),
            ("build", [("pip install", "ok", 40, "build.log", ""),
                       ("CUDA kernels", "FAIL", 1, "build.log", "exit 1")], 41),
            ("tests", [("pytest -m cuda", "FAIL", 150, "cuda-tests.log", "exit 1")], 151),
            ("sanitize", [("kernels --list", "ok", 9, "kernels.txt", ""),
                          ("memcheck", "TIMEOUT", 400, "m.log", "")], 420),
            ("bench", [("run.py", "ok", 300, "bench.log", NOTE)], None),
        )
    )  # fmt: skip
    text = summary.write_summary(tmp_path, tuple(PHASES))
    assert (tmp_path / "summary.md").read_text() == text
    rows = table(text)
    assert list(rows) == PHASES
    assert rows["info"][:3] == ["ok", "2", "R1"]
    assert rows["build"][:2] == ["FAIL", "41"] and "CUDA kernels FAIL 1 s (exit 1)" in rows["build"][3]
    assert "logs: `build.log`" in rows["build"][3]  # the log that exists
    assert rows["tests"][:2] == ["FAIL", "151"] and "3 passed, 1 failed, 2 skipped, 1 errors" in rows["tests"][3]
    assert rows["sanitize"][:2] == ["TIMEOUT", "420"]
    assert rows["bench"][0] == "FAIL" and "did not finish" in rows["bench"][3] and NOTE in rows["bench"][3]
    assert rows["models"] == rows["train"] == ["skipped-not-selected", "", "", ""]
    assert "Tests (`cuda-tests.xml`): 3 passed, 1 failed, 2 skipped, 1 errors." in text
    assert "- tests/test_kernels.py::test_d[cpp-cuda]\n- tests/test_optim.py::test_g" in text


def test_a_second_run_adds_to_the_first_and_replaces_the_phases_it_repeats(tmp_path):
    path = tmp_path / "phases.tsv"
    path.write_text(
        HEADER
        + records(
            "R1",
            ("build", [("pip install", "ok", 40, "build.log", "")], 41),
            ("tests", [("pytest -m cuda", "FAIL", 150, "cuda-tests.log", "exit 1")], 151),
        )
    )
    first = table(summary.render(tmp_path, tuple(PHASES)))
    assert first["tests"][:3] == ["FAIL", "151", "R1"] and first["sanitize"][0] == "skipped-not-selected"
    with path.open("a") as f:
        f.write(
            records(
                "R2",
                ("tests", [("pytest -m cuda", "ok", 140, "cuda-tests.log", "")], 141),
                ("sanitize", [("memcheck", "ok", 60, "m.log", "")], 61),
            )
        )
    second = table(summary.render(tmp_path, tuple(PHASES)))
    assert second["build"][:3] == ["ok", "41", "R1"]
    assert second["tests"][:3] == ["ok", "141", "R2"]
    assert second["sanitize"][:3] == ["ok", "61", "R2"]
    assert [second[p][0] for p in ("info", "bench", "models", "train")] == ["skipped-not-selected"] * 4


def test_runs_split_over_two_invocations_of_the_script_share_one_summary(tmp_path):
    # PHASE_TIMEOUT=0 leaves no time to start a phase's commands: the records and the summary are all that runs
    first = suite(str(tmp_path), "--only", "tests", PHASE_TIMEOUT="0")
    second = suite(str(tmp_path), "--only", "bench,train", PHASE_TIMEOUT="0")
    assert first.returncode == 1 and second.returncode == 1, first.stderr + second.stderr
    lines = (tmp_path / "phases.tsv").read_text().splitlines()
    assert lines[0] == HEADER.strip()
    assert [line.split("\t")[1:4:2] for line in lines[1:] if "\tstarted\t" in line] == [
        ["tests", "started"], ["bench", "started"], ["train", "started"],
    ]  # fmt: skip
    text = (tmp_path / "summary.md").read_text()
    assert text in second.stdout
    rows = table(text)
    statuses = {phase: cells[0] for phase, cells in rows.items()}
    assert statuses == {"info": "skipped-not-selected", "build": "skipped-not-selected", "tests": "TIMEOUT",
                        "sanitize": "skipped-not-selected", "bench": "TIMEOUT", "models": "skipped-not-selected",
                        "train": "TIMEOUT"}  # fmt: skip
    assert "not started: no time left in the phase" in rows["bench"][3]
    assert "no readable cuda-tests.xml" in rows["tests"][3]


# the benchmark suite without pytorch_optimizer


def test_the_benchmarks_skip_pytorch_optimizer_with_a_note_when_it_is_not_installed(tmp_path):
    (tmp_path / "pytorch_optimizer.py").write_text('raise ImportError("not installed, for this test")\n')
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench_sam_step.py", "bench_whole_step.py",
         "bench_train_step.py", "--quick", "--results=", f"--benchmark-storage=file://{tmp_path}/storage",
         "-k", "pytorch_optimizer", "-rs"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path},
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # every pytorch_optimizer benchmark of the three files is skipped, each with the note, and nothing else ran: the
    # training step's (the SAM step's, the whole step's and the SAM family's step the peer in turn with the others)
    assert re.search(r"^\d+ skipped, \d+ deselected in ", done.stdout, re.MULTILINE), done.stdout[-2000:]
    skipped = re.findall(r"^SKIPPED \[\d+\] (\w+)\.py:\d+: (.*)$", done.stdout, re.MULTILINE)
    assert {file for file, _ in skipped} == {"bench_train_step"}
    assert {reason for _, reason in skipped} == {NOTE}
    # the benchmarks that step their contenders in turn leave the peer out of the rounds, every row saying why; the
    # family's GEAR-SAM variants, which the peer lacks, step no yardstick of it either
    results = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench_sam_step.py", "--quick",
         f"--results={results}", f"--benchmark-storage=file://{tmp_path}/storage", "-k",
         "test_sam_step and small or test_family_sam_step and GEAR"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path},
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows and not any(r["contender"].startswith("pytorch_optimizer") for r in rows)
    assert all(r["left_out"]["pytorch_optimizer"] == NOTE and "pytorch_optimizer" not in r["vs"] for r in rows)
    family = [r for r in rows if "variant" in r]
    assert {r["variant"] for r in family} == {"GEAR-SAM", "GEAR-SAM + GSAM"}
    assert not any("pytorch_optimizer" in step for r in family for step in r["stepped_in_turn"])


def test_contenders_and_run_say_when_pytorch_optimizer_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import raises ImportError
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # run.py imports its neighbours by name; sys.path is restored
    neighbours = ("contenders", "report")
    for name in neighbours:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        run = _load("run")
        assert run.peer_notes() == [f"note: {NOTE}"]
        contenders = sys.modules["contenders"]
        assert contenders.not_installed() == {"pytorch_optimizer": NOTE}
        assert "pytorch_optimizer" not in contenders.available("cpu")
        assert "per-tensor loop" in contenders.available("cpu")
    finally:
        for name in neighbours:  # the benchmarks' modules, imported by plain name, leave with their folder
            sys.modules.pop(name, None)

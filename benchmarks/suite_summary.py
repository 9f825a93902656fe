"""The summary of ``gpu_suite.sh``, and the environment record of its ``info`` phase.

    python benchmarks/suite_summary.py summary RESULTS_DIR [--phases info,build,...]   write and print summary.md
    python benchmarks/suite_summary.py environment        print the GPU, driver and versions (exit 1 without a GPU)

``gpu_suite.sh`` appends to ``RESULTS_DIR/phases.tsv``, one tab-separated line per event under a header line:

    run  phase  step  status  seconds  log  note

A phase is framed by a ``started`` and a ``finished`` line (``step`` is ``-``; ``seconds`` of ``finished`` is the
phase's wall time); in between, each command of the phase adds a line with status ``ok``, ``FAIL`` or ``TIMEOUT``.
Runs into the same folder append to the file, so a phase's result is the lines after its last ``started``: a later
run of a phase replaces its earlier result, and phases split over several runs end up in one summary. Only the
standard library is imported, except by ``environment``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("info", "build", "tests", "sanitize", "bench", "models", "train")
RECORDS = "phases.tsv"
FIELDS = ("run", "phase", "step", "status", "seconds", "log", "note")
JUNIT = "cuda-tests.xml"
SUMMARY = "summary.md"
NOT_SELECTED = "skipped-not-selected"
MAX_LISTED_FAILURES = 20


@dataclass
class Step:
    name: str
    status: str
    seconds: int
    log: str
    note: str


@dataclass
class PhaseResult:
    name: str
    status: str  # ok, FAIL, TIMEOUT or skipped-not-selected
    seconds: int | None = None
    run: str = ""
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_records(path: Path) -> list[dict[str, str]]:
    """The lines of a records file as dicts keyed by ``FIELDS`` (header and blank lines left out); [] if absent."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        values = line.split("\t")
        if not line.strip() or values[0] == FIELDS[0]:
            continue
        values += [""] * (len(FIELDS) - len(values))  # a note left empty may lose its trailing tab
        records.append(dict(zip(FIELDS, values)))
    return records


def _seconds(text: str) -> int:
    return int(text) if text.strip().isdigit() else 0


def phase_result(name: str, records: list[dict[str, str]]) -> PhaseResult:
    """The result of phase ``name``'s newest run among ``records``: skipped-not-selected when it never started."""
    mine = [r for r in records if r["phase"] == name]
    starts = [i for i, r in enumerate(mine) if r["status"] == "started"]
    if not starts:
        return PhaseResult(name, NOT_SELECTED)
    newest = mine[starts[-1] :]
    steps = [
        Step(r["step"], r["status"], _seconds(r["seconds"]), r["log"], r["note"])
        for r in newest
        if r["status"] not in ("started", "finished")
    ]
    finished = [r for r in newest if r["status"] == "finished"]
    result = PhaseResult(name, "ok", run=newest[0]["run"], steps=steps)
    if finished:
        result.seconds = _seconds(finished[-1]["seconds"])
    else:
        result.seconds = sum(s.seconds for s in steps)
        result.notes.append("did not finish: the run was stopped during this phase")
    statuses = {s.status for s in steps}
    if "FAIL" in statuses or not finished:
        result.status = "FAIL"
    elif "TIMEOUT" in statuses:
        result.status = "TIMEOUT"
    return result


def junit_counts(path: Path) -> dict[str, int] | None:
    """``{"passed", "failed", "skipped", "errors"}`` counted over the test cases of a JUnit XML file, or None when
    the file is missing or not XML. A case with an error counts as an error even if it also failed."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for case in root.iter("testcase"):
        counts[_outcome(case)] += 1
    return counts


def _outcome(case: ET.Element) -> str:
    if case.find("error") is not None:
        return "errors"
    if case.find("failure") is not None:
        return "failed"
    if case.find("skipped") is not None:
        return "skipped"
    return "passed"


def unsuccessful_tests(path: Path) -> list[str]:
    """``file::name`` of each failed or erroring test case of a JUnit XML file, in file order ([] if unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    names = []
    for case in root.iter("testcase"):
        if _outcome(case) in ("failed", "errors"):
            where = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            names.append(f"{where}::{case.get('name', '?')}")
    return names


def format_counts(counts: dict[str, int]) -> str:
    """``"N passed, N failed, N skipped, N errors"``."""
    return ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped", "errors"))


def collect(results_dir: Path, phases: tuple[str, ...] = PHASES) -> list[PhaseResult]:
    """One result per phase, in ``phases`` order, with the test counts added to the tests phase's notes."""
    records = read_records(results_dir / RECORDS)
    results = [phase_result(name, records) for name in phases]
    for result in results:
        if result.name == "tests" and result.status != NOT_SELECTED:
            counts = junit_counts(results_dir / JUNIT)
            result.notes.append(format_counts(counts) if counts is not None else f"no readable {JUNIT}")
    return results


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _steps_cell(result: PhaseResult, results_dir: Path) -> str:
    parts = [f"{s.name} {s.status} {s.seconds} s" + (f" ({s.note})" if s.note else "") for s in result.steps]
    logs = sorted({s.log for s in result.steps if s.log and (results_dir / s.log).exists()})
    if logs:
        parts.append("logs: " + ", ".join(f"`{log}`" for log in logs))
    return _cell("; ".join(result.notes + parts))


def render(results_dir: Path, phases: tuple[str, ...] = PHASES) -> str:
    """The Markdown summary of the phases recorded in ``results_dir`` so far."""
    results = collect(results_dir, phases)
    runs = sorted({r.run for r in results if r.run})
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# gpu_suite.sh summary",
        "",
        f"Results in `{results_dir}`, summarised {now} from `{RECORDS}`"
        + (f" (runs started {', '.join(runs)})." if runs else " (no phase has run yet)."),
        "",
        "| phase | status | seconds | run | steps and notes |",
        "|---|---|---:|---|---|",
    ]
    for r in results:
        seconds = "" if r.seconds is None else str(r.seconds)
        lines.append(f"| {r.name} | {r.status} | {seconds} | {r.run} | {_steps_cell(r, results_dir)} |")
    tests = next((r for r in results if r.name == "tests"), None)
    if tests is not None and tests.status != NOT_SELECTED:
        counts = junit_counts(results_dir / JUNIT)
        lines += [
            "",
            f"Tests (`{JUNIT}`): " + (format_counts(counts) if counts is not None else "no readable file") + ".",
        ]
        failing = unsuccessful_tests(results_dir / JUNIT)
        lines += [f"- {name}" for name in failing[:MAX_LISTED_FAILURES]]
        if len(failing) > MAX_LISTED_FAILURES:
            lines.append(f"- ... and {len(failing) - MAX_LISTED_FAILURES} more")
    return "\n".join(lines) + "\n"


def write_summary(results_dir: Path, phases: tuple[str, ...] = PHASES) -> str:
    """Writes ``results_dir/summary.md``; returns its text."""
    text = render(results_dir, phases)
    (results_dir / SUMMARY).write_text(text, encoding="utf-8")
    return text


def _output_line(command: list[str], containing: str = "") -> str | None:
    """The first non-empty output line of ``command`` that contains ``containing``, or None when there is none or
    the command cannot run or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip() and containing in line]
    return lines[0] if done.returncode == 0 and lines else None


def cuda_tool(name: str) -> str | None:
    """Path of a CUDA toolkit program (nvcc, compute-sanitizer): PATH, then $CUDA_HOME/bin, then /usr/local/cuda."""
    for candidate in (
        shutil.which(name),
        *(os.path.join(d, "bin", name) for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if d),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def environment() -> tuple[list[str], bool]:
    """Lines describing the machine and the software the suite runs with, and whether torch sees a CUDA GPU."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    commit = _output_line(["git", "rev-parse", "--short", "HEAD"])
    dirty = _output_line(["git", "status", "--porcelain", "--untracked-files=no"])
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"commit: {commit or 'unknown'}{' with local changes' if dirty else ''}",
        f"python: {platform.python_version()} ({sys.executable})",
        f"torch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
        f"triton: {triton_version}",
    ]
    has_gpu = torch.cuda.is_available()
    if has_gpu:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                f"gpu {i}: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, "
                f"compute capability {p.major}.{p.minor}"
            )
    else:
        lines.append("gpu: none (torch.cuda.is_available() is False)")
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    lines.append(f"driver: {_output_line(smi) or 'unknown (nvidia-smi did not answer)'}")
    nvcc = cuda_tool("nvcc")
    lines.append(f"nvcc: {(_output_line([nvcc, '--version'], 'release') if nvcc else None) or 'not found'}")
    lines.append(f"compute-sanitizer: {cuda_tool('compute-sanitizer') or 'not found'}")
    lines.append(f"pytorch_optimizer: {_peer_version('pytorch_optimizer')}")
    return lines, has_gpu


def _peer_version(name: str) -> str:
    if importlib.util.find_spec(name) is None:
        return "not installed (the benchmarks skip its contender)"
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "importable, version unknown"


def main(argv: list[str] | None = None) -> int:
    """Runs a subcommand; returns the exit status (environment: 1 when torch sees no CUDA GPU)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help=f"write RESULTS_DIR/{SUMMARY} from {RECORDS} and {JUNIT}, and print it")
    summary.add_argument("results_dir", type=Path)
    summary.add_argument("--phases", default=",".join(PHASES), help="the suite's phases, in order, comma-separated")
    sub.add_parser("environment", help="print the GPU, driver, python, torch, CUDA, triton and nvcc versions")
    args = parser.parse_args(argv)
    if args.command == "environment":
        lines, has_gpu = environment()
        print("\n".join(lines))
        return 0 if has_gpu else 1
    phases = tuple(p for p in args.phases.replace(" ", ",").split(",") if p)
    print(write_summary(args.results_dir, phases), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

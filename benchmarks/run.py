"""The benchmark suite in one command: run every benchmark, append the rows to the results file, print the report.

    python benchmarks/run.py              full run (CPU: over an hour on 2 cores; the two sets of
                                          about 2000 tensors took 52 minutes alone, most of it
                                          compiling the compiled rows)
    python benchmarks/run.py --quick      smoke run, small sets and few rounds (under two minutes on CPU)
    python benchmarks/run.py --results PATH    append to PATH instead of benchmarks/results/runs.jsonl
    python benchmarks/run.py --report PATH     also write the report (Markdown) to PATH

A peer contender that is not installed (``pytorch_optimizer``) is skipped, and the run says so before the pytest
output and under the report. Then ``python benchmarks/report.py`` renders any run again (``--run ID``). A full run
into ``benchmarks/results/runs.jsonl`` also renders the reports of ``benchmarks/results/`` again
(``report.py --reports``): its machine's report gets a section with the run's tables, for its note to be written.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import DEFAULT_RESULTS, load_runs, render, write_reports  # noqa: E402 (found through the path set just above)


def peer_notes() -> list[str]:
    """One note per peer contender that is not installed here (its benchmarks are skipped); empty when none is."""
    from contenders import not_installed  # imports torch: only when a run starts

    return [f"note: {note}" for note in not_installed().values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the gearsam_fused benchmark suite")
    parser.add_argument("--quick", action="store_true", help="small sets and few rounds")
    parser.add_argument("--results", default=str(DEFAULT_RESULTS), help="JSONL file to append the rows to")
    parser.add_argument("--report", help="also write the rendered report (Markdown) to this file")
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = parser.parse_args(argv)
    results = Path(args.results).resolve()
    known = set(load_runs(results)) if results.exists() else set()
    # pytest-benchmark's own tables and store are not the report: they stay quiet, the store in a temporary folder
    # (never in the source tree), and pytest's output is shown only when a benchmark fails
    storage = tempfile.mkdtemp(prefix="gearsam-bench-")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "bench_sam_step.py"),
               str(HERE / "bench_whole_step.py"), str(HERE / "bench_skipped_step.py"),
               str(HERE / "bench_momentum_step.py"), str(HERE / "bench_train_step.py"), str(HERE / "bench_trainer.py"),
               f"--results={results}", "--benchmark-quiet", f"--benchmark-storage=file://{storage}",
               "-W", "ignore::DeprecationWarning",
               "--benchmark-disable-gc", *(["--quick"] if args.quick else []), *args.pytest_args]  # fmt: skip
    notes = peer_notes()
    for note in notes:
        print(note, flush=True)
    print(f"running the benchmark suite{' (quick)' if args.quick else ''}; its report follows", flush=True)
    done = subprocess.run(command, cwd=HERE, check=False, capture_output=True, text=True)
    shutil.rmtree(storage, ignore_errors=True)
    if done.returncode != 0:
        print(done.stdout[-20000:] + done.stderr[-5000:], file=sys.stderr)
        return done.returncode
    new = [rows for run, rows in load_runs(results).items() if run not in known]
    if not new:
        print(f"no rows were added to {results}", file=sys.stderr)
        return 1
    report = "\n".join([render(new[-1], str(results)), *notes])
    print(report)
    if args.report:
        Path(args.report).write_text(report + "\n", encoding="utf-8")
    if results == DEFAULT_RESULTS and not args.quick:  # the committed record: its machine's report follows it
        for path in write_reports(results.parent):
            print(f"rendered {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

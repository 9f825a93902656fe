"""Line and branch coverage of the library (``gearsam_fused/``, ``triton_kernels/``) under the default tier and the full
tier, compared: what the default tier leaves out must cost no coverage.

    python tests/quality/coverage_tiers.py                      # runs both tiers under coverage, then compares
    python tests/quality/coverage_tiers.py --full-data PATH     # reuses a full tier's combined data file
    python tests/quality/coverage_tiers.py tests/library        # both tiers of part of the suite

Needs ``coverage`` (the settings are ``pyproject.toml``'s: branches, every subprocess and gloo rank measured). Writes
``tests/quality/coverage.md``: each tier's totals, and every file and line the full tier reaches and the default tier
does not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("coverage.md")


def run_tier(tier: str, data_dir: Path, paths: list[str]) -> tuple[Path, float]:
    """The tier's tests in ``paths`` under coverage; returns the combined data file and the minutes the run took."""
    data = data_dir / ".coverage"
    env = dict(os.environ, COVERAGE_FILE=str(data))
    # as the README runs the tests, over the cores: coverage measures the workers as it measures any subprocess
    pytest = ["pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--dist", "loadfile", *paths]
    command = [sys.executable, "-m", "coverage", "run", "-m", *pytest]
    start = time.perf_counter()
    done = subprocess.run(command + (["--full"] if tier == "full" else []), cwd=ROOT, env=env)
    minutes = (time.perf_counter() - start) / 60
    if done.returncode != 0:
        raise SystemExit(f"the {tier} tier failed under coverage (exit {done.returncode})")
    combine(data)
    return data, minutes


def combine(data: Path) -> None:
    """Merges the per-process files beside ``data`` into it (a no-op where that was done)."""
    parts = [str(p) for p in data.parent.glob(data.name + ".*")]
    if parts:
        subprocess.run(
            [sys.executable, "-m", "coverage", "combine", f"--data-file={data}", *parts], cwd=ROOT, check=True
        )


def files_of(data: Path) -> dict[str, dict]:
    """Per file (from the package's folder on), the lines and branches run and missed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "coverage.json"
        subprocess.run(
            [sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", str(report), "-q"],
            cwd=ROOT,
            check=True,
        )
        files = json.loads(report.read_text())["files"]
    return {package_path(name): f for name, f in files.items()}


def package_path(name: str) -> str:
    """``.../gearsam_fused/x.py`` -> ``gearsam_fused/x.py``: the same key for data made in any checkout."""
    parts = Path(name).parts
    start = next(i for i, part in enumerate(parts) if part in ("gearsam_fused", "triton_kernels"))
    return "/".join(parts[start:])


def totals(files: dict[str, dict]) -> dict[str, int]:
    keys = ("covered_lines", "num_statements", "covered_branches", "num_branches")
    return {k: sum(f["summary"][k] for f in files.values()) for k in keys}


def percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 100.0


def gaps(default: dict[str, dict], full: dict[str, dict]) -> list[tuple[str, list[int], list]]:
    """(file, lines, branches) that the full tier runs and the default tier does not."""
    out = []
    for name in sorted(full):
        mine = default.get(name, {"executed_lines": [], "executed_branches": []})
        lines = sorted(set(full[name]["executed_lines"]) - set(mine["executed_lines"]))
        branches = sorted(
            {tuple(b) for b in full[name]["executed_branches"]} - {tuple(b) for b in mine["executed_branches"]}
        )
        if lines or branches:
            out.append((name, lines, branches))
    return out


def render(default: dict, full: dict, minutes: dict[str, float | None], arguments: str) -> str:
    d, f = totals(default), totals(full)
    rows = []
    for tier, t in (("default", d), ("full", f)):
        took = f"{minutes[tier]:.1f}" if minutes.get(tier) is not None else "-"
        rows.append(
            f"| {tier} | {t['covered_lines']} / {t['num_statements']} | "
            f"{percent(t['covered_lines'], t['num_statements']):.2f}% | {t['covered_branches']} / {t['num_branches']} "
            f"| {percent(t['covered_branches'], t['num_branches']):.2f}% | {took} |"
        )
    line_gap = percent(f["covered_lines"], f["num_statements"]) - percent(d["covered_lines"], d["num_statements"])
    branch_gap = percent(f["covered_branches"], f["num_branches"]) - percent(d["covered_branches"], d["num_branches"])
    missing = gaps(default, full)
    detail = [f"- `{name}`: lines {lines or '-'}; branches {branches or '-'}" for name, lines, branches in missing]
    return "\n".join(
        [
            "# Coverage of the default tier against the full tier",
            "",
            f"{datetime.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}, commit {commit()}.",
            f"Made by `python tests/quality/coverage_tiers.py{arguments}` (coverage.py, branch coverage of "
            "`gearsam_fused/` and `triton_kernels/`, subprocesses and gloo ranks included; no GPU here, so the "
            "CUDA-only code is missed by both tiers alike).",
            "",
            "| tier | lines | line coverage | branches | branch coverage | minutes under coverage |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"The full tier's line coverage is {line_gap:+.2f} points and its branch coverage {branch_gap:+.2f} points "
            "above the default tier's.",
            "",
            "## Reached by the full tier only",
            "",
            *(detail or ["Nothing: every line and branch the full tier runs, the default tier runs."]),
            "",
        ]
    )


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tests"], help="the tests to run (default: all of tests/)")
    parser.add_argument("--full-data", type=Path, help="a combined coverage data file of the full tier to reuse")
    parser.add_argument("--default-data", type=Path, help="a combined coverage data file of the default tier to reuse")
    parser.add_argument(
        "--full-minutes", type=float, help="the minutes the reused full tier's run took, for the report"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the report goes (default: {OUT.name} here)")
    args = parser.parse_args(argv)
    minutes: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = {}
        for tier, given in (("default", args.default_data), ("full", args.full_data)):
            if given is not None:
                combine(given.resolve())
                data[tier], minutes[tier] = given.resolve(), args.full_minutes if tier == "full" else None
            else:
                (Path(tmp) / tier).mkdir()
                data[tier], minutes[tier] = run_tier(tier, Path(tmp) / tier, args.paths)
        arguments = "".join(f" {p}" for p in args.paths if p != "tests") + "".join(
            f" --{t}-data PATH" for t, g in (("full", args.full_data), ("default", args.default_data)) if g
        )
        text = render(files_of(data["default"]), files_of(data["full"]), minutes, arguments)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

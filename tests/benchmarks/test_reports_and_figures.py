"""The committed record and what is drawn from it: each machine's report in benchmarks/results/ is what its rows
render, every full run is in one, every run the documentation cites is in the rows, and ``report.py --figures``
writes the figures it promises from the rows they name, or stops when those rows are missing. No torch: the renderer
and the figures read JSON only."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _load(name: str):
    """A module of benchmarks/ under a name of its own; the folder goes on the import path, where report.py finds
    figures.py and figures.py finds report."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_record_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


report = _load("report")
figures = _load("figures")

RUN_ID = re.compile(r"`([0-9a-f]{12})`")


# ------------------------------------------------------------------------------ the committed record


def test_every_machine_report_is_what_its_rows_render():
    stale = report.write_reports(RESULTS, check=True)
    assert not stale, f"run `python benchmarks/report.py --reports`: {[p.name for p in stale]}"


def test_every_full_run_is_in_its_machines_report_and_the_record_has_one_report_per_machine():
    results = report.load_results(RESULTS)
    kinds = {report.machine_kind(rows[0]) for rows, _ in results.values() if not rows[0]["quick"]}
    assert {p.stem for p in RESULTS.glob("*.md")} == kinds
    for run, (rows, _) in results.items():
        if not rows[0]["quick"]:
            assert run in (RESULTS / f"{report.machine_kind(rows[0])}.md").read_text(encoding="utf-8"), run


def test_every_run_the_documentation_cites_is_in_the_rows():
    runs = set(report.load_results(RESULTS))
    pages = [ROOT / "README.md", BENCHMARKS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        cited = set(RUN_ID.findall(page.read_text(encoding="utf-8")))
        assert cited <= runs, (page.name, sorted(cited - runs))


def test_the_figures_are_committed_small_and_shown():
    performance = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for figure in figures.FIGURES:
        path = figures.FIGURES_DIR / f"{figure.name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        assert path.stat().st_size < 300_000, (path.name, path.stat().st_size)
        assert f"](figures/{figure.name}.png)" in performance, figure.name
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Performance\n") :].split("\n## ", 1)[0]
    (shown,) = re.findall(r"!\[[^]]*\]\((docs/figures/[\w-]+\.png)\)", section)  # one figure, from the docs
    assert (ROOT / shown).is_file() and section.rstrip().endswith("(docs/performance.md).")


def test_machine_kinds_are_named_from_the_rows():
    def row(cpu="AMD EPYC", gpu=None):
        return {"cpu": cpu, "gpu": gpu, "cpu_count": 2}

    assert report.machine_kind(row()) == "cpu-amd-epyc"
    assert report.machine_kind(row("Intel(R) Xeon(R) Processor")) == "cpu-intel-xeon"
    assert report.machine_kind(row(gpu="NVIDIA H100 80GB HBM3")) == "gpu-h100"
    assert report.machine_kind(row(gpu="NVIDIA H200")) == "gpu-h200"
    assert report.machine_title(row("Intel(R) Xeon(R) Processor")) == "Intel Xeon, 2 cores"


# ------------------------------------------------------------------------------ made-up rows

MACHINE = {"date": "2026-01-02", "commit": "abc1234", "torch": "2.13.0", "triton": "3.9.0", "quick": False}


def _machine(gpu: bool) -> dict:
    if gpu:
        return {**MACHINE, "device": "cuda", "gpu": "NVIDIA H200", "cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 16}
    return {**MACHINE, "device": "cpu", "gpu": None, "cpu": "AMD EPYC", "cpu_count": 2}


def _whole_step(run: str, gpu: bool, name: str, base: str, contender: str, ms: float) -> dict:
    parameters = 1_000_000
    counted = (40 if base == "SGD" else 48) * parameters
    return {
        **_machine(gpu), "run": run, "benchmark": "bench_whole_step", "set": name, "base": base,
        "contender": contender, "median_ms": ms, "q1_ms": ms * 0.9, "q3_ms": ms * 1.1, "parameters": parameters,
        "tensors": 10, "bytes_counted": counted, "gbps": counted / ms / 1e6, "floor_gbps": 100.0, "floor_kind": "copy",
        **({"cuda_event_median_ms": ms * 0.8} if gpu else {}),
    }  # fmt: skip


def _model_step(run: str, model: str, contender: str) -> dict:
    return {
        **_machine(True), "run": run, "benchmark": "bench_models", "model": model, "base": "SGD", "tiny": False,
        "contender": contender, "median_ms": 70.0, "q1_ms": 69.0, "q3_ms": 71.0, "over_plain": 1.9,
        "over_plain_q1": 1.85, "over_plain_q3": 1.95, "beyond_ms": 0.5, "beyond_q1_ms": 0.1, "beyond_q3_ms": 0.9,
    }  # fmt: skip


def promised_rows() -> list[dict]:
    """Rows for every run and set that figures.FIGURES names: our step and each contender, twice as slow and more."""
    rows, seen = [], set()
    for figure in figures.FIGURES:
        gpu = "gpu" in figure.name
        for run, sets in figure.sources:
            if (run, sets) in seen:
                continue
            seen.add((run, sets))
            if figure.kind == "sam_tax":
                rows += [
                    _model_step(run, m, c) for m in ("ResNet-50", "GPT-2 small") for c in ("per-tensor loop SAM", "SAM")
                ]
                continue
            for name in sets or ("set a", "set b"):
                for base in figures.BASES:
                    for i, contender in enumerate(("cpp", *figures.CONTENDERS)):
                        rows.append(_whole_step(run, gpu, name, base, contender, 1.0 + i))
    return rows


def _results(tmp_path: Path, rows: list[dict]) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return folder


# ------------------------------------------------------------------------------ the figures


def test_report_figures_writes_every_figure_it_promises(tmp_path):
    results, out = _results(tmp_path, promised_rows()), tmp_path / "figures"
    assert report.main(["--figures", "--results-dir", str(results), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{f.name}.png" for f in figures.FIGURES)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in out.iterdir())


def test_a_speed_up_of_contenders_stepped_in_turn_is_the_median_of_per_round_ratios_with_its_quartiles():
    """Where the rows carry the ratios of the same rounds (``vs``), the figure draws those medians and quartiles; rows
    of runs before, the ratio of two medians, without a spread."""
    old = {c: _whole_step("aaaaaaaaaaaa", False, "set a", "SGD", c, ms)
           for c, ms in (("cpp", 2.0), ("pytorch_optimizer", 9.0), ("pytorch_optimizer, per tensor", 6.0))}  # fmt: skip
    assert figures._speedup_of(old, "pytorch_optimizer") == (3.0, 3.0, 3.0)  # its faster path, 6 / 2
    assert figures._speedup_of(old, figures.COMPILED) is None
    stats = {"median": 2.5, "q1": 2.2, "q3": 2.9, "low": 2.0, "high": 3.1}
    new = {**old, "cpp": {**old["cpp"], "vs": {"pytorch_optimizer": stats}}}
    assert figures._speedup_of(new, "pytorch_optimizer") == (2.5, 2.2, 2.9)
    assert figures._speedup_of(new, "per-tensor loop") is None


@pytest.mark.parametrize("missing", ["run", "set", "our row"])
def test_a_figure_whose_source_rows_are_missing_stops_before_writing_any(tmp_path, missing):
    figure = figures.FIGURES[0]
    run, _ = figure.sources[0]
    # the first figure's run with its sets named, as a figure may name the sets it takes from a run
    named = (figures.Figure(figure.name, figure.kind, ((run, ("set a", "set b")),)), *figures.FIGURES[1:])
    rows = promised_rows()  # its run's rows hold "set a" and "set b"
    if missing == "run":
        rows = [r for r in rows if r["run"] != run]
    elif missing == "set":
        rows = [r for r in rows if not (r["run"] == run and r.get("set") == "set a")]
    else:
        rows = [r for r in rows if not (r["run"] == run and r["contender"] == figures.OURS)]
    results, out = _results(tmp_path, rows), tmp_path / "figures"
    with pytest.raises(SystemExit, match=f"figure {figure.name}: .*"):
        figures.draw(report.load_results(results), out, named)
    if missing != "set":  # the command draws the figures as they are named, and stops as well
        with pytest.raises(SystemExit, match=f"figure {figure.name}: .*"):
            report.main(["--figures", "--results-dir", str(results), "--out", str(out)])
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------ the per-machine reports


def test_reports_render_their_blocks_again_keep_the_prose_and_add_new_full_runs(tmp_path):
    rows = [
        _whole_step("aaaaaaaaaaaa", False, "set a", "SGD", c, 1.0 + i) for i, c in enumerate(("cpp", "per-tensor loop"))
    ]
    rows += [{**r, "run": "bbbbbbbbbbbb"} for r in rows] + [{**r, "run": "cccccccccccc", "quick": True} for r in rows]
    results = _results(tmp_path, rows)
    prose = "# AMD EPYC, 2 cores\n\nWhy run `aaaaaaaaaaaa` was made.\n\n"
    path = results / "cpu-amd-epyc.md"
    path.write_text(prose + "<!-- report.py: run aaaaaaaaaaaa -->\nstale\n<!-- /report.py -->\n", encoding="utf-8")
    assert report.write_reports(results, check=True) == [path]
    assert report.write_reports(results) == [path]
    text = path.read_text(encoding="utf-8")
    assert text.startswith(prose) and "stale" not in text
    assert "**Whole step, SGD, set a**" in text and "(run `aaaaaaaaaaaa`)" in text
    assert "## Run `bbbbbbbbbbbb`, 2026-01-02" in text and "<!-- report.py: run bbbbbbbbbbbb -->" in text
    assert "cccccccccccc" not in text  # a quick run is a smoke test, not the record
    assert report.write_reports(results, check=True) == []  # rendering again changes nothing

    path.write_text(prose + "<!-- report.py: run dddddddddddd -->\n<!-- /report.py -->\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="renders run dddddddddddd, which no results file holds"):
        report.write_reports(results)

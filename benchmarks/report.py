"""Render the rows of a results file (JSONL, one row per benchmark, appended by every run) as Markdown.

    python benchmarks/report.py [RESULTS.jsonl] [--run ID] [--device cpu|cuda]

Without ``--run`` it renders the newest full (non-quick) run for the device, or the newest run of any kind if there
is no full one. Ratios are the headline: each fused contender against the per-tensor loop and against
pytorch_optimizer, measured in the same run, and for the whole step (SAM with its base optimizer's update) against the
base optimizer's step alone.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from gearsam_fused.allocation import GEAR_RULE, SAM_RULE

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "runs.jsonl"


def load_runs(path: Path) -> dict[str, list[dict]]:
    """run id -> its rows, in file order (oldest run first)."""
    runs: dict[str, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            runs.setdefault(row["run"], []).append(row)
    return runs


def pick_run(runs: dict[str, list[dict]], run: str | None = None, device: str | None = None) -> list[dict]:
    if run is not None:
        if run not in runs:
            raise SystemExit(f"no run {run!r} in the results; runs: {', '.join(runs)}")
        return runs[run]
    candidates = [rows for rows in runs.values() if device is None or rows[0]["device"] == device]
    if not candidates:
        raise SystemExit(f"no run on {device} in the results")
    full = [rows for rows in candidates if not rows[0]["quick"]]
    return (full or candidates)[-1]


def _where(row: dict) -> str:
    place = row["gpu"] or f"CPU {row['cpu']} ({row['cpu_count']} cores)"
    return (
        f"{place}, {row['date']}, commit {row['commit']}, torch {row['torch']}, triton {row['triton']}"
        f"{', quick mode' if row['quick'] else ''} (run `{row['run']}`)"
    )


def _ratio(baseline: float | None, value: float) -> str:
    return f"{baseline / value:.2f}x" if baseline else "-"


def sam_step_tables(rows: list[dict]) -> list[str]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == "bench_sam_step":
            # rows written before the rule was named "gear-sam" call it "gear"
            groups[(row["set"], {"gear": GEAR_RULE}.get(row["rule"], row["rule"]))].append(row)
    lines = []
    for (name, rule), group in groups.items():
        first = group[0]
        # GEAR-SAM has no peer implementation: its ratios are against the per-tensor loops' SAM step of the same run.
        sam = {r["contender"]: r["median_ms"] for r in groups.get((name, "sam"), [])}
        loop, peer = sam.get("per-tensor loop"), sam.get("pytorch_optimizer")
        lines += [
            f"**{'SAM' if rule == SAM_RULE else 'GEAR-SAM'} step, {name}** ({first['parameters'] / 1e6:.1f}M parameters in "
            f"{first['tensors']} tensors; copy bandwidth {first['copy_gbps']:.0f} GB/s)",
            "",
            "| contender | median ms | IQR ms | vs per-tensor loop SAM | vs pytorch_optimizer SAM | GB/s | % of copy | launches | held MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            lines.append(
                f"| {r['contender']} | {r['median_ms']:.3f} | {r['q3_ms'] - r['q1_ms']:.3f} | {_ratio(loop, r['median_ms'])} | "
                f"{_ratio(peer, r['median_ms'])} | {r['gbps']:.1f} | {r['pct_copy']:.0f} | {r.get('launches', '-')} | "
                f"{r['held_bytes'] / 2**20:.1f} |"
            )
        lines.append("")
    return lines


def whole_step_tables(rows: list[dict]) -> list[str]:
    """Per (set, base optimizer): every contender's whole step (SAM and the base optimizer's update), against the
    per-tensor implementations and against the base optimizer's step alone."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == "bench_whole_step":
            groups[(row["set"], row["base"])].append(row)
    lines = []
    for (name, base), group in groups.items():
        first = group[0]
        by = {r["contender"]: r["median_ms"] for r in group}
        loop, peer, bare = by.get("per-tensor loop"), by.get("pytorch_optimizer"), by.get("bare base step")
        lines += [
            f"**Whole step, {base}, {name}** ({first['parameters'] / 1e6:.1f}M parameters in {first['tensors']} "
            f"tensors; {first['bytes_counted'] // first['parameters']} bytes counted per parameter; copy bandwidth "
            f"{first['copy_gbps']:.0f} GB/s)",
            "",
            "| contender | median ms | IQR ms | vs per-tensor loop | vs pytorch_optimizer | / bare base step | GB/s | % of copy | launches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            over_bare = f"{r['median_ms'] / bare:.2f}x" if bare else "-"
            lines.append(
                f"| {r['contender']} | {r['median_ms']:.3f} | {r['q3_ms'] - r['q1_ms']:.3f} | {_ratio(loop, r['median_ms'])} | "
                f"{_ratio(peer, r['median_ms'])} | {over_bare} | {r['gbps']:.1f} | {r['pct_copy']:.0f} | "
                f"{r.get('launches', '-')} |"
            )
        lines.append("")
    if lines:
        lines += [
            "Whole step = `first_step` + `second_step` with the base optimizer's update. \"vs\" columns: the other's median "
            "over this one's (above 1x: this one is faster); \"/ bare base step\": this median over the base optimizer's "
            "step alone (`foreach=True`, no SAM). GB/s from the counted bytes (SGD 40, AdamW 48 per parameter).",
            "",
        ]
    return lines


def trainer_tables(rows: list[dict]) -> list[str]:
    """The trainers' optimizer steps, plain and with SAM, on the same GPT-2: Hugging Face's, then Lightning's."""
    lines = []
    for title, test, plain_name in (("Hugging Face Trainer step", "test_trainer_step", "Trainer"),
                                    ("Lightning step", "test_lightning_step", "LightningModule")):  # fmt: skip
        steps = [r for r in rows if r["benchmark"] == "bench_trainer" and r["test"].startswith(test)]
        if steps:
            lines += _trainer_table(title, steps, plain_name)
    return lines


def _trainer_table(title: str, steps: list[dict], plain_name: str) -> list[str]:
    plain = next((r["step_ms"] for r in steps if r["contender"] == plain_name), None)
    first = steps[0]
    lines = [
        f"**{title}** (GPT-2 of {first['parameters'] / 1e6:.2f}M parameters, {first['micro_batches']} "
        f"micro-batches of {first['batch']} x {first['seq']} tokens per step, AdamW, max_grad_norm 1.0"
        f"{', bf16' if first['bf16'] else ''}; {first['steps']} steps per round)",
        "",
        f"| contender | ms per step | / {plain_name} |",
        "|---|---:|---:|",
    ]
    for r in steps:
        lines.append(f"| {r['contender']} | {r['step_ms']:.1f} | {r['step_ms'] / plain:.2f}x |" if plain else
                     f"| {r['contender']} | {r['step_ms']:.1f} | - |")  # fmt: skip
    note = ("SAM runs the forward and backward passes twice per step; the data loading, clipping, optimizer step and "
            "the trainer's own work run once.")  # fmt: skip
    return lines + ["", note, ""]


def train_step_table(rows: list[dict]) -> list[str]:
    steps = [r for r in rows if r["benchmark"] == "bench_train_step"]
    if not steps:
        return []
    by = {r["contender"]: r["median_ms"] for r in steps}
    first = steps[0]
    lines = [
        f"**Training step, CIFAR ResNet-18 width {first['width']}, batch {first['batch']}** "
        f"(autocast {first['autocast']}, channels_last {first['channels_last']})",
        "",
        "| row | median ms | IQR ms | SAM tax ms | SAM tax % of step |",
        "|---|---:|---:|---:|---:|",
    ]
    parts = by.get("forward+backward"), by.get("base step")
    for r in steps:
        if r["contender"] not in ("forward+backward", "base step", "SGD") and None not in parts:
            t = r["median_ms"] - 2 * parts[0] - parts[1]
            tax = f"{t:.2f} | {100 * t / r['median_ms']:.1f}"
        else:
            tax = " | "
        lines.append(f"| {r['contender']} | {r['median_ms']:.2f} | {r['q3_ms'] - r['q1_ms']:.2f} | {tax} |")
    lines += ["", "SAM tax = step - 2 x (forward+backward) - base step, from medians of the same run.", ""]
    return lines


def render(rows: list[dict], source: str) -> str:
    lines = [f"Measured on {_where(rows[0])}. Source: `{source}`.", ""]
    return "\n".join(
        lines + sam_step_tables(rows) + whole_step_tables(rows) + train_step_table(rows) + trainer_tables(rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=str(DEFAULT_RESULTS))
    parser.add_argument("--run", help="run id (default: the newest full run)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="only runs on this device")
    args = parser.parse_args(argv)
    path = Path(args.results)
    rows = pick_run(load_runs(path), args.run, args.device)
    try:
        source = str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        source = str(path)
    print(render(rows, source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

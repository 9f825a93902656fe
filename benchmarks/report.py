"""Render the rows of a results file (JSONL, one row per benchmark, appended by every run) as Markdown.

    python benchmarks/report.py [RESULTS.jsonl] [--run ID] [--device cpu|cuda]
    python benchmarks/report.py --reports [--check]     the per-machine reports in benchmarks/results/
    python benchmarks/report.py --figures [--out DIR]   the documentation's figures (docs/figures/)

Without ``--run`` it renders the newest full (non-quick) run for the device, or the newest run of any kind if there
is no full one. Ratios are the headline: each fused contender against the per-tensor loop and against
pytorch_optimizer, measured in the same run, and for the whole step (SAM with its base optimizer's update) against the
base optimizer's step alone.

``--reports`` rewrites one report per kind of machine (``cpu-amd-epyc.md``, ``gpu-h200.md``, ...) from every results
file of ``benchmarks/results/``: ``runs.jsonl`` and the rows a GPU run keeps in its own folder (``gpu-*/*.jsonl``).
A report is prose written by hand around blocks this script renders: each block between
``<!-- report.py: run ID -->`` and ``<!-- /report.py -->`` is rendered again from that run's rows, everything else is
kept as written, and a full run that the report does not name yet gets a section of its own at the end. ``--check``
changes nothing and fails where a report is not what its rows render. ``--figures`` draws ``figures.FIGURES`` from the
same files.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from gearsam_fused.allocation import GEAR_RULE, SAM_RULE

from rows import (
    COMPILED,
    OWN_SAM,
    PEER,
    _peers,
    best_peer,
    counted_gbps,
    floor_gbps,
    machine_title,
    pct_floor,
    quartiles,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TORCH_STEP = "torch's base step"  # as bench_whole_step.TORCH_STEP (no torch import here)
DEFAULT_RESULTS = RESULTS_DIR / "runs.jsonl"


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


def sam_parts(
    step_s: list[float],
    forward_backward_s: list[float],
    sgd_s: list[float],
    steps: list[int] | None = None,
    second_passes: list[int] | None = None,
) -> dict[str, float]:
    """From per-round seconds measured back to back (a SAM step, one forward+backward pass, one SGD step), the
    median and quartiles in ms of ``beyond`` (step - 2 x forward+backward) and of the tax (step - SGD step -
    forward+backward), each computed per round, the tax's median share of the step in %, and the step over the SGD
    step (median and quartiles).

    A round of a schedule holds ``steps[i]`` training steps of which ``second_passes[i]`` took the second pass; its
    numbers are per training step: step = round / steps, beyond = (round - (steps + second passes) x fwd+bwd) / steps,
    tax = (round - steps x SGD step - second passes x fwd+bwd) / steps (one step and one pass per round without)."""
    n = len(step_s)
    steps = [1] * n if steps is None else steps
    second_passes = [1] * n if second_passes is None else second_passes
    if not n == len(forward_backward_s) == len(sgd_s) == len(steps) == len(second_passes) > 0:
        raise ValueError("one forward+backward pass and one SGD step per round of the SAM step")
    rounds = list(zip(step_s, forward_backward_s, sgd_s, steps, second_passes))
    per_step = [s / k for s, f, g, k, p in rounds]
    beyond = [1e3 * (s - (k + p) * f) / k for s, f, g, k, p in rounds]
    tax = [1e3 * (s - k * g - p * f) / k for s, f, g, k, p in rounds]
    share = [100 * (s - k * g - p * f) / s for s, f, g, k, p in rounds]
    over_sgd = [s / k / g for s, f, g, k, p in rounds]
    fields = {"forward_backward_ms": 1e3 * quartiles(forward_backward_s)[1], "sgd_ms": 1e3 * quartiles(sgd_s)[1]}
    for name, values in (("beyond", beyond), ("tax", tax), ("step", [1e3 * t for t in per_step])):
        fields.update(dict(zip((f"{name}_q1_ms", f"{name}_ms", f"{name}_q3_ms"), quartiles(values))))
    fields["tax_pct"] = quartiles(share)[1]
    fields.update(dict(zip(("over_sgd_q1", "over_sgd", "over_sgd_q3"), quartiles(over_sgd))))
    return fields


def step_intervals(marks: list[float]) -> list[float]:
    """Durations between consecutive time marks (seconds), e.g. the ends of consecutive optimizer steps."""
    return [b - a for a, b in zip(marks, marks[1:])]


def _where(row: dict) -> str:
    caches = ", ".join(f"{level} {size / 2**20:g} MiB" for level, size in row.get("cpu_caches", {}).items())
    place = row["gpu"] or f"CPU {row['cpu']} ({row['cpu_count']} cores{f'; {caches}' if caches else ''})"
    return (
        f"{place}, {row['date']}, commit {row['commit']}, torch {row['torch']}, triton {row['triton']}"
        f"{f', transparent huge pages {pages}' if (pages := row.get('huge_pages')) else ''}"
        f"{', quick mode' if row['quick'] else ''} (run `{row['run']}`)"
    )


def pct_traffic_floor(row: dict) -> str:
    """The row's % of its traffic floor (conftest.MemoryFloor: its read-only bytes at the read rate), where the run
    measured it; '-' otherwise."""
    return f"{row['pct_traffic_floor']:.0f}" if "pct_traffic_floor" in row else "-"


def floor_note(group: list[dict]) -> str:
    """How the floor of a table's rows was measured."""
    first = group[0]
    if "vs" in first:  # contenders stepped in turn: the floor measured once per round, shared by the rows
        floors = sorted({round(r["floor_gbps"]) for r in group})  # several: the rows' kinds, or rounds of their own
        span = "-".join(map(str, dict.fromkeys((floors[0], floors[-1]))))
        kinds = ", ".join(sorted({r["floor_row_kind"] for r in group if "floor_row_kind" in r}))
        what = f"{first['floor_kind']}: {kinds} here" if kinds else first["floor_kind"]
        return (f"memory floor ({what}) measured before each round and after the last, each round's rate over that "
                f"kind's around it, {span} GB/s")  # fmt: skip
    if "floor_best_gbps" in first:  # measured between each row's rounds
        floors = sorted(r["floor_gbps"] for r in group)
        span = f"{floors[0]:.0f}-{floors[-1]:.0f} GB/s over the rows"
        if "floor_row_kind" in first:  # one kind per row, the fastest over its rounds
            kinds = ", ".join(sorted({r["floor_row_kind"] for r in group}))
            return (f"memory floor ({first['floor_kind']}: {kinds} here) measured between each row's rounds, each "
                    f"round's rate over that kind's around it, {span}")  # fmt: skip
        paired = ", each round's rate over the floor around it" if "floor_paired" in first else ""
        return f"memory floor ({first['floor_kind']}) measured between each row's rounds{paired}, {span}"
    if "floor_gbps" in first:
        return f"memory floor {first['floor_gbps']:.0f} GB/s ({first['floor_kind']})"
    return f"memory floor {floor_gbps(first):.0f} GB/s (the run's copy, by the bytes it moved)"


def _ratio(baseline: float | None, value: float) -> str:
    return f"{baseline / value:.2f}x" if baseline else "-"


def _spread(stats: dict | None) -> str:
    """A ratio of per-round ratios (``rows.ratio_stats``), median [quartiles]; "-" where there is none."""
    return f"{stats['median']:.2f}x [{stats['q1']:.2f}, {stats['q3']:.2f}]" if stats else "-"


def _vs(row: dict, label: str) -> str:
    """The row's ratio to reference ``label`` of the same rounds (the reference's time over the row's)."""
    return _spread(row.get("vs", {}).get(label))


def _over(row: dict, label: str) -> str:
    """The row's time over reference ``label``'s, in the same rounds."""
    return _spread(row.get("over", {}).get(label))


def _in_turn_note(group: list[dict]) -> str:
    """For rows stepped in turn within the same rounds: how many rounds, and which path stood for each reference."""
    first = group[0]
    paths = {label: path for label, path in {**first.get("vs_path", {}), **first.get("over_path", {})}.items()
             if path != label}  # fmt: skip
    named = "".join(f"; {label} = its faster path in these rounds, `{path}`" for label, path in paths.items())
    return f"{first['rounds']} rounds, the contenders stepped in turn within each{named}{_not_run(first)}"


def _not_run(*group: dict) -> str:
    """The contenders the rows of ``group`` say were left out of their rounds, each with why."""
    left = {name: why for row in group for name, why in (row.get("left_out") or {}).items()}
    return "".join(f"; not run here: `{name}` ({why})" for name, why in left.items())


IN_TURN_NOTE = (
    "The contenders were stepped in turn within each round (the memory floor measured once per round, then each "
    "contender's step timed alone, the order turned by one place each round), and each ratio is the median of the "
    "per-round ratios of the same rounds, [first quartile, third quartile] after it: a ratio whose quartiles "
    "straddle 1.00x is inside the noise of the run."
)


def sam_step_tables(rows: list[dict]) -> list[str]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == "bench_sam_step" and "variant" not in row:  # the family's: family_tables
            # rows written before the rule was named "gear-sam" call it "gear"
            groups[(row["set"], {"gear": GEAR_RULE}.get(row["rule"], row["rule"]))].append(row)
    lines = []
    for (name, rule), group in groups.items():
        first = group[0]
        # GEAR-SAM has no peer implementation: its ratios are against the per-tensor loops' SAM step of the same run.
        sam = {r["contender"]: r["median_ms"] for r in groups.get((name, "sam"), [])}
        loop = sam.get("per-tensor loop")
        peer_path, peer = best_peer(sam)
        if "vs" in first:  # stepped in turn: the ratios of the same rounds
            lines += _sam_step_in_turn(name, rule, group)
            continue
        lines += [
            f"**{'SAM' if rule == SAM_RULE else 'GEAR-SAM'} step, {name}** ({first['parameters'] / 1e6:.1f}M parameters in "
            f"{first['tensors']} tensors; {first['bytes_counted'] // first['parameters']} bytes counted per parameter; "
            f"{floor_note(group)}"
            f"{f'; pytorch_optimizer SAM = its faster path here, `{peer_path}`' if len(_peers(sam)) > 1 else ''})",
            "",
            "| contender | median ms | IQR ms | vs per-tensor loop SAM | vs pytorch_optimizer SAM | GB/s | % of floor | % of traffic floor | launches | held MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            lines.append(
                f"| {r['contender']} | {r['median_ms']:.3f} | {r['q3_ms'] - r['q1_ms']:.3f} | {_ratio(loop, r['median_ms'])} | "
                f"{_ratio(peer, r['median_ms'])} | {counted_gbps(r):.1f} | {pct_floor(r):.0f} | {pct_traffic_floor(r)} | {r.get('launches', '-')} | "
                f"{r['held_bytes'] / 2**20:.1f} |"
            )
        lines.append("")
    if any("vs" in r for r in rows if r["benchmark"] == "bench_sam_step" and "variant" not in r):
        lines += [IN_TURN_NOTE + " GEAR-SAM, which neither the per-tensor loop nor pytorch_optimizer implements, is "
                  "compared with their SAM steps of the same rounds.", ""]  # fmt: skip
    if lines:
        lines += [
            "SAM step = `first_step` + `second_step` with a base optimizer that does nothing: energy, perturbation and "
            "restore, the bytes counted per parameter as each set's line says (16 from commit 70c85b1, the restore an "
            "exchange of memory; 28 in runs before commit 177df32, a perturbation and a restore that copy w); % of floor: "
            "that rate over the memory floor measured between the "
            "row's rounds (median); % of traffic floor: the same over the floor of the row's traffic, whose energy pass "
            "(4 bytes per parameter) only reads, those bytes at the read rate measured beside it.",
            "",
        ]
    return lines


def _sam_step_in_turn(name: str, rule: str, group: list[dict]) -> list[str]:
    """A SAM-step table of contenders stepped in turn: each ratio the median [quartiles] of its per-round ratios."""
    first = group[0]
    lines = [
        f"**{'SAM' if rule == SAM_RULE else 'GEAR-SAM'} step, {name}** ({first['parameters'] / 1e6:.1f}M parameters in "
        f"{first['tensors']} tensors; {first['bytes_counted'] // first['parameters']} bytes counted per parameter; "
        f"{_in_turn_note(group)}; {floor_note(group)})",
        "",
        "| contender | median ms | IQR ms | vs per-tensor loop SAM [IQR] | vs pytorch_optimizer SAM [IQR] | GB/s | "
        "% of floor | % of traffic floor | launches | held MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in group:
        lines.append(
            f"| {r['contender']} | {r['median_ms']:.3f} | {r['q3_ms'] - r['q1_ms']:.3f} | {_vs(r, 'per-tensor loop')} | "
            f"{_vs(r, 'pytorch_optimizer')} | {counted_gbps(r):.1f} | {pct_floor(r):.0f} | {pct_traffic_floor(r)} | "
            f"{r.get('launches', '-')} | {r['held_bytes'] / 2**20:.1f} |"
        )
    return [*lines, ""]


def _compiled_note(group: list[dict]) -> str:
    row = next((r for r in group if r["contender"] == COMPILED and "max_rel_diff" in r), None)
    return f"; compiled foreach SAM's weights {row['max_rel_diff']:.1e} from ours, relative" if row else ""


def _seconds(value: float | None) -> str:
    """A compile or capture time: whole seconds from 10 s, tenths below (a CUDA graph's capture may take under one)."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _whole_step_in_turn(name: str, base: str, group: list[dict]) -> list[str]:
    """A whole-step table of contenders stepped in turn: each ratio the median [quartiles] of its per-round ratios."""
    first = group[0]
    lines = [
        f"**Whole step, {base}, {name}** ({first['parameters'] / 1e6:.1f}M parameters in {first['tensors']} "
        f"tensors; {first['bytes_counted'] // first['parameters']} bytes counted per parameter; "
        f"{_in_turn_note(group)}; {floor_note(group)}{_compiled_note(group)})",
        "",
        "| contender | base step | median ms | IQR ms | vs per-tensor loop [IQR] | vs pytorch_optimizer [IQR] | "
        "vs compiled foreach SAM [IQR] | / torch's base step [IQR] | GB/s | % of floor | % of traffic floor | "
        "compile s | launches |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in group:
        compile_s = _seconds(r.get("compile_s", r.get("capture_s")))
        lines.append(
            f"| {r['contender']} | {r.get('base_flags', '-')} | {r['median_ms']:.3f} | {r['q3_ms'] - r['q1_ms']:.3f} | "
            f"{_vs(r, 'per-tensor loop')} | {_vs(r, 'pytorch_optimizer')} | {_vs(r, COMPILED)} | "
            f"{_over(r, TORCH_STEP)} | {counted_gbps(r):.1f} | {pct_floor(r):.0f} | {pct_traffic_floor(r)} | "
            f"{compile_s} | {r.get('launches', '-')} |"
        )
    return [*lines, ""]


def whole_step_tables(rows: list[dict]) -> list[str]:
    """Per (set, base optimizer): every contender's whole step (SAM and the base optimizer's update), against the
    per-tensor implementations, the compiled foreach SAM and the base optimizer's step alone."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == "bench_whole_step" and "variant" not in row:  # the family's: family_tables
            groups[(row["set"], row["base"])].append(row)
    lines = []
    for (name, base), group in groups.items():
        first = group[0]
        if "vs" in first:  # stepped in turn: the ratios of the same rounds
            lines += _whole_step_in_turn(name, base, group)
            continue
        by = {r["contender"]: r["median_ms"] for r in group}
        loop, bare, compiled = by.get("per-tensor loop"), by.get("bare base step"), by.get(COMPILED)
        peer_path, peer = best_peer(by)
        lines += [
            f"**Whole step, {base}, {name}** ({first['parameters'] / 1e6:.1f}M parameters in {first['tensors']} "
            f"tensors; {first['bytes_counted'] // first['parameters']} bytes counted per parameter; {floor_note(group)}"
            f"{f'; pytorch_optimizer = its faster path here, `{peer_path}`' if len(_peers(by)) > 1 else ''}"
            f"{_compiled_note(group)})",
            "",
            "| contender | median ms | IQR ms | vs per-tensor loop | vs pytorch_optimizer | vs compiled foreach SAM | "
            "/ bare base step | GB/s | % of floor | % of traffic floor | compile s | launches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            over_bare = f"{r['median_ms'] / bare:.2f}x" if bare else "-"
            compile_s = _seconds(r.get("compile_s", r.get("capture_s")))
            lines.append(
                f"| {r['contender']} | {r['median_ms']:.3f} | {r['q3_ms'] - r['q1_ms']:.3f} | {_ratio(loop, r['median_ms'])} | "
                f"{_ratio(peer, r['median_ms'])} | {_ratio(compiled, r['median_ms'])} | {over_bare} | "
                f"{counted_gbps(r):.1f} | {pct_floor(r):.0f} | {pct_traffic_floor(r)} | {compile_s} | {r.get('launches', '-')} |"
            )
        lines.append("")
    in_turn = [r for r in rows if r["benchmark"] == "bench_whole_step" and "variant" not in r and "vs" in r]
    if in_turn:
        lines += [
            "Whole step = `first_step` + `second_step` with the base optimizer's update, each contender at its best: "
            "the per-tensor loop, pytorch_optimizer's per-tensor path and our `base per tensor` rows step torch's "
            "optimizer with `fused=True`, pytorch_optimizer's foreach path with `foreach=True` (it hands its flag on; "
            "torch refuses both), the compiled foreach SAM compiles its `foreach=True` step (its perturbation one "
            "compiled function with float32 norms, its restore and the base step another; `, reduce-overhead`: both "
            "captured in CUDA graphs by inductor), and torch's base step alone is timed with each flag (`bare base "
            "step`, `bare base step (fused)`). \"vs\" columns: the other's time over this one's (above 1x: this one "
            "is faster); \"/ torch's base step\": this one's time over torch's base step alone, its faster path in "
            "the same rounds (each table's heading names it). " + IN_TURN_NOTE + " GB/s from the counted bytes, per "
            "parameter as each set's line says (a SAM step's floor, SGD 36, AdamW 44; torch's base step alone its own "
            "20 and 28); % of floor: each round's rate over the memory floor measured around it (median); % of "
            "traffic floor: the same over the floor of the row's traffic, whose energy pass (4 bytes per parameter) "
            "only reads, those bytes at the read rate measured beside it (conftest.MemoryFloor). compile s: the "
            "compiled contenders' calls that compiled (the first calls and the first steps' recompiles; not in their "
            "times); for a `BACKEND, CUDA graph` row (`capturable=True`, the timed step a `graph.replay()`), its three "
            "warm-up steps and the capture.",
            "",
        ]
    if len(in_turn) < len([r for r in rows if r["benchmark"] == "bench_whole_step" and "variant" not in r]):
        lines += [
            "Whole step = `first_step` + `second_step` with the base optimizer's update. \"vs\" columns: the other's median "
            "over this one's (above 1x: this one is faster); \"/ bare base step\": this median over the base optimizer's "
            "step alone (`foreach=True`, no SAM). GB/s from the counted bytes, per parameter as each set's line says: a SAM "
            "step's floor (SGD 36, AdamW 44; 40 and 48 in runs before commit 177df32, which counted a perturbation "
            "that copies w to the backup), the bare base step its own 20 and 28; % of floor: that rate over the memory floor measured between the row's rounds (median); % of traffic floor: the "
            "same over the floor of the row's traffic, whose energy pass (4 bytes per parameter) only reads, those bytes at "
            "the read rate measured beside it (conftest.MemoryFloor). compile s: "
            "the compiled contenders' calls that compiled (the first calls and the first steps' recompiles; not in "
            "their median): the compiled foreach SAM, and our `BACKEND, compiled` (`first_step` and `second_step` under "
            "`torch.compile(fullgraph=True)`); for a `BACKEND, CUDA graph` row (`capturable=True`, the timed step "
            "a `graph.replay()`), its three warm-up steps and the capture.",
            "",
        ]
    return lines


FAMILY_STEPS = {"bench_sam_step": "SAM step", "bench_whole_step": "whole step"}
FAMILY_WHAT = (
    "SAM family: GSAM (alpha 0.4), WSAM (gamma 0.9, decoupled), F-SAM (sigma 1, lmbda 0.9) and GEAR-SAM with "
    "GSAM's descent, beside SAM and GEAR-SAM, ours on the flat buffers (whole step: the base step fused into the "
    "restore) and pytorch_optimizer's (GSAM driven as its `step()` does: `perturb_weights`, "
    "`gradient_decompose`, `un_perturb`, the base step)."
)
#: what each variant's passes add to SAM's bytes (contenders.Variant)
FAMILY_PASSES = (
    "what the variant's passes over the flat buffers read and write, each pass counted once "
    "(contenders.Variant): GSAM 24 (keeping g 4, written by the perturbation; <g, h> and ||h||^2 in one read "
    "of g and h, 8, read only; the mix 12; in a whole step the fused base step takes the mix as one more read "
    "of g, 4: 16), WSAM 32 (keeping g 4; the exchange of g and h - g 16; adding h - g after the update 12; in "
    "a whole step the fused base step steps with g and takes the sharpness step from the h and g it has read, "
    "one more read of g, 4: 8), F-SAM 12 (its EMA pass, g and m in and out, 16, sums the new g's energies, in "
    "place of SAM's energy pass, 4; no pass only reads)."
)
#: the traffic floor of a variant's passes that only read
FAMILY_TRAFFIC = (
    "% of traffic floor: the rate over the floor of that traffic, the passes that only read (SAM's energy 4, "
    "GSAM's 8 more; F-SAM none) at the read rate measured beside it."
)


def _same_round(row: dict) -> str:
    """A family row's cost over its plain SAM timed in the same rounds, median [quartiles] ("-": a peer's row, a plain
    variant's, or a whole step of a run before the whole step paired them)."""
    if "over_paired_plain" not in row:
        return "-"
    return f"{row['over_paired_plain']:.2f}x [{row['over_paired_plain_q1']:.2f}, {row['over_paired_plain_q3']:.2f}]"


def _family_heading(benchmark: str, name: str, base: str | None, group: list[dict], rounds: str) -> str:
    """A family table's heading: the step, the set, and ``rounds``, what its ratios come from."""
    first = group[0]
    return (f"**SAM family, {FAMILY_STEPS[benchmark]}{f', {base}' if base else ''}, {name}** "
            f"({first['parameters'] / 1e6:.1f}M parameters in {first['tensors']} tensors; {rounds})")  # fmt: skip


def _family_in_turn(benchmark: str, name: str, base: str | None, group: list[dict]) -> list[str]:
    """A family table of rows stepped in turn, each variant's with its yardsticks in rounds of their own: each ratio
    the median [quartiles] of its per-round ratios."""
    sam_step = benchmark == "bench_sam_step"
    paths = {r["variant"]: r["vs_path"][PEER] for r in group if PEER in r["vs_path"]}
    faster = ", ".join(f"{variant} `{path}`" for variant, path in paths.items())
    rounds = (f"{group[0]['rounds']} rounds, each variant's contenders stepped in turn with their yardsticks within "
              f"each round of their own{f'; pytorch_optimizer = its faster path in those rounds: {faster}' if faster else ''}"
              f"{_not_run(*group)}; {floor_note(group)}")  # fmt: skip
    lines = [
        _family_heading(benchmark, name, base, group, rounds),
        "",
        "| variant | contender | bytes per parameter | median ms | IQR ms | vs pytorch_optimizer [IQR] | / own SAM [IQR] "
        f"| GB/s | % of floor | % of traffic floor |{' held MB |' if sam_step else ''}",
        f"|---|---|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|' if sam_step else ''}",
    ]
    for r in group:
        held = f" {r['held_bytes'] / 2**20:.1f} |" if sam_step else ""
        lines.append(
            f"| {r['variant']} | {r['contender']} | {r['bytes_counted'] // r['parameters']} | {r['median_ms']:.3f} | "
            f"{r['q3_ms'] - r['q1_ms']:.3f} | {_vs(r, PEER)} | {_over(r, OWN_SAM)} | {counted_gbps(r):.1f} | "
            f"{pct_floor(r):.0f} | {pct_traffic_floor(r)} |{held}"
        )
    return [*lines, ""]


def _family_of_medians(benchmark: str, name: str, base: str | None, group: list[dict]) -> list[str]:
    """A family table of runs that timed each row in a test of its own: its ratios from the rows' medians."""
    sam_step = benchmark == "bench_sam_step"
    medians = {(r["variant"], r["contender"]): r["median_ms"] for r in group}
    variants = dict.fromkeys(r["variant"] for r in group)  # in the order of the rows
    peers = {v: best_peer({c: ms for (w, c), ms in medians.items() if w == v}) for v in variants}
    faster = ", ".join(f"{v} `{path}`" for v, (path, _) in peers.items() if path is not None)
    rounds = f"{floor_note(group)}{f'; pytorch_optimizer = its faster path here: {faster}' if faster else ''}"
    lines = [
        _family_heading(benchmark, name, base, group, rounds),
        "",
        "| variant | contender | bytes per parameter | median ms | IQR ms | vs pytorch_optimizer | / own SAM | "
        f"/ own SAM, same round [IQR] | GB/s | % of floor | % of traffic floor |{' held MB |' if sam_step else ''}",
        f"|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|' if sam_step else ''}",
    ]
    for r in group:
        peer = peers.get(r["peer_variant"], (None, None))[1]
        plain = medians.get((r["plain_variant"], r["contender"]))
        over_plain = f"{r['median_ms'] / plain:.2f}x" if plain else "-"
        held = f" {r['held_bytes'] / 2**20:.1f} |" if sam_step else ""
        lines.append(
            f"| {r['variant']} | {r['contender']} | {r['bytes_counted'] // r['parameters']} | {r['median_ms']:.3f} | "
            f"{r['q3_ms'] - r['q1_ms']:.3f} | {_ratio(peer, r['median_ms'])} | {over_plain} | "
            f"{_same_round(r)} | {counted_gbps(r):.1f} | "
            f"{pct_floor(r):.0f} | {pct_traffic_floor(r)} |{held}"
        )
    return [*lines, ""]


def family_tables(rows: list[dict]) -> list[str]:
    """Per benchmark (SAM step, whole step), set and base optimizer: each variant of the SAM family, ours and
    pytorch_optimizer's, against the peer's faster path for the same variant and against the same contender's plain
    SAM (GEAR-SAM for a GEAR-SAM variant): of the same rounds where the run stepped them in turn, else of the run."""
    groups: dict[tuple[str, str, str | None], list[dict]] = defaultdict(list)
    for row in rows:
        if "variant" in row:
            groups[(row["benchmark"], row["set"], row.get("base"))].append(row)
    lines = []
    for (benchmark, name, base), group in groups.items():
        in_turn = "vs" in group[0]
        lines += (_family_in_turn if in_turn else _family_of_medians)(benchmark, name, base, group)
    family = [r for r in rows if "variant" in r]
    if any("vs" in r for r in family):
        lines += [
            f"{FAMILY_WHAT} Each variant's contenders were stepped in turn within rounds of their own, each on a copy "
            "of the set of its own, beside yardsticks that have no rows: each contender's plain variant (SAM; GEAR-SAM "
            "for a GEAR-SAM variant) and, for a GEAR-SAM variant, which the peer does not have, the peer's variant "
            "under SAM's radius. \"vs pytorch_optimizer\": the peer's faster path for the same variant (a GEAR-SAM "
            'variant: its variant under SAM\'s radius) over this step (above 1x: this one is faster); "/ own SAM": '
            f"this step over the same contender's plain variant, the cost of the variant's part. {IN_TURN_NOTE} Bytes "
            "per parameter: SAM's count (SAM step 16, whole step SGD 36, AdamW 44) plus "
            f"{FAMILY_PASSES} {FAMILY_TRAFFIC}",
            "",
        ]
    if any("vs" not in r for r in family):
        lines += [
            f'{FAMILY_WHAT} "vs pytorch_optimizer": the peer\'s faster path for '
            "the same variant over this median (a GEAR-SAM variant, which the peer does not have: its variant under "
            "SAM's radius); \"/ own SAM\": this median over the same contender's SAM (a GEAR-SAM variant: its GEAR-SAM) "
            'in the same run, the cost of the variant\'s part; "same round": per round, this step over our plain '
            "SAM's (GEAR-SAM's) timed just before it on a copy of the set, median [quartiles] (whole steps: in runs "
            "after `1cc6ebdbd959`). Bytes per parameter: SAM's count (SAM step 16, whole step SGD 36, AdamW 44; the "
            "SAM step 24 from commit 177df32 to commit 3c9b394, and before them 28, 40 and 48) plus "
            f"{FAMILY_PASSES} Runs up to `1cc6ebdbd959` "
            "counted GSAM's <g, h> and ||h||^2 as two passes (12), runs up to `d59ac9c9b7ac` WSAM's whole step at its "
            "passes' 32, runs up to `da8a41256197` keeping g as a copy pass of 8 and GSAM's mix as a pass of its own "
            "in the whole step too, runs up to `0441ecd2a291` a pass of 4 for ||g||^2 besides, and runs up to "
            "`0078243c39f0` F-SAM's EMA pass and its energy pass apart (16, 4 of them read-only). "
            f"{FAMILY_TRAFFIC}",
            "",
        ]
    return lines


def skipped_step_tables(rows: list[dict]) -> list[str]:
    """Per (set, base optimizer): a step the schedule skips (``first_step`` returning False) against the base
    optimizer's step alone, by the medians of the run and round by round."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == "bench_skipped_step":
            groups[(row["set"], row["base"])].append(row)
    lines = []
    for (name, base), group in groups.items():
        first = group[0]
        bare = next((r["median_ms"] for r in group if r["contender"] == "bare base step"), None)
        lines += [
            f"**Skipped step, {base}, {name}** ({first['parameters'] / 1e6:.1f}M parameters in {first['tensors']} "
            f"tensors; {floor_note(group)})",
            "",
            "| contender | bytes per parameter | median ms | IQR ms | / bare base step | / bare base step, same round "
            "[IQR] | GB/s | % of floor | % of traffic floor | launches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            over_bare = f"{r['median_ms'] / bare:.2f}x" if bare else "-"
            paired = (f"{r['over_paired_bare']:.2f}x [{r['over_paired_bare_q1']:.2f}, {r['over_paired_bare_q3']:.2f}]"
                      if "over_paired_bare" in r else "-")  # fmt: skip
            lines.append(
                f"| {r['contender']} | {r['bytes_counted'] // r['parameters']} | {r['median_ms']:.3f} | "
                f"{r['q3_ms'] - r['q1_ms']:.3f} | {over_bare} | {paired} | {counted_gbps(r):.1f} | {pct_floor(r):.0f} | "
                f"{pct_traffic_floor(r)} | {r.get('launches', '-')} |"
            )
        lines.append("")
    if lines:
        lines += [
            "Skipped step = `first_step()` returning False under `Every(k)` or `LookSAM(k)`: the energy pass and the "
            'base optimizer\'s update fused over the flat buffers (LookSAM: with its correction). "/ bare base step": '
            'this median over the base optimizer\'s step alone (`foreach=True`); "same round": per round, this step '
            "over a bare base step timed just before it on a copy of the set, median and quartiles over the rounds. "
            "Bytes per parameter: the row's floor (energy 4, update SGD 20 / AdamW 28, LookSAM's correction 4); % of traffic "
            "floor: the rate over the floor of that traffic, the energy pass's 4 bytes, which only read, at the read "
            "rate measured beside it.",
            "",
        ]
    return lines


def _per_round(row: dict, name: str) -> str:
    """A per-round ratio of the row, median [quartiles]; "-" where the row has none."""
    if name not in row:
        return "-"
    return f"{row[name]:.2f}x [{row[f'{name}_q1']:.2f}, {row[f'{name}_q3']:.2f}]"


def momentum_step_tables(rows: list[dict]) -> list[str]:
    """Per (set, base optimizer): MomentumSAM's step against our fused base step alone, a step a schedule skips and
    torch's ``foreach`` step, all stepped in turn within each round, by the ratios of the same rounds."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == "bench_momentum_step":
            groups[(row["set"], row["base"])].append(row)
    lines = []
    for (name, base), group in groups.items():
        first = group[0]
        lines += [
            f"**MomentumSAM step, {base}, {name}** ({first['parameters'] / 1e6:.1f}M parameters in {first['tensors']} "
            f"tensors; {first['rounds']} rounds, the contenders stepped in turn within each; {floor_note(group)})",
            "",
            "| contender | bytes per parameter | median ms | IQR ms | GB/s | / fused base step, same round [IQR] | "
            "/ its bytes at the fused base step's rate [IQR] | / its bytes at the skipped step's rate [IQR] | "
            "/ bare base step, same round [IQR] | % of floor | % of traffic floor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            lines.append(
                f"| {r['contender']} | {r['bytes_counted'] // r['parameters']} | {r['median_ms']:.3f} | "
                f"{r['q3_ms'] - r['q1_ms']:.3f} | {r['gbps']:.1f} | {_per_round(r, 'over_base')} | "
                f"{_per_round(r, 'over_allowed')} | {_per_round(r, 'over_allowed_skipped')} | "
                f"{_per_round(r, 'over_bare')} | {pct_floor(r):.0f} | {pct_traffic_floor(r)} |"
            )
        lines.append("")
    if lines:
        lines += [
            "MomentumSAM step = `step()`: restore and update in one pass (which on `cpp` and `triton` also sums the "
            "new momentum's energies as it writes it; `torch` reads the momentum again for them), the look-ahead "
            "along it. Fused base step: our update alone over the flat buffers (`update_`); SAM skipped "
            "step: `first_step()` returning False under `Every(k)`, its energy pass and the update; bare base step: "
            "torch's `step()` (`foreach=True`). Every ratio is per round, this step over another stepped in the same "
            'round, median [quartiles] over the rounds: "/ fused base step" over our fused base step on the same '
            "backend (the bare base step's: over the first backend's); \"/ its bytes at ... rate\" over the time "
            "this row's counted bytes take at the rate that step reaches in the same round (1.00x: as fast per byte "
            "as the update alone). Bytes per parameter: the update SGD 20 / AdamW 28 (w, g and the state in, w and "
            "the state out; torch's `foreach` step counted the same, though it moves more), an energy pass 4 "
            "(read-only: the skipped step's, and MomentumSAM's on `torch`), the look-ahead 16 (w and the momentum in, the saved copy and w out); % of traffic floor: "
            "the rate over the floor of that traffic, the read-only 4 at the read rate measured beside it.",
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
    alone = "step_q1_ms" in first  # the steps timed alone, without the trainer's set-up
    lines = [
        f"**{title}** (GPT-2 of {first['parameters'] / 1e6:.2f}M parameters, {first['micro_batches']} "
        f"micro-batches of {first['batch']} x {first['seq']} tokens per step, AdamW, max_grad_norm 1.0"
        f"{', bf16' if first['bf16'] else ''}; {first['steps']} steps per round)",
        "",
    ]
    if alone:
        lines += [f"| contender | AdamW | ms per step | IQR ms | / {plain_name} |", "|---|---|---:|---:|---:|"]
    else:
        lines += [f"| contender | ms per step | / {plain_name} |", "|---|---:|---:|"]
    for r in steps:
        over = f"{r['step_ms'] / plain:.2f}x" if plain else "-"
        if alone:
            adamw = r["optim"] + (", fused into the restore" if r.get("base_step_mode") == "fused" else "")
            lines.append(f"| {r['contender']} | {adamw} | {r['step_ms']:.1f} | {r['step_q3_ms'] - r['step_q1_ms']:.1f} | "
                         f"{over} |")  # fmt: skip
        else:
            lines.append(f"| {r['contender']} | {r['step_ms']:.1f} | {over} |")
    note = ("SAM runs the forward and backward passes twice per step; the data loading, clipping, optimizer step and "
            "the trainer's own work run once.")  # fmt: skip
    if alone:
        note += (f" A step's time runs from the end of one optimizer step to the end of the next; the first step of "
                 f"each round, which holds the trainer's set-up, is left out ({first['steps_timed']} steps timed).")  # fmt: skip
    return lines + ["", note, ""]


def train_step_table(rows: list[dict]) -> list[str]:
    steps = [r for r in rows if r["benchmark"] == "bench_train_step"]
    if not steps:
        return []
    first = steps[0]
    lines = [
        f"**Training step, CIFAR ResNet-18 width {first['width']}, batch {first['batch']}** "
        f"(autocast {first['autocast']}, channels_last {first['channels_last']})",
        "",
    ]
    if not any("tax_ms" in r for r in steps):
        return lines + _train_step_table_from_medians(steps)
    lines += [
        "| row | median ms | IQR ms | step - 2 x (fwd+bwd) ms [IQR] | SAM tax ms [IQR] | SAM tax % of step | base step "
        "| / SGD step, same round [IQR] | second passes |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in steps:
        cycle = "steps_per_round" in r  # a schedule's row: the numbers are per training step
        median, iqr = (
            (r["step_ms"], r["step_q3_ms"] - r["step_q1_ms"]) if cycle else (r["median_ms"], r["q3_ms"] - r["q1_ms"])
        )
        if "tax_ms" in r:
            beyond = f"{r['beyond_ms']:.2f} [{r['beyond_q1_ms']:.2f}, {r['beyond_q3_ms']:.2f}]"
            tax = f"{r['tax_ms']:.2f} [{r['tax_q1_ms']:.2f}, {r['tax_q3_ms']:.2f}] | {r['tax_pct']:.1f}"
            base = {"fused": "fused into the restore", "per-tensor": "SGD `step()` after the restore"}.get(
                r.get("base_step_mode"), "SGD `step()`"
            )
            if cycle and r.get("base_step_mode") == "fused":
                base += " (skipped steps: into the update)"
        else:
            beyond, tax, base = "", " ", ""
        over = f"{r['over_sgd']:.2f}x [{r['over_sgd_q1']:.2f}, {r['over_sgd_q3']:.2f}]" if "over_sgd" in r else ""
        if cycle:
            passes = f"{r['sam_fraction']:.2f} of steps ({r['schedule']}, {r['steps_per_round']} steps per round)"
        elif r.get("one_pass"):
            passes = "none (one pass per step)"
        else:
            passes = "every step" if "tax_ms" in r else ""
        name = r["contender"] + (f" (compiling: {r['compile_s']:.0f} s)" if r.get("compile_s") is not None else "")
        lines.append(f"| {name} | {median:.2f} | {iqr:.2f} | {beyond} | {tax} | {base} | {over} | {passes} |")
    lines += [
        "",
        "Per round, back to back: one forward+backward pass, one SGD step (its own forward+backward and update), then "
        "the SAM step. step - 2 x (fwd+bwd): the SAM machinery, the base update and two zero_grad. SAM tax = SAM "
        "step - SGD step - (fwd+bwd): what SAM adds to a plain SGD step beyond the second pass. Median and "
        "quartiles [q1, q3] over the rounds of each row; the forward+backward, base step and SGD rows are the "
        'parts timed alone. "/ SGD step, same round": per round, the step over that round\'s SGD step.',
        "",
    ]
    one_pass = [r for r in steps if r.get("one_pass")]
    if one_pass:
        lines += [
            'A one-pass row (MomentumSAM) takes one forward+backward per step, as SGD does: its "step - 2 x '
            '(fwd+bwd)" column holds step - (fwd+bwd), its tax step - SGD step. Each of its rounds also timed full '
            "SAM (the `SAM` row's optimizer, on a copy of the model) after the SGD step:",
            "",
            "| row | median ms | / SGD step, same round [IQR] | full SAM / SGD step, same rounds [IQR] | / full SAM "
            "step, same round [IQR] | SGD step ms | full SAM step ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in one_pass:
            lines.append(
                f"| {r['contender']} | {r['median_ms']:.2f} | {_per_round(r, 'over_sgd')} | "
                f"{_per_round(r, 'sam_over_sgd')} | {_per_round(r, 'over_paired_sam')} | {r['sgd_ms']:.2f} | "
                f"{r['paired_sam_ms']:.2f} |"
            )
        lines.append("")
    if any("steps_per_round" in r for r in steps):
        lines += [
            "Rows with a schedule (`Every(k)`, `LookSAM(k)`, `Adaptive()`) run the public protocol, `loss.backward(); "
            "if opt.first_step(zero_grad=True):` second forward+backward, `opt.second_step(zero_grad=True)`; a round is "
            "`steps per round` training steps (one whole cycle under Every and LookSAM, its SAM step first) and every "
            "number of the row is per training step: median = round / steps; step - 2 x (fwd+bwd) = (round - (steps "
            "+ second passes) x fwd+bwd) / steps; SAM tax = (round - steps x SGD step - second passes x fwd+bwd) / "
            "steps.",
            "",
        ]
    return lines


def _train_step_table_from_medians(steps: list[dict]) -> list[str]:
    """Runs before the parts were timed in each round: the tax from the medians of the part rows."""
    by = {r["contender"]: r["median_ms"] for r in steps}
    lines = ["| row | median ms | IQR ms | SAM tax ms | SAM tax % of step |", "|---|---:|---:|---:|---:|"]
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


def floor_start_line(rows: list[dict]) -> list[str]:
    """The floor's kinds as measured at the run's start (best of 10 interleaved rounds each), where the run kept them."""
    start = next((r["floor_start_gbps"] for r in rows if r.get("floor_start_gbps")), None)
    if start is None:
        return []
    kinds = ", ".join(f"{kind} {gbps:.1f}" for kind, gbps in sorted(start.items(), key=lambda item: -item[1]))
    return [f"The memory floor's kinds at the start of the run, GB/s by the bytes each moves: {kinds}.", ""]


# A step's passes past the stream threshold, each with the floor kind whose traffic it has: the energy pass only reads,
# the perturbation reads two streams and writes one it does not read (since commit 177df32), the base step updates w
# and its state in place, and SAM's restore exchanges memory, no bytes (since commit 3c9b394). Keyed by (benchmark,
# base optimizer); each with the name a report gives it.
STEP_PASSES = {
    ("bench_sam_step", None): ("SAM step", ((4, "read"), (12, "streamed update"))),
    ("bench_whole_step", "SGD"): (
        "whole step SGD",
        ((4, "read"), (12, "streamed update"), (20, "streamed AdamW step")),
    ),
    ("bench_whole_step", "AdamW"): (
        "whole step AdamW",
        ((4, "read"), (12, "streamed update"), (28, "streamed AdamW step")),
    ),
}


def pass_bound(passes: tuple[tuple[int, str], ...], gbps: dict[str, float]) -> float:
    """The % of the fastest kind in ``gbps`` that a step of these (bytes, kind) passes reaches if each pass moves its
    bytes at its own kind's rate."""
    seconds = sum(nbytes / gbps[kind] for nbytes, kind in passes)
    return 100 * sum(nbytes for nbytes, _ in passes) / seconds / max(gbps.values())


def pass_bound_line(rows: list[dict]) -> list[str]:
    """What the floor's kinds at the start of the run allow a step (:data:`STEP_PASSES`), for each step whose eager
    ``cpp`` row counted those passes' bytes."""
    start = next((r["floor_start_gbps"] for r in rows if r.get("floor_start_gbps")), None)
    bounds = []
    for (benchmark, base), (name, passes) in STEP_PASSES.items():
        counted = sum(nbytes for nbytes, _ in passes)
        mine = [
            r for r in rows
            if r["benchmark"] == benchmark and r.get("base") == base and r["contender"] == "cpp" and "variant" not in r
        ]  # fmt: skip
        if (
            start
            and all(kind in start for _, kind in passes)
            and any(r["bytes_counted"] == counted * r["parameters"] for r in mine)
        ):
            bounds.append(f"{name} {pass_bound(passes, start):.1f}%")
    if not bounds:
        return []
    return [
        "A step whose every pass moved its bytes at its own kind's rate above (the energy pass's 4 a parameter at read, "
        "the perturbation's 12 at streamed update, a base step's update in place at streamed AdamW step, SAM's "
        f"restore an exchange of memory) would reach, of the fastest kind: {', '.join(bounds)}.",
        "",
    ]


def model_table(mine: list[dict]) -> list[str]:
    """One model's rows of ``bench_models`` as a Markdown table (header and rows): every SAM contender's step around
    the same base optimizer, what it adds beyond its two forward+backward passes and its tax; for rows stepped in turn
    also the ratios to the other contenders of the same rounds."""

    def ms(row: dict, key: str) -> str:
        if row.get(key) is None:
            return ""
        spread = (row.get(f"{key[:-3]}_q1_ms"), row.get(f"{key[:-3]}_q3_ms"))
        return f"{row[key]:.2f}" + (f" ({spread[0]:.2f}–{spread[1]:.2f})" if None not in spread else "")

    def number(value: float | None, form: str = "{:.1f}") -> str:
        return "" if value is None else form.format(value)

    in_turn = "vs" in mine[0]
    extra = (
        " vs per-tensor loop SAM [IQR] | vs pytorch_optimizer [IQR] | vs compiled foreach SAM [IQR] |"
        if in_turn
        else ""
    )
    lines = [
        "| contender | step ms (IQR) | fwd+bwd ms | base step ms | beyond 2 passes ms (IQR) | SAM tax ms (IQR) | "
        f"tax % | / plain |{extra} peak MiB | held MiB | base step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 3 if in_turn else "") + "---:|---:|---|",
    ]
    for r in mine:
        ratios = (f" {_vs(r, 'per-tensor loop SAM')} | {_vs(r, 'pytorch_optimizer')} | {_vs(r, COMPILED)} |"
                  if in_turn else "")  # fmt: skip
        base_step = r.get("base_step_mode") or r.get("base_flags", "")
        lines.append(
            f"| {r['contender']} | {r['median_ms']:.2f} ({r['q1_ms']:.2f}–{r['q3_ms']:.2f}) | "
            f"{number(r.get('forward_backward_ms'), '{:.2f}')} | {number(r.get('base_step_ms'), '{:.2f}')} | "
            f"{ms(r, 'beyond_ms')} | {ms(r, 'tax_ms')} | {number(r.get('tax_pct'))} | "
            f"{number(r.get('over_plain'), '{:.2f}x')} |{ratios} {number(r.get('peak_mib'), '{:.0f}')} | "
            f"{number(r.get('held_mib'), '{:.0f}')} | {base_step} |"
        )
    return lines


MODELS_NOTE = (
    "Each round of a SAM row times one forward+backward pass, one base step and the SAM step back to back: "
    "beyond 2 passes = step - 2 x (forward+backward), SAM tax = that minus the base step (median and quartiles "
    'over the rounds, ms); "/ plain": per round, the step over that round\'s forward+backward plus base step '
    "(median); peak and held MiB (CUDA): the allocator's peak during one step and what stays allocated after "
    "it, both above what was allocated before the row built its model."
)
MODELS_IN_TURN_NOTE = (
    "Every row and part stepped in turn within each round (one forward+backward pass on a copy of its own, one base "
    "step with `foreach=True` and one with `fused=True`, each on a copy of its own), the order turned by one place "
    "each round: beyond 2 passes = step - 2 x (forward+backward), SAM tax = that minus the base step (the faster "
    'flag in these rounds, `base_step_path`), per round (median and quartiles, ms); "/ plain": per round, the step '
    "over that round's forward+backward plus base step (median); \"vs\" columns: the other's time over this one's in "
    "the same round, median [quartiles] (a ratio whose quartiles straddle 1.00x is inside the noise); base step: "
    "ours, whether it ran fused into the restore, the others their base optimizer's flags; peak and held MiB "
    "(CUDA): the allocator's peak during one step and what stays allocated after it, both above what was "
    "allocated before the row built its model."
)


def models_tables(rows: list[dict]) -> list[str]:
    """The real models' training steps (``bench_models``), one table per model (:func:`model_table`)."""
    steps = [r for r in rows if r["benchmark"] == "bench_models"]
    lines = []
    for model in dict.fromkeys(r["model"] for r in steps):
        mine = [r for r in steps if r["model"] == model]
        first = mine[0]
        size = ", ".join(
            f"{k} {first[k]}" for k in ("batch", "image", "tokens", "layers", "depth", "width") if k in first
        )
        autocast = f", autocast {first['autocast']}" if first.get("autocast") else ""
        rounds = f"; {_in_turn_note(mine)}" if "vs" in first else ""
        lines += [
            f"**Training step, {model}** ({size}{', tiny' if first['tiny'] else ''}; base {first['base']}{autocast}"
            f"{rounds})",
            "",
            *model_table(mine),
            "",
        ]
    if lines:
        lines += [MODELS_IN_TURN_NOTE if any("vs" in r for r in steps) else MODELS_NOTE, ""]
    return lines


def render(rows: list[dict], source: str) -> str:
    lines = [f"Measured on {_where(rows[0])}. Source: `{source}`.", "", *floor_start_line(rows), *pass_bound_line(rows)]
    return "\n".join(
        lines
        + sam_step_tables(rows)
        + whole_step_tables(rows)
        + family_tables(rows)
        + skipped_step_tables(rows)
        + momentum_step_tables(rows)
        + train_step_table(rows)
        + trainer_tables(rows)
        + models_tables(rows)
    ).rstrip("\n")


# ------------------------------------------------------------------------------ the per-machine reports


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, tuple[list[dict], Path]]:
    """run id -> (its rows, the file they are in), over ``runs.jsonl`` and every GPU run's own rows
    (``*/*.jsonl``: a GPU run keeps its files together in a folder of its own). A run id in two files is an error."""
    found: dict[str, tuple[list[dict], Path]] = {}
    files = [results_dir / "runs.jsonl"] if (results_dir / "runs.jsonl").is_file() else []
    for path in files + sorted(results_dir.glob("*/*.jsonl")):
        for run, rows in load_runs(path).items():
            if run in found:
                raise SystemExit(f"run {run} has rows in both {found[run][1]} and {path}")
            found[run] = (rows, path)
    return found


def machine_kind(row: dict) -> str:
    """The kind of machine a row was measured on, as a file name: ``gpu-`` and the GPU's model (``gpu-h200``), or
    ``cpu-`` and the CPU's vendor and family (``cpu-amd-epyc``, ``cpu-intel-xeon``)."""
    if row["gpu"]:
        words = [w for w in re.split(r"[^a-z0-9]+", row["gpu"].lower()) if w and w != "nvidia"]
        return "gpu-" + words[0]
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"\((r|tm)\)", " ", row["cpu"].lower())) if w]
    return "cpu-" + "-".join([w for w in words if w not in ("processor", "cpu")][:2])


BLOCK = re.compile(r"<!-- report\.py: run (\w+) -->\n.*?<!-- /report\.py -->", re.S)


def _block(run: str, rows: list[dict], source: str) -> str:
    return f"<!-- report.py: run {run} -->\n{render(rows, source)}\n<!-- /report.py -->"


def update_report(text: str, kind: str, results: dict[str, tuple[list[dict], Path]], results_dir: Path) -> str:
    """``text`` (a machine's report, or "" for a new one) with every rendered block rendered again from its run's rows,
    and a section at its end for each full run of this kind of machine that it does not name."""

    def source(path: Path) -> str:
        return f"benchmarks/results/{path.relative_to(results_dir).as_posix()}"

    def again(match: re.Match) -> str:
        run = match.group(1)
        if run not in results:
            raise SystemExit(f"the report of {kind} renders run {run}, which no results file holds")
        rows, path = results[run]
        if machine_kind(rows[0]) != kind:
            raise SystemExit(f"the report of {kind} renders run {run}, measured on {machine_kind(rows[0])}")
        return _block(run, rows, source(path))

    text = BLOCK.sub(again, text)
    mine = [(run, rows, path) for run, (rows, path) in results.items() if machine_kind(rows[0]) == kind]
    if not text:
        text = f"# {machine_title(mine[0][1][0])}\n\nEvery full benchmark run on this kind of machine, oldest first.\n"
    new = [(run, rows, path) for run, rows, path in mine if not rows[0]["quick"] and run not in text]
    for run, rows, path in new:
        text = text.rstrip("\n") + f"\n\n## Run `{run}`, {rows[0]['date']}\n\n{_block(run, rows, source(path))}\n"
    return text


def machine_reports(results_dir: Path = RESULTS_DIR) -> dict[Path, str]:
    """Each machine kind's report path -> its text rendered again (the kinds with a full run or a report)."""
    results = load_results(results_dir)
    kinds = {machine_kind(rows[0]) for rows, _ in results.values() if not rows[0]["quick"]}
    kinds |= {path.stem for path in results_dir.glob("*.md") if BLOCK.search(path.read_text(encoding="utf-8"))}
    out = {}
    for kind in sorted(kinds):
        path = results_dir / f"{kind}.md"
        out[path] = update_report(path.read_text(encoding="utf-8") if path.exists() else "", kind, results, results_dir)
    return out


def write_reports(results_dir: Path = RESULTS_DIR, check: bool = False) -> list[Path]:
    """Renders every machine's report again; returns the reports that changed (with ``check``, that would change,
    writing nothing)."""
    changed = []
    for path, text in machine_reports(results_dir).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            changed.append(path)
            if not check:
                path.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=str(DEFAULT_RESULTS))
    parser.add_argument("--run", help="run id (default: the newest full run)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="only runs on this device")
    parser.add_argument("--reports", action="store_true", help="render the per-machine reports of --results-dir again")
    parser.add_argument(
        "--check", action="store_true", help="with --reports: write nothing, fail where one would change"
    )
    parser.add_argument("--figures", action="store_true", help="draw the documentation's figures into --out")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help="the results folder of --reports and --figures")
    parser.add_argument("--out", help="the figures' folder (default docs/figures)")
    args = parser.parse_args(argv)
    if args.reports or args.figures:
        results_dir = Path(args.results_dir)
        if args.reports:
            changed = write_reports(results_dir, check=args.check)
            for path in changed:
                print(f"{'out of date' if args.check else 'rendered'}: {path}")
            if args.check and changed:
                return 1
        if args.figures:
            import figures  # matplotlib: only to draw

            for path in figures.draw(load_results(results_dir), Path(args.out) if args.out else figures.FIGURES_DIR):
                print(f"drew {path}")
        return 0
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

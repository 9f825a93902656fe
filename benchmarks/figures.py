"""The documentation's figures, drawn from the committed benchmark rows (``python benchmarks/report.py --figures``).

Each figure of :data:`FIGURES` names the runs it is drawn from, and for each run the parameter sets taken from it,
so that a figure shows exactly the rows the documentation quotes; its title says which runs, on which machine, on
which day. A figure whose runs, sets or contenders are missing from the results is an error, not a figure with a gap:
:func:`draw` stops before writing anything. Matplotlib draws off screen (Agg); every figure is a PNG of at most a few
hundred KB, written without the plotting library's version in its metadata so that drawing it again from the same
rows gives the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rows import COMPILED, best_peer, machine_title, pct_floor

FIGURES_DIR = Path(__file__).resolve().parents[1] / "docs" / "figures"
DPI = 110

#: the contender a speed-up is of: the backend ``backend="auto"`` picks where the extension is built, its base step
#: fused into the restore
OURS = "cpp"
#: the other ways to write the whole step, as the whole-step benchmark names them; pytorch_optimizer stands for its
#: faster path on each set (report.best_peer)
CONTENDERS = ("per-tensor loop", "pytorch_optimizer", COMPILED)
BASES = ("SGD", "AdamW")


@dataclass(frozen=True)
class Figure:
    """One figure: ``name`` (its file, ``NAME.png``), ``kind`` (``speedup``, ``floor`` or ``sam_tax``) and
    ``sources``, each a run id and the sets taken from that run (empty: all of its sets)."""

    name: str
    kind: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]


#: the contenders stepped in turn within each round, each ratio a median of per-round ratios (the speed-up's spread),
#: on a quiet host
CPU_WHOLE_STEP = (("e550606be96b", ()),)
H200_WHOLE_STEP = (("14eacf009fbf", ()), ("87b2e3cbb337", ()), ("50011f34c1af", ()))

FIGURES = (
    Figure("whole-step-speedup-cpu-amd-epyc", "speedup", CPU_WHOLE_STEP),
    Figure("whole-step-speedup-gpu-h200", "speedup", H200_WHOLE_STEP),
    Figure("whole-step-speedup-gpu-h100", "speedup", (("f98d1da1c71d", ()),)),
    Figure("whole-step-floor-cpu-amd-epyc", "floor", CPU_WHOLE_STEP),
    Figure("whole-step-floor-gpu-h200", "floor", H200_WHOLE_STEP),
    Figure("sam-tax-gpu-h100", "sam_tax", (("349fcb4f7520", ()),)),
)


class MissingRows(SystemExit):
    """A figure's source rows are not in the results."""


def source_rows(figure: Figure, results: dict[str, tuple[list[dict], Path]]) -> list[dict]:
    """The rows ``figure`` is drawn from; :class:`MissingRows` where a run or one of its named sets is missing."""
    rows = []
    for run, sets in figure.sources:
        if run not in results:
            raise MissingRows(f"figure {figure.name}: no rows of run {run} in the results")
        mine = [r for r in results[run][0] if "variant" not in r]  # the SAM family's rows are not the whole step
        have = {r.get("set") for r in mine}
        missing = [s for s in sets if s not in have]
        if missing:
            raise MissingRows(f"figure {figure.name}: run {run} has no rows of {', '.join(missing)}")
        rows += [r for r in mine if not sets or r.get("set") in sets]
    return rows


def _whole_steps(figure: Figure, rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """(set, base) -> contender -> row, the sets ordered by size; :class:`MissingRows` where a set lacks our row or
    every contender."""
    steps = sorted((r for r in rows if r["benchmark"] == "bench_whole_step"), key=lambda r: r["parameters"])
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in steps:
        groups.setdefault((r["set"], r["base"]), {})[r["contender"]] = r
    if not groups:
        raise MissingRows(f"figure {figure.name}: its runs hold no whole-step rows")
    for (name, base), group in groups.items():
        if OURS not in group or not any(c in group for c in (*CONTENDERS, "pytorch_optimizer, per tensor")):
            raise MissingRows(f"figure {figure.name}: no `{OURS}` row, or no contender, for {name} with {base}")
    return groups


def _provenance(figure: Figure, rows: list[dict]) -> str:
    """Machine, days and runs of a figure's rows, for its title."""
    first = rows[0]
    days = " and ".join(dict.fromkeys(r["date"] for r in rows))
    runs = ", ".join(run for run, _ in figure.sources)
    return f"{machine_title(first)}, {days}; run{'s' if len(figure.sources) > 1 else ''} {runs}"


SHORT = {"2000 tensors x 4096": "2000 x 4096", "2048 small tensors": "2048 small", "GPT-2-medium shapes": "GPT-2-medium",
         "GPT-2-medium shapes (width 512)": "GPT-2-medium\n(width 512)"}  # fmt: skip


def _set_label(row: dict) -> str:
    """A set's name and size under its bars: tensors and millions of parameters."""
    return f"{SHORT.get(row['set'], row['set'])}\n{row['parameters'] / 1e6:.1f}M, {row['tensors']} t."


def _log_axis(ax, top: float) -> None:
    """A log axis from 0.5 to above ``top`` with plain numbers at 1, 2, 5, 10, ... (ratios read as "x times")."""
    from matplotlib.ticker import NullFormatter

    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= top * 1.6]
    ax.set_yscale("log")
    ax.set_ylim(0.5, top * 1.6)
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())


def _speedup_of(group: dict[str, dict], contender: str) -> tuple[float, float, float] | None:
    """Our speed-up over a contender on one set (pytorch_optimizer: its faster path), with its spread: where the
    contenders were stepped in turn, the median of the per-round ratios and its quartiles (``vs``); in runs before,
    the ratio of the two medians, without a spread (its quartiles the median itself). None where it did not run."""
    ours = group[OURS]
    if "vs" in ours:
        stats = ours["vs"].get(contender)
        return None if stats is None else (stats["median"], stats["q1"], stats["q3"])
    medians = {c: r["median_ms"] for c, r in group.items()}
    theirs = best_peer(medians)[1] if contender == "pytorch_optimizer" else medians.get(contender)
    return None if theirs is None else (theirs / ours["median_ms"],) * 3


def _speedup(figure: Figure, rows: list[dict], axes) -> None:
    groups = _whole_steps(figure, rows)
    present = [c for c in CONTENDERS if any(_speedup_of(g, c) is not None for g in groups.values())]
    width = 0.8 / len(present)
    in_turn = all("vs" in g[OURS] for g in groups.values())
    for ax, base in zip(axes, BASES):
        sets = [group for (_, b), group in groups.items() if b == base]
        top = 1.0
        for i, contender in enumerate(present):
            xs, ys, low, high = [], [], [], []
            for x, group in enumerate(sets):
                ratio = _speedup_of(group, contender)
                if ratio is not None:
                    xs.append(x + (i - (len(present) - 1) / 2) * width)
                    ys.append(ratio[0])
                    low.append(ratio[0] - ratio[1])
                    high.append(ratio[2] - ratio[0])
            label = "pytorch_optimizer (faster path)" if contender == "pytorch_optimizer" else contender
            spread = {"yerr": [low, high], "capsize": 2, "error_kw": {"linewidth": 0.8}} if in_turn else {}
            bars = ax.bar(xs, ys, width, label=label, color=f"C{CONTENDERS.index(contender)}", **spread)
            if in_turn:  # above the quartile's whisker, which the bar's own label would sit under
                for x, y, h in zip(xs, ys, high):
                    ax.text(x, (y + h) * 1.04, f"{y:.2f}", ha="center", va="bottom", fontsize=6.5)
            else:
                ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6.5, padding=1)
            top = max(top, *ys, *(y + h for y, h in zip(ys, high)))
        ax.axhline(1.0, color="black", linewidth=0.8)
        _log_axis(ax, top)
        ax.set_xlim(-0.6, len(sets) - 0.4)
        ax.set_xticks(range(len(sets)), [_set_label(next(iter(g.values()))) for g in sets], fontsize=7.5)
        ax.set_title(base, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if in_turn:
        axes[0].set_ylabel(f"their time / `{OURS}`'s, same round: median, quartiles\n(above 1: ours is faster)")
    else:
        axes[0].set_ylabel(f"their median / `{OURS}`'s (above 1: ours is faster)")


def _floor(figure: Figure, rows: list[dict], axes) -> None:
    groups = _whole_steps(figure, rows)
    backends = [b for b in (OURS, "triton") if any(b in g for g in groups.values())]
    for ax, base in zip(axes, BASES):
        sets = [group for (_, b), group in groups.items() if b == base]
        xs = range(len(sets))
        for i, contender in enumerate([*backends, "per-tensor loop"]):
            points = [(x, g[contender]) for x, g in zip(xs, sets) if contender in g]
            if not points:
                continue
            color = "grey" if contender == "per-tensor loop" else f"C{i}"
            ax.plot([x for x, _ in points], [pct_floor(r) for _, r in points], "o-", color=color,
                    label=f"{contender}, each step synchronised")  # fmt: skip
            queued = [(x, r) for x, r in points if r.get("cuda_event_median_ms")]
            if queued and contender != "per-tensor loop":
                ax.plot([x for x, _ in queued], [_queued_pct(r) for _, r in queued], "s--", color=color,
                        label=f"{contender}, steps queued (CUDA events)")  # fmt: skip
        ax.set_ylim(0, 110)
        ax.axhline(100, color="black", linewidth=0.8)
        ax.set_xticks(list(xs), [_set_label(next(iter(g.values()))) for g in sets], fontsize=7.5)
        counted = sorted({g[OURS]["bytes_counted"] // g[OURS]["parameters"] for g in sets})
        ax.set_title(f"{base} (counted at {' and '.join(map(str, counted))} bytes a parameter)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("% of the memory floor measured in the run")


def _queued_pct(row: dict) -> float:
    """A CUDA row's counted bytes over its queued steps' time (``cuda_event_median_ms``), as % of its floor."""
    return 100 * row["bytes_counted"] / (row["cuda_event_median_ms"] * 1e6) / row["floor_gbps"]


def _sam_tax(figure: Figure, rows: list[dict], axes) -> None:
    steps = [r for r in rows if r["benchmark"] == "bench_models" and "beyond_ms" in r]
    if not steps:
        raise MissingRows(f"figure {figure.name}: its runs hold no SAM rows of bench_models")
    models = list(dict.fromkeys(r["model"] for r in steps))
    contenders = list(dict.fromkeys(r["contender"] for r in steps))
    width = 0.8 / len(contenders)
    for i, contender in enumerate(contenders):
        for ax, key, scale in ((axes[0], "over_plain", ""), (axes[1], "beyond", "_ms")):
            xs, ys, low, high = [], [], [], []
            for x, model in enumerate(models):
                row = next((r for r in steps if r["model"] == model and r["contender"] == contender), None)
                if row is None:
                    continue
                value = row[f"{key}{scale}"]
                xs.append(x + (i - (len(contenders) - 1) / 2) * width)
                ys.append(value)
                low.append(value - row[f"{key}_q1{scale}"])
                high.append(row[f"{key}_q3{scale}"] - value)
            label = f"{contender} (ours)" if contender in ("SAM", "GEAR-SAM") else contender
            ax.bar(xs, ys, width, yerr=[low, high], capsize=2, label=label, color=f"C{i}")
    labels = [f"{m}\n({next(r for r in steps if r['model'] == m)['base']})" for m in models]
    for ax in axes:
        ax.set_xticks(range(len(models)), labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.axhline(0, color="black", linewidth=0.8)
    axes[0].set_ylim(1.0, None)
    axes[0].set_ylabel("SAM step / plain step, same round")
    axes[0].set_title("the whole training step", fontsize=10)
    axes[1].set_ylabel("ms beyond the two forward+backward passes")
    axes[1].set_title("what SAM adds beyond its second pass", fontsize=10)


TITLES = {
    "speedup": "Whole step (SAM and the base optimizer's update), `cpp` against the other ways to write it",
    "floor": "Whole step, `cpp` (and `triton`): counted bytes per second as % of the measured memory floor",
    "sam_tax": "Training step of real models (bf16): SAM steps against the plain step, median and quartiles",
}
DRAW = {"speedup": _speedup, "floor": _floor, "sam_tax": _sam_tax}


def draw(results: dict[str, tuple[list[dict], Path]], out: Path = FIGURES_DIR, figures=FIGURES) -> list[Path]:
    """Draws every figure of ``figures`` from ``results`` (report.load_results) into ``out``; checks them all before
    writing any. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = {figure: source_rows(figure, results) for figure in figures}
    for figure, rows in sources.items():  # every figure's rows, before any file is written
        if figure.kind in ("speedup", "floor"):
            _whole_steps(figure, rows)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for figure, rows in sources.items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), layout="constrained")
        DRAW[figure.kind](figure, rows, axes)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=8, frameon=False)
        fig.suptitle(f"{TITLES[figure.kind]}\n{_provenance(figure, rows)}", fontsize=10)
        path = out / f"{figure.name}.png"
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written

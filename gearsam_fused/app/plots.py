"""Plots of a run directory (``gearsam plot RUN_DIR``), drawn from its ``metrics.jsonl`` alone.

- ``curves.png``: train and test loss and accuracy (%) per epoch, each optimizer's mean over seeds with its min-max
  band;
- ``block_shares.png``: per-block budget share rho_b**2 / rho**2 over training (mean over seeds), one panel per
  sharpness-aware optimizer: SAM's implicit allocation next to GEAR-SAM's, the paper's block-dynamics figure.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("plots need matplotlib: pip install matplotlib") from exc

from gearsam_fused.allocation import GEAR_RULE, SAM_RULE

from .metrics import read_metrics

_TITLES = {"sgd": "SGD", SAM_RULE: "SAM", GEAR_RULE: "GEAR-SAM"}
_CURVES = (("train_loss", "train loss"), ("test_loss", "test loss"), ("train_acc", "train accuracy (%)"),
           ("test_acc", "test accuracy (%)"))  # fmt: skip
_SHARPNESS = ("train_sharpness", "realized sharpness L(w + ε) − L(w)")


def render(run_dir: str | Path) -> list[Path]:
    """Write the plots of ``run_dir`` next to its ``metrics.jsonl``; returns their paths."""
    run_dir = Path(run_dir)
    source = run_dir / "metrics.jsonl"
    if not source.is_file():
        raise ValueError(f"{run_dir} is not a run directory: it has no metrics.jsonl")
    rows = read_metrics(source)
    epochs = [r for r in rows if r["kind"] == "epoch"]
    if not epochs:
        raise ValueError(f"{source} has no epoch rows yet: nothing to plot")
    written = [_save(curves_figure(epochs), run_dir / "curves.png")]
    blocks = [r for r in rows if r["kind"] == "blocks"]
    if blocks:
        written.append(_save(block_shares_figure(blocks), run_dir / "block_shares.png"))
    return written


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


def _by_optimizer(rows: list[dict]) -> dict[str, list[dict]]:
    grouped = defaultdict(list)
    for row in rows:
        grouped[row["optimizer"]].append(row)
    return grouped


def curves_figure(rows: list[dict]) -> Figure:
    """Loss and accuracy (%) over epochs, and the realized sharpness L(w + eps) - L(w) of the sharpness-aware runs when
    the rows have it (a third column). Losses start at 0 and accuracies span 0-100%, so a short or flat run is not
    blown up into noise; the epoch axis reaches one epoch past either end, so a single epoch still reads as a point
    in a plot."""
    sharpness = any(row.get("train_sharpness") is not None for row in rows)
    curves = _CURVES + (_SHARPNESS,) if sharpness else _CURVES
    fig = Figure(figsize=(15 if sharpness else 10, 7), layout="constrained")
    grid = fig.subplots(2, 3 if sharpness else 2, sharex=True)
    axes = list(grid[:, :2].ravel())  # train loss, test loss, train accuracy, test accuracy
    if sharpness:
        axes.append(grid[0, 2])
        fig.delaxes(grid[1, 2])
    epochs = {row["epoch"] for row in rows}
    for name, runs in _by_optimizer(rows).items():
        per_epoch = defaultdict(list)
        for row in runs:
            per_epoch[row["epoch"]].append(row)
        x = sorted(per_epoch)
        for ax, (key, _) in zip(axes, curves):
            if any(r.get(key) is None for r in runs):  # SGD has no realized sharpness
                continue
            scale = 100.0 if key.endswith("_acc") else 1.0
            values = [[scale * r[key] for r in per_epoch[e]] for e in x]
            mean = [sum(v) / len(v) for v in values]
            (line,) = ax.plot(x, mean, marker="o", markersize=3 if len(x) > 5 else 6, label=_TITLES.get(name, name))
            ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)
    for ax, (key, label) in zip(axes, curves):
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if key.endswith("_acc"):
            ax.set_ylim(0, 100)
        elif key.endswith("_loss"):
            ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-3))
    axes[0].set_xlim(min(epochs) - 1, max(epochs) + 1)
    for ax in axes[2:]:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend()
    fig.suptitle("mean over seeds (band: min to max)")
    return fig


def block_shares_figure(rows: list[dict]) -> Figure:
    """Per-block budget shares over steps, one stacked panel per sharpness-aware optimizer."""
    grouped = _by_optimizer(rows)
    # SAM first, so that its implicit allocation reads as the baseline of GEAR-SAM's
    names = [n for n in (SAM_RULE, GEAR_RULE) if n in grouped] + sorted(set(grouped) - {SAM_RULE, GEAR_RULE})
    fig = Figure(figsize=(5.5 * len(names), 4.2), layout="constrained")
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    for ax, name in zip(axes, names):
        per_step = defaultdict(list)
        for row in grouped[name]:
            per_step[row["step"]].append(row["share"])
        steps = sorted(per_step)
        blocks = grouped[name][0]["blocks"]
        # mean share of each block at each step, averaged over the seeds that reached that step
        shares = [[sum(s[b] for s in per_step[t]) / len(per_step[t]) for t in steps] for b in range(len(blocks))]
        ax.stackplot(steps, shares, labels=blocks, alpha=0.85)
        ax.set_title(f"{_TITLES.get(name, name)}" + (" (implicit allocation)" if name == SAM_RULE else ""))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(steps) > 1:
            ax.set_xlim(steps[0], steps[-1])
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("budget share  rho_b² / rho²")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", title="block")
    return fig


def study_figure(numbers: dict) -> Figure:
    """A study's test accuracy (%) against the varied setting, one line per optimizer (bars: ± std over seeds)."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    values = list(dict.fromkeys(row["value"] for row in numbers["accuracy"]))
    for name in dict.fromkeys(row["optimizer"] for row in numbers["accuracy"]):
        mine = {row["value"]: row for row in numbers["accuracy"] if row["optimizer"] == name}
        x = [i for i, v in enumerate(values) if v in mine]
        ax.errorbar(x, [mine[values[i]]["mean"] for i in x], yerr=[mine[values[i]]["std"] for i in x], marker="o",
                    capsize=3, label=_TITLES.get(name, name))  # fmt: skip
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set_xlabel(numbers["setting"])
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(numbers["about"])
    return fig


def hessian_figure(rows: list[dict]) -> Figure:
    """Histograms of the top Hessian eigenvalues per optimizer (every seed's), on shared bins."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    pooled = {name: [e for r in rows if r["optimizer"] == name for e in r["eigenvalues"]] for name in
              dict.fromkeys(r["optimizer"] for r in rows)}  # fmt: skip
    everything = [e for values in pooled.values() for e in values]
    low, high = min(everything), max(everything)
    bins = [low + (high - low) * i / 20 for i in range(21)] if high > low else 10
    for name, values in pooled.items():
        ax.hist(values, bins=bins, alpha=0.5, label=f"{_TITLES.get(name, name)} (max {max(values):.3g})")
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("count")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"top-{len(rows[0]['eigenvalues'])} Hessian eigenvalues")
    return fig


def render_study(study_dir: str | Path) -> list[Path]:
    """Write ``study.png`` (and ``hessian.png`` for each probed run) of a study directory; returns their paths."""
    study_dir = Path(study_dir)
    numbers = json.loads((study_dir / "study.json").read_text())
    written = [_save(study_figure(numbers), study_dir / "study.png")]
    for rows_file in sorted(study_dir.glob("*/hessian.jsonl")):
        written.append(render_hessian(rows_file.parent))
    return written


def render_hessian(run_dir: str | Path) -> Path:
    """Write ``hessian.png`` of a probed run directory; returns its path."""
    rows = read_metrics(Path(run_dir) / "hessian.jsonl")
    return _save(hessian_figure(rows), Path(run_dir) / "hessian.png")

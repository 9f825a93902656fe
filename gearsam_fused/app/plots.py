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
    from matplotlib.ticker import FuncFormatter, MaxNLocator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("plots need matplotlib: pip install matplotlib") from exc

from gearsam_fused import GEARSAM, SAM

from .metrics import read_metrics

# The rules' names, as the metrics rows call SAM and GEAR-SAM.
SAM_RULE, GEAR_RULE = SAM.rule, GEARSAM.rule

_TITLES = {"sgd": "SGD", SAM_RULE: "SAM", GEAR_RULE: "GEAR-SAM", "gsam": "GSAM", "wsam": "WSAM",
           "friendly-sam": "F-SAM", "gear-gsam": "GEAR-SAM + GSAM descent", "momentum-sam": "momentum SAM (one pass)",
           "momentum-gear-sam": "momentum GEAR-SAM (one pass)"}  # fmt: skip
# One colour per optimizer in every panel and figure, whichever optimizers a panel leaves out (SGD has no realized
# sharpness): matplotlib's cycle would hand the next line the colour of the one skipped.
_COLORS = {"sgd": "C0", SAM_RULE: "C1", GEAR_RULE: "C2", "gsam": "C3", "wsam": "C4", "friendly-sam": "C5",
           "gear-gsam": "C6", "momentum-sam": "C7", "momentum-gear-sam": "C8"}  # fmt: skip


def color_of(name: str) -> str:
    """The colour of optimizer ``name`` in every plot (one-pass ``NAME:RHO`` takes its NAME's); names beyond the known
    ones get the next colours of the cycle, in a fixed order."""
    name = name.partition(":")[0]
    if name in _COLORS:
        return _COLORS[name]
    return f"C{(len(_COLORS) + sum(map(ord, name))) % 10}"


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
            values = [[r[key] for r in per_epoch[e]] for e in x]
            mean = [sum(v) / len(v) for v in values]
            color = color_of(name)
            ax.plot(x, mean, marker="o", markersize=3 if len(x) > 5 else 6, label=_TITLES.get(name, name), color=color)
            ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.2)
    for ax, (key, label) in zip(axes, curves):
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if key.endswith("_acc"):
            ax.set_ylim(0, 100)
        elif key.endswith("_loss"):
            ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-3))
    axes[0].set_xlim(min(epochs) - 1, max(epochs) + 1)
    for ax in axes[2:]:  # the bottom row, and the sharpness panel, which has no panel below it
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelbottom=True)
    axes[0].legend()
    seeds = len({row["seed"] for row in rows})
    fig.suptitle("one seed" if seeds == 1 else f"mean over {seeds} seeds (band: min to max)")
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


def study_figure(numbers: dict, where: str = "") -> Figure:
    """A study's test accuracy (%) against the varied setting, one line per optimizer (bars: ± std over seeds, each
    optimizer's set a little apart so that they do not hide each other), titled with the study's settings."""
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.subplots()
    setting = numbers["setting"]
    values = list(dict.fromkeys(row["value"] for row in numbers["accuracy"]))
    names = list(dict.fromkeys(row["optimizer"] for row in numbers["accuracy"]))
    for index, name in enumerate(names):
        mine = {row["value"]: row for row in numbers["accuracy"] if row["optimizer"] == name}
        shift = 0.08 * (index - (len(names) - 1) / 2)
        x = [i for i, v in enumerate(values) if v in mine]
        std = [mine[values[i]]["std"] for i in x]
        ax.errorbar([i + shift for i in x], [mine[values[i]]["mean"] for i in x], marker="o", capsize=3,
                    yerr=[float("nan") if s is None else s for s in std], color=color_of(name),
                    label=_TITLES.get(name, name))  # fmt: skip
    percent = setting == "label_noise"
    ax.set_xticks(range(len(values)), [f"{100 * v:g}" if percent else str(v) for v in values])
    ax.set_xlabel({"label_noise": "symmetric label noise (% of training labels)", "rho": "ρ", "beta": "β",
                   "partition": "partition"}.get(setting, setting))  # fmt: skip
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="optimizer")  # beside the plot, never over a bar
    fig.suptitle(f"{numbers['about']}\n{where + ': ' if where else ''}{_settings_line(numbers)}", fontsize="medium")
    return fig


def transfer_figure(numbers: dict, where: str = "") -> Figure:
    """The transfer study: test accuracy (%) against the target's training images per class, one line per optimizer
    (bars: ± std over seeds); beside it, the per-seed paired differences between the optimizers (each seed a dot, the
    mean ± std a bar), which the seeds' spread does not blur."""
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    values = list(numbers["values"])
    names = list(dict.fromkeys(row["optimizer"] for row in numbers["accuracy"]))
    cfg = numbers.get("settings") or {}
    for index, name in enumerate(names):
        mine = {row["value"]: row for row in numbers["accuracy"] if row["optimizer"] == name}
        shift = 0.08 * (index - (len(names) - 1) / 2)
        x = [i for i, v in enumerate(values) if v in mine]
        rho = (cfg.get("optimizer_rho") or {}).get(name, cfg.get("rho"))  # each sharpness-aware one's own radius
        label = _TITLES.get(name, name) + ("" if name == "sgd" or rho is None else f" (ρ {rho:g})")
        left.errorbar([i + shift for i in x], [mine[values[i]]["mean"] for i in x], marker="o", capsize=3,
                      yerr=[_bar(mine[values[i]]["std"]) for i in x], color=color_of(name), label=label)  # fmt: skip
    left.set_ylabel("test accuracy (%)")
    left.set_title("accuracy after fine-tuning")
    left.legend(loc="lower right", title="optimizer")
    pairs = list(dict.fromkeys(row["pair"] for row in numbers["paired_differences"]))
    for index, pair in enumerate(pairs):
        b, _, a = pair.partition(" - ")
        label = f"{_TITLES.get(b, b)} − {_TITLES.get(a, a)}"
        mine = {row["value"]: row for row in numbers["paired_differences"] if row["pair"] == pair}
        shift = 0.12 * (index - (len(pairs) - 1) / 2)
        x = [i for i, v in enumerate(values) if v in mine]
        # the colour of the pair's first optimizer, a marker of its own; dashed where it is not set against SGD
        color, marker = color_of(b), "osD^v"[index % 5]
        for i in x:
            seeds = list(mine[values[i]]["per_seed"].values())
            right.plot([i + shift] * len(seeds), seeds, marker, color=color, alpha=0.35, markersize=4)
        right.errorbar([i + shift for i in x], [mine[values[i]]["mean"] for i in x], marker=marker, capsize=3,
                       yerr=[_bar(mine[values[i]]["std"]) for i in x], color=color, label=label,
                       linestyle="--" if a != "sgd" else "-")  # fmt: skip
    right.axhline(0.0, color="0.3", linewidth=0.8)
    right.set_ylabel("paired difference (accuracy points)")
    right.set_title("same seed: differences (dots: seeds; bars: mean ± std)")
    right.legend(loc="upper right", fontsize="small")
    for ax in (left, right):
        ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_xlabel("training images per class of the target")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{numbers['about']}\n{where + ': ' if where else ''}{_settings_line(numbers)}{_ran(numbers)}",
                 fontsize="medium")  # fmt: skip
    return fig


# The marker of each kind of second-pass schedule in the efficiency figure (its colour is the optimizer's), and of
# one-pass momentum SAM, whose configurations are its radii.
_SCHEDULE_MARKERS = {"always": "o", "every": "^", "looksam": "s", "random": "v", "adaptive": "D", "one pass": "P"}


def efficiency_figure(numbers: dict, where: str = "") -> Figure:
    """A baseline study's accuracy (%) against training time relative to the baseline, one marker per configuration:
    the colour is the optimizer (SAM-rule and GEAR-rule families apart), the shape the kind of schedule, each marker
    labelled with its schedule; bars: ± std over seeds, both ways."""
    fig = Figure(figsize=(9, 5.6), layout="constrained")
    ax = fig.subplots()
    accuracy = {(r["value"], r["optimizer"]): r for r in numbers["accuracy"]}
    reference = numbers.get("reference")
    for row in numbers["costs"]:
        value, name, time = row["value"], row["optimizer"], row["time_ratio"]
        if time is None:  # no baseline run of that seed yet: no time to set it against
            continue
        acc = accuracy[(value, name)]
        base, _, rho = name.partition(":")
        kind = "one pass" if rho else str(value).split(":")[0]
        ax.errorbar(time["mean"], acc["mean"], xerr=_bar(time["std"]), yerr=_bar(acc["std"]), color=color_of(name),
                    marker=_SCHEDULE_MARKERS.get(kind, "o"), markersize=9 if value == reference else 7, capsize=3,
                    elinewidth=0.8, linestyle="none")  # fmt: skip
        label = f"ρ {rho}" if rho else _TITLES.get(name, name) if value == reference else str(value)
        ax.annotate(label, (time["mean"], acc["mean"]), textcoords="offset points", xytext=(6, 5), fontsize="small",
                    color=color_of(name))  # fmt: skip
    names = list(dict.fromkeys(r["optimizer"].partition(":")[0] for r in numbers["costs"]))
    kinds = list(dict.fromkeys("one pass" if ":" in r["optimizer"] else str(r["value"]).split(":")[0]
                               for r in numbers["costs"] if r["optimizer"] != "sgd"))  # fmt: skip
    handles = [ax.plot([], [], "o", color=color_of(n), label=_TITLES.get(n, n))[0] for n in names]
    handles += [ax.plot([], [], _SCHEDULE_MARKERS.get(k, "o"), color="0.4", label=k)[0] for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="optimizer / schedule")
    baseline = numbers.get("baseline") or "the baseline"
    ax.set_xlabel(f"training time relative to {_TITLES.get(baseline, baseline)} (same seed; wall clock)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{numbers['about']}\n{where + ': ' if where else ''}{_settings_line(numbers)}{_ran(numbers)}",
                 fontsize="medium")  # fmt: skip
    return fig


def _bar(std: float | None) -> float:
    return float("nan") if std is None else std


def _ran(numbers: dict) -> str:
    """Where and when a study's runs ran, for a figure's title: the first start's machine and date."""
    machines = numbers.get("machines")
    if not machines:
        return ""
    first = machines[0]
    gpu = f", {first['gpu']}" if first.get("gpu") else ""
    return f"\n{first['date']}, {first['cpu']} ({first['cpu_count']} cores){gpu}"


def _settings_line(numbers: dict) -> str:
    """The run behind a study's figure, in one line: data, model, epochs and how many seeds the bars span."""
    cfg = numbers.get("settings")
    if not cfg:
        return "mean ± std over seeds"
    seeds = len(cfg["seeds"])
    return (f"{cfg['dataset']}, {cfg['model']}, {cfg['epochs']} epoch{'s' * (cfg['epochs'] != 1)}, "
            f"mean ± std over {seeds} seed{'s' * (seeds != 1)}" + ("" if seeds > 1 else " (no spread)"))  # fmt: skip


def hessian_figure(rows: list[dict], title: str = "") -> Figure:
    """The top Hessian eigenvalues per optimizer, by rank: the mean over seeds with its min-max band, on a log axis
    (the spectrum falls by orders of magnitude); eigenvalues that did not converge are marked with a cross."""
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.subplots()
    names = list(dict.fromkeys(r["optimizer"] for r in rows))
    k = len(rows[0]["eigenvalues"])
    ranks = list(range(1, k + 1))
    positive = all(e > 0 for r in rows for e in r["eigenvalues"])
    for name in names:
        mine = [r["eigenvalues"] for r in rows if r["optimizer"] == name]
        columns = list(zip(*mine))
        mean = [sum(c) / len(c) for c in columns]
        color = color_of(name)
        ax.plot(ranks, mean, marker="o", color=color, label=f"{_TITLES.get(name, name)} (max {mean[0]:.3g})")
        ax.fill_between(ranks, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2)
        loose = [(i + 1, e) for r in rows if r["optimizer"] == name for i, (e, ok) in
                 enumerate(zip(r["eigenvalues"], r.get("converged", [True] * k))) if not ok]  # fmt: skip
        if loose:
            ax.plot(*zip(*loose), "x", color=color, markersize=9)
    if positive:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")  # 20, not 2 x 10^1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("rank of the eigenvalue")
    ax.set_ylabel("Hessian eigenvalue")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="optimizer")
    seeds = len({r["seed"] for r in rows})
    fig.suptitle(f"top-{k} Hessian eigenvalues{title}: mean over {seeds} seed{'s' * (seeds != 1)} (band: min to max;"
                 " x: not converged)", fontsize="medium")  # fmt: skip
    return fig


def render_study(study_dir: str | Path) -> list[Path]:
    """Write ``study.png`` (and ``hessian.png`` for each probed run) of a study directory; returns their paths. The
    Hessian study's figure is its spectrum."""
    study_dir = Path(study_dir)
    numbers = json.loads((study_dir / "study.json").read_text())
    if numbers.get("costs"):
        figure = efficiency_figure(numbers, study_dir.name)
    elif numbers.get("study") == "transfer" and numbers.get("accuracy"):
        figure = transfer_figure(numbers, study_dir.name)
    elif numbers.get("hessian"):
        rows = [row for value_rows in numbers["hessian"].values() for row in value_rows]
        figure = hessian_figure(rows, f" of {study_dir.name}")
    elif numbers.get("accuracy"):
        figure = study_figure(numbers, study_dir.name)
    else:
        raise ValueError(f"{study_dir} has no finished run yet: nothing to plot")
    written = [_save(figure, study_dir / "study.png")]
    for rows_file in sorted(study_dir.glob("*/hessian.jsonl")):
        written.append(render_hessian(rows_file.parent))
    return written


def render_hessian(run_dir: str | Path) -> Path:
    """Write ``hessian.png`` of a probed run directory; returns its path."""
    rows = read_metrics(Path(run_dir) / "hessian.jsonl")
    return _save(hessian_figure(rows, f" of {Path(run_dir).name}"), Path(run_dir) / "hessian.png")

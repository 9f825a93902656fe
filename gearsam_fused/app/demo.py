"""``gearsam demo``: SGD, SAM and GEAR-SAM side by side where they part, in about half a minute of CPU.

scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes) train a small three-stage ResNet in seconds
on a CPU; every optimizer sees the same seed's split, flipped labels, initial weights and batch order. On the clean
digits all three end at about 99% and nothing separates them; the demo flips 40% of the training labels (the noisy
setting of ``gearsam reproduce``), where SGD learns flipped labels that sharpness-aware training leaves alone. It
prints the test accuracy, each optimizer's difference to SGD under the same seed and the training's CPU time, then a
one-line reading of the run, and zooms the accuracy panels of ``curves.png`` to the run's range, each final value
labelled.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .metrics import read_metrics
from .training import GEAR_RULE, PAPER, SAM_RULE, SGD, RunConfig, run_experiment

#: What ``gearsam demo`` sets beyond :func:`demo_config`: 40% of the training labels flipped; a radius for noisy
#: labels (in the studies, 15 epochs at 40%: SAM gains about 6 points over SGD at rho 0.05, about 20 at 0.15 to 0.3);
#: the cosine schedule, which settles the last epoch's accuracy (a constant lr swings it by points from epoch to
#: epoch); ten epochs and one seed, which fit half a minute; one thread, so that the CPU time is the training's own
#: work (threads that wait for each other on a busy machine spin, and their CPU time counts) and the accuracies do not
#: depend on the machine's core count.
DEMO = {"label_noise": 0.4, "rho": 0.2, "schedule": "cosine", "epochs": 10, "seeds": [0], "threads": 1}

# How the report names the optimizers.
_TITLES = {SGD: "SGD", SAM_RULE: "SAM", GEAR_RULE: "GEAR-SAM"}


def demo_config(**overrides) -> RunConfig:
    """The digits settings the demo and the paper's studies start from (``study_config`` builds on them): digits, the
    five-block ``digits_resnet``, SGD, SAM and GEAR-SAM, 15 epochs, three seeds, constant lr 0.05, clean labels.
    ``gearsam demo`` runs :func:`demo_run_config`."""
    settings = dict(
        command="demo", dataset="digits", model="digits_resnet", optimizers=list(PAPER), seeds=[0, 1, 2],
        epochs=15, batch_size=64, lr=0.05, rho=0.05, beta=0.9, telemetry_every=25,
    )  # fmt: skip
    settings.update(overrides)
    return RunConfig(**settings)


def demo_run_config(**given) -> RunConfig:
    """The settings of ``gearsam demo``: :func:`demo_config` with :data:`DEMO`, then ``given`` (the options)."""
    return demo_config(**{**DEMO, **given})


def run_demo(cfg: RunConfig, run_dir: Path, *, overwrite: bool = False, log=print, stream=None) -> list[dict]:
    """Train the demo's runs into ``run_dir`` (see :func:`~.training.run_experiment`), then report them: the table
    of :func:`demo_table` and the line of :func:`demo_reading`, through ``log`` and into ``summary.md``. Returns the
    ``result`` rows."""
    said: list[str] = []

    def description_only(line: str) -> None:
        # run_experiment's first line describes the run, once every setting has passed its checks; its per-run lines
        # and table give wall-clock times, which the demo's table replaces with CPU time
        if not said:
            log(line)
        said.append(line)

    results = run_experiment(cfg, run_dir, overwrite=overwrite, log=description_only, stream=stream)
    table, reading = demo_table(results, cfg.optimizers), demo_reading(results, cfg)
    log("")
    log(table)
    log("")
    log(reading)
    summary = Path(run_dir) / "summary.md"
    head = summary.read_text().split("```")[0] if summary.is_file() else ""  # the title, machine and date
    summary.write_text(f"{head}```\n{table}\n```\n\n{reading}\n")
    return results


def _per_seed(results: list[dict], name: str, key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in results if r["optimizer"] == name}


def _spread(values: list[float], form: str) -> str:
    """``± std`` over seeds, or ``± n/a`` for a single seed, which has no spread."""
    return f"± {format(statistics.stdev(values), form)}" if len(values) > 1 else "± n/a"


def demo_table(results: list[dict], optimizers) -> str:
    """Per optimizer: test accuracy (%, mean ± std over seeds), its difference to SGD's under the same seed (points,
    mean ± std over seeds) and the training's CPU time per run (the process's, evaluation left out) with its ratio to
    SGD's."""
    accuracy = {name: _per_seed(results, name, "test_acc") for name in optimizers}
    cpu = {name: _per_seed(results, name, "cpu_seconds") for name in optimizers}
    width = max(9, *map(len, optimizers))
    header = f"{'optimizer':<{width}}  {'test acc (%)':<14}  {'vs SGD, same seed':>17}  {'training CPU time / run':>23}"
    lines = [header, "-" * len(header)]
    for name in optimizers:
        accs = list(accuracy[name].values())
        acc = f"{statistics.mean(accs):.2f} {_spread(accs, '.2f')}"
        diffs = [a - accuracy[SGD][seed] for seed, a in accuracy[name].items() if seed in accuracy.get(SGD, {})]
        diff = f"{statistics.mean(diffs):+.2f} {_spread(diffs, '.2f')}" if name != SGD and diffs else "-"
        seconds = statistics.mean(cpu[name].values())
        ratio = f"({seconds / statistics.mean(cpu[SGD].values()):.1f}x SGD)" if name != SGD and SGD in cpu else ""
        lines.append(f"{name:<{width}}  {acc:<14}  {diff:>17}  {seconds:>8.1f} s {ratio:<12}".rstrip())
    return "\n".join(lines)


def demo_reading(results: list[dict], cfg: RunConfig) -> str:
    """The run in one line: GEAR-SAM's and SAM's test accuracy against SGD's (the mean of the same-seed differences),
    at what CPU time, over how many seeds, and nothing the run does not show."""
    accuracy = {name: _per_seed(results, name, "test_acc") for name in cfg.optimizers}
    cpu = {name: statistics.mean(_per_seed(results, name, "cpu_seconds").values()) for name in cfg.optimizers}
    compared = [name for name in (GEAR_RULE, SAM_RULE) if name in accuracy and SGD in accuracy]
    if not compared:
        return "Reading: none; it sets SAM or GEAR-SAM against SGD, and this run did not train both."
    seeds = sorted(accuracy[SGD])
    parts = []
    for name in compared:
        diffs = [accuracy[name][seed] - accuracy[SGD][seed] for seed in seeds]
        mean = statistics.mean(diffs)
        side = "level with SGD" if round(mean, 1) == 0 else f"{abs(mean):.1f} points {'above' if mean > 0 else 'below'}"
        if not parts:
            side = f"ends {side}" + (" SGD" if round(mean, 1) else "") + " in test accuracy"
        ahead = f" (ahead on {sum(d > 0 for d in diffs)} of {len(diffs)} seeds)" if len(diffs) > 1 else ""
        parts.append(f"{_TITLES[name]} {side}{ahead}")
    labels = f"with {cfg.label_noise:.0%} of the training labels flipped" if cfg.label_noise else "on clean labels"
    costs = " and ".join(f"{cpu[name] / cpu[SGD]:.1f}x" for name in compared)
    text = f"Reading: {labels}, {' and '.join(parts)}, for {costs} SGD's training CPU time; "
    if len(seeds) == 1:
        return text + f"one seed ({seeds[0]}), a single draw, not an average (--seeds 0 1 2 trains more)."
    return text + f"the mean of the same-seed differences over {len(seeds)} seeds ({', '.join(map(str, seeds))})."


def is_demo_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run of ``gearsam demo`` (its ``config.json`` says so)."""
    config = Path(run_dir) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("command") == "demo"


def render_demo(run_dir: str | Path) -> list[Path]:
    """Write a demo run's plots, as :func:`~.plots.render` does, with the accuracy panels of ``curves.png`` zoomed to
    the run's range and each optimizer's final value labelled; returns their paths. Needs matplotlib."""
    from . import plots  # an ImportError without matplotlib, as for every plot

    run_dir = Path(run_dir)
    source = run_dir / "metrics.jsonl"
    rows = read_metrics(source) if source.is_file() else []
    epochs = [r for r in rows if r["kind"] == "epoch"]
    if not epochs:
        return plots.render(run_dir)  # which says what is missing
    noise = json.loads((run_dir / "config.json").read_text()).get("label_noise", 0.0)
    written = [run_dir / "curves.png"]
    demo_curves_figure(epochs, noise).savefig(written[0], dpi=110)
    blocks = [r for r in rows if r["kind"] == "blocks"]
    if blocks:
        written.append(run_dir / "block_shares.png")
        plots.block_shares_figure(blocks).savefig(written[1], dpi=110)
    return written


def demo_curves_figure(rows: list[dict], noise: float):
    """:func:`~.plots.curves_figure` of the epoch ``rows``, its accuracy panels zoomed and labelled (see
    :func:`_zoom_accuracies`), titled with the share ``noise`` of training labels flipped. Needs matplotlib."""
    from . import plots

    figure = plots.curves_figure(rows)
    _zoom_accuracies(figure, noise)
    seeds = len({r["seed"] for r in rows})
    spread = "one seed" if seeds == 1 else f"mean over {seeds} seeds (band: min to max)"
    figure.suptitle(f"{noise:.0%} of the training labels flipped; {spread}" if noise else spread)
    return figure


def _zoom_accuracies(figure, noise: float) -> None:
    """Zoom each accuracy panel of ``figure`` (a :func:`~.plots.curves_figure`) to the range of its curves and bands,
    and label each curve's final value at its right end, in its colour (labels moved apart where values are close).
    The training accuracy is on the labels trained on: with ``noise``, a dashed line marks the share of them left
    unflipped, above which a model has learned flipped labels."""
    last = max(x for ax in figure.axes for line in ax.lines for x in line.get_xdata())
    kept = 100.0 * (1.0 - noise)
    for ax in figure.axes:
        title = ax.get_title()
        if not title.endswith("accuracy (%)") or not ax.lines:
            continue
        low, high = ax.dataLim.intervaly
        marked = noise and title.startswith("train")
        if marked:
            low, high = min(low, kept), max(high, kept)
        pad = max(1.0, 0.06 * (high - low))
        ax.set_ylim(max(low - pad, 0.0), min(high + pad, 101.0))
        bottom, top = ax.get_ylim()
        placed: list[float] = []
        ends = sorted((line.get_ydata()[-1], line.get_xdata()[-1], line.get_color()) for line in ax.lines)
        gap = 0.07 * (top - bottom)
        for y, *_ in ends:  # upwards from the lowest value, a gap apart; then down again from below the top
            placed.append(max(y, placed[-1] + gap) if placed else y)
        for i in reversed(range(len(placed))):
            placed[i] = min(placed[i], placed[i + 1] - gap if i + 1 < len(placed) else top - gap / 2)
        for (y, x, color), at in zip(ends, placed):
            ax.annotate(f"{y:.1f}", xy=(x, y), xytext=(x + 0.15, at), va="center", fontsize="small", color=color,
                        annotation_clip=False)  # fmt: skip
        if marked:
            ax.set_title("train accuracy on the noisy labels (%)")
            ax.axhline(kept, color="0.4", linestyle="--", linewidth=0.8)
            ax.annotate(f"labels left unflipped: {kept:.0f}%", xy=(0.02, kept), xycoords=("axes fraction", "data"),
                        xytext=(0, -3), textcoords="offset points", va="top", fontsize="small", color="0.4")  # fmt: skip
    for ax in figure.axes:  # room for the labels right of the last epoch (the panels share their epoch axis)
        ax.set_xlim(right=max(ax.get_xlim()[1], last + 1.6))

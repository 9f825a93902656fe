"""``gearsam reproduce STUDY``: the paper's studies as runs of the training loop under the same seeds.

A study varies one setting over a grid (the paper's, or ``--values``) and trains its optimizers at every value, each
value in a run directory of its own under the study's (``label_noise=0.2/``, ...). It then writes ``study.md``: the
test accuracy (mean ± std over seeds) per value and optimizer, and the per-seed paired differences between them —
the same seed gives two optimizers the same initial weights, batches and noisy labels, so the paired difference is
the comparison the seed spread does not blur — and ``study.json`` with every number. The plots draw ``study.png``.
The ``hessian`` study trains each optimizer once, keeps the final weights and probes their Hessian spectrum.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from gearsam_fused.allocation import GEAR_RULE, SAM_RULE
from gearsam_fused.partition import STRATEGIES

from .demo import demo_config
from .probe import ProbeSettings, probe_run, spectrum_table
from .training import SGD, RunConfig, run_experiment

SUMMARY = "study.md"
NUMBERS = "study.json"


@dataclass(frozen=True)
class Study:
    """``setting`` of :class:`RunConfig` takes each of ``values`` for ``optimizers``; ``base`` are the study's own
    defaults beyond :data:`DEFAULTS`."""

    setting: str
    values: tuple
    optimizers: tuple[str, ...]
    about: str
    base: tuple = ()
    reference: object = None  # the value each other is compared with, seed by seed (one-optimizer studies)


#: Every study's defaults beyond the demo's. With a constant lr the last epoch's accuracy on noisy labels swings by
#: several points from seed to seed; the cosine schedule settles it, and five seeds make the paired differences
#: between optimizers readable.
DEFAULTS = {"schedule": "cosine", "seeds": [0, 1, 2, 3, 4]}
# On the clean digits every setting reaches about 99.4%: the studies of a setting train on 40% noisy labels instead.
_NOISY = (("label_noise", 0.4),)


STUDIES = {
    "label-noise": Study("label_noise", (0.0, 0.2, 0.4, 0.6, 0.8), (SGD, SAM_RULE, GEAR_RULE),
                         "symmetric label noise on the training set (paper: Robustness to Label Noise)"),
    # the global partition, a single block, is SAM itself
    "partition": Study("partition", STRATEGIES, (GEAR_RULE,), "GEAR-SAM's partition of the network into blocks",
                       _NOISY, "global"),
    "rho": Study("rho", (0.10, 0.15, 0.20, 0.25, 0.30), (SAM_RULE, GEAR_RULE), "the global radius rho", _NOISY),
    "beta": Study("beta", (0.80, 0.85, 0.90, 0.95, 0.99), (GEAR_RULE,), "GEAR-SAM's EMA factor beta", _NOISY, 0.90),
    # one value, the configured label noise: the study is the probe of the trained models
    "hessian": Study("label_noise", (), (SGD, SAM_RULE, GEAR_RULE),
                     "the Hessian spectrum of the trained models (paper: Top Eigenvalues of Hessian)",
                     (("seeds", [0, 1, 2]),)),
}  # fmt: skip


def study_config(name: str | None = None, **given) -> RunConfig:
    """The settings of study ``name`` (of every study when None): the demo's, :data:`DEFAULTS`, the study's own,
    then ``given``."""
    base = dict(STUDIES[name].base) if name else {}
    return demo_config(**{"command": f"reproduce {name or ''}".strip(), **DEFAULTS, **base, **given})


def run_study(name: str, cfg: RunConfig, study_dir: Path, *, values=None, probe: ProbeSettings | None = None,
              log=print) -> dict:  # fmt: skip
    """Run study ``name`` with ``cfg``'s other settings (its ``optimizers`` are the study's, unless ``cfg`` names a
    subset of them); writes ``study.md`` and ``study.json`` into ``study_dir`` and returns the numbers."""
    study = STUDIES[name]
    values = tuple(values) if values else study.values or (getattr(cfg, study.setting),)
    optimizers = tuple(o for o in study.optimizers if o in cfg.optimizers) or study.optimizers
    probe = probe or ProbeSettings()
    results, spectra = {}, {}
    for value in values:
        run_cfg = dataclasses.replace(cfg, command=f"reproduce {name}", optimizers=list(optimizers),
                                      **{study.setting: value})  # fmt: skip
        if name == "hessian":
            run_cfg = dataclasses.replace(run_cfg, checkpoint_every=run_cfg.epochs)
        run_dir = Path(study_dir) / f"{study.setting}={value}"
        log(f"\n== {study.setting} = {value}")
        results[value] = run_experiment(run_cfg, run_dir, log=log)
        if name == "hessian":
            spectra[value] = probe_run(run_dir, probe, log=log)
    numbers = summarize_study(study, values, optimizers, results)
    text = study_markdown(name, cfg, numbers)
    if spectra:
        numbers["hessian"] = {str(value): rows for value, rows in spectra.items()}
        for rows in spectra.values():
            text += (f"\nHessian spectrum of the mean test loss ({probe.batches} batches of {probe.batch_size} test "
                     f"images), mean ± std over seeds:\n\n```\n{spectrum_table(rows, probe.k)}\n```\n")  # fmt: skip
    Path(study_dir).mkdir(parents=True, exist_ok=True)
    (Path(study_dir) / NUMBERS).write_text(json.dumps(numbers, indent=2) + "\n")
    (Path(study_dir) / SUMMARY).write_text(text)
    return numbers


def summarize_study(study: Study, values, optimizers, results: dict) -> dict:
    """Accuracy (%) per value and optimizer (mean, std, per seed) and per-seed paired differences: between each pair
    of optimizers at each value, and each optimizer's at each value against its own at the study's ``reference``."""
    accuracy = {
        v: {o: {r["seed"]: 100.0 * r["test_acc"] for r in results[v] if r["optimizer"] == o} for o in optimizers}
        for v in values
    }
    rows = [{"value": v, "optimizer": o, **_stats(accuracy[v][o])} for v in values for o in optimizers]
    pairs = []
    for value in values:
        for first, second in itertools.combinations(optimizers, 2):
            pairs.append({"value": value, "pair": f"{second} - {first}", **_paired(accuracy[value][second],
                                                                                   accuracy[value][first])})  # fmt: skip
        if study.reference in values and value != study.reference:
            for name in optimizers:
                pairs.append({"value": value, "pair": f"{name} - {name} at {study.setting}={study.reference}",
                              **_paired(accuracy[value][name], accuracy[study.reference][name])})  # fmt: skip
    return {"setting": study.setting, "about": study.about, "accuracy": rows, "paired_differences": pairs}


def _paired(minuend: dict, subtrahend: dict) -> dict:
    """:func:`_stats` of the per-seed differences over the seeds both have."""
    seeds = sorted(set(minuend) & set(subtrahend))
    return _stats({s: minuend[s] - subtrahend[s] for s in seeds})


def _stats(per_seed: dict) -> dict:
    values = list(per_seed.values())
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "per_seed": {str(seed): value for seed, value in per_seed.items()},
    }


def study_markdown(name: str, cfg: RunConfig, numbers: dict) -> str:
    """``study.md``: the settings, the accuracy table and the paired differences (mean ± std over seeds)."""
    setting = numbers["setting"]
    lines = [
        f"# gearsam reproduce {name}: {numbers['about']}",
        "",
        f"{cfg.dataset}, model {cfg.model}, {cfg.epochs} epochs, seeds {list(cfg.seeds)}, lr {cfg.lr}, batch "
        f"{cfg.batch_size}, rho {cfg.rho}, beta {cfg.beta}, partition {cfg.partition}, label noise "
        f"{cfg.label_noise} (unless varied: {setting}). Each value's run directory has its own summary.md with the "
        "machine and date.",
        "",
        "Test accuracy (%), mean ± std over seeds:",
        "",
        f"| {setting} | optimizer | accuracy | per seed |",
        "|---|---|---:|---|",
    ]
    for row in numbers["accuracy"]:
        seeds = ", ".join(f"{v:.2f}" for v in row["per_seed"].values())
        lines.append(f"| {row['value']} | {row['optimizer']} | {row['mean']:.2f} ± {row['std']:.2f} | {seeds} |")
    if numbers["paired_differences"]:
        lines += ["", "Paired differences (same seed), accuracy points, mean ± std over seeds:", "",
                  f"| {setting} | difference | mean ± std | per seed |", "|---|---|---:|---|"]  # fmt: skip
        for row in numbers["paired_differences"]:
            seeds = ", ".join(f"{v:+.2f}" for v in row["per_seed"].values())
            lines.append(f"| {row['value']} | {row['pair']} | {row['mean']:+.2f} ± {row['std']:.2f} | {seeds} |")
    return "\n".join(lines) + "\n"

"""``gearsam reproduce STUDY``: the paper's studies as runs of the training loop under the same seeds.

A study varies one setting over a grid (the paper's, or ``--values``) and trains its optimizers at every value, each
value in a run directory of its own under the study's (``label_noise=0.2/``, ...). It then writes ``study.md``: the
test accuracy (mean ± std over seeds) per value and optimizer, and the per-seed paired differences between them —
the same seed gives two optimizers the same initial weights, batches and noisy labels, so the paired difference is
the comparison the seed spread does not blur — and ``study.json`` with every number. The plots draw ``study.png``.
The ``hessian`` study trains each optimizer once, keeps the final weights and probes their Hessian spectrum. The
``efficiency`` study varies SAM's and GEAR-SAM's second-pass schedule and sets accuracy against cost: the share of
steps that took the second pass and the training time against SGD's, trained once, at the reference value, as is
one-pass momentum SAM at each of its radii. The
``family`` study trains the SAM family's variants (:data:`~.training.FAMILY`) beside SGD, SAM and GEAR-SAM at one
label noise. The ``transfer`` study fine-tunes a pretrained network on a new task with SGD, SAM and GEAR-SAM, from a
few training images per class to all of them: from ``--weights`` (torchvision's ImageNet weights, say), or, without
them, from a source network it pretrains itself, once per seed, on the dataset's other classes (``source/``, a run
directory of its own that every optimizer and target size starts from).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from gearsam_fused.partition import STRATEGIES

from ..machine import describe_machine
from .demo import demo_config
from .metrics import MetricsLog, read_metrics
from .probe import ROWS, ProbeSettings, probe_run, spectrum_table
from .training import (
    ALL,
    ALWAYS,
    FAMILY,
    GEAR_RULE,
    ONE_PASS,
    RESUMABLE,
    SAM_RULE,
    SGD,
    RunConfig,
    check_model,
    check_out,
    check_run_weights,
    checkpoint_path,
    clear_dir,
    load_run_data,
    one_pass,
    plural,
    run_experiment,
)
from .weights import SEED

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
    # an optimizer trained at the reference value only, which every other run is compared with, seed by seed, in
    # accuracy and in training time (the study's table then has the costs: see summarize_study)
    baseline: str | None = None

    def trained_at(self, value, optimizers: tuple) -> tuple:
        """The optimizers of ``optimizers`` that the study trains at ``value``: at a baseline study's other values,
        not the baseline nor one-pass momentum SAM, which have no second pass to schedule."""
        if self.baseline is None or value == self.reference:
            return optimizers
        return tuple(o for o in optimizers if o != self.baseline and one_pass(o) is None)


#: Every study's defaults beyond the demo's. With a constant lr the last epoch's accuracy on noisy labels swings by
#: several points from seed to seed; the cosine schedule settles it, and five seeds make the paired differences
#: between optimizers readable. A checkpoint every epoch lets ``--resume`` continue a run where it was cut off.
DEFAULTS = {"schedule": "cosine", "seeds": [0, 1, 2, 3, 4], "checkpoint_every": 1}
# On the clean digits every setting reaches about 99.4%: the studies of a setting train on 40% noisy labels instead.
_NOISY = (("label_noise", 0.4),)


#: The efficiency study's look-ahead radii of one-pass momentum SAM.
MOMENTUM_RHOS = ("0.1", "0.3", "1", "3")

#: The transfer study's fine-tuning, the paper's: 30 epochs at lr 0.01 with cosine decay, SGD (momentum 0.9) as the
#: base optimizer, SAM at rho 0.05 and GEAR-SAM at rho 0.2 with beta 0.9, no augmentation, every layer trained, the
#: classifier replaced. Without --weights, on the digits: the target is digits 5-9, in batches of 32 (the paper's 128
#: is more than a few-image target holds), weight decay 1e-4 (the paper's for ResNet-50: the digits network is a
#: ResNet).
_TRANSFER = (("epochs", 30), ("lr", 0.01), ("batch_size", 32), ("momentum", 0.9), ("weight_decay", 1e-4),
             ("rho", 0.05), ("optimizer_rho", {GEAR_RULE: 0.2}), ("beta", 0.9), ("classes", [5, 6, 7, 8, 9]))  # fmt: skip
#: The paper's weight decay by backbone (1e-4 for every other, ResNet-50's).
TRANSFER_WEIGHT_DECAY = {"efficientnet_b0": 1e-5}
#: With --weights: the paper's batch of 128 and every class of the target dataset.
_FROM_WEIGHTS = {"batch_size": 128, "classes": None}
#: The transfer study's source network, pretrained by the study itself when it is given no --weights: SGD alone on
#: the dataset's classes outside the target's, with the digits studies' settings (the same model, seeds, device and
#: threads as the fine-tuning), one network per seed, in the study's run directory ``source/``.
SOURCE = "source"
SOURCE_SETTINGS = {"epochs": 15, "lr": 0.05, "batch_size": 64, "momentum": 0.9, "weight_decay": 5e-4,
                   "schedule": "cosine"}  # fmt: skip

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
    # SGD and one-pass momentum SAM, at the cost of one pass, train once: they have no second pass to schedule. The
    # one-pass radius moves along the momentum, on another scale than SAM's: a grid of its own finds its best value
    "efficiency": Study("second_pass", (ALWAYS, "every:2", "every:5", "every:10", "looksam:2", "looksam:5",
                                        "looksam:10", "adaptive"),
                        (SGD, SAM_RULE, GEAR_RULE, *(f"{name}:{rho}" for name in ONE_PASS for rho in MOMENTUM_RHOS)),
                        "second-pass schedules and one-pass momentum SAM: accuracy against cost, next to full "
                        "SAM/GEAR-SAM and SGD", (*_NOISY, ("epochs", 8)), ALWAYS, SGD),
    # one value, the other studies' 40% noisy labels: SGD, SAM and GEAR-SAM first, so that the paired differences
    # set each variant against both
    "family": Study("label_noise", (0.4,), (SGD, SAM_RULE, GEAR_RULE, *FAMILY),
                    "the SAM family (GSAM, WSAM, F-SAM, GEAR-SAM with GSAM's descent) next to SGD, SAM and GEAR-SAM",
                    _NOISY),
    # the target's training images per class, a few to all; with --weights, all of them unless --values says more
    "transfer": Study("train_per_class", (2, 5, 10, 20, 50, ALL), (SGD, SAM_RULE, GEAR_RULE),
                      "fine-tuning a pretrained network on a new task, from a few training images per class to all "
                      "(paper: Transfer Learning)", _TRANSFER),
}  # fmt: skip


def study_config(name: str | None = None, **given) -> RunConfig:
    """The settings of study ``name`` (of every study when None): the demo's, :data:`DEFAULTS`, the study's own
    (its optimizers among them: the demo trains only SGD, SAM and GEAR-SAM), then ``given``. The transfer study's
    own depend on what is given (:func:`transfer_defaults`)."""
    base = {"optimizers": list(STUDIES[name].optimizers), **dict(STUDIES[name].base)} if name else {}
    if name == "transfer":
        base, given = transfer_defaults(base, given)
    return demo_config(**{"command": f"reproduce {name or ''}".strip(), **DEFAULTS, **base, **given})


def transfer_defaults(base: dict, given: dict) -> tuple[dict, dict]:
    """The transfer study's defaults and the settings given, for what is given: the paper's weight decay for the
    backbone (:data:`TRANSFER_WEIGHT_DECAY`); with ``weights``, the paper's batch, every class, and an image folder
    when a ``data_dir`` is given without a dataset; radii given per optimizer added to the study's."""
    base = {**base, "weight_decay": TRANSFER_WEIGHT_DECAY.get(given.get("model"), base["weight_decay"])}
    if given.get("weights") is not None:
        base.update(_FROM_WEIGHTS)
        if given.get("data_dir") is not None and "dataset" not in given:
            base["dataset"] = "imagefolder"
    if "optimizer_rho" in given:
        given = {**given, "optimizer_rho": {**base["optimizer_rho"], **given["optimizer_rho"]}}
    return base, given


def source_config(cfg: RunConfig, num_classes: int) -> RunConfig:
    """The transfer study's source run (:data:`SOURCE_SETTINGS`): SGD alone on the ``num_classes`` classes of the
    dataset outside ``cfg.classes``, every training image, clean labels, a checkpoint at the end at least (the
    fine-tuning starts from it)."""
    classes = [c for c in range(num_classes) if c not in cfg.classes]
    return dataclasses.replace(
        cfg, optimizers=[SGD], classes=classes, train_per_class=ALL, weights=None, label_noise=0.0,
        second_pass=ALWAYS, optimizer_rho={}, **SOURCE_SETTINGS,
        checkpoint_every=cfg.checkpoint_every or SOURCE_SETTINGS["epochs"],
    )  # fmt: skip


#: Where a fine-tuning run of the transfer study finds its seed's source network: relative to its run directory.
SOURCE_WEIGHTS = str(Path("..") / SOURCE / checkpoint_path(Path(), SGD, SEED))


def _transfer_source(cfg: RunConfig, model) -> RunConfig | None:
    """The transfer study's source run for ``cfg``, None when it starts from ``--weights``; a ValueError, before
    anything is written, for weights that do not fit ``model`` (built with ``cfg``, on the meta device) and for a
    study that has neither weights nor target classes with others to pretrain on."""
    if cfg.weights is not None:
        check_run_weights(cfg, model)
        return None
    data = load_run_data(dataclasses.replace(cfg, classes=None))
    if cfg.classes is None or data.num_classes - len(set(cfg.classes)) < 2:
        raise ValueError(f"the transfer study fine-tunes the network of --weights PATH (a state dict you have, "
                         f"torchvision's ImageNet weights say) or, without it, a source network it pretrains on the "
                         f"dataset's classes outside the target's --classes; {data.name} has {data.num_classes} "
                         f"classes and --classes names {cfg.classes}, which leaves fewer than 2 to pretrain on")  # fmt: skip
    source = source_config(cfg, data.num_classes).validate()
    check_model(source, load_run_data(source))
    return source


def run_study(name: str, cfg: RunConfig, study_dir: Path, *, values=None, probe: ProbeSettings | None = None,
              overwrite: bool = False, resume: bool = False, log=print) -> dict:  # fmt: skip
    """Run study ``name`` with ``cfg``'s other settings (its ``optimizers`` are the study's, unless ``cfg`` names a
    subset of them); writes ``study.md`` and ``study.json`` into ``study_dir`` and returns the numbers. Every run's
    settings are checked first; ``study_dir`` must be empty, or is cleared with ``overwrite``. With ``resume``, the
    runs already in ``study_dir`` go on from their checkpoints and finished runs are kept, not trained again."""
    study = STUDIES[name]
    if not values and name == "transfer" and cfg.weights is not None:
        values = (ALL,)  # the paper's table: every training image of the target
    values = tuple(values) if values else study.values or (getattr(cfg, study.setting),)
    optimizers = tuple(o for o in study.optimizers if o in cfg.optimizers) or study.optimizers
    grid = _grid(name, cfg, values, optimizers)
    probe = probe or ProbeSettings()
    study_dir = Path(study_dir)
    # where and when each start of the study ran: the first, then each --resume
    saved = json.loads((study_dir / NUMBERS).read_text()) if resume and (study_dir / NUMBERS).is_file() else {}
    machines = saved.get("machines", [])
    hint = f", --resume {study_dir} to continue it" if (study_dir / NUMBERS).is_file() else ""
    stale = not resume and check_out(study_dir, overwrite=overwrite, hint=hint)
    model = check_model(cfg, load_run_data(cfg))  # before anything is written
    source = _transfer_source(cfg, model) if name == "transfer" else None
    if stale:
        clear_dir(study_dir)
    study_dir.mkdir(parents=True, exist_ok=True)
    # written first, so that an interrupted study can be resumed and re-rendered from what it says
    header = {"study": name, "settings": dataclasses.asdict(cfg), "values": list(values),
              "optimizers": list(optimizers), "probe": dataclasses.asdict(probe), "complete": False,
              "machines": [*machines, describe_machine(cfg.device)]}  # fmt: skip
    if source is not None:
        header["source_settings"] = dataclasses.asdict(source)
    (study_dir / NUMBERS).write_text(json.dumps(header, indent=2) + "\n")
    if source is not None:  # one network per seed, which every optimizer and every target size starts from
        log(f"\n== the source network: {source.dataset} classes {source.classes}")
        again = resume and (study_dir / SOURCE / "config.json").is_file()
        if again:
            _check_same_run(study_dir / SOURCE, source)
        run_experiment(source, study_dir / SOURCE, resume=again, log=log)
    for value, run_cfg in grid:
        run_dir = study_dir / run_name(study.setting, value)
        log(f"\n== {'training for the Hessian probe' if name == 'hessian' else f'{study.setting} = {value}'}")
        again = resume and (run_dir / "config.json").is_file()
        if again:
            _check_same_run(run_dir, run_cfg)
        run_experiment(run_cfg, run_dir, resume=again, log=log)
        if name == "hessian":
            probe_run(run_dir, probe, log=log)
    return rebuild_study(study_dir)


def _grid(name: str, cfg: RunConfig, values: tuple, optimizers: tuple) -> list[tuple[object, RunConfig]]:
    """Each value with its run's settings, every one validated: a bad value fails the study before its first run, not
    after the runs before it."""
    study = STUDIES[name]
    cfg.validate()
    grid = []
    for value in values:
        trained = list(study.trained_at(value, optimizers))
        run_cfg = dataclasses.replace(cfg, command=f"reproduce {name}", optimizers=trained, **{study.setting: value})
        if name == "transfer" and cfg.weights is None:  # each seed's source network, pretrained by the study
            run_cfg = dataclasses.replace(run_cfg, weights=SOURCE_WEIGHTS)
        if name == "hessian":  # the probe needs the final weights
            run_cfg = dataclasses.replace(run_cfg, checkpoint_every=run_cfg.checkpoint_every or run_cfg.epochs)
        try:  # named as the study names it (its run directories, its tables), not as an option
            grid.append((value, run_cfg.validate(spell=str)))
        except ValueError as exc:
            raise ValueError(f"{exc}, in --values") from None
    return grid


def run_name(setting: str, value) -> str:
    """The run directory of one value of a study (``second_pass=every-2`` for ``every:2``: no colon in a path)."""
    return f"{setting}={value}".replace(":", "-")


def _check_same_run(run_dir: Path, run_cfg: RunConfig) -> None:
    """A ValueError unless the run already in ``run_dir`` computes what ``run_cfg`` asks for (it may differ only in
    how long and where it runs)."""
    saved = dataclasses.asdict(RunConfig.load(run_dir / "config.json"))
    wanted = dataclasses.asdict(run_cfg)
    changed = sorted(k for k in wanted if k not in RESUMABLE and saved[k] != wanted[k])
    if changed:
        raise ValueError(f"cannot resume {run_dir}: its runs were trained with other {changed}")


def rebuild_study(study_dir: Path) -> dict:
    """Write ``study.md`` and ``study.json`` of ``study_dir`` from its run directories (the finished runs' results
    and, for the Hessian study, their probes) and the settings its ``study.json`` recorded; returns the numbers. A
    study cut short is summarized as far as it got, and says so."""
    study_dir = Path(study_dir)
    if not (study_dir / NUMBERS).is_file():
        raise ValueError(f"{study_dir} is not a study directory: it has no {NUMBERS}")
    header = json.loads((study_dir / NUMBERS).read_text())
    if "settings" not in header:
        raise ValueError(f"{study_dir / NUMBERS} records no settings: it was written by an older gearsam; run the "
                         "study again to rebuild it")  # fmt: skip
    name, cfg = header["study"], RunConfig(**header["settings"])
    study, values, optimizers = STUDIES[name], tuple(header["values"]), tuple(header["optimizers"])
    results, spectra = {}, {}
    for value in values:
        run_dir = study_dir / run_name(study.setting, value)
        rows = MetricsLog(run_dir / "metrics.jsonl").rows()
        results[value] = [r for r in rows if r["kind"] == "result" and r["epochs"] == cfg.epochs]
        if (run_dir / ROWS).is_file():
            spectra[value] = read_metrics(run_dir / ROWS)
    numbers = summarize_study(study, values, optimizers, results)
    expected = sum(len(study.trained_at(value, optimizers)) for value in values) * len(cfg.seeds)
    complete = sum(map(len, results.values())) == expected and (name != "hessian" or len(spectra) == len(values))
    if header.get("source_settings"):  # the transfer study's own source networks: accuracy on the source classes
        source = RunConfig(**header["source_settings"])
        rows = MetricsLog(study_dir / SOURCE / "metrics.jsonl").rows()
        done = {r["seed"]: r["test_acc"] for r in rows if r["kind"] == "result" and r["epochs"] == source.epochs}
        numbers.update(source_settings=header["source_settings"], source=_stats(done) if done else None)
        complete = complete and len(done) == len(source.seeds)
    numbers.update(
        {k: header[k] for k in ("study", "settings", "values", "optimizers", "probe")},
        machines=header.get("machines", []),
        complete=complete,
        unit="test accuracy in % of the test images",
    )
    text = transfer_markdown(cfg, numbers) if name == "transfer" else study_markdown(name, cfg, numbers)
    if spectra:
        numbers["hessian"] = {str(value): rows for value, rows in spectra.items()}
        text = _with_spectra(text, spectra, ProbeSettings(**header["probe"]))
    (study_dir / NUMBERS).write_text(json.dumps(numbers, indent=2) + "\n")
    (study_dir / SUMMARY).write_text(text)
    return numbers


def _with_spectra(text: str, spectra: dict, probe: ProbeSettings) -> str:
    """``study.md`` with the Hessian spectrum first, after its title and settings: it is what the study measures."""
    title, rest = text.split("\n\nTest accuracy", 1)
    tables = "".join(f"```\n{spectrum_table(rows, probe.k)}\n```\n" for rows in spectra.values())
    return (f"{title}\n\nHessian spectrum of the mean test loss ({plural(probe.batches, 'batch')} of "
            f"{plural(probe.batch_size, 'test image')}), mean ± std over seeds (each eigenvalue's residual and "
            f"convergence: the run directory's hessian.md):\n\n{tables}\nTest accuracy{rest}")  # fmt: skip


def summarize_study(study: Study, values, optimizers, results: dict) -> dict:
    """Accuracy (%) per value and optimizer (mean, std, per seed) and per-seed paired differences: between each pair
    of optimizers at each value, and each optimizer's at each value against its own at the study's ``reference``.
    Values and optimizers without a finished run (a study cut short) are left out; the std of one seed is None.

    A study with a ``baseline`` also compares each run with the baseline's at the reference value, and has ``costs``:
    per value and optimizer, the share of steps that took the second pass and the training time (wall clock, and the
    process's CPU time) divided by the baseline's of the same seed, from the runs' own counts and timings."""
    accuracy = {
        v: {o: {r["seed"]: r["test_acc"] for r in results.get(v, []) if r["optimizer"] == o}
            for o in optimizers}
        for v in values
    }  # fmt: skip
    rows = [{"value": v, "optimizer": o, **_stats(accuracy[v][o])} for v in values for o in optimizers
            if accuracy[v][o]]  # fmt: skip
    pairs = []
    for value in values:
        compared = [(f"{b} - {a}", accuracy[value][b], accuracy[value][a])
                    for a, b in itertools.combinations(optimizers, 2)]  # fmt: skip
        if study.reference in values and value != study.reference:
            compared += [(f"{o} - {o} at {study.setting}={study.reference}", accuracy[value][o],
                          accuracy[study.reference][o]) for o in optimizers]  # fmt: skip
            if study.baseline in optimizers:
                compared += [(f"{o} - {study.baseline} at {study.setting}={study.reference}", accuracy[value][o],
                              accuracy[study.reference][study.baseline]) for o in optimizers]  # fmt: skip
        pairs += [{"value": value, "pair": pair, **_paired(first, second)} for pair, first, second in compared
                  if set(first) & set(second)]  # fmt: skip
    numbers = {"setting": study.setting, "about": study.about, "accuracy": rows, "paired_differences": pairs}
    if study.baseline is not None:
        numbers.update(reference=study.reference, baseline=study.baseline)
        numbers["costs"] = _costs(study, values, optimizers, results)
    return numbers


def _costs(study: Study, values, optimizers, results: dict) -> list[dict]:
    """Per value and optimizer with a finished run: :func:`_stats` of the share of steps that took the second pass,
    and of the training time, wall clock and CPU, as a ratio to the baseline's of the same seed at the reference."""
    baseline = {r["seed"]: r for r in results.get(study.reference, []) if r["optimizer"] == study.baseline}
    costs = []
    for value in values:
        for name in optimizers:
            runs = {r["seed"]: r for r in results.get(value, []) if r["optimizer"] == name}
            if not runs:
                continue
            timed = sorted(set(runs) & set(baseline))
            costs.append({
                "value": value, "optimizer": name,
                "second_passes": _stats({s: r.get("sam_steps", 0) / max(r["step"], 1) for s, r in runs.items()}),
                "seconds": _stats({s: r["seconds"] for s, r in runs.items()}),
                "time_ratio": _stats({s: runs[s]["seconds"] / baseline[s]["seconds"] for s in timed}) if timed
                else None,
                "cpu_ratio": _stats({s: runs[s]["cpu_seconds"] / baseline[s]["cpu_seconds"] for s in timed})
                if timed and all(runs[s].get("cpu_seconds") and baseline[s].get("cpu_seconds") for s in timed)
                else None,
            })  # fmt: skip
    return costs


def _paired(minuend: dict, subtrahend: dict) -> dict:
    """:func:`_stats` of the per-seed differences over the seeds both have."""
    seeds = sorted(set(minuend) & set(subtrahend))
    return _stats({s: minuend[s] - subtrahend[s] for s in seeds})


def _stats(per_seed: dict) -> dict:
    """Mean, std (None for a single seed: there is no spread to tell) and the values by seed."""
    values = list(per_seed.values())
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "per_seed": {str(seed): value for seed, value in per_seed.items()},
    }


def spread(std: float | None, sign: str = "") -> str:
    """A std as tables print it: ``n/a`` for a single seed."""
    return "n/a" if std is None else f"{std:{sign}.2f}".lstrip("+")


def study_markdown(name: str, cfg: RunConfig, numbers: dict) -> str:
    """``study.md``: the settings, the accuracy table and the paired differences (mean ± std over seeds)."""
    setting = numbers["setting"]
    varied = "" if name == "hessian" else f" (unless varied: {setting})"
    lines = [
        f"# gearsam reproduce {name}: {numbers['about']}",
        "",
        f"{cfg.dataset}, model {cfg.model}, {cfg.epochs} epoch{'s' * (cfg.epochs != 1)}, seeds {list(cfg.seeds)}, "
        f"lr {cfg.lr} ({cfg.schedule}), batch {cfg.batch_size}, rho {cfg.radii()}, beta {cfg.beta}, partition "
        f"{cfg.partition}, label noise {cfg.label_noise}{varied}. Each run directory has its own summary.md with the "
        "machine and date.",
    ]
    if numbers.get("machines"):
        lines += ["", "Run " + "; resumed ".join(map(where_run, numbers["machines"])) + "."]
    if not numbers.get("complete", True):
        lines += ["", f"**Incomplete**: not every run has finished; `gearsam reproduce {name} --resume STUDY_DIR` "
                  "continues the study."]  # fmt: skip
    if "costs" in numbers:
        return "\n".join(lines + _costs_table(numbers, cfg)) + "\n"
    lines += [
        "",
        "Test accuracy (%), mean ± std over seeds:",
        "",
        f"| {setting} | optimizer | accuracy | per seed |",
        "|---|---|---:|---|",
    ]
    for row in numbers["accuracy"]:
        seeds = ", ".join(f"{v:.2f}" for v in row["per_seed"].values())
        lines.append(f"| {row['value']} | {row['optimizer']} | {row['mean']:.2f} ± {spread(row['std'])} | {seeds} |")
    if numbers["paired_differences"]:
        lines += ["", "Paired differences (same seed), accuracy points, mean ± std over seeds:", "",
                  f"| {setting} | difference | mean ± std | per seed |", "|---|---|---:|---|"]  # fmt: skip
        for row in numbers["paired_differences"]:
            seeds = ", ".join(f"{v:+.2f}" for v in row["per_seed"].values())
            lines.append(f"| {row['value']} | {row['pair']} | {row['mean']:+.2f} ± {spread(row['std'])} | {seeds} |")
    return "\n".join(lines) + "\n"


def signed(value: float) -> str:
    """A difference to two decimals with its sign, ``+0.00`` for one that rounds to zero (not ``-0.00``)."""
    return f"{round(value, 2) or 0.0:+.2f}"


#: How the transfer study's table names the optimizers.
_NAMES = {SGD: "SGD", SAM_RULE: "SAM", GEAR_RULE: "GEAR-SAM"}


def transfer_markdown(cfg: RunConfig, numbers: dict) -> str:
    """The transfer study's ``study.md``: what was fine-tuned from what, then one table, per target size: each
    optimizer's accuracy and the per-seed paired differences between them (with the seeds where the first was
    ahead); the per-seed numbers folded away below it."""

    def title(name: str) -> str:
        return _NAMES.get(name, name)

    optimizers, values = numbers["optimizers"], numbers["values"]
    seeds = len(cfg.seeds)
    source = numbers.get("source_settings")
    if source:
        src = RunConfig(**source)
        start = (f"the seed's source network (below), every layer trained, the classifier replaced by one for the "
                 f"{len(cfg.classes or [])} target classes and initialised from the seed")  # fmt: skip
    else:
        start = f"--weights {cfg.weights}, every layer trained, the classifier replaced and initialised from the seed"
    classes = (
        "every class" if cfg.classes is None else f"classes {cfg.classes} (relabelled 0 to {len(cfg.classes) - 1})"
    )
    lines = [
        f"# gearsam reproduce transfer: {numbers['about']}",
        "",
        f"Target: {cfg.dataset}, {classes}; each seed draws its training images per class from the training split "
        f"(a smaller draw inside a larger one; `all`: the whole split) and tests on the whole test split. Model "
        f"{cfg.model}, fine-tuned from {start}: {plural(cfg.epochs, 'epoch')}, lr {cfg.lr} ({cfg.schedule}), batch "
        f"{cfg.batch_size}, SGD momentum {cfg.momentum}, weight decay {cfg.weight_decay:g}, rho {cfg.radii()}, beta "
        f"{cfg.beta}, partition {cfg.partition}, label noise {cfg.label_noise}, no augmentation; seeds "
        f"{list(cfg.seeds)}.",
    ]
    if source:
        accuracy = numbers.get("source")
        reached = ("not finished yet" if accuracy is None else
                   f"test accuracy on its own classes {accuracy['mean']:.2f} ± {spread(accuracy['std'])}")  # fmt: skip
        lines += ["", f"Source: {src.dataset} classes {src.classes}, SGD, {plural(src.epochs, 'epoch')}, lr {src.lr} "
                  f"({src.schedule}), batch {src.batch_size}, weight decay {src.weight_decay:g}, one network per seed "
                  f"(`{SOURCE}/`): {reached}."]  # fmt: skip
    if numbers.get("machines"):
        lines += ["", "Run " + "; resumed ".join(map(where_run, numbers["machines"])) + "."]
    if not numbers.get("complete", True):
        lines += ["", "**Incomplete**: not every run has finished; `gearsam reproduce transfer --resume STUDY_DIR` "
                  "continues the study."]  # fmt: skip
    accuracy = {(r["value"], r["optimizer"]): r for r in numbers["accuracy"]}
    pairs = {(r["value"], r["pair"]): r for r in numbers["paired_differences"]}
    compared = [(b, a) for a, b in itertools.combinations(optimizers, 2)]
    header = [*map(title, optimizers), *(f"{title(b)} − {title(a)}" for b, a in compared)]
    lines += ["", f"| {numbers['setting']} | " + " | ".join(header) + " |", "|---" + "|---:" * len(header) + "|"]
    for value in values:
        cells = [f"{r['mean']:.2f} ± {spread(r['std'])}" if (r := accuracy.get((value, o))) else "–"
                 for o in optimizers]  # fmt: skip
        for b, a in compared:
            row = pairs.get((value, f"{b} - {a}"))
            ahead = "" if row is None else sum(d > 0 for d in row["per_seed"].values())
            cells.append("–" if row is None else f"{signed(row['mean'])} ± {spread(row['std'])} "
                         f"({ahead}/{len(row['per_seed'])})")  # fmt: skip
        lines.append(f"| {value} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Test accuracy (%) at the end of fine-tuning, mean ± std over {plural(seeds, 'seed')}. The differences are "
        "per-seed paired differences in accuracy points, mean ± std over seeds, and (in brackets) the seeds on which "
        "the first was ahead: a seed gives every optimizer the same source network, training images, classifier "
        "initialisation and batches.",
        "",
        "<details><summary>Per seed</summary>",
        "",
        f"| {numbers['setting']} | run | per seed |",
        "|---|---|---|",
    ]
    for row in numbers["accuracy"]:
        lines.append(f"| {row['value']} | {title(row['optimizer'])} | "
                     f"{', '.join(f'{v:.2f}' for v in row['per_seed'].values())} |")  # fmt: skip
    for row in numbers["paired_differences"]:
        b, _, a = row["pair"].partition(" - ")
        lines.append(f"| {row['value']} | {title(b)} − {title(a)} | "
                     f"{', '.join(f'{v:+.2f}' for v in row['per_seed'].values())} |")  # fmt: skip
    return "\n".join([*lines, "", "</details>"]) + "\n"


def where_run(machine: dict) -> str:
    """Where and when a study (or its resumption) ran, from :func:`~gearsam_fused.machine.describe_machine`."""
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    code = f", commit {machine['commit']}" if machine.get("commit") else ""
    return f"on {machine['date']}, {machine['cpu']} ({machine['cpu_count']} cores){gpu}, torch {machine['torch']}{code}"


def configuration(optimizer: str, value) -> str:
    """A run of the efficiency study as its table and figure name it: ``sam``, ``sam every:2``, ``sgd``."""
    return optimizer if value == ALWAYS or optimizer == SGD else f"{optimizer} {value}"


def _costs_table(numbers: dict, cfg: RunConfig) -> list[str]:
    """A baseline study's one table: per configuration (optimizers in order, then values) the share of second passes,
    the time against the baseline's, the accuracy and its paired differences against the same optimizer at the
    reference and against the baseline; the per-seed numbers folded away below it."""
    accuracy = {(r["value"], r["optimizer"]): r for r in numbers["accuracy"]}
    pairs = {(r["value"], r["pair"]): r for r in numbers["paired_differences"]}
    costs = sorted(numbers["costs"], key=lambda r: numbers["optimizers"].index(r["optimizer"]))
    reference, baseline = numbers.get("reference", ALWAYS), numbers.get("baseline", SGD)

    def difference(value, optimizer, against: str) -> str:
        if value == reference:
            row = pairs.get((value, f"{optimizer} - {against}")) if optimizer != against else None
        else:
            row = pairs.get((value, f"{optimizer} - {against} at {numbers['setting']}={reference}"))
        return "–" if row is None else f"{row['mean']:+.2f} ± {spread(row['std'])}"

    def ratio(stats) -> str:
        return "–" if stats is None else f"{stats['mean']:.2f} ± {spread(stats['std'])}"

    lines = [
        "",
        f"| configuration | second passes (% of steps) | time / {baseline} | CPU time / {baseline} | test accuracy (%) | "
        f"vs full, same rule | vs {baseline} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    details = ["| configuration | accuracy per seed | time / run (s) per seed |", "|---|---|---|"]
    for row in costs:
        value, optimizer = row["value"], row["optimizer"]
        acc = accuracy[(value, optimizer)]
        full = "–" if optimizer == baseline else difference(value, optimizer, optimizer)
        lines.append(
            f"| {configuration(optimizer, value)} | {100 * row['second_passes']['mean']:.1f} | "
            f"{ratio(row['time_ratio'])} | {ratio(row['cpu_ratio'])} | {acc['mean']:.2f} ± {spread(acc['std'])} | "
            f"{full} | {difference(value, optimizer, baseline)} |"
        )
        details.append(
            f"| {configuration(optimizer, value)} | {', '.join(f'{v:.2f}' for v in acc['per_seed'].values())} | "
            f"{', '.join(f'{v:.1f}' for v in row['seconds']['per_seed'].values())} |"
        )
    seeds = len(cfg.seeds)
    lines += [
        "",
        f"Mean ± std over {plural(seeds, 'seed')}. *Test accuracy*: at the end of training. *vs full, same rule* and "
        f"*vs {baseline}*: per-seed paired differences in accuracy points (the same seed gives every configuration "
        f"the same initial weights, batches and noisy labels) against the same optimizer at {numbers['setting']} "
        f"{reference} (full SAM / full GEAR-SAM) and against {baseline}. *Second passes*: the share of steps that ran "
        "the second forward and backward, counted by each run. *Time*: each run's own training time (wall clock over "
        f"its training epochs, evaluation left out; from its metrics) divided by {baseline}'s under the same seed; "
        "*CPU time*: the same with the process's CPU time (all its threads). The runs ran one after another on the "
        "one machine named above, with whatever else it ran at the time: the ratios are what that measured, not a "
        "quiet-machine benchmark.",
        "",
        "<details><summary>Per seed</summary>",
        "",
        *details,
        "",
        "</details>",
    ]
    return lines

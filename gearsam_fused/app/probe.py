"""``gearsam hessian RUN_DIR``: the Hessian spectrum of each trained model of a run directory, as in the paper's
Hessian study (PyHessian's quantities: the largest eigenvalue, the top-k eigenvalues' mean and variance, the trace).

The Hessian is that of the mean cross-entropy over the first test images, in float32 and eval mode (BatchNorm on its
running statistics), for the weights of each run's last checkpoint (``--checkpoint-every`` must have been set). It
writes ``hessian.jsonl`` (one row per optimizer and seed, with the eigenvalues) and ``hessian.md`` (the table), and
the plots draw ``hessian.png`` from the rows.
"""

from __future__ import annotations

import json
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gearsam_fused.analysis import hessian_spectrum, hessian_trace

from .data import as_float
from .training import (
    RunConfig,
    SettingWarning,
    build_model,
    checkpoint_path,
    load_run_data,
    read_checkpoint,
    resolve_device,
)

ROWS = "hessian.jsonl"
TABLE = "hessian.md"


@dataclass
class ProbeSettings:
    """How much of the test set and how many Hessian-vector products the probe spends."""

    k: int = 10  # top eigenvalues
    batches: int = 2
    batch_size: int = 256
    max_iter: int = 50  # Hessian-vector products per eigenvalue, at most
    tol: float = 1e-3  # relative change of an eigenvalue that ends its iteration
    trace_samples: int = 20
    seed: int = 0


def probe_run(run_dir: Path, settings: ProbeSettings, log=print) -> list[dict]:
    """Probe every checkpoint of ``run_dir``; writes ``hessian.jsonl`` and ``hessian.md`` there and returns the rows."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} is not a run directory: it has no config.json")
    cfg = RunConfig.load(run_dir / "config.json")
    runs = [(name, seed) for name in cfg.optimizers for seed in cfg.seeds]
    checkpoints = [(name, seed, checkpoint_path(run_dir, name, seed)) for name, seed in runs]
    checkpoints = [c for c in checkpoints if c[2].is_file()]
    if not checkpoints:
        raise ValueError(f"{run_dir} has no checkpoints: train with --checkpoint-every N to probe its models")
    device = resolve_device(cfg.device)
    data = load_run_data(cfg)
    images, labels = (t.to(device) for t in data.test)
    size = settings.batch_size
    batches = [(images[i : i + size], labels[i : i + size]) for i in range(0, size * settings.batches, size)]
    batches = [b for b in batches if len(b[1])]
    # every checkpoint read (or refused) before the first probe: weights only, nothing in a file runs
    weights = [read_checkpoint(path, keys=("model",))["model"] for _, _, path in checkpoints]
    rows = []
    for (name, seed, _), state in zip(checkpoints, weights):
        model = build_model(cfg, data).to(device)
        model.load_state_dict(state)
        rows.append({"optimizer": name, "seed": seed, **_spectrum(model, batches, settings)})
        log(f"  {name:<9} seed {seed}: max eigenvalue {rows[-1]['max_eigenvalue']:.4g}, trace {rows[-1]['trace']:.4g}")
    (run_dir / ROWS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / TABLE).write_text(
        f"# Hessian spectrum of {run_dir.name}\n\n```\n{spectrum_table(rows, settings.k)}\n```\n\n"
        f"Each eigenvalue, its residual ||Hv - λv|| / |λ| and whether it converged (relative change ≤ {settings.tol} "
        f"within --max-iter {settings.max_iter}):\n\n```\n{convergence_table(rows)}\n```\n"
    )
    _warn_unconverged(rows, settings)
    return rows


def _warn_unconverged(rows: list[dict], settings: ProbeSettings) -> None:
    """A SettingWarning when some eigenvalue stopped at ``max_iter`` before its tolerance: it may be far off."""
    loose = sum(not ok for r in rows for ok in r["converged"])
    if loose:
        worst = max(res for r in rows for res, ok in zip(r["residuals"], r["converged"]) if not ok)
        warnings.warn(SettingWarning(
            f"{loose} of {sum(len(r['converged']) for r in rows)} eigenvalues did not converge within --max-iter "
            f"{settings.max_iter} (largest residual {worst:.2g}); they may be far from the true ones: raise --max-iter"
        ), stacklevel=2)  # fmt: skip


def convergence_table(rows: list[dict]) -> str:
    """Per optimizer and seed, each eigenvalue with its residual, the products it took and whether it converged."""
    header = (
        f"{'optimizer':<10}  {'seed':>4}  {'rank':>4}  {'eigenvalue':>12}  {'residual':>9}  {'products':>8}  converged"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        for rank, cells in enumerate(zip(r["eigenvalues"], r["residuals"], r["iterations"], r["converged"]), 1):
            value, residual, products, ok = cells
            lines.append(f"{r['optimizer']:<10}  {r['seed']:>4}  {rank:>4}  {value:>12.5g}  {residual:>9.2g}  "
                         f"{products:>8}  {'yes' if ok else 'NO'}")  # fmt: skip
    return "\n".join(lines)


def _cross_entropy(model, batch) -> torch.Tensor:
    return F.cross_entropy(model(as_float(batch[0])), batch[1])


def _spectrum(model, batches, settings: ProbeSettings) -> dict:
    """The probe's numbers for one model."""
    spectrum = hessian_spectrum(
        model, _cross_entropy, batches, settings.k, max_iter=settings.max_iter, tol=settings.tol, seed=settings.seed
    )
    eigenvalues = spectrum.eigenvalues
    trace = hessian_trace(model, _cross_entropy, batches, samples=settings.trace_samples, seed=settings.seed)
    return {
        "eigenvalues": eigenvalues,
        "residuals": spectrum.residuals,
        "iterations": spectrum.iterations,
        "converged": spectrum.converged,
        "max_eigenvalue": eigenvalues[0],
        "top_mean": statistics.mean(eigenvalues),
        "top_variance": statistics.pvariance(eigenvalues),
        "trace": trace,
    }


def spectrum_table(rows: list[dict], k: int) -> str:
    """Per optimizer, the mean (± std over seeds) of the largest eigenvalue, the top-``k`` mean and variance and the
    trace."""
    header = (
        f"{'optimizer':<10}  {'max eigenvalue':>18}  {f'top-{k} mean':>18}  {f'top-{k} variance':>18}  {'trace':>18}"
    )
    lines = [header, "-" * len(header)]
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == name]
        cells = [_mean_std([r[key] for r in mine]) for key in ("max_eigenvalue", "top_mean", "top_variance", "trace")]
        lines.append(f"{name:<10}  " + "  ".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def _mean_std(values: list[float]) -> str:
    spread = f"{statistics.stdev(values):.2g}" if len(values) > 1 else "n/a"  # one seed has no spread
    return f"{statistics.mean(values):.4g} ± {spread}"
